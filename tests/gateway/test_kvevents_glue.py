"""kvgate.gateway.kvevents against the tiers' change interface (a store double with ``changes`` and
``held_keys``): full keys to vLLM block hashes by the namespace's key form, media, topics, batching per
flush, and the snapshot; a real publisher and subscriber carry the events."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from kvgate.config import Config
from kvgate.gateway.kvevents import KeyForms, KvEvents, blocks_of
from kvgate.keys import full_key
from kvgate.kvevents.subscriber import Subscriber
from kvgate.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored


@dataclass
class Change:
    tier: str
    kind: str
    fkeys: list[bytes]


class Changes:
    def __init__(self):
        self.callbacks = []

    def subscribe(self, callback):
        self.callbacks.append(callback)

    def emit(self, tier, kind, fkeys):
        for cb in self.callbacks:
            cb(Change(tier, kind, fkeys))


@dataclass
class Card:
    serial: str | None


class Store:
    def __init__(self, held):
        self.changes = Changes()
        self.held = held

    cards: tuple = ()  # the cards mounted (serials): announced on their topics

    def card_states(self):
        return [Card(serial) for serial in self.cards]

    async def held_keys(self, chunk=10_000):
        for tier, fkeys in self.held.items():
            for i in range(0, len(fkeys), chunk):
                yield tier, fkeys[i:i + chunk]
                await asyncio.sleep(0)


def vkey(h: bytes, group: int) -> bytes:
    return h + group.to_bytes(4, "big")


def test_key_forms():
    forms = KeyForms(limit=2)
    forms.declare(b"v", "vllm", 256)
    ks = [full_key(b"v", vkey(b"H" * 32, 3)), full_key(b"o", b"whole-key"), full_key(b"v", b"abc")]
    assert blocks_of(ks, forms) == [(b"H" * 32, 3, 256), (b"whole-key", 0, 0), (b"abc", 0, 256)]
    forms.declare(b"a", "", 16)
    forms.declare(b"b", "", 16)
    assert len(forms) == 2 and forms.get(b"v") == ("", 0)  # the oldest went
    with pytest.raises(ValueError, match="block_keys"):
        forms.declare(b"x", "sglang", 0)


def test_changes_become_vllm_events_batched_per_flush(tmp_path):
    cfg = Config(kv_events_endpoint=f"ipc://{tmp_path}/p", kv_events_replay_endpoint=f"ipc://{tmp_path}/r",
                 kv_events_topic="gw1")
    held = {"ram": [full_key(b"v", vkey(bytes([i]) * 32, 0)) for i in range(3)],
            "SERIAL1": [full_key(b"v", vkey(b"\x09" * 32, 1))]}
    store = Store(held)
    forms = KeyForms()
    forms.declare(b"v", "vllm", 64)

    async def main():
        ev = KvEvents(cfg, store, forms)
        await ev.start()
        loop = asyncio.get_running_loop()
        sub = Subscriber(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)
        got = []
        try:
            got += await loop.run_in_executor(None, sub.poll, 0.5)  # the snapshot on join
            while True:  # the slow joiner: until a live batch arrives
                store.changes.emit("ram", "stored", [full_key(b"v", vkey(b"w" * 32, 0))])
                await asyncio.sleep(0.05)
                if any(b.events[0].block_hashes == [b"w" * 32] for _, _, b in
                       await loop.run_in_executor(None, sub.poll, 0.05)):
                    break
            before = ev.stats["batches"]
            keys = [full_key(b"v", vkey(bytes([i]) * 32, i % 2)) for i in range(6)]
            store.changes.emit("ram", "stored", keys[:3])
            store.changes.emit("ram", "stored", keys[3:])
            store.changes.emit("SERIAL1", "removed", [keys[0]])
            store.changes.emit("ram", "cleared", [])
            await asyncio.sleep(0.1)
            assert ev.stats["batches"] - before == 2  # one per topic, not one per change or key
            live = []
            deadline = time.monotonic() + 5
            while len(live) < 2 and time.monotonic() < deadline:
                live += await loop.run_in_executor(None, sub.poll, 0.1)
        finally:
            sub.close()
            await ev.close()
        return got, live

    snap, live = asyncio.run(main())
    by_topic = {}
    for t, _, b in snap:
        by_topic.setdefault(t, []).extend(b.events)
    assert isinstance(by_topic["gw1"][0], AllBlocksCleared)
    assert [h for e in by_topic["gw1"][1:] for h in e.block_hashes] == [bytes([i]) * 32 for i in range(3)]
    card = by_topic["gw1@card:SERIAL1"]
    assert isinstance(card[0], AllBlocksCleared)
    assert card[1] == BlockStored(block_hashes=[b"\x09" * 32], parent_block_hash=None, token_ids=[], block_size=64,
                                  lora_id=None, medium="STORAGE", lora_name=None, group_idx=1, locality="LOCAL",
                                  ownership="kvgate")
    (t1, _, ram), (t2, _, cardb) = sorted(live, key=lambda x: x[0])
    assert t1 == "gw1" and t2 == "gw1@card:SERIAL1"
    groups = [(type(e).__name__, e.group_idx if not isinstance(e, AllBlocksCleared) else None,
               len(getattr(e, "block_hashes", []))) for e in ram.events]
    # consecutive keys merge while their group agrees; the clear comes last, in the order it happened
    assert groups == [("BlockStored", 0, 1), ("BlockStored", 1, 1), ("BlockStored", 0, 1), ("BlockStored", 1, 1),
                      ("BlockStored", 0, 1), ("BlockStored", 1, 1), ("AllBlocksCleared", None, 0)]
    assert all(e.medium == "CPU" and e.block_size == 64 for e in ram.events[:-1])
    assert cardb.events == [BlockRemoved(block_hashes=[b"\x00" * 32], medium="STORAGE", group_idx=0,
                                         locality="LOCAL", ownership="kvgate")]


def test_a_large_change_is_cut_into_batches():
    ev = KvEvents(Config(), Store({}), KeyForms())
    events = []
    ev._append(events, "ram", "stored", [full_key(b"", b"%08d" % i) for i in range(25_000)])
    assert len(events) == 1
    batches = ev._split(events)
    assert [sum(len(e.block_hashes) for e in b) for b in batches] == [10_000, 10_000, 5_000]
    assert [h for b in batches for e in b for h in e.block_hashes] == [b"%08d" % i for i in range(25_000)]


def test_a_card_that_joins_the_set_is_announced_within_mounts_s(tmp_path, monkeypatch):
    """A gateway's events say which cards it mounts: each card once, at start and when one joins (an empty
    batch on the card's topic), a card without its serial yet when it has one."""
    monkeypatch.setattr(KvEvents, "MOUNTS_S", 0.05)
    cfg = Config(kv_events_endpoint=f"ipc://{tmp_path}/p", kv_events_replay_endpoint=f"ipc://{tmp_path}/r",
                 kv_events_topic="gw1")
    store = Store({})
    store.cards = ("S1",)

    async def main():
        ev = KvEvents(cfg, store, KeyForms())
        await ev.start()
        loop = asyncio.get_running_loop()
        sub = Subscriber(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)
        try:
            got = await loop.run_in_executor(None, sub.poll, 0.5)  # S1 by replay: announced before we joined
            store.cards = ("S1", None)  # a card still adopting: no serial, not announced
            await asyncio.sleep(0.2)
            store.cards = ("S1", "S2")
            await asyncio.sleep(0.2)
            got += await loop.run_in_executor(None, sub.poll, 0.3)
        finally:
            sub.close()
            await ev.close()
        topics = [t for t, _, _ in got]
        assert "gw1@card:S1" in topics and topics.count("gw1@card:S2") == 1, topics
        assert not any("None" in t for t in topics)
        assert all(not b.events or isinstance(b.events[0], AllBlocksCleared) for _, _, b in got)  # nothing stored

    asyncio.run(main())
