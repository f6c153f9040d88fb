"""A directory card written straight out of client memory (``ObjectFileWriter``'s kernel path).

The store hands a ``writes_client_memory`` card the client's own region
instead of a staged copy.  The card must then store exactly the bytes that
were there, with the hash of what landed in the file, turn a region shrunk
under it into ``MemoryFault`` (never SIGBUS), and publish nothing once the
caller gave up, without making the event loop (``abandon``) wait for a
``pwrite`` in flight.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvgate.cards import DirectoryCard, ObjectMeta, WriteAbandoned
from kvgate.cards.objectformat import CHECKSUM_PIECE
from kvgate.gateway import shm
from kvgate.keys import full_key
from kvgate.memcopy import Abandon, MemoryFault, in_client_memory

SIZE = 3 * CHECKSUM_PIECE + 4321  # several pieces and a short last one


@pytest.fixture
def card(tmp_path: Path) -> DirectoryCard:
    c = DirectoryCard(str(tmp_path / "card"))
    c.open()
    return c


@pytest.fixture
def client_file() -> Iterator[tuple[int, shm.Region]]:
    """A /dev/shm file of ours, mapped as the gateway maps a client's registered region."""
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 2 * SIZE)
        region = shm.map_client_region(path, os.getuid())
        try:
            yield fd, region
        finally:
            region.close()
    finally:
        os.close(fd)
        os.unlink(path)


def _fill(fd: int, data: np.ndarray, offset: int = 0) -> None:
    """Write the client's bytes through its file, as the client would (the test never loads the mapping)."""
    os.pwrite(fd, data.tobytes(), offset)


def _leftovers(card: DirectoryCard, k: bytes) -> list[str]:
    d = os.path.dirname(card.object_path(k))
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_client_memory_is_stored_exactly_with_the_hash_of_what_landed(card: DirectoryCard, client_file) -> None:
    fd, region = client_file
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    _fill(fd, data, 100)
    src = region.slice(100, SIZE)
    assert in_client_memory(src) and DirectoryCard.writes_client_memory
    k = full_key(b"ns", b"direct")
    card.write(k, src, ObjectMeta(), Abandon())
    src.release()
    out = np.zeros(SIZE, np.uint8)
    assert card.read_into(k, memoryview(out)).payload_len == SIZE  # the hash checks out
    assert np.array_equal(out, data)


def test_a_shrunk_client_region_is_a_memory_fault_and_publishes_nothing(card: DirectoryCard, client_file) -> None:
    fd, region = client_file
    k = full_key(b"ns", b"shrunk")
    src = region.slice(0, SIZE)
    os.ftruncate(fd, CHECKSUM_PIECE)  # the first piece is still there, the rest is gone
    with pytest.raises(MemoryFault):
        card.write(k, src, ObjectMeta(), Abandon())
    src.release()
    assert not card.exists(k) and _leftovers(card, k) == []  # no object, no temp file


def _client_pieces(monkeypatch, after_first=None) -> list[int]:
    """Count the pwrites whose source is client memory (``after_first``: called after the first one)."""
    real_pwrite, pieces = os.pwrite, []

    def counting(fd: int, data, offset: int) -> int:
        n = real_pwrite(fd, data, offset)
        if in_client_memory(data):
            pieces.append(offset)
            if len(pieces) == 1 and after_first is not None:
                after_first()
        return n

    monkeypatch.setattr(os, "pwrite", counting)
    return pieces


def test_no_piece_is_read_after_the_caller_gave_up(card: DirectoryCard, client_file, monkeypatch) -> None:
    fd, region = client_file
    _fill(fd, np.full(SIZE, 5, np.uint8))
    k = full_key(b"ns", b"late")
    src = region.slice(0, SIZE)
    guard = Abandon()
    pieces = _client_pieces(monkeypatch, after_first=guard.abandon)  # the deadline passes mid-write
    with pytest.raises(WriteAbandoned):
        card.write(k, src, ObjectMeta(), guard)
    monkeypatch.undo()
    src.release()
    assert len(pieces) == 1  # the next piece was not read
    assert not card.exists(k) and _leftovers(card, k) == []


