"""The helpers of direct reads: alignment, cachestat, and the choice for cached files."""

from __future__ import annotations

import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.cards.directory.directio import READ_PIECE, CachedReadChoice, Scratch, align_down, cached_pages, fully_cached, is_aligned
from kvgate.cards.objectformat import ALIGN
from kvgate.keys import full_key
from tests.helpers import evict


def test_alignment_helpers() -> None:
    m = mmap.mmap(-1, 4 * ALIGN)
    v = memoryview(m)
    assert is_aligned(v) and is_aligned(v[ALIGN:]) and not is_aligned(v[1:])
    assert is_aligned(v[:0])
    assert not is_aligned(memoryview(bytes(ALIGN)))  # read-only: never a destination
    assert [align_down(n) for n in (0, 1, ALIGN - 1, ALIGN, 2 * ALIGN + 5)] == [0, 0, 0, ALIGN, 2 * ALIGN]


def test_scratch_is_aligned_and_grows_for_long_headers() -> None:
    s = Scratch()
    assert is_aligned(s.head(100)) and len(s.head(100)) == 100
    assert is_aligned(s.piece) and len(s.piece) == READ_PIECE
    big = s.head(3 * ALIGN)
    assert len(big) == 3 * ALIGN and is_aligned(big)


def test_cached_pages_follows_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 * ALIGN))
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_pages(fd) is None:
            pytest.skip("kernel without cachestat(2)")
        os.read(fd, 8 * ALIGN)
        assert fully_cached(fd, 8 * ALIGN)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert cached_pages(fd) == 0 and not fully_cached(fd, 8 * ALIGN)
    finally:
        os.close(fd)


def test_choice_copies_until_the_device_is_timed_and_faster() -> None:
    c = CachedReadChoice()
    assert not c.direct_for_cached()
    c.note(False, 1 << 20, 0.001)  # copy: ~1 GB/s
    assert not c.direct_for_cached()  # the device not timed yet
    c.note(True, 1 << 20, 0.01)  # direct: ~100 MB/s
    assert not c.direct_for_cached()
    for _ in range(40):  # the copy slows down (a busy host): direct wins
        c.note(False, 1 << 20, 0.1)
    assert c.direct_rate is not None and c.copy_rate is not None and c.direct_rate > c.copy_rate
    picks = [c.direct_for_cached() for _ in range(3 * CachedReadChoice.PROBE_EVERY)]
    # mostly direct, with one copy in PROBE_EVERY to keep timing the copy
    assert picks.count(False) == 3 and picks.count(True) == len(picks) - 3


def test_choice_weighs_stalled_copies_by_the_time_they_take() -> None:
    """Most copies quick, one in three stalled (a contended host): on average a
    byte takes longer than from the steady device, so cached files go direct,
    although an average of the copies' rates would favour the quick ones."""
    c = CachedReadChoice()
    mib = 1 << 20
    for cycle in range(20):
        c.note(True, mib, 0.006)
        for seconds in (0.0005, 0.0005, 0.040):
            c.note(False, mib, seconds)
            if cycle >= 5:  # past the first samples: at every point of the cycle
                assert c.direct_rate > c.copy_rate
    assert c.direct_for_cached()


def test_choice_ignores_tiny_objects_and_moves_gradually() -> None:
    c = CachedReadChoice()
    c.note(False, 100, 1e-6)
    assert c.copy_rate is None
    c.note(False, 1 << 20, 1.0)
    c.note(False, 1 << 20, 0.5)
    assert (1 << 20) < c.copy_rate < (2 << 20)


def timed(copy_rate: float, direct_rate: float) -> CachedReadChoice:
    """A choice that has timed one read each way, at these rates."""
    c = CachedReadChoice()
    c.note(False, ALIGN, ALIGN / copy_rate)
    c.note(True, ALIGN, ALIGN / direct_rate)
    return c


