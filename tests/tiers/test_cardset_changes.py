"""In process: cards that join, drain and leave a running card set, with every object still readable."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from kvgate.cards import ObjectMeta
from kvgate.config import Config
from kvgate.keys import dialog_digest, full_key
from kvgate.tiers import mover
from kvgate.tiers.cardset import CardChangeError, CardSet
from kvgate.tiers.finder import KeyFinder
from tests.helpers import wait_until_async
from tests.tiers.common import scanned_card_set

SIZE = 4096


def _payload(k: bytes) -> bytes:
    return hashlib.sha256(k).digest() * (SIZE // 32)


async def _started(tmp_path: Path, names: list[str]) -> CardSet:
    for n in names:
        (tmp_path / n).mkdir()
    cfg = Config(storage_devices=[str(tmp_path / n) for n in names], card_capacity=64 << 20, storage_slots=64)
    return await scanned_card_set(cfg)


async def _write_dialog(cards: CardSet, d: int, blocks: int = 4) -> list[bytes]:
    dialog = dialog_digest(b"dialog-%d" % d)
    keys = [full_key(b"ns", b"d%d-b%d" % (d, i)) for i in range(blocks)]
    home = cards.layout.card_for(keys[0], dialog)
    items = [(k, memoryview(_payload(k)), ObjectMeta(dialog, i)) for i, k in enumerate(keys)]
    for (k, p, m), stored in zip(items, await home.write(items)):
        assert isinstance(stored, int)
        assert cards.note_written(home, [k], [stored], [len(p)], [m])[0]
    return keys


async def _read_all(cards: CardSet, d: int, keys: list[bytes]) -> int:
    """How many leading blocks of the dialog read back right (a wrong byte fails the test)."""
    dialog = dialog_digest(b"dialog-%d" % d)
    n = 0
    for k, home in zip(keys, cards.layout.cards_for(keys, dialog)):
        mc, entry = KeyFinder(cards).find(k, home)
        if mc is None or entry is None:
            break
        dest = memoryview(bytearray(SIZE))
        (r,) = await mc.read([(k, dest)])
        if r.header is None:
            break
        assert dest.tobytes() == _payload(k), "a wrong byte"
        n += 1
    return n


def test_join_drain_undrain_remove_lose_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mover, "RETRY_S", 0.05)

    async def main() -> None:
        cards = await _started(tmp_path, ["a", "b"])
        try:
            assert cards.mover.rate == cards.cfg.card_move_rate == 128 << 20
            dialogs = {d: await _write_dialog(cards, d) for d in range(40)}
            gen0, fp0 = cards.generation, cards.fingerprint

            (tmp_path / "c").mkdir()
            joined = await cards.add(str(tmp_path / "c"))
            assert cards.generation == gen0 + 1 and cards.fingerprint != fp0
            share = len(cards.layout.slot_map.slots_of(joined.serial)) / cards.layout.slot_map.slots
            assert 0.1 < share < 0.6, share
            # A join costs no hits: every dialog reads back whole, before and after the mover ran.
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 40
            await _settle(cards)
            assert len(joined.index) > 0, "the mover copied the joined card's slots over"
            for mc in cards.cards:
                assert not await cards.mover.misplaced(mc)
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 40

            # Drain: no new writes land there; once its objects are elsewhere it leaves.
            drained = cards.cards[0]
            serial = drained.serial
            cards.drain(serial)
            assert all(cards.layout.card_for(k, dialog_digest(b"dialog-%d" % d)) is not drained
                       for d, ks in dialogs.items() for k in ks)
            await _settle(cards)
            assert drained not in cards.cards and serial not in cards.layout.slot_map.serials
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 40

            with pytest.raises(CardChangeError, match="no card with serial"):
                cards.undrain(serial)
            other = cards.cards[0]
            cards.drain(other.serial)
            cards.undrain(other.serial)  # back before it emptied: it serves again
            await _settle(cards)
            assert other in cards.cards and other.serial in cards.layout.slot_map.serials
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 40

            # Remove: at once; what it held is a miss from then on, the rest reads back.
            gone = cards.cards[0]
            had = {d for d, ks in dialogs.items() if ks[0] in gone.index}
            await cards.remove(gone.serial)
            got = {d: await _read_all(cards, d, k) for d, k in dialogs.items()}
            assert all(got[d] == 4 for d in dialogs if d not in had)
            assert all(got[d] == 0 for d in had)
            with pytest.raises(CardChangeError, match="last card in service"):
                cards.drain(cards.cards[0].serial)
        finally:
            await cards.stop()

    asyncio.run(main())


async def _misplaced(cards: CardSet) -> int:
    return sum([len(await cards.mover.misplaced(mc)) for mc in cards.cards])


async def _settle(cards: CardSet) -> None:
    deadline = asyncio.get_running_loop().time() + 8
    while await _misplaced(cards) or cards._draining:
        assert asyncio.get_running_loop().time() < deadline, "the mover did not settle within 8 s"
        await asyncio.sleep(0.02)


def test_adding_a_card_in_use_or_missing_says_why(tmp_path: Path) -> None:
    async def main() -> None:
        cards = await _started(tmp_path, ["a"])
        try:
            with pytest.raises(CardChangeError, match="in use already"):
                await cards.add(str(tmp_path / "a"))
            with pytest.raises(CardChangeError, match="cannot be used"):
                await cards.add(str(tmp_path / "missing"))
            assert len(cards.cards) == 1 and cards.generation == 0
        finally:
            await cards.stop()

    asyncio.run(main())


def test_a_new_device_list_adds_and_drains(tmp_path: Path, monkeypatch) -> None:
    """What SIGHUP applies: entries new to storage_devices join, entries gone from it drain and leave."""
    monkeypatch.setattr(mover, "RETRY_S", 0.05)

    async def main() -> None:
        cards = await _started(tmp_path, ["a", "b"])
        try:
            dialogs = {d: await _write_dialog(cards, d) for d in range(20)}
            (tmp_path / "c").mkdir()
            (tmp_path / "d").mkdir()
            a = str(tmp_path / "a")
            problems = await cards.apply_devices([str(tmp_path / "b"), str(tmp_path / "[cd]"),
                                                  str(tmp_path / "later")])
            assert problems == []
            assert sorted(mc.location for mc in cards.cards if not cards.is_draining(mc)) == [
                str(tmp_path / n) for n in "bcd"]
            assert [mc.pattern for mc in cards.pending] == [str(tmp_path / "later")]
            await _settle(cards)
            assert a not in [mc.location for mc in cards.cards], "the entry gone drained and left"
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 20
            await cards.apply_devices([str(tmp_path / "b"), str(tmp_path / "[cd]")])
            assert cards.pending == []
        finally:
            await cards.stop()

    asyncio.run(main())


def test_the_mover_keeps_to_its_rate_and_copies_the_hottest_dialogs_first(tmp_path: Path) -> None:
    """What docs/operations.md promises of the mover: at most its rate in bytes a second, hottest dialogs first."""
    async def main() -> None:
        cards = await _started(tmp_path, ["a"])
        try:
            dialogs = {d: await _write_dialog(cards, d) for d in range(24)}
            (src,) = cards.cards
            cards.mover.rate = 20 * SIZE  # bytes a second: the half of 96 objects that move take about 2.4 s
            copied: list[bytes] = []
            real_note_written = cards.note_written

            def note_written(mc, fkeys, stored, payload_lens, metas):
                copied.extend(fkeys)
                return real_note_written(mc, fkeys, stored, payload_lens, metas)

            cards.note_written = note_written  # type: ignore[method-assign]
            (tmp_path / "b").mkdir()
            # Which dialogs move depends on the new card's (random) serial: hold the mover until the
            # hot ones are chosen among those, so the order is checked on every run.
            real_wake, cards.mover.wake = cards.mover.wake, lambda: None  # type: ignore[method-assign]
            joined = await cards.add(str(tmp_path / "b"))  # one source card: one order to check
            moving = [d for d, ks in dialogs.items() if cards.layout.card_for(ks[0], dialog_digest(b"dialog-%d" % d)) is joined]
            assert len(moving) >= 2, moving  # about 12 of 24
            hot = moving[::2]
            for d in hot:  # read again: these are the hot ones now
                for k in dialogs[d]:
                    src.catalog.note_hit(k, SIZE)
            cards.mover.wake = real_wake  # type: ignore[method-assign]
            cards.mover.wake()
            started = asyncio.get_running_loop().time()
            await asyncio.sleep(1.0)
            in_one_second = cards.mover.moved_bytes
            assert 0 < in_one_second <= 20 * SIZE + 8 * SIZE, in_one_second  # the rate, plus one batch
            await _settle(cards)
            took = asyncio.get_running_loop().time() - started
            assert took >= cards.mover.moved_bytes / cards.mover.rate - 8 * SIZE / cards.mover.rate, took
            moved_dialogs = [next(d for d, ks in dialogs.items() if k in ks) for k in copied]
            first = list(dict.fromkeys(moved_dialogs))
            hot_moved = [d for d in first if d in hot]
            assert hot_moved and first[: len(hot_moved)] == hot_moved, f"cold dialogs copied before hot ones: {first}"
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 24
        finally:
            await cards.stop()

    asyncio.run(main())


def _keys_of(d: int) -> list[bytes]:
    """The 4 blocks of dialog ``d``."""
    return [full_key(b"ns", b"d%d-b%d" % (d, i)) for i in range(4)]


async def _put_on_card(store, d: int, indexed: bool = True) -> None:
    """Dialog ``d`` through the store, then out of RAM (on its card only); ``indexed`` False: also out of the
    card's index, as another gateway of a shared card would have written it."""
    from kvgate.tiers.store import PutItem
    from kvgate.types import Retention

    dialog = dialog_digest(b"dialog-%d" % d)
    items = [PutItem(k, memoryview(_payload(k)), ObjectMeta(dialog, i)) for i, k in enumerate(_keys_of(d))]
    assert await store.put(items, Retention.LONG) == [True] * 4
    for k in _keys_of(d):
        store.ram.pages.delete(k)
        if not indexed:
            for mc in store.cards.set.cards:
                mc.catalog.note_gone(k)


