"""Writes and deletes of one key on a card run in the order they were issued (``KeyOrder``).

An eviction or expiry deletes its object later, on a card thread; a write of
the same key issued in between must never be the one that delete removes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from kvgate.cards import ObjectMeta
from kvgate.config import Config
from kvgate.tiers.io import KeyOrder
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.finder import KeyFinder
from tests.helpers import wait_until_async
from tests.tiers.common import background_deletes_done, scanned_card_set


def test_operations_on_one_key_run_in_issue_order_and_others_do_not_wait() -> None:
    async def main() -> None:
        order, log = KeyOrder(), []

        async def op(name: str, keys: list[bytes], hold: float, write: bool = False) -> None:
            async with order.turn(keys, write=write):
                log.append(f"{name} start")
                await asyncio.sleep(hold)
                log.append(f"{name} end")

        first = asyncio.create_task(op("delete a", [b"a"], 0.2))
        await asyncio.sleep(0)  # issued first
        second = asyncio.create_task(op("write a", [b"a", b"b"], 0.0, write=True))
        other = asyncio.create_task(op("write c", [b"c"], 0.0, write=True))
        await wait_until_async(lambda: "write c end" in log, 5, "the write of another key ran")
        assert order.writing(b"a") and order.writing(b"b"), "a write waiting for its turn counts as under way"
        assert log == ["delete a start", "write c start", "write c end"], log
        await asyncio.gather(first, second, other)
        assert log[-2:] == ["write a start", "write a end"]
        assert not order.writing(b"a") and not order.writing(b"c")
        await asyncio.sleep(0)  # the last turn's ending runs once its task is done
        assert order.pending() == 0

    asyncio.run(main())


def test_a_cancelled_waiter_does_not_let_later_operations_jump_the_queue() -> None:
    async def main() -> None:
        order, log = KeyOrder(), []

        async def op(name: str, hold: float) -> None:
            async with order.turn([b"k"]):
                log.append(f"{name} start")
                await asyncio.sleep(hold)
                log.append(f"{name} end")

        first = asyncio.create_task(op("first", 0.2))
        await asyncio.sleep(0)  # issued first
        waiting = asyncio.create_task(op("cancelled", 0.0))
        await asyncio.sleep(0.01)  # it waits for its turn now
        waiting.cancel()
        await asyncio.sleep(0.01)  # and is cancelled while the first still holds the key
        third = asyncio.create_task(op("third", 0.0))
        await asyncio.gather(first, third)
        assert log == ["first start", "first end", "third start", "third end"], log

    asyncio.run(main())


def _slow_deletes(card, seconds: float) -> threading.Event:
    """Card deletes (by name: what an eviction runs) that wait ``seconds`` before they remove anything (a slow
    or busy device)."""
    started = threading.Event()
    real = card.delete_named

    def delete_named(digest: bytes) -> bool:
        started.set()
        time.sleep(seconds)
        return real(digest)

    card.delete_named = delete_named
    return started


async def _tier(tmp_path: Path, capacity: int) -> CardSet:
    card = tmp_path / "card"
    card.mkdir()
    return await scanned_card_set(Config(storage_devices=[str(card)], card_capacity=capacity, eviction_policy="lru"))


async def _put(tier: CardSet, key: bytes, fill: int, size: int) -> bool:
    cs = tier.cards[0]
    meta = ObjectMeta(created_ns=time.time_ns())
    (stored,) = await cs.write([(key, memoryview(bytes([fill]) * size), meta)])
    assert isinstance(stored, int), stored
    return tier.note_written(cs, [key], [stored], [size], [meta])[0]


async def _read(tier: CardSet, key: bytes, size: int) -> bytes | None:
    dest = bytearray(size)
    (r,) = await tier.cards[0].read([(key, memoryview(dest))])
    return bytes(dest) if r.header is not None else None


def test_a_rewrite_after_an_eviction_is_not_deleted_by_it(tmp_path: Path) -> None:
    size = 64 << 10

    async def main() -> None:
        tier = await _tier(tmp_path, capacity=3 * (size + 8192))
        cs = tier.cards[0]
        started = _slow_deletes(cs.card, 0.5)
        for i, k in enumerate((b"a", b"b", b"c")):
            assert await _put(tier, k, i, size)
        assert await _put(tier, b"d", 3, size)  # over capacity: "a" is evicted, its delete is slow
        assert b"a" not in cs.index
        await wait_until_async(started.is_set, 5, "the eviction's delete running")
        assert await _put(tier, b"a", 9, size)  # written again while that delete runs
        await background_deletes_done(cs)
        assert b"a" in cs.index
        assert await _read(tier, b"a", size) == bytes([9]) * size, "the acknowledged rewrite is on the card"
        await tier.stop()

    asyncio.run(main())


def test_an_eviction_issued_while_a_rewrite_is_under_way_leaves_the_new_object(tmp_path: Path) -> None:
    size = 64 << 10

    async def main() -> None:
        tier = await _tier(tmp_path, capacity=3 * (size + 8192))
        cs = tier.cards[0]
        for i, k in enumerate((b"a", b"b", b"c")):
            assert await _put(tier, k, i, size)
        real_write = cs.card.write_many
        in_write = threading.Event()

        def slow_write_many(items, guard=None):
            in_write.set()
            time.sleep(0.3)  # the point: the rewrite is still under way when the eviction is decided
            return real_write(items, guard)

        cs.card.write_many = slow_write_many
        rewrite = asyncio.create_task(_put(tier, b"a", 9, size))
        await wait_until_async(in_write.is_set, 5, "the rewrite in its card write")
        cs.card.write_many = real_write
        _slow_deletes(cs.card, 0.5)  # the victim's delete would end after the rewrite's rename
        assert await _put(tier, b"d", 3, size)  # over capacity: the old "a" is the victim, its rewrite under way
        assert await rewrite
        await background_deletes_done(cs)
        assert await _read(tier, b"a", size) == bytes([9]) * size, "the rewrite survived the old object's eviction"
        await tier.stop()

    asyncio.run(main())


def test_an_evicted_object_is_a_miss_while_its_delete_is_pending(tmp_path: Path) -> None:
    """A put answered False for an object its own batch evicted: no probe may find it before the delete runs."""
    size = 64 << 10

    async def main() -> None:
        tier = await _tier(tmp_path, capacity=3 * (size + 8192))
        cs = tier.cards[0]
        started = _slow_deletes(cs.card, 0.5)
        for i, k in enumerate((b"a", b"b", b"c", b"d")):
            await _put(tier, k, i, size)
        assert b"a" not in cs.index and cs.card.exists(b"a"), "evicted, still on the card"
        assert KeyFinder(tier).find(b"a", cs) == (None, None), "a probe would find what the put said is not stored"
        assert KeyFinder(tier).find(b"b", cs)[1] is not None
        await background_deletes_done(cs)
        assert started.is_set()
        assert not cs.card.exists(b"a") and b"a" not in cs.catalog.leaving
        assert await _put(tier, b"a", 7, size)  # stored again: found again
        assert KeyFinder(tier).find(b"a", cs)[1] is not None and await _read(tier, b"a", size) == bytes([7]) * size
        await tier.stop()

    asyncio.run(main())