def test_card_reads_a_cached_file_directly_when_direct_is_faster(tmp_path: Path) -> None:
    card = DirectoryCard(str(tmp_path / "card"))
    card.open()
    if not card.direct_reads:
        pytest.skip("no O_DIRECT here")
    k = full_key(b"ns", b"cached")
    data = np.random.default_rng(1).integers(0, 256, 3 * ALIGN + 7, dtype=np.uint8)
    card.write(k, memoryview(data), ObjectMeta())
    with open(card.object_path(k), "rb") as f:
        f.read()
    fd = os.open(card.object_path(k), os.O_RDONLY)
    try:
        if cached_pages(fd) is None or not fully_cached(fd, os.fstat(fd).st_size):
            pytest.skip("cannot see the page cache here")
    finally:
        os.close(fd)
    m = mmap.mmap(-1, len(data))
    out = np.frombuffer(m, dtype=np.uint8)

    card.cached_reads = timed(copy_rate=1.0, direct_rate=1e15)  # direct "faster"
    card.read_into(k, memoryview(m))
    assert np.array_equal(out, data)
    assert card.cached_reads.copy_rate == 1.0 and card.cached_reads.direct_rate < 1e15  # timed the direct read

    card.cached_reads = timed(copy_rate=1e15, direct_rate=1.0)  # copy faster
    out[:] = 0
    card.read_into(k, memoryview(m))
    assert np.array_equal(out, data)
    assert card.cached_reads.direct_rate == 1.0 and card.cached_reads.copy_rate < 1e15
    assert card.read_rates() == {"cached_copy_bytes_per_second": card.cached_reads.copy_rate,
                                 "direct_read_bytes_per_second": 1.0}


def test_direct_pieces_are_lent_one_reader_at_a_time_oldest_freed_first() -> None:
    import threading

    from kvgate.cards.directory.directio import READ_PIECE, DirectPieces

    pieces = DirectPieces(3)
    seen = []
    for _ in range(6):
        with pieces.take() as p:
            assert len(p) == READ_PIECE
            seen.append(id(p))
    assert len(set(seen[:3])) == 3 and seen[:3] == seen[3:], "every piece in turn, then the same cycle again"
    held = [pieces.take() for _ in range(3)]
    assert len({id(h.__enter__()) for h in held}) == 3, "three readers hold three different pieces"
    got = threading.Event()

    def reader() -> None:
        with pieces.take():
            got.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not got.wait(0.2), "no piece is free: the fourth reader waits"
    held[0].__exit__(None, None, None)
    assert got.wait(5), "a piece handed back goes to the waiting reader"
    t.join()
    for h in held[1:]:
        h.__exit__(None, None, None)


def test_a_batch_of_cold_objects_is_read_from_the_device_at_once(tmp_path: Path) -> None:
    """read_many_into hands the device's reads to the card's device readers, all at once, and copies the
    cached ones itself meanwhile: every byte right, a missing and a corrupt object reported in place (the
    corrupt one deleted), and the cold reads overlapping in time on the readers' threads."""
    import threading
    import time as _time

    card = DirectoryCard(str(tmp_path / "card"))
    card.open()
    if not card.direct_reads:
        pytest.skip("no O_DIRECT here")
    n, size = 12, 2 * READ_PIECE + 3 * ALIGN
    rng = np.random.default_rng(5)
    keys = [full_key(b"ns", b"cold-%d" % i) for i in range(n)]
    datas = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    for k, d in zip(keys, datas):
        card.write(k, memoryview(d), ObjectMeta())
    probe = os.open(card.object_path(keys[0]), os.O_RDONLY)
    try:
        if cached_pages(probe) is None:
            pytest.skip("kernel without cachestat(2)")
    finally:
        os.close(probe)
    for k in keys[1:]:
        evict(card.object_path(k))
    with open(card.object_path(keys[0]), "rb") as f:  # the first one cached: read by the calling thread
        f.read()
    with open(card.object_path(keys[5]), "r+b") as f:  # a bit flipped in the payload of a cold one
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    evict(card.object_path(keys[5]))
    missing = full_key(b"ns", b"never-written")

    inside = 0
    most = 0
    threads: set[str] = set()
    lock = threading.Lock()
    read_direct = card._read_direct

    def counted(*args):
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
            threads.add(threading.current_thread().name)
        try:
            _time.sleep(0.05)  # long enough that reads handed over together overlap
            return read_direct(*args)
        finally:
            with lock:
                inside -= 1

    card._read_direct = counted  # type: ignore[method-assign]
    m = mmap.mmap(-1, (n + 1) * size)
    out = np.frombuffer(m, dtype=np.uint8)
    views = [memoryview(m)[i * size : (i + 1) * size] for i in range(n + 1)]
    res = card.read_many_into([*zip(keys, views), (missing, views[n])])
    assert [type(r).__name__ for r in res] == (["Header"] * 5 + ["ObjectCorrupt"] + ["Header"] * 6
                                               + ["ObjectMissing"])
    for i, d in enumerate(datas):
        if i != 5:
            assert np.array_equal(out[i * size : (i + 1) * size], d), f"object {i}"
    assert not os.path.exists(card.object_path(keys[5])), "the corrupt object is deleted"
    assert most >= 8, f"cold reads overlapped only {most} at a time"
    assert threading.current_thread().name not in threads and all(t.startswith("kvgate-dev") for t in threads)
    card.close()


