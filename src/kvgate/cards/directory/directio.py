"""What a read with ``O_DIRECT`` needs: aligned memory, aligned offsets, a flag it can turn on.

Why directory cards read with ``O_DIRECT`` at all: a buffered read of a cold
file costs this host's CPU twice, once to fill the page cache and once to copy
out of it, and on an inference host those cycles belong to the engine.  An
``O_DIRECT`` read lets the device write the destination (vLLM's CPU tier, the
gateway's RAM tier) with no copy and no page cache churn.  A file the page
cache holds whole is copied out of it, or read around it when that has
been timed faster (``CachedReadChoice``).

Which case a file is in comes from ``cachestat(2)`` (Linux 6.5), which counts
cached pages without doing any I/O.  ``preadv2(RWF_NOWAIT)`` cannot tell: on
a miss it starts readahead before it says EAGAIN, and the direct read that
follows would fetch the same bytes a second time.  Without ``cachestat``
every read is direct, as vLLM's own file tier does.

The flag is switched on the descriptor already open (``fcntl(F_SETFL)``)
rather than by opening the path again, so the decision and the read concern
the same inode even while a writer renames a new version over the name.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kvgate.cards.objectformat import ALIGN

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
SUPPORTED = bool(O_DIRECT)
PAGE = mmap.PAGESIZE
# Reads go piece by piece through a scratch buffer, each piece hashed while
# it is still in the CPU cache; 1 MiB measured best here (256 KiB pays more
# calls, whole 2 MiB objects fall out of a 2 MiB L2).  A multiple of ALIGN.
READ_PIECE = 1 << 20
# What a read straight into its destination takes in its first call, with the
# header: a whole 2 MiB object (vLLM's usual) in one call, as a raw read of the
# file does.  The guard's lock is held for its copy, about 0.3 ms here.
IN_PLACE_FIRST = 2 << 20


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64)
                for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


# The syscall number is the same on every architecture that has it (the unified table).
_NR_CACHESTAT = 451 if sys.platform.startswith("linux") and platform.machine() in (
    "x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x", "loongarch64") else None
_libc = ctypes.CDLL(None, use_errno=True) if _NR_CACHESTAT is not None else None
_cachestat_works = _NR_CACHESTAT is not None


class _CachestatArgs(threading.local):
    def __init__(self) -> None:
        self.range = _CachestatRange(0, 0)  # len 0: to the end of the file
        self.stat = _Cachestat()
        self.range_ref, self.stat_ref = ctypes.byref(self.range), ctypes.byref(self.stat)


_args = _CachestatArgs()


def cached_pages(fd: int) -> int | None:
    """How many pages of the file the page cache holds; None where the kernel cannot say."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    a = _args
    if _libc.syscall(_NR_CACHESTAT, fd, a.range_ref, a.stat_ref, 0) == 0:  # type: ignore[union-attr]
        return a.stat.nr_cache
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # older kernel, or a seccomp filter
        _cachestat_works = False
    return None