def test_abandon_does_not_wait_for_a_pwrite_in_flight(card: DirectoryCard, client_file, monkeypatch) -> None:
    """A pwrite held up (as by dirty-page throttling or a hung NFS server) must not hold up ``abandon``,
    which runs on the event loop; the write it belongs to then publishes nothing."""
    fd, region = client_file
    _fill(fd, np.full(SIZE, 9, np.uint8))
    k = full_key(b"ns", b"held")
    src = region.slice(0, SIZE)
    entered, release = threading.Event(), threading.Event()
    real_pwrite = os.pwrite

    def held_pwrite(fd_: int, data, offset: int) -> int:
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return real_pwrite(fd_, data, offset)

    monkeypatch.setattr(os, "pwrite", held_pwrite)
    guard = Abandon()
    outcome: list[BaseException] = []

    def write() -> None:
        try:
            card.write(k, src, ObjectMeta(), guard)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        guard.abandon()
        assert time.monotonic() - t0 < 0.5  # did not wait for the held pwrite
    finally:
        release.set()
        writer.join(10)
    monkeypatch.undo()
    src.release()
    assert len(outcome) == 1 and isinstance(outcome[0], WriteAbandoned)
    assert not card.exists(k) and _leftovers(card, k) == []


def test_own_memory_is_hashed_in_place_and_client_memory_read_back(card: DirectoryCard, client_file,
                                                                     monkeypatch) -> None:
    fd, region = client_file
    data = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    _fill(fd, data)
    real_preadv, read_backs = os.preadv, []

    def counting(fd_: int, bufs, offset: int, *flags) -> int:
        read_backs.append(offset)
        return real_preadv(fd_, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    assert not in_client_memory(memoryview(data))
    card.write(full_key(b"ns", b"own"), memoryview(data), ObjectMeta(), Abandon())
    assert read_backs == []  # hashed where it was, no second copy
    src = region.slice(0, SIZE)
    card.write(full_key(b"ns", b"client"), src, ObjectMeta(), Abandon())
    src.release()
    assert len(read_backs) == 4  # one read-back per 256 KiB piece (three and a short one)
    monkeypatch.undo()
    for name in (b"own", b"client"):
        out = np.zeros(SIZE, np.uint8)
        card.read_into(full_key(b"ns", name), memoryview(out))
        assert np.array_equal(out, data)


def test_memory_we_may_load_is_written_in_one_call_and_short_writes_are_taken_up(card: DirectoryCard,
                                                                                monkeypatch) -> None:
    """Header and payload go in one ``pwritev``; a kernel that writes only part of it (legal) gets the
    rest in further calls, and the object reads back whole."""
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    real, calls = os.pwritev, []

    def short(fd_: int, bufs, offset: int, *flags) -> int:
        calls.append(len(bufs))
        total = sum(len(b) for b in bufs)
        if total <= 1000:
            return real(fd_, bufs, offset, *flags)
        first = bytes(memoryview(bufs[0])[:1000]) if len(bufs[0]) >= 1000 else None
        if first is None:  # the first buffer is shorter: write it whole and 1 byte of the next
            return real(fd_, [bufs[0], memoryview(bufs[1])[:1]], offset, *flags)
        return os.pwrite(fd_, first, offset)

    monkeypatch.setattr(os, "pwritev", short)
    card.write(full_key(b"ns", b"short"), memoryview(data), ObjectMeta(), Abandon())
    monkeypatch.undo()
    assert calls[0] == 2 and len(calls) > 2  # header and payload asked at once, finished over several calls
    out = np.zeros(SIZE, np.uint8)
    card.read_into(full_key(b"ns", b"short"), memoryview(out))
    assert np.array_equal(out, data)