def test_device_readers_run_at_the_callers_scheduling_class() -> None:
    import threading

    from kvgate.cards.directory.directio import DeviceReaders

    readers = DeviceReaders("kvgate-dev-test", size=2)
    got: list = []

    def caller() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except OSError:
            got.append("refused")
            return
        got.extend(readers.run([(os.sched_getscheduler, 0), (os.sched_getscheduler, 0)]))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    if got == ["refused"]:
        pytest.skip("no real-time scheduling here")
    assert got == [os.SCHED_RR, os.SCHED_RR]
    assert readers.run([(os.sched_getscheduler, 0)]) == [os.SCHED_OTHER], "back to the caller's class"
    readers.close()


def test_device_readers_run_every_call_even_when_closed_meanwhile() -> None:
    from kvgate.cards.directory.directio import DeviceReaders

    readers = DeviceReaders("kvgate-dev-test", size=2)
    assert readers.run([(pow, 2, 3), (pow, 3, 2)]) == [8, 9]
    pool = readers._pool
    readers.close()
    readers._pool = pool  # a run that took the pool just before close() shut it down
    assert readers.run([(pow, 2, 4)]) == [16], "a call the closed pool refuses runs on the caller's thread"


def test_a_read_whose_plan_fails_leaves_no_descriptor_open(tmp_path: Path) -> None:
    card = DirectoryCard(str(tmp_path / "card"))
    card.open()
    k = full_key(b"ns", b"planned")
    card.write(k, memoryview(np.zeros(ALIGN, np.uint8)), ObjectMeta())

    def refused(fd: int):
        raise OSError(5, "Input/output error")

    card._plan = refused  # type: ignore[method-assign]
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(OSError):
            card.read_into(k, memoryview(bytearray(ALIGN)))
        (res,) = card.read_many_into([(k, memoryview(bytearray(ALIGN)))])
        assert isinstance(res, OSError)
    assert len(os.listdir("/proc/self/fd")) <= before  # (a leak would leave 20 or 40 behind)
    card.close()


def test_device_readers_wait_for_every_call_before_a_refused_one_raises() -> None:
    import threading
    import time as _time

    from kvgate.cards.directory.directio import DeviceReaders

    readers = DeviceReaders("kvgate-dev-test", size=1)
    readers.run([(pow, 1, 1)])
    ended = threading.Event()

    def slow() -> None:
        _time.sleep(0.3)
        ended.set()

    def boom() -> None:
        raise ValueError("refused call")

    real_submit = readers._pool.submit  # type: ignore[union-attr]
    calls = iter([real_submit, None])

    def submit(*a, **kw):  # the first call goes to the pool, then the pool is closed under the second
        f = next(calls)
        if f is None:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return f(*a, **kw)

    readers._pool.submit = submit  # type: ignore[union-attr, method-assign]
    with pytest.raises(ValueError):
        readers.run([(slow,), (boom,)])
    assert ended.is_set(), "run raised while a call it handed over was still running"
    readers.close()
