"""The tiers' changes (``kvgate.tiers.events``): what the RAM tier and the cards note as stored, removed and
cleared, with full keys and tier names, and ``TieredStore.held_keys``; on a real RAM tier, real directory
cards and a real ``IoPool``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvgate.cards import ObjectMeta
from kvgate.keys import encode_namespace, full_key
from kvgate.tiers.events import CLEARED, KEY_BYTES, REMOVED, STORED, TierChange, TierChanges
from kvgate.tiers.ram import RamPages
from kvgate.tiers.store import GetItem, PutItem, TieredStore
from kvgate.types import Retention
from tests.helpers import wait_until_async
from tests.tiers.test_store import DIALOG, fk, payload, put, started_store

EVENTS = {"kv_events_endpoint": "tcp://127.0.0.1:5599"}  # the store binds nothing: it only keeps keys


class Seen:
    """A subscriber that keeps every change."""

    def __init__(self, changes: TierChanges) -> None:
        self.changes: list[TierChange] = []
        self.unsubscribe = changes.subscribe(self.changes.append)

    def keys(self, tier: str, kind: str) -> list[bytes]:
        return [k for c in self.changes if c.tier == tier and c.kind == kind for k in c.fkeys]

    def kinds(self, tier: str) -> list[str]:
        return [c.kind for c in self.changes if c.tier == tier]


def ram_put(ram: RamPages, key: bytes, size: int = 100) -> None:
    res = ram.reserve(key, size, ObjectMeta(created_ns=time.time_ns()), Retention.SHORT)
    assert res is not None
    ram.commit(res)


def serial_of(store: TieredStore, i: int = 0) -> str:
    serial = store.cards.set.cards[i].serial
    assert serial is not None
    return serial


def test_the_ram_tier_notes_commits_evictions_deletes_expiries_and_clears() -> None:
    ram = RamPages(4 << 10, page_size=1 << 10, ttl=3600)
    seen = Seen(ram.changes)
    for k in (b"a", b"b", b"c", b"d"):
        ram_put(ram, k)
    ram_put(ram, b"e")  # a full tier: the oldest goes
    ram.delete(b"b")
    ram.ttl_ns = 0  # everything older than now is past the ttl
    time.sleep(0.001)
    assert not ram.contains(b"c")
    ram.ttl_ns = None
    ram.clear()
    assert seen.keys("ram", STORED) == [b"a", b"b", b"c", b"d", b"e"]
    assert seen.keys("ram", REMOVED) == [b"a", b"b", b"c"]
    assert seen.changes[-1] == TierChange("ram", CLEARED, [])


def test_notes_of_one_loop_turn_are_one_change_per_run_and_a_raising_subscriber_is_dropped() -> None:
    async def main() -> None:
        ram = RamPages(64 << 10, page_size=1 << 10)
        seen = Seen(ram.changes)

        def bad(_change: TierChange) -> None:
            raise RuntimeError("a broken subscriber")

        ram.changes.subscribe(bad)
        for i in range(10):
            ram_put(ram, b"k%d" % i)
        ram.delete(b"k0")
        ram.delete(b"k1")
        assert seen.changes == []  # noted, emitted after this turn
        await asyncio.sleep(0)
        assert seen.changes == [TierChange("ram", STORED, [b"k%d" % i for i in range(10)]),
                                TierChange("ram", REMOVED, [b"k0", b"k1"])]
        assert ram.changes._subscribers == [seen.changes.append]  # the raising one went, the other stayed
        seen.unsubscribe()
        assert not ram.changes.listening
        ram_put(ram, b"later")
        await asyncio.sleep(0)
        assert len(seen.changes) == 2

    asyncio.run(main())


def test_puts_deletes_and_cleans_note_full_keys_per_tier_and_held_keys_lists_what_is_held(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path, **EVENTS) as store:
            seen = Seen(store.changes)
            serial = serial_of(store)
            keys = [b"plain", b"vllm-block" + b"\x00" * 4, b"x" * KEY_BYTES]
            assert await put(store, keys, Retention.LONG) == [True] * 3
            await asyncio.sleep(0)
            assert seen.keys("ram", STORED) == [fk(k) for k in keys]
            assert seen.keys(serial, STORED) == [fk(k) for k in keys]
            assert len([c for c in seen.changes if c.kind == STORED]) == 2  # one per tier for the batch
            held = {tier: set() for tier in ("ram", serial)}
            async for tier, fkeys in store.held_keys(chunk=2):
                assert len(fkeys) <= 2
                held[tier].update(fkeys)
            assert held == {"ram": {fk(k) for k in keys}, serial: {fk(k) for k in keys}}  # NUL ends kept

            assert await store.delete([fk(b"plain")], DIALOG) == 1
            await asyncio.sleep(0)
            assert seen.keys("ram", REMOVED) == [fk(b"plain")]
            assert seen.keys(serial, REMOVED) == [fk(b"plain")]

            other = encode_namespace("other-ns")
            items = [PutItem(full_key(other, b"o%d" % i), memoryview(payload(b"o")), ObjectMeta(DIALOG, i, time.time_ns()))
                     for i in range(3)]
            assert await store.put(items, Retention.LONG) == [True] * 3
            await store.clean_namespace(other)
            await asyncio.sleep(0)
            gone = {full_key(other, b"o%d" % i) for i in range(3)}
            assert set(seen.keys("ram", REMOVED)) - {fk(b"plain")} == gone
            assert set(seen.keys(serial, REMOVED)) - {fk(b"plain")} == gone

            long_key = b"y" * (KEY_BYTES + 1)
            assert await put(store, [long_key], Retention.LONG) == [True]
            await asyncio.sleep(0)
            assert fk(long_key) not in seen.keys(serial, STORED)  # too long to keep: not emitted, counted
            assert fk(long_key) in seen.keys("ram", STORED)  # (the RAM tier has every key)
            assert await store.lookup([fk(long_key)], DIALOG) == 1
            assert store.changes.unkept == 1  # the row is marked: a lookup does not try it again
            held = {tier: set() for tier in ("ram", serial)}
            async for tier, fkeys in store.held_keys():
                held[tier].update(fkeys)
            assert held[serial] == {fk(k) for k in keys[1:]}
            assert held["ram"] == {fk(k) for k in keys[1:]} | {fk(long_key)}

    asyncio.run(main())


def test_evictions_and_expiries_on_a_card_note_removed(tmp_path: Path) -> None:
    async def main() -> None:
        # A card for three objects of 10,000 bytes (14,096 stored), a RAM tier for none of them.
        async with started_store(tmp_path, card_capacity=55_000, max_bytes=0, ttl=0.5, **EVENTS) as store:
            seen = Seen(store.changes)
            serial = serial_of(store)
            keys = [b"e%d" % i for i in range(8)]
            for k in keys:
                await put(store, [k], Retention.LONG)  # (a put whose own write is evicted answers False)
            await asyncio.sleep(0)
            stored, evicted = seen.keys(serial, STORED), seen.keys(serial, REMOVED)
            assert stored == [fk(k) for k in keys]
            assert len(evicted) == 5 and set(evicted) < set(stored)
            await asyncio.sleep(0.6)
            mc = store.cards.set.cards[0]
            for k in keys:
                mc.catalog.entry(fk(k))  # past the ttl: deleted, its row goes once the delete is done
            await wait_until_async(lambda: len(mc.index) == 0, 10, "the expired objects' deletes")
            await asyncio.sleep(0)
            assert set(seen.keys(serial, REMOVED)) == {fk(k) for k in keys}

    asyncio.run(main())


def test_a_put_that_replaces_an_object_notes_stored_only(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path, **EVENTS) as store:
            await put(store, [b"again"], Retention.LONG)
            seen = Seen(store.changes)
            await put(store, [b"again"], Retention.LONG)
            await asyncio.sleep(0)
            assert seen.changes == [TierChange("ram", STORED, [fk(b"again")]),
                                    TierChange(serial_of(store), STORED, [fk(b"again")])]

    asyncio.run(main())


def test_a_card_leaving_the_set_notes_cleared(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path, n_cards=2, **EVENTS) as store:
            seen = Seen(store.changes)
            await put(store, [b"a", b"b", b"c"], Retention.LONG)
            serial = serial_of(store, 1)
            await store.cards.set.remove(serial, force=True)
            await asyncio.sleep(0)
            assert seen.changes[-1] == TierChange(serial, CLEARED, [])

    asyncio.run(main())


def test_rows_from_the_index_snapshot_are_noted_once_a_read_or_lookup_names_their_key(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path, **EVENTS) as store:
            await put(store, [b"read", b"looked-up", b"unnamed"], Retention.LONG)
        async with started_store(tmp_path, **EVENTS) as store:
            serial = serial_of(store)
            mc = store.cards.set.cards[0]
            assert len(mc.index) == 3 and mc.life.keeper.loaded == 3
            seen = Seen(store.changes)
            assert [t async for t in store.held_keys()] == []  # known by digest only
            dest = memoryview(bytearray(20_000))
            sizes, _ = await store.get([GetItem(fk(b"read"), DIALOG, dest)])
            assert sizes == [10_000]
            assert await store.lookup([fk(b"looked-up")], DIALOG) == 1
            await asyncio.sleep(0)
            assert seen.keys(serial, STORED) == [fk(b"read"), fk(b"looked-up")]
            held = [k for _tier, ks in [t async for t in store.held_keys()] for k in ks]
            assert sorted(held) == sorted([fk(b"read"), fk(b"looked-up")])

    asyncio.run(main())


def test_with_events_off_no_key_column_exists(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path) as store:
            await put(store, [b"a"], Retention.LONG)
            index = store.cards.set.cards[0].index
            assert not index.keys and not hasattr(index.rows, "key") and not hasattr(index.rows, "klen")
            held = [t async for t in store.held_keys()]
            assert held == [("ram", [fk(b"a")])]  # the RAM tier has its keys anyway

    asyncio.run(main())


def test_put_and_get_cost_with_and_without_a_subscriber(tmp_path: Path) -> None:
    """A timing for the report, not an assertion: puts of 32 objects of 10,000 bytes, then a get of them,
    into the RAM tier only (``short``: where a note's cost would show) and through to the card (``long``),
    with nobody listening, then one subscriber, then nobody again.  Measured (2 shared cores), microseconds
    per put/get: short 1,126-1,227/672-804 without, 1,104-1,256/639-782 with one; long is card writes,
    11-19 ms either way.  The RAM tier alone (reserve, commit, pin, unpin, delete of 10,000 keys, lru,
    median of 7): 14.3 us a key before the tiers noted changes, 13.0 with nobody listening, 13.1 with one
    subscriber: within the noise."""

    async def rounds(store: TieredStore, tag: bytes, retention: Retention, n: int) -> str:
        dests = [memoryview(bytearray(10_000)) for _ in range(32)]
        put_s = get_s = 0.0
        for r in range(n):
            ks = [tag + b"%d-%d" % (r, i) for i in range(32)]
            t0 = time.perf_counter()
            await put(store, ks, retention)
            t1 = time.perf_counter()
            await store.get([GetItem(fk(k), DIALOG, d) for k, d in zip(ks, dests)])
            get_s += time.perf_counter() - t1
            put_s += t1 - t0
        return f"{put_s / n * 1e6:.0f}/{get_s / n * 1e6:.0f}"

    async def main() -> None:
        async with started_store(tmp_path, max_bytes=64 << 20, card_capacity=256 << 20, **EVENTS) as store:
            for retention, n in ((Retention.SHORT, 100), (Retention.LONG, 20)):
                tag = retention.name.encode()
                await rounds(store, tag + b"w", retention, 10)
                quiet = await rounds(store, tag + b"q", retention, n)
                seen = Seen(store.changes)
                heard = await rounds(store, tag + b"h", retention, n)
                seen.unsubscribe()
                quiet2 = await rounds(store, tag + b"r", retention, n)
                print(f"\n{retention.name}: put/get of 32 x 10,000 B, us: nobody listening {quiet} and {quiet2}, "
                      f"one subscriber {heard}")

    asyncio.run(main())
