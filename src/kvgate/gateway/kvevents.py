"""The gateway's tiers' changes, published as vLLM KV events (``kv_events_endpoint``).

``KvEvents`` subscribes to ``store.changes`` (``kvgate.tiers.events.TierChange(tier, kind, fkeys)``) and
turns each change into ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events of
``kvgate.kvevents.wire``, handed to an ``EventPublisher``:

- A full key splits into (namespace, client key); the client key into (block hash, group index) by the
  namespace's key form, which its engine declared in its hello (``Hello.block_keys``, kept in
  ``KeyForms``): ``"vllm"``: ``key[:-4]`` and ``int.from_bytes(key[-4:], "big")`` (vLLM's offloading key,
  ``make_offload_key``); otherwise, or for a namespace no engine has declared since this gateway started
  (objects a card held from before), the whole key and group 0.
- ``block_size``: the namespace's declared tokens per key, 0 when not declared (vLLM's ``block_size`` is an
  ``int``: its decoder refuses nil).  ``medium``: ``"CPU"`` for the RAM tier, ``"STORAGE"`` for a card;
  ``locality`` ``"LOCAL"``; ``ownership`` ``"kvgate"``; ``token_ids`` ``[]``; ``parent_block_hash`` None
  (a router places a block by its hash, which already chains its parents).
- Topic: ``kv_events_topic`` for the RAM tier, ``<topic>@card:<serial>`` for a card, so a card shared by
  several gateways is one topic that each of them publishes (a router dedups by topic).
- Changes are collected and published once per ``FLUSH_S`` (10 ms), never per key: one batch per topic
  per flush, at most ``MAX_HASHES`` block hashes per batch (a batch of 10,000 32-byte hashes is about
  350 KB of msgpack; a million in one would stall subscribers' decoders).
- The publisher's snapshot provider is ``store.held_keys()``, each chunk turned into the same events.
- Mounts: an empty batch on a card's topic when the card joins this gateway's set (checked at start and
  every ``MOUNTS_S``), so a router knows which gateways can read a card before anything is stored on it
  (its prefill/decode hand-off asks "can the decode endpoint's gateway read this card?").  The topic is
  then one this publisher has published: a replay starts it afresh like the others.

Everything here runs on the event loop; the publisher's thread does the encoding and the sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from kvgate.config import Config
from kvgate.keys import split_full_key
from kvgate.kvevents.publisher import EventPublisher
from kvgate.kvevents.wire import (
    LOCALITY_LOCAL, MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, Event,
)

log = logging.getLogger(__name__)

OWNERSHIP = "kvgate"
_NO_FORM = ("", 0)
RAM_TIER = "ram"
KEY_FORMS = ("", "vllm")


class KeyForms:
    """What each namespace's engine declared: (block_keys, block_size), at most ``limit`` namespaces (the
    oldest declaration goes first; a gateway serves one engine, which uses a few)."""

    def __init__(self, limit: int = 1024):
        self.limit = limit
        self._forms: OrderedDict[bytes, tuple[str, int]] = OrderedDict()

    def declare(self, namespace: bytes, block_keys: str, block_size: int) -> None:
        """Record a hello's declaration.  Raises ValueError naming the field if it is not one we know."""
        if block_keys not in KEY_FORMS:
            raise ValueError(f"block_keys must be one of {KEY_FORMS}, got {block_keys!r}")
        if block_size < 0:
            raise ValueError(f"block_size must be >= 0, got {block_size}")
        self._forms[namespace] = (block_keys, block_size)
        self._forms.move_to_end(namespace)
        while len(self._forms) > self.limit:
            self._forms.popitem(last=False)

    def get(self, namespace: bytes) -> tuple[str, int]:
        return self._forms.get(namespace, ("", 0))

    def __len__(self) -> int:
        return len(self._forms)


