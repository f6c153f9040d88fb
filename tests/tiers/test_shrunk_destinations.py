"""A card read into a client region shrunk under its mapping: MemoryFault for the request, no strike for the card."""

from __future__ import annotations

import asyncio
import os
import uuid

import numpy as np
import pytest

from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.gateway import shm
from kvgate.memcopy import Abandon, MemoryFault, ReadAbandoned
from kvgate.tiers.io import CardIo
from tests.tiers.common import serving_card

SIZE = (2 << 20) + 100


@pytest.fixture
def card(tmp_path) -> DirectoryCard:
    loc = str(tmp_path / "card")
    os.mkdir(loc)
    c = DirectoryCard(loc)
    c.open()
    c.write(b"k", memoryview(np.full(SIZE, 7, np.uint8)), ObjectMeta())
    return c


def test_a_shrunk_destination_fails_the_read_and_not_the_card(card: DirectoryCard) -> None:
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        region = shm.map_client_region(path, os.getuid())  # mapped as the gateway maps a client's file
        dest = region.slice(0, SIZE)
        os.ftruncate(fd, 0)

        async def main() -> None:
            cs = serving_card(card, CardIo(1, 10.0, "shrunk"))
            try:
                for _ in range(5):  # more than io_timeout_strikes
                    with pytest.raises(MemoryFault):
                        await cs.read([(b"k", dest)])
                assert cs.life.health.strikes == 0 and cs.life.health.errors == 0 and cs.active
                ok = memoryview(bytearray(SIZE))
                (r,) = await cs.read([(b"k", ok)])
                assert r.header.payload_len == SIZE and ok.tobytes() == bytes([7]) * SIZE
            finally:
                cs.io.shutdown(wait=True)

        asyncio.run(main())
        dest.release()
        region.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_an_abandoned_read_writes_nothing_and_keeps_the_object(card: DirectoryCard) -> None:
    guard = Abandon()
    guard.abandon()
    dest = memoryview(bytearray(SIZE))
    with pytest.raises(ReadAbandoned):
        card.read_into(b"k", dest, guard)
    assert not any(dest)
    assert card.exists(b"k")  # not taken for corrupt