@pytest.mark.parametrize("placement", ["dialog", "stripe"])
def test_a_join_costs_no_hits_of_objects_no_index_holds_until_the_move_settles(tmp_path: Path,
                                                                              placement: str) -> None:
    """Objects another gateway of a shared card wrote are in no index here, so the mover does not know
    them: while it settles a join, a miss on a slot's new card asks the slot's old one (lookup, exists,
    get, prewarm).  Once it has settled, they are misses on their new card, as docs/operations.md says."""
    from kvgate.tiers.store import GetItem
    from tests.tiers.test_store import started_store

    keys_of = _keys_of

    async def main() -> None:
        async with started_store(tmp_path, n_cards=1, key_placement=placement, storage_slots=64) as store:
            cards = store.cards.set
            (old,) = cards.cards
            theirs = range(40)  # written by "another gateway": on the card, in no index here
            for d in theirs:
                await _put_on_card(store, d, indexed=False)
            for d in range(100, 140):  # ours, indexed: the mover has these to copy, slowly
                await _put_on_card(store, d)
            cards.mover.rate = 2 * SIZE

            async def restorable(d: int) -> tuple[int, list[bool], int]:
                dialog = dialog_digest(b"dialog-%d" % d)
                keys = keys_of(d)
                n = await store.lookup(keys, dialog)
                present = await store.exists(keys, dialog)
                items = [GetItem(k, dialog, memoryview(bytearray(SIZE))) for k in keys]
                sizes, _ = await store.get(items)
                for it, size in zip(items, sizes):
                    if size == SIZE:
                        assert it.dest.tobytes() == _payload(it.fkey), "a wrong byte"
                return n, present, sum(s == SIZE for s in sizes)

            (tmp_path / "card1").mkdir()
            new = await cards.add(str(tmp_path / "card1"))
            moved = [d for d in theirs if cards.layout.card_for(keys_of(d)[0], dialog_digest(b"dialog-%d" % d)) is new]
            assert moved and await cards.mover.misplaced(old), "some slots moved, and the mover is still copying"
            for d in theirs:
                assert await restorable(d) == (4, [True] * 4, 4), f"dialog {d} lost hits to the join"
            dialog = dialog_digest(b"dialog-%d" % moved[0])
            assert await store.prewarm(keys_of(moved[0]), dialog) == 4  # into RAM, from the old card

            cards.mover.rate = 1 << 30
            cards.mover.wake()
            await wait_until_async(lambda: not cards.layout.settling, 30, "the mover settled the join", interval=0.02)
            if placement == "dialog":  # whole dialogs moved: theirs are misses on the new card now
                for d in moved[1:]:
                    assert (await restorable(d))[0] == 0
            for d in range(100, 140):  # ours were copied: every block still there
                assert (await restorable(d))[0] == 4

    asyncio.run(main())


