"""ManagedCard on its own: what each card answer reads as, and what a full card does (ENOSPC lowers its
capacity once per episode, not once per failed write).

One request that meets a full card fails several objects at once; lowering
the capacity to 90 % of what is held for each of them shrank it to
0.9 ** n of what fits (a 48-object request on an 8 MiB card left 0.3 MiB).
While the objects evicted for the first ENOSPC are still being deleted, a
further ENOSPC tells nothing new.  Once they are gone, a new ENOSPC lowers
the capacity again.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

from kvgate.cards import ObjectMeta, make_card
from kvgate.config import Config
from kvgate.keys import dialog_digest
from kvgate.tiers.io import CardIo
from tests.tiers.common import serving_card


def test_enospc_lowers_capacity_once_while_evicted_objects_are_deleted(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "card").mkdir()  # a configured card directory is never created by the gateway
        cfg = Config(storage_devices=[str(tmp_path / "card")], card_capacity=1 << 30)
        card = make_card(str(tmp_path / "card"), cfg)
        io = CardIo(1, 5.0, "test-card")
        cs = serving_card(card, io, cfg, serial=await io.run(card.open))
        for i in range(100):
            cs.note_written(b"k%03d" % i, 1000, 900, ObjectMeta(dialog_digest(b"d%d" % (i // 10)), i % 10, 1))
        assert cs.used == 100_000

        full = OSError(errno.ENOSPC, "No space left on device")
        for _ in range(8):  # one request, eight objects that did not fit
            cs.note_result(full)
        assert cs.capacity == 90_000, "lowered once per failed object"
        assert cs.used <= 90_000 and cs.counters.evictions == 10
        assert cs.active, "a full card is not a broken card"
        await cs.tasks.wait()  # the evicted objects are deleted
        cs.note_result(full)  # full again with the room made: the medium is smaller still
        assert cs.capacity == 81_000
        await cs.close()

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
