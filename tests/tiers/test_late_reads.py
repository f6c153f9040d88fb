"""A card read that ends after its deadline writes nothing into the destination.

The caller has its answer (a miss) by then and may have reused the buffer: a
client's region, the session region, an aborted RAM reservation now holding
another object (tests/tiers/test_store.py: a prewarm's).  Real cards (a
directory on a real file, a real redis-server stalled with SIGSTOP), in
process, with a short deadline.
"""

from __future__ import annotations

import asyncio
import ctypes
import glob
import mmap
import os
import threading
import time

import numpy as np
import pytest

from kvgate import memcopy
from kvgate.cards import DirectoryCard, Header, ObjectMeta, RedisCard
from kvgate.tiers.io import CardIo, IoTimeout
from kvgate.tiers.card import ManagedCard
from tests.tiers.common import serving_card
from tests.cards.test_redis import server_factory  # noqa: F401 - a fixture
from tests.helpers import evict, pages_cached
from tests.processes import REDIS_SERVER

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.2
SLOW_S = 1.0  # how long the slowed read waits before it reads: well past the deadline
SIZE = (3 << 20) + 100  # several read pieces, the last one partial


def _payload(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, size, dtype=np.uint8).tobytes()


class Slowed:
    """Wraps a card's read method: sleeps past the deadline, then reads; records how the read ended."""

    def __init__(self, obj: object, name: str):
        self.obj, self.name = obj, name
        self.inner = getattr(obj, name)
        self.done = threading.Event()
        self.calls = 0
        self.outcome: object = None
        setattr(obj, name, self)

    def __call__(self, *args):
        self.calls += 1
        time.sleep(SLOW_S)
        try:
            self.outcome = self.inner(*args)
            return self.outcome
        except BaseException as e:
            self.outcome = e
            raise
        finally:
            self.done.set()

    def undo(self) -> None:
        setattr(self.obj, self.name, self.inner)


async def _read_late(cs: ManagedCard, key: bytes, dest: memoryview, slowed: Slowed) -> None:
    """Read with a deadline that passes; dest must be untouched at the answer and after the read ended."""
    (res,) = await cs.read([(key, dest)])
    assert isinstance(res.error, IoTimeout), res  # the answer: a miss
    assert not any(dest), "bytes landed before the answer"
    assert await asyncio.to_thread(slowed.done.wait, 30), "the slowed read never ended"
    await asyncio.sleep(0.1)  # the point: any late delivery would have landed by now
    assert slowed.calls == 1
    assert not any(dest), "bytes landed after the answer"
    assert not isinstance(slowed.outcome, Header), "the late read went on to deliver"


@pytest.mark.parametrize("way", ["buffered", "in_place", "direct"])
def test_a_directory_read_past_its_deadline_writes_nothing(tmp_path, way: str) -> None:
    """buffered: into guarded client memory, through the scratch; in_place: straight into memory the
    gateway may load; direct: from the device."""
    loc = str(tmp_path / "card")
    os.mkdir(loc)
    card = DirectoryCard(loc, direct_reads=way == "direct")
    card.open()
    key = b"late-" + way.encode()
    card.write(key, memoryview(_payload(1)), ObjectMeta())
    if way == "direct":
        (path,) = glob.glob(os.path.join(loc, "db*", "*", "*"))
        evict(path)
        if pages_cached(path):
            pytest.skip("this filesystem keeps the file cached")
    slowed = Slowed(card, f"_read_{way}")
    mm = mmap.mmap(-1, SIZE)
    dest = memoryview(mm)  # page aligned, as a direct read into it wants
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    if way == "buffered":
        memcopy.add_client_memory(base, SIZE)

    async def main() -> None:
        cs = serving_card(card, CardIo(1, DEADLINE_S, "late"))
        try:
            await _read_late(cs, key, dest, slowed)
        finally:
            cs.io.shutdown(wait=True)

    try:
        asyncio.run(main())
    finally:
        memcopy.remove_client_memory(base, SIZE)
    # The card itself is fine: an unhurried read gets every byte.
    slowed.undo()
    assert card.read_into(key, dest).payload_len == SIZE
    assert dest.tobytes() == _payload(1)


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_a_redis_read_stalled_past_its_deadline_writes_nothing(server_factory) -> None:  # noqa: F811
    srv = server_factory()
    # The card's own socket timeout is long: the stalled read is still waiting when the deadline passes.
    card = RedisCard(srv.url, io_timeout_ms=20_000)
    card.open()
    key = b"late-redis"
    card.write(key, memoryview(_payload(2)), ObjectMeta())
    inner = card.read_many_into
    done = threading.Event()

    def read_many_into(*args):
        try:
            return inner(*args)
        finally:
            done.set()

    card.read_many_into = read_many_into
    dest = memoryview(bytearray(SIZE))

    async def main() -> None:
        cs = serving_card(card, CardIo(1, DEADLINE_S, "late"))
        try:
            srv.pause()
            try:
                (res,) = await cs.read([(key, dest)])
                assert isinstance(res.error, IoTimeout), res
                assert not any(dest), "bytes landed before the answer"
            finally:
                srv.resume()
            assert await asyncio.to_thread(done.wait, 30), "the stalled read never ended"
            await asyncio.sleep(0.1)  # the point: any late delivery would have landed by now
            assert not any(dest), "bytes landed after the answer"
        finally:
            cs.io.shutdown(wait=True)

    try:
        asyncio.run(main())
        assert card.read_into(key, dest).payload_len == SIZE  # the server answers again, whole
        assert dest.tobytes() == _payload(2)
    finally:
        card.close()
