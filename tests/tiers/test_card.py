"""ManagedCard on its own: what each card answer reads as, how a prefix probe asks the card, and what a
full card does (ENOSPC lowers its capacity to what the medium really has, once per episode, not once per
failed write).

One request that meets a full card fails several objects at once; lowering
the capacity for each of them compounded (0.9 ** n of what fits: a
48-object request on an 8 MiB card left 0.3 MiB), and a guess from what was
indexed when the write failed was 0 when nothing of the request was indexed
yet.  So an ENOSPC reads the medium's free space again: capacity is what
the card holds plus what is free, less the reserve.  While the objects
evicted for the first ENOSPC are still being deleted, a further ENOSPC
tells nothing new.  Once they are gone, a new ENOSPC lowers it again.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

from kvgate.cards import Card, ObjectMeta, make_card
from kvgate.config import Config
from kvgate.keys import dialog_digest
from kvgate.tiers.holds import Holds
from kvgate.tiers.card import ManagedCard
from kvgate.tiers.io import CardIo
from tests.tiers.common import serving_card


async def _serving_directory_card(tmp_path: Path, **settings) -> tuple[Card, ManagedCard]:
    """A directory card in ``tmp_path / "card"`` and its ``ManagedCard`` in service, one I/O thread."""
    (tmp_path / "card").mkdir()
    cfg = Config(storage_devices=[str(tmp_path / "card")], **settings)
    card = make_card(str(tmp_path / "card"), cfg)
    io = CardIo(1, 5.0, "test-card")
    return card, serving_card(card, io, cfg, serial=await io.run(card.open))


def test_enospc_lowers_capacity_to_the_medium_once_while_evicted_objects_are_deleted(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "card").mkdir()  # a configured card directory is never created by the gateway
        cfg = Config(storage_devices=[str(tmp_path / "card")], card_reserve=10_000)  # sized by its free space
        card = make_card(str(tmp_path / "card"), cfg)
        card.free_bytes = lambda: 0  # type: ignore[method-assign]  # another writer filled the medium
        io = CardIo(1, 5.0, "test-card")
        cs = serving_card(card, io, cfg, serial=await io.run(card.open))  # capacity 1 GiB: the free space it had
        for i in range(100):
            cs.catalog.note_written([b"k%03d" % i], [1000], [900],
                                    [ObjectMeta(dialog_digest(b"d%d" % (i // 10)), i % 10, 1)])
        assert cs.used == 100_000

        async def settle() -> None:  # the free space read, then the delete it spawned
            while cs.life.tasks._running:
                await cs.life.tasks.wait()

        full = OSError(errno.ENOSPC, "No space left on device")
        for _ in range(8):  # one request, eight objects that did not fit
            cs.life.note_result(full)
        await settle()  # the free space is read, the card shrunk, the evicted objects deleted
        assert cs.capacity == 90_000, "held + free - reserve, once for the whole request"
        assert cs.used <= 90_000 and cs.catalog.counters.evictions == 10
        snap = cs.snapshot()  # the default policy says which of its orders chose each eviction
        assert snap["prefix_order_evictions"] + snap["recency_order_evictions"] == 10, snap
        assert cs.active, "a full card is not a broken card"
        cs.life.note_result(full)  # full again with the room made: others took it
        await settle()
        assert cs.capacity == 80_000
        card.free_bytes = lambda: 1 << 20  # type: ignore[method-assign]
        cs.life.note_result(full)  # a write that failed for room the medium has now: nothing to lower
        await settle()
        assert cs.capacity == 80_000
        await cs.life.close()

    asyncio.run(main())


def test_a_configured_capacity_larger_than_the_medium_is_lowered_to_it_and_writes_then_make_room_first(
        tmp_path: Path) -> None:
    """card_capacity promises room (no reserve applies); an ENOSPC shows the medium is smaller: capacity
    becomes what it holds plus what is free, and from then on a write evicts before it starts."""
    async def main() -> None:
        card, cs = await _serving_directory_card(tmp_path, card_capacity=1 << 30)
        payload = memoryview(bytes(4096))
        keys = [b"k%d" % i for i in range(4)]
        for k in keys:
            (stored,) = await cs.write([(k, payload, ObjectMeta(created_ns=1))])
            assert cs.catalog.note_written([k], [stored], [len(payload)], [ObjectMeta(created_ns=1)])[0]
        assert cs.catalog.room.slack > 1 << 40 and cs.catalog.deleting == 0, "as configured: the write went first, no eviction"
        card.free_bytes = lambda: 0  # type: ignore[method-assign]
        cs.life.note_result(OSError(errno.ENOSPC, "No space left on device"))
        while cs.life.tasks._running:
            await cs.life.tasks.wait()
        assert cs.capacity == cs.used == 4 * stored and cs.catalog.room.slack == 0
        (again,) = await cs.write([(b"new", payload, ObjectMeta(created_ns=1))])
        assert isinstance(again, int) and cs.catalog.counters.evictions == 1, "room made before the write"
        assert len([k for k in keys if cs.card.exists(k)]) == 3, "the victim is deleted (the write waited for it)"
        await cs.life.close()

    asyncio.run(main())


def test_each_card_answer_reads_as_its_own_outcome() -> None:
    """``CardRead.of``: an object a newer kvgate wrote is TOO_NEW (left in place), not a plain miss."""
    from kvgate.cards import BufferTooSmall, Header, ObjectCorrupt, ObjectMissing, ObjectTooNew
    from kvgate.tiers.reads import CardRead, ReadOutcome

    header = Header(64, 3, 0, ObjectMeta(), b"k", 64)
    cases = [(header, ReadOutcome.HIT), (ObjectMissing("k"), ReadOutcome.MISSING),
             (ObjectTooNew("k"), ReadOutcome.TOO_NEW), (ObjectCorrupt("k"), ReadOutcome.CORRUPT),
             (BufferTooSmall(10), ReadOutcome.TOO_SMALL), (TimeoutError("late"), ReadOutcome.FAILED)]
    for answer, outcome in cases:
        assert CardRead.of(answer).outcome is outcome, answer


def test_a_batch_is_cut_from_its_end_where_held_objects_leave_no_room(tmp_path: Path) -> None:
    """Held objects (lookup-and-lock) are never evicted to make room: a batch that would need them gone
    keeps its leading objects and its last ones are refused (``NoRoom``) without I/O, until the holds end."""
    from kvgate.tiers.catalog import NoRoom

    async def main() -> None:
        (tmp_path / "card").mkdir()
        cfg = Config(storage_devices=[str(tmp_path / "card")], card_reserve=0)  # sized by free space, no slack
        card = make_card(str(tmp_path / "card"), cfg)
        io = CardIo(2, 5.0, "test-card")
        payload = memoryview(bytes(64 << 10))
        holds = Holds()
        cs = serving_card(card, io, cfg, serial=await io.run(card.open), holds=holds)
        old = [b"old%d" % i for i in range(3)]
        for k in old:
            (stored,) = await cs.write([(k, payload, ObjectMeta(created_ns=1))])
            assert cs.catalog.note_written([k], [stored], [len(payload)], [ObjectMeta(created_ns=1)])[0]
        cs.catalog.room.capacity = 3 * stored + stored // 2  # room for three and a half
        assert holds.hold(1, old[:2]) == [True, True]
        new = [(b"new%d" % i, payload, ObjectMeta(created_ns=2)) for i in range(3)]
        out = await cs.write(new)
        assert isinstance(out[0], int) and [type(r) for r in out[1:]] == [NoRoom, NoRoom], out
        assert "held" in str(out[2]) and cs.catalog.room.writing == 0
        assert cs.catalog.counters.evictions == 1 and all(cs.card.exists(k) for k in old[:2]), "held objects stay"
        holds.release(1, old[:2])
        out = await cs.write(new[1:])
        assert all(isinstance(r, int) for r in out), out
        await cs.life.close()

    asyncio.run(main())


def test_a_card_lowered_by_a_full_medium_grows_back_at_its_next_resize_check(tmp_path: Path) -> None:
    """What docs/architecture.md (Capacity) and docs/operations.md promise: a card sized by its free space,
    lowered after another writer filled the medium, takes its room back by itself once the medium has it again
    (``resize``, every ``RESIZE_EVERY_CHECKS`` health checks)."""
    from kvgate.tiers.life import RESIZE_EVERY_CHECKS

    async def main() -> None:
        card, cs = await _serving_directory_card(tmp_path, card_reserve=0)
        for i in range(10):
            cs.catalog.note_written([b"k%d" % i], [1000], [900], [ObjectMeta(created_ns=1)])
        card.free_bytes = lambda: 0  # type: ignore[method-assign]
        cs.life.note_result(OSError(errno.ENOSPC, "No space left on device"))
        while cs.life.tasks._running:
            await cs.life.tasks.wait()
        assert cs.capacity == 10_000
        card.free_bytes = lambda: 1 << 20  # type: ignore[method-assign]  # the other writer is gone
        for _ in range(RESIZE_EVERY_CHECKS - 1):
            assert await cs.life.check()
        assert cs.capacity == 10_000, "not before its check"
        assert await cs.life.check()
        assert cs.capacity == 10_000 + (1 << 20)
        await cs.life.close()

    asyncio.run(main())


def test_a_prefix_probe_asks_the_first_key_alone_before_the_rest() -> None:
    """A probe of keys no index knows is most often a prompt nothing holds: one check answers it, not one per
    key (1,000 absent keys took 13 ms of stats on a directory card)."""
    from kvgate.tiers.card import _exists_prefix

    class Holding:
        def __init__(self, held: set[bytes]) -> None:
            self.held, self.asked = held, []

        def exists_many(self, keys: list[bytes], not_before_ns: int | None = None) -> list[bool]:
            self.asked.append(list(keys))
            return [k in self.held for k in keys]

    keys = [b"k%d" % i for i in range(1000)]
    none = Holding(set())
    assert _exists_prefix(none, keys, None) == 0 and none.asked == [keys[:1]]
    some = Holding(set(keys[:600]) | {keys[700]})
    assert _exists_prefix(some, keys, None) == 600 and some.asked == [keys[:1], keys[1:]]
    one = Holding({keys[0]})
    assert _exists_prefix(one, keys[:1], None) == 1 and one.asked == [keys[:1]]


def test_a_write_that_names_a_key_twice_is_indexed_as_its_last_object(tmp_path: Path) -> None:
    """A client may put one key twice in a request: the card write indexes the batch at once
    (``CardCatalog.note_written``), and the later object must be what the index holds, counted once."""
    async def main() -> None:
        card, cs = await _serving_directory_card(tmp_path, card_reserve=0)
        stayed = cs.catalog.note_written([b"a", b"k", b"k"], [500, 1000, 2000], [400, 900, 1900],
                                         [ObjectMeta(created_ns=1), ObjectMeta(created_ns=2), ObjectMeta(created_ns=3)])
        assert stayed.tolist() == [True, True, True]
        entry = cs.index.get(b"k")
        assert entry is not None and (entry.stored_bytes, entry.payload_len, entry.created_ns) == (2000, 1900, 3)
        assert len(cs.index) == 2 and cs.used == 2500
        await cs.life.close()

    asyncio.run(main())
