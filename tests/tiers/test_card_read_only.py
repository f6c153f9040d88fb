"""A card that refuses writes as read-only (EROFS) stays in service for reads, takes no writes
without I/O, and takes writes again once its write probe passes (in process, no mount needed;
tests/faults does the same with a real read-only mount)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import numpy as np

from kvgate.cards import CardUnavailable, DirectoryCard, ObjectMeta
from kvgate.config import Config
from kvgate.keys import full_key
from kvgate.tiers.io import CardIo
from kvgate.tiers.health import READ_ONLY_RECHECK_S
from tests.tiers.common import serving_card


class SwitchableCard(DirectoryCard):
    """A directory card whose writes (and write probe) fail with EROFS while ``read_only`` is set."""

    read_only = False
    writes_tried = 0

    def write(self, *args, **kwargs) -> int:
        self.writes_tried += 1
        if self.read_only:
            raise CardUnavailable(errno.EROFS, "Read-only file system", self.location)
        return super().write(*args, **kwargs)

    def check_writable(self) -> None:
        if self.read_only:
            raise CardUnavailable(errno.EROFS, "card takes no writes: Read-only file system", self.location)
        super().check_writable()


def test_a_read_only_card_serves_reads_and_takes_writes_again(tmp_path: Path) -> None:
    async def main() -> None:
        loc = str(tmp_path / "card")
        card = SwitchableCard(loc)
        io = CardIo(2, 5.0, "test-card")
        cs = serving_card(card, io, Config(storage_devices=[loc], card_capacity=1 << 30), serial=await io.run(card.open))
        payload = memoryview(np.arange(50_000, dtype=np.uint8))
        k1, k2 = full_key(b"ns", b"one"), full_key(b"ns", b"two")
        assert all(isinstance(r, int) for r in await cs.write([(k1, payload, ObjectMeta())]))

        card.read_only = True
        (r,) = await cs.write([(k2, payload, ObjectMeta())])
        assert isinstance(r, OSError) and r.errno == errno.EROFS
        assert cs.read_only and cs.active, "read-only is not out of service"
        tried = card.writes_tried
        (r,) = await cs.write([(k2, payload, ObjectMeta())])
        assert isinstance(r, OSError) and r.errno == errno.EROFS
        assert card.writes_tried == tried, "a known read-only card is not written to"
        dest = memoryview(bytearray(len(payload)))
        (h,) = await cs.read([(k1, dest)])
        assert h.header is not None and dest == payload, "reads go on"

        cs.life.health.read_only_since -= READ_ONLY_RECHECK_S
        await cs.life.check()  # the probe still fails: stays read-only, tried again later
        assert cs.read_only
        card.read_only = False
        await cs.life.check()  # too soon after the last probe
        assert cs.read_only
        cs.life.health.read_only_since -= READ_ONLY_RECHECK_S
        await cs.life.check()
        assert not cs.read_only and cs.active
        assert all(isinstance(r, int) for r in await cs.write([(k2, payload, ObjectMeta())]))
        await cs.life.close()

    asyncio.run(main())
