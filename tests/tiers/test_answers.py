"""In process: the RAM tier's ttl, where ``KeyFinder.find`` answers from, and what a scan counts.

The same behaviours are proven end to end in tests/gateway/test_answers_agree.py
and tests/gateway/test_card_capacity.py; these pin the rules down one by one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.config import Config
from kvgate.keys import dialog_digest
from kvgate.tiers.eviction import LONG

from kvgate.tiers.cardset import CardSet
from kvgate.tiers.finder import KeyFinder
from tests.tiers.common import background_deletes_done, scanned_card_set
from kvgate.tiers.ram import RamPages

PAGE = 4096


def put_ram(tier: RamPages, key: bytes, created_ns: int) -> None:
    res = tier.reserve(key, 100, ObjectMeta(created_ns=created_ns), LONG)
    assert res is not None
    tier.commit(res)


def test_ram_entry_past_the_ttl_is_a_miss_for_every_question() -> None:
    expired: list[int] = []
    tier = RamPages(16 * PAGE, PAGE, ttl=2.0, on_expired=expired.append)
    now = time.time_ns()
    for k in (b"old1", b"old2", b"old3"):
        put_ram(tier, k, now - 3_000_000_000)
    put_ram(tier, b"new", now)
    assert not tier.contains(b"old1")
    assert tier.size_of(b"old2") is None
    assert tier.pin(b"old3") is None
    assert tier.entries == 1 and tier.contains(b"new") and tier.size_of(b"new") == 100
    assert sum(expired) == 3
    assert tier.used_pages == 1, "the expired entries' pages are free again"


def test_ram_without_ttl_keeps_old_entries() -> None:
    tier = RamPages(4 * PAGE, PAGE)
    put_ram(tier, b"k", 1)
    assert tier.contains(b"k")


async def _long_tier(tmp_path: Path, n_cards: int, **cfg) -> CardSet:
    dirs = [tmp_path / f"card{i}" for i in range(n_cards)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    config = Config(storage_devices=[str(d) for d in dirs], storage_slots=16 * n_cards, **cfg)
    return await scanned_card_set(config)


def test_find_answers_from_any_index_and_probes_only_the_home_card(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await _long_tier(tmp_path, 3, card_capacity=1 << 30)
        d = dialog_digest(b"a dialog")
        keys = [b"k%02d" % i for i in range(30)]
        written = {}
        for k in keys:
            cs = tier.layout.card_for(k, d)
            assert tier.note_written(cs, [k], [100], [90], [ObjectMeta(d, -1, time.time_ns())])[0]
            written[k] = cs
        no_dialog_homes = tier.layout.cards_for(keys, dialog_digest(None))
        assert any(h is not written[k] for k, h in zip(keys, no_dialog_homes)), "some keys live off their key's card"
        for k, home in zip(keys, no_dialog_homes):
            cs, entry = KeyFinder(tier).find(k, home)
            assert cs is written[k] and entry == written[k].index.get(k)
        home = tier.layout.card_for(b"unknown", dialog_digest(None))
        assert KeyFinder(tier).find(b"unknown", home) == (home, None)
        await tier.stop()

    asyncio.run(main())


def test_a_rewrite_on_another_card_drops_the_old_copy(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await _long_tier(tmp_path, 3, card_capacity=1 << 30)
        k = next(b"k%d" % i for i in range(100)
                 if tier.layout.card_for(b"k%d" % i, dialog_digest(None)) is not tier.layout.card_for(b"k%d" % i, dialog_digest(b"d")))
        first, second = tier.layout.card_for(k, dialog_digest(None)), tier.layout.card_for(k, dialog_digest(b"d"))
        tier.note_written(first, [k], [100], [90], [ObjectMeta(created_ns=time.time_ns())])
        tier.note_written(second, [k], [100], [90], [ObjectMeta(dialog_digest(b"d"), -1, time.time_ns())])
        assert k not in first.index and first.used == 0
        assert KeyFinder(tier).find(k, first)[0] is second
        await tier.stop()

    asyncio.run(main())


def test_find_calls_an_indexed_object_past_the_ttl_a_miss_and_deletes_it(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await _long_tier(tmp_path, 1, card_capacity=1 << 30, ttl=2.0)
        cs = tier.cards[0]
        payload = memoryview(b"x" * 100)
        old = ObjectMeta(created_ns=time.time_ns() - 3_000_000_000)
        (stored,) = await cs.write([(b"old", payload, old)])
        assert tier.note_written(cs, [b"old"], [stored], [100], [old])[0]
        assert KeyFinder(tier).find(b"old", cs) == (None, None), "a miss, not 'ask the card'"
        assert KeyFinder(tier).find(b"old", cs) == (None, None)
        await background_deletes_done(cs)
        assert b"old" not in cs.index and not cs.card.exists(b"old")
        await tier.stop()

    asyncio.run(main())


def test_scan_counts_what_the_card_holds_toward_its_capacity(tmp_path: Path, monkeypatch) -> None:
    """Sized by free space, a card's capacity after the scan is held + free - reserve, not free - reserve."""
    async def main() -> None:
        tier = await _long_tier(tmp_path, 1, card_capacity=1 << 30)
        cs = tier.cards[0]
        items = [(b"k%d" % i, memoryview(bytes(1 << 20)), ObjectMeta(created_ns=time.time_ns())) for i in range(8)]
        for (k, p, m), stored in zip(items, await cs.write(items)):
            tier.note_written(cs, [k], [stored], [len(p)], [m])
        held = cs.used
        await tier.stop()

        # Leave half of what the card holds free beyond the reserve: sized by
        # free space alone, it could keep only half of its objects.
        # The filesystem's free space as it is now, held still: other writers on the same disk (a build
        # beside the tests) moved it by more than half of what the card holds between two starts.
        free = cs.card.free_bytes()
        monkeypatch.setattr(DirectoryCard, "free_bytes", lambda self: free)
        tier = await _long_tier(tmp_path, 1, card_reserve=free - held // 2)
        cs = tier.cards[0]
        assert cs.used == held and len(cs.index) == 8 and cs.catalog.counters.evictions == 0
        assert cs.capacity == held + held // 2
        await tier.stop()

    asyncio.run(main())