@pytest.mark.parametrize("placement", ["dialog", "stripe"])
def test_two_joins_before_the_mover_settles_cost_no_hits_either(tmp_path: Path, placement: str) -> None:
    """A slot that moved twice (card0 -> card1 -> card2) before the mover settled: a miss on card2 asks
    card1, then card0, where the objects no index holds still are (lookup, exists, get, prewarm,
    delete)."""
    from kvgate.tiers.store import GetItem
    from tests.tiers.test_store import started_store

    keys_of = _keys_of

    async def main() -> None:
        async with started_store(tmp_path, n_cards=1, key_placement=placement, storage_slots=64) as store:
            cards = store.cards.set
            (card0,) = cards.cards
            theirs = range(60)
            for d in theirs:  # written by "another gateway": on card0, in no index here
                await _put_on_card(store, d, indexed=False)

            async def busy() -> bool:  # a mover that never gets done: the changes stay unsettled
                return True

            cards.mover._round = busy  # type: ignore[method-assign]
            homes = {}
            for name in ("card1", "card2"):
                (tmp_path / name).mkdir()
                homes[name] = await cards.add(str(tmp_path / name))
            assert len(cards.layout._unsettled) == 2

            def twice(d: int) -> bool:  # the first key's slot was card1's after the first join, card2's now
                k, dialog = keys_of(d)[0], dialog_digest(b"dialog-%d" % d)
                return (cards.layout.card_for(k, dialog) is homes["card2"]
                        and cards.layout.earlier_homes(k, dialog, homes["card2"])[:1] == [homes["card1"]])

            moved_twice = [d for d in theirs if twice(d)]
            assert moved_twice, "no slot moved twice: pick more dialogs"
            for d in theirs:
                dialog = dialog_digest(b"dialog-%d" % d)
                keys = keys_of(d)
                assert await store.lookup(keys, dialog) == 4, f"dialog {d}: lookup"
                assert await store.exists(keys, dialog) == [True] * 4, f"dialog {d}: exists"
                items = [GetItem(k, dialog, memoryview(bytearray(SIZE))) for k in keys]
                sizes, _ = await store.get(items)
                assert sizes == [SIZE] * 4, f"dialog {d}: get"
                for it in items:
                    assert it.dest.tobytes() == _payload(it.fkey), "a wrong byte"
            d = moved_twice[0]
            dialog = dialog_digest(b"dialog-%d" % d)
            assert await store.prewarm(keys_of(d), dialog) == 4
            assert await store.delete(keys_of(d), dialog) == 4
            assert not card0.card.exists(keys_of(d)[0]), "deleted where it was, two changes back"

    asyncio.run(main())