def blocks_of(fkeys: list[bytes], forms: KeyForms) -> list[tuple[bytes, int, int]]:
    """(block hash, group index, block size) of each full key, by its namespace's key form."""
    out = []
    for fkey in fkeys:
        ns, key = split_full_key(fkey)
        form, size = forms.get(ns)
        if form == "vllm" and len(key) > 4:
            out.append((key[:-4], int.from_bytes(key[-4:], "big"), size))
        else:
            out.append((key, 0, size))
    return out


class KvEvents:
    """Publishes ``store``'s changes (see the module docstring).  ``start()`` binds the publisher's sockets
    (ConfigError naming the key if it cannot) and subscribes; ``close()`` flushes and stops."""

    FLUSH_S = 0.01
    MAX_HASHES = 10_000
    MOUNTS_S = 5.0  # how soon a card that joins the set is announced (a look at the set costs microseconds)

    def __init__(self, cfg: Config, store: Any, forms: KeyForms):
        self.cfg = cfg
        self.store = store
        self.forms = forms
        self.topic = cfg.kv_events_topic
        self.publisher: EventPublisher | None = None
        self._pending: list[Any] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._unsubscribe: Any = None
        self._mounted: set[str] = set()
        self._mounts_handle: asyncio.TimerHandle | None = None
        self.stats = {"changes": 0, "batches": 0}

    def topic_of(self, tier: str) -> str:
        return self.topic if tier == RAM_TIER else f"{self.topic}@card:{tier}"

    @staticmethod
    def medium_of(tier: str) -> str:
        return MEDIUM_CPU if tier == RAM_TIER else MEDIUM_STORAGE

    async def start(self) -> None:
        cfg = self.cfg
        self.publisher = EventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                        cfg.kv_events_buffer, snapshot=self._snapshot,
                                        loop=asyncio.get_running_loop())
        self.publisher.start()
        self._unsubscribe = self.store.changes.subscribe(self._on_change)
        self.announce_mounts()
        log.info("KV events on %s (replay %s), topic %r", cfg.kv_events_endpoint,
                 cfg.kv_events_replay_endpoint or "off", self.topic)

    async def close(self) -> None:
        if callable(self._unsubscribe):
            self._unsubscribe()
        self._unsubscribe = None
        for handle in (self._flush_handle, self._mounts_handle):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._mounts_handle = None
        self.flush()
        if self.publisher is not None:
            pub, self.publisher = self.publisher, None
            await asyncio.get_running_loop().run_in_executor(None, pub.close)

    def status(self) -> dict[str, Any]:
        """Counters for the gateway's status: changes taken, batches handed over, and the publisher's
        (published, dropped, holes, replays, snapshots, malformed_requests, ...)."""
        pub = self.publisher
        return {"topic": self.topic, "changes": self.stats["changes"], "batches": self.stats["batches"],
                "namespaces_declared": len(self.forms), "last_seq": pub.last_seq if pub is not None else 0,
                **(dict(pub.stats) if pub is not None else {})}

    def announce_mounts(self) -> None:
        """Publish an empty batch on the topic of each card that joined the set since the last look, then
        look again in ``MOUNTS_S`` (module docstring).  On the loop; never blocks."""
        self._mounts_handle = None
        if self.publisher is None:
            return
        serials = {c.serial for c in self.store.card_states() if c.serial}
        for serial in sorted(serials - self._mounted):
            self.publisher.publish(self.topic_of(serial), [])
            self.stats["batches"] += 1
        self._mounted = serials
        self._mounts_handle = asyncio.get_running_loop().call_later(self.MOUNTS_S, self.announce_mounts)

    # --- changes ------------------------------------------------------------------------------------

    def _on_change(self, change: Any) -> None:
        """A TierChange, on the loop: kept for the next flush (never blocks, never publishes per key)."""
        self._pending.append(change)
        self.stats["changes"] += 1
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush)

    def flush(self) -> None:
        """Publish what changed since the last flush: per topic, its events in the order they happened."""
        self._flush_handle = None
        pending, self._pending = self._pending, []
        if not pending or self.publisher is None:
            return
        by_topic: dict[str, list[Event]] = {}
        for change in pending:
            events = by_topic.setdefault(self.topic_of(change.tier), [])
            self._append(events, change.tier, change.kind, change.fkeys)
        now = time.time()
        for topic, events in by_topic.items():
            for batch in self._split(events):
                self.publisher.publish(topic, batch, now)
                self.stats["batches"] += 1

    def _append(self, events: list[Event], tier: str, kind: str, fkeys: list[bytes]) -> None:
        """Events of one change added to ``events``, merged with the last one where kind, group and block
        size agree."""
        if kind == "cleared":
            events.append(AllBlocksCleared())
            return
        if kind not in ("stored", "removed"):
            log.warning("tier change of unknown kind %r skipped", kind)
            return
        # One pass, no call per key: about 0.7 us a key on the loop with the batch split (100,000 vLLM
        # keys, measured on the 2-core test machine; 1.05 us through blocks_of); encoding is the thread's.
        medium = self.medium_of(tier)
        stored = kind == "stored"
        forms = self.forms._forms
        last = events[-1] if events else None
        sig = (last.group_idx, getattr(last, "block_size", None)) if (
            last is not None and type(last) is (BlockStored if stored else BlockRemoved)
            and last.medium == medium) else None
        hashes = last.block_hashes if sig is not None else None
        for fkey in fkeys:
            n = fkey[0]
            form, size = forms.get(fkey[1:1 + n], _NO_FORM)
            if form == "vllm" and len(fkey) > n + 5:
                block_hash, group = fkey[1 + n:-4], int.from_bytes(fkey[-4:], "big")
            else:
                block_hash, group = fkey[1 + n:], 0
            here = (group, size if stored else None)
            if here != sig:
                if stored:
                    ev: Event = stored_event([], group, size, medium)
                else:
                    ev = BlockRemoved(block_hashes=[], medium=medium, group_idx=group, locality=LOCALITY_LOCAL,
                                      ownership=OWNERSHIP)
                events.append(ev)
                sig, hashes = here, ev.block_hashes
            hashes.append(block_hash)

    def _split(self, events: list[Event]) -> list[list[Event]]:
        """``events`` in batches of at most MAX_HASHES block hashes (a long event is cut in pieces)."""
        out: list[list[Event]] = []
        cur: list[Event] = []
        n = 0
        for ev in events:
            hashes = getattr(ev, "block_hashes", [])
            for i in range(0, max(len(hashes), 1), self.MAX_HASHES):
                piece = ev if len(hashes) <= self.MAX_HASHES else _with_hashes(ev, hashes[i:i + self.MAX_HASHES])
                k = len(getattr(piece, "block_hashes", []))
                if cur and n + k > self.MAX_HASHES:
                    out.append(cur)
                    cur, n = [], 0
                cur.append(piece)
                n += k
        if cur:
            out.append(cur)
        return out

    # --- the snapshot --------------------------------------------------------------------------------

    async def _snapshot(self) -> AsyncIterator[tuple[str, list[Event]]]:
        """Everything held, as (topic, [BlockStored...]) chunks: the publisher's snapshot provider."""
        async for tier, fkeys in self.store.held_keys(chunk=self.MAX_HASHES):
            events: list[Event] = []
            self._append(events, tier, "stored", fkeys)
            if events:
                yield self.topic_of(tier), events


def stored_event(hashes: list[bytes], group: int, size: int, medium: str) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=size, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group, locality=LOCALITY_LOCAL,
                       ownership=OWNERSHIP)


def _with_hashes(ev: Event, hashes: list) -> Event:
    if isinstance(ev, BlockStored):
        return stored_event(hashes, ev.group_idx or 0, ev.block_size, ev.medium or MEDIUM_STORAGE)
    return BlockRemoved(block_hashes=hashes, medium=ev.medium, group_idx=ev.group_idx, locality=ev.locality,
                        ownership=ev.ownership)