def fully_cached(fd: int, size: int) -> bool:
    pages = cached_pages(fd)
    return pages is not None and pages >= -(-size // PAGE)


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_aligned(view: memoryview) -> bool:
    """Whether writable ``view`` starts on an ``ALIGN`` boundary (page-aligned mappings and RAM tier pages do)."""
    if not len(view):
        return True
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0
    except TypeError:  # read-only: never a read destination
        return False


def set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False when the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | O_DIRECT if on else flags & ~O_DIRECT
    if want == flags:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError:
        return False
    return True


class CachedReadChoice:
    """Whether a file the page cache holds whole is copied out of it or read around it.

    The copy costs this host's CPU, a direct read costs device time.  With
    cores to spare the copy is several times faster than the device; on a
    small host whose cores the engine keeps busy (vLLM's CPU build on two
    cores, measured, with the reading threads at normal priority) it is
    slower, and reading around the cache wins.  So
    both are timed, wall time per byte of each object read and verified,
    and the cheaper one serves cached files: direct reads of uncached files
    keep the device's figure current, and while cached files go direct, one
    in ``PROBE_EVERY`` is copied anyway to keep the copy's figure current.
    Until the device has been timed at all, cached files are copied.

    The moving averages are of *seconds per byte*, not of bytes per second:
    a copy on a contended host is mostly quick with a few reads stalled for
    many milliseconds, and an average of rates follows the quick ones while
    the stalls are what a batch of reads waits for.
    """

    PROBE_EVERY = 16
    WEIGHT = 0.2  # of the newest sample in each moving average

    def __init__(self) -> None:
        self._copy_cost: float | None = None  # seconds per byte
        self._direct_cost: float | None = None
        self._cached_reads = 0

    @property
    def copy_rate(self) -> float | None:
        """Bytes per second of copies out of the page cache (None until timed)."""
        return _rate(self._copy_cost)

    @property
    def direct_rate(self) -> float | None:
        """Bytes per second of direct reads (None until timed)."""
        return _rate(self._direct_cost)

    def direct_for_cached(self) -> bool:
        if self._copy_cost is None or self._direct_cost is None or self._direct_cost >= self._copy_cost:
            return False
        self._cached_reads += 1
        return self._cached_reads % self.PROBE_EVERY != 0

    def note(self, direct: bool, nbytes: int, seconds: float) -> None:
        """One object read both ways were open to: ``nbytes`` read and verified in ``seconds``."""
        if nbytes < ALIGN or seconds <= 0:  # tiny objects time the call overhead, not the medium
            return
        cost = seconds / nbytes
        old = self._direct_cost if direct else self._copy_cost
        new = cost if old is None else old + self.WEIGHT * (cost - old)
        if direct:
            self._direct_cost = new
        else:
            self._copy_cost = new


def _rate(cost: float | None) -> float | None:
    return None if cost is None else 1.0 / cost


class Scratch(threading.local):
    """Per-thread aligned buffers every read of a directory card lands in: the header block and one piece.

    Reads land here, never in the destination: the bytes are hashed here and
    handed over through the caller's guard (the contract in ``cards.base``).
    Allocated once per thread (an anonymous mapping is page aligned, as
    ``O_DIRECT`` wants) and grown only for a header longer than one block,
    which takes a very long key.
    """

    def __init__(self) -> None:
        self._head = mmap.mmap(-1, ALIGN)
        self._piece = mmap.mmap(-1, READ_PIECE)
        self.piece = memoryview(self._piece)

    def head(self, size: int) -> memoryview:
        if len(self._head) < size:
            self._head = mmap.mmap(-1, size)
        return memoryview(self._head)[:size]


# Direct reads land in a ring of pieces shared by every reading thread, handed
# out oldest-freed first, never straight in the destination: a device read
# cannot be called back once the caller has stopped waiting for it, and the
# destination may be an engine's memory, reused by then.  The device writes
# pages it has just written more slowly on these VMs (virtio disk): one thread,
# 1 MiB O_DIRECT reads of cold 2 MiB objects, into the same 1 MiB again and
# again 0.41-0.49 GiB/s, into 8 pieces in turn 0.52-0.56, into 32 pieces
# 0.98-1.09, into fresh pages every time 1.19-1.25.  With 16 reads in flight
# (DEVICE_READS) the ring's size mattered again: a gateway's get of 64 cold
# 2 MiB objects took 111-133 ms through 32 pieces, 76-98 through 64 and 63-85
# through 128 (raw O_DIRECT reads of the same files straight into the same
# memory, 16 threads: 37-84 ms, a noisy device).  128 MiB in all, whatever the
# cards and threads, touched as it is first used.
DIRECT_SLOTS = 128


class DirectPieces:
    """Page-aligned ``READ_PIECE`` buffers for ``O_DIRECT`` reads, lent one at a time; thread-safe.

    ``take()`` blocks while every piece is lent (more readers than pieces):
    a reader holds one only for one read, hash and hand-over.
    """

    def __init__(self, count: int = DIRECT_SLOTS):
        self._mm = mmap.mmap(-1, count * READ_PIECE)
        view = memoryview(self._mm)
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(view[i * READ_PIECE : (i + 1) * READ_PIECE])

    @contextmanager
    def take(self) -> Iterator[memoryview]:
        piece = self._free.get()
        try:
            yield piece
        finally:
            self._free.put(piece)


# Reads from the device at once, per card (DeviceReaders), as vLLM's own file
# tier reads with 16 threads.  One thread per read keeps one piece in flight,
# and the device wants many: raw 1 MiB O_DIRECT reads through a ring here,
# 64 cold 2 MiB objects, 1.84-1.85 GiB/s on 4 threads, 1.99-2.15 on 16; a card
# reading 64 cold objects on 4 threads, each handing its cold reads to these,
# 101-108 ms, where each thread reading its own one after the other took
# 146-149.
DEVICE_READS = 16


class DeviceReaders:
    """A card's threads for reads that wait on the device: ``run`` hands a batch of calls to them, up to
    ``DEVICE_READS`` at once, and returns their results in order once every one has ended.

    Each call runs at the scheduling class and priority of the thread that
    called ``run`` (a card thread, at ``SCHED_RR`` for an engine's restore:
    ``kvgate.tiers.io``), so handing a read over never lowers its priority.
    Called from a card's I/O threads, several at once; made on first use;
    ``close`` (the card's) lets the threads end once idle.
    """

    def __init__(self, name: str, size: int = DEVICE_READS):
        self._name = name
        self._size = size
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, calls: list[tuple]) -> list:
        """``fn(*args)`` of each ``(fn, *args)`` in ``calls``; what each returned, in order.  Every call has
        ended when this returns or raises (they may write memory the caller reuses afterwards)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix=self._name)
            pool = self._pool
        policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
        priority = os.sched_getparam(0).sched_priority if policy is not None else 0
        futures: list[Future] = []
        for fn, *args in calls:
            try:
                futures.append(pool.submit(_at_class, policy, priority, fn, *args))
            except RuntimeError:  # closed meanwhile (the card left): the call runs here, never not at all
                done: Future = Future()
                try:
                    done.set_result(fn(*args))
                except BaseException as e:  # raised once every call has ended, as the pool's would be
                    done.set_exception(e)
                futures.append(done)
        wait(futures)
        return [f.result() for f in futures]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


class _Class(threading.local):
    now: tuple[int | None, int] = (None, 0)  # the scheduling (policy, priority) this thread was last put at


_class = _Class()


def _at_class(policy: int | None, priority: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this thread at scheduling ``policy`` and ``priority`` (left as it is where refused)."""
    if policy is not None and _class.now != (policy, priority):
        try:
            os.sched_setscheduler(0, policy, os.sched_param(priority))
            _class.now = (policy, priority)
        except OSError:
            pass  # the read runs either way; a priority is never worth a failed read
    return fn(*args)


_direct_pieces: DirectPieces | None = None
_direct_pieces_lock = threading.Lock()


def direct_pieces() -> DirectPieces:
    """The process's one ring (made on the first direct read)."""
    global _direct_pieces
    if _direct_pieces is None:
        with _direct_pieces_lock:
            if _direct_pieces is None:
                _direct_pieces = DirectPieces()
    return _direct_pieces