def test_a_move_waits_for_a_card_out_of_service_and_goes_on_when_it_is_back(tmp_path: Path, monkeypatch) -> None:
    """The joined card goes out of service before the mover copied anything to it: the mover tries again
    less and less often (each round copies the index's columns), and goes on as soon as the card is
    back, not at its next try; misses keep asking the old card meanwhile."""
    monkeypatch.setattr(mover, "RETRY_S", 0.1)

    async def main() -> None:
        cards = await _started(tmp_path, ["a"])
        loop = asyncio.get_running_loop()
        try:
            dialogs = {d: await _write_dialog(cards, d) for d in range(24)}
            started: list[float] = []  # when each round began
            real_round = cards.mover._round

            async def counted_round() -> bool:
                started.append(loop.time())
                return await real_round()

            cards.mover._round = counted_round  # type: ignore[method-assign]
            (tmp_path / "b").mkdir()
            joined = await cards.add(str(tmp_path / "b"))
            joined.life.health.take_out("test: out of service", by_error=True)
            await asyncio.sleep(3.2)  # at RETRY_S 0.1 without backing off: 32 rounds
            # Backing off: rounds at about 0, 0.1, 0.3, 0.7, 1.5 and 3.1 s, the next not before 6.3 s.
            assert 2 <= len(started) <= 7, started
            assert cards.layout.settling, "the join is not settled while its card is out"
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 24
            rounds, back = len(started), loop.time()
            joined.life.health.taken_out_by_error = False  # it answers its next check: back at once
            await wait_until_async(lambda: joined.active, 5, "the card back in service")
            await wait_until_async(lambda: len(started) > rounds, 5, "a round after the card came back")
            assert started[rounds] - back < 2.0, "the card's return woke the mover (its back-off was 3 s)"
            await _settle(cards)
            assert len(joined.index) > 0, "the mover went on once the card was back"
            await wait_until_async(lambda: not cards.layout.settling, 10, "the join settled")
            assert [await _read_all(cards, d, k) for d, k in dialogs.items()] == [4] * 24
        finally:
            await cards.stop()

    asyncio.run(main())


def test_the_cards_share_one_referee_that_counts_what_they_all_hold(tmp_path: Path) -> None:
    """The orders' merit is the traffic's: under "adaptive" every card's index asks one referee, sized by
    what the whole set holds, and a card's index made afresh (cleared, or loaded at restart) keeps it."""
    async def main() -> None:
        cards = await _started(tmp_path, ["a", "b", "c"])
        try:
            referee = cards.referee
            assert referee is not None and cards.cfg.eviction_policy == "adaptive"
            assert all(mc.index.policy.referee is referee for mc in cards.cards)
            for d in range(12):
                await _write_dialog(cards, d)
            assert sum(len(mc.index) for mc in cards.cards) == 48 == referee._resident()
            assert len({id(mc) for mc in cards.cards if len(mc.index)}) > 1, "the dialogs went to several cards"
            mc = cards.cards[0]
            mc.index.clear()
            assert mc.index.policy.referee is referee
            assert mc.catalog.new_index().policy.referee is referee
        finally:
            await cards.stop()
        lru = Config(storage_devices=[str(tmp_path / "a")], card_capacity=64 << 20, eviction_policy="lru")
        plain = await scanned_card_set(lru)
        try:
            assert plain.referee is None and plain.cards[0].index.policy.referee is None
        finally:
            await plain.stop()

    asyncio.run(main())
