"""Cross-memory reads: a client copies a get's bytes straight out of the gateway's memory.

A local client's get into its own buffers (not a registered region) used
to cross the session region: the gateway copied each object into it, the
client copied it out, two copies of every byte.  With ``process_vm_readv``
the client reads the gateway's pages itself, one copy done by the kernel:
on these machines one thread moved 16.4 GiB/s that way against 20.5 for
``np.copyto`` between two warm buffers, two threads 21.
The gateway lends the objects (pinned RAM-tier pages, or a buffer holding
what a card read verified) until the client gives the loan back, so what the
client reads cannot change under it; and since the client does the copy, no
byte lands in its memory after its call returned, whatever the gateway does.

Linux lets a process read another's memory when it could ptrace it: the
same user, and, where Yama's ``ptrace_scope`` is 1, a target that named it
its tracer.  The gateway lends only to sessions of its own user and, under
Yama 1, allows any of its user's processes (``allow_readers``): what they
can read then, they could already read under the kernel's default rules.
Anything else (another user, Yama 2 or 3, a seccomp filter) fails with
``EPERM`` at the first read and the client goes back to the session region.

A card object the page cache holds is lent as its file instead: the
gateway opens it and the client takes the descriptor (``pidfd_getfd``, the
same permission as ``process_vm_readv``), reads the payload straight into
its buffer with ``RWF_NOWAIT`` and checks its XXH3 there (``read_files``):
one copy and a hash, where a card read into a buffer of the gateway's and
the client's read of that cost two copies and a hash.  A piece the cache
lost meanwhile, or a payload that does not hash right, is asked of the
gateway again, which reads it the usual way (and deletes it if bad): no
unverified byte is handed back.

Where the gateway's RAM tier lives in a sealed memfd (kvgate.tiers.ram), the
client maps it read-only, once a process (``map_arena``: the descriptor taken
as above) and copies the lent pieces that lie in it with a memcpy
(``read``'s ``arena``): ``process_vm_readv`` out of the same pages ran at
0.66 of a memcpy here (7.1 ms for 64 MiB on two threads, where one thread's
memcpy took 4.7); pieces elsewhere (a card read's buffer) go as before.

Used by the client (``read``, ``read_files``, from the thread that runs its
copies); the gateway's side, letting its user's processes read it, is
``kvgate.gateway.lending``.  Linux only; elsewhere ``supported`` is False
and nothing here is called.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import select
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvgate import native
from kvgate.errors import InvalidArgument, KvgateError
from kvgate.keys import payload_hash
from kvgate.memcopy import IOV_MAX, syscall


# A read this large is split over two threads: one thread reaches about 0.8 of a memcpy here, two its
# full speed; below a few MiB the hand-off costs more than it gains.
SPLIT_BYTES = 8 << 20


class CrossMemoryError(KvgateError, OSError):
    """A cross-memory read failed: ``errno`` EPERM (not permitted), ESRCH (no such process), EFAULT (an
    address outside the mapped memory) or a short read."""


_readv = syscall("process_vm_readv") if sys.platform.startswith("linux") else None
try:
    _libc = ctypes.CDLL(None, use_errno=True) if _readv is not None else None
except OSError:
    _libc = None
supported = _readv is not None
# pidfd_getfd(2): the one number of every architecture's unified syscall table (Linux 5.6)
_NR_PIDFD_GETFD = 438
files_supported = supported and _libc is not None and hasattr(os, "pidfd_open") and hasattr(os, "RWF_NOWAIT")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_copier = native.load("_copy")
if _copier is not None:
    _copier.kvgate_copy_spans.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _copier.kvgate_copy_spans.restype = None


def _helper() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-crossmem")
        return _pool


#: (address, length) runs: a list of pairs, or an (n, 2) integer array
Runs = np.ndarray | list[tuple[int, int]]


def iovecs(runs: Runs) -> np.ndarray:
    """``runs`` ((address, length) pairs, or such an array) as an (n, 2) uint64 array laid out as the
    kernel's ``struct iovec``, without the empty ones."""
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 2)
    return arr if arr[:, 1].all() else arr[arr[:, 1] != 0]


def _trimmed(runs: np.ndarray, ends: np.ndarray, pos: int, stop: int) -> np.ndarray:
    """The iovecs of bytes [pos, stop) of ``runs`` (``ends``: their running ends), at most ``IOV_MAX``."""
    i = int(np.searchsorted(ends, pos, "right"))  # the run holding byte pos
    j = int(np.searchsorted(ends, stop - 1, "right")) + 1  # one past the run holding byte stop - 1
    out = runs[i:j].copy()
    skip = pos - (int(ends[i]) - int(runs[i, 1]))
    out[0, 0] += np.uint64(skip)
    out[0, 1] -= np.uint64(skip)
    out[-1, 1] -= np.uint64(int(ends[j - 1]) - stop)
    return out


def _stop(ends: np.ndarray, pos: int, end: int) -> int:
    """How far past ``pos`` one call's ``IOV_MAX`` runs of a side reach (at most ``end``)."""
    i = int(np.searchsorted(ends, pos, "right"))
    return min(end, int(ends[min(i + IOV_MAX, len(ends)) - 1]))


def _read_runs(pid: int, local: np.ndarray, remote: np.ndarray, start: int, end: int) -> None:
    """Bytes [start, end) of the remote runs into the same bytes of the local ones, in calls of at most
    ``IOV_MAX`` runs a side, each side's iovecs a slice of its array.

    The arrays are cut with ``searchsorted`` over their running ends: no Python step per run (a get of
    SGLang's pages reads thousands of fragments; a Python step per run cost about 1 us, as much as
    copying 8 KiB)."""
    lend, rend = np.cumsum(local[:, 1], dtype=np.int64), np.cumsum(remote[:, 1], dtype=np.int64)
    pos = start
    while pos < end:
        stop = min(_stop(lend, pos, end), _stop(rend, pos, end))
        lv, rv = _trimmed(local, lend, pos, stop), _trimmed(remote, rend, pos, stop)
        got = _readv(pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
        if got < 0:
            e = ctypes.get_errno()
            raise CrossMemoryError(e, f"process_vm_readv of pid {pid}: {os.strerror(e)}")
        if got == 0:
            raise CrossMemoryError(errno.EFAULT, f"process_vm_readv of pid {pid} read nothing of "
                                                 f"{stop - pos} bytes")
        pos += got


class MappedArena:
    """The gateway's RAM arena mapped read-only here (``map_arena``): its bytes [remote, remote + size) are
    ours at [local, local + size).  Unmapped when the last reference goes: a copy running on another
    thread holds one, so a session that closes meanwhile never unmaps it under that copy."""

    __slots__ = ("remote", "size", "local", "_mm", "_view", "__weakref__")

    def __init__(self, mm: mmap.mmap, remote: int, size: int):
        self._mm = mm
        self._view = np.frombuffer(mm, np.uint8)
        self.remote, self.size, self.local = remote, size, int(self._view.ctypes.data)


_SEALED = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_arenas: "weakref.WeakValueDictionary[tuple[int, int, int, int], MappedArena]" = weakref.WeakValueDictionary()


class _ExitWatch:
    """One daemon thread that drops an owner's ``arena`` once the gateway it maps dies.

    A mapping keeps the memfd's pages alive: a client that sits idle while its gateway is restarted would
    hold the old arena's memory beside the new one's until its next call.  Each watch polls a duplicate
    of the owner's pidfd (readable once that process has exited) and holds the owner weakly; ``forget``
    stops one (its session closed), as does the owner's collection (a session dropped without close).
    The poll set is changed on the watch's thread only, woken by a pipe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: list[tuple[int, Any]] = []  # in order: (a pidfd's duplicate, owner ref) or (-1, owner)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the thread
        threading.Thread(target=self._run, name="kvgate-arena-watch", daemon=True).start()

    def add(self, pidfd: int, owner: Any) -> None:
        with self._lock:
            # an owner dropped without close wakes the thread, which then closes its duplicate
            self._asked.append((os.dup(pidfd), weakref.ref(owner, self._gone)))
        self._wake()

    def _gone(self, _ref: Any) -> None:
        self._wake()

    def forget(self, owner: Any) -> None:
        with self._lock:
            self._asked.append((-1, owner))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watched: dict[int, Any] = {}
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                owner = watched[fd]()
                if owner is not None:
                    owner.arena = None  # (a copy running holds its own reference: unmapped after it)
                self._drop(poller, watched, fd)
            with self._lock:
                asked, self._asked = self._asked, []
            for fd, who in asked:
                if fd >= 0:
                    watched[fd] = who
                    poller.register(fd, select.POLLIN)
                else:
                    for old in [old for old, ref in watched.items() if ref() is who]:
                        self._drop(poller, watched, old)
            del asked
            for fd in [fd for fd, ref in watched.items() if ref() is None]:
                self._drop(poller, watched, fd)

    @staticmethod
    def _drop(poller: select.poll, watched: dict[int, Any], fd: int) -> None:
        poller.unregister(fd)
        del watched[fd]
        os.close(fd)


_watch: _ExitWatch | None = None


def _after_fork() -> None:
    """A forked child has none of its parent's threads: it starts its own helper and watch when it needs them."""
    global _pool, _pool_lock, _watch
    _pool, _pool_lock, _watch = None, threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork)


def drop_arena_on_exit(pidfd: int, owner: Any) -> None:
    """Set ``owner.arena`` to None once the process of ``pidfd`` (the gateway) exits; ``stop_watching``
    ends it.  Holds ``owner`` weakly."""
    global _watch
    with _pool_lock:
        if _watch is None:
            _watch = _ExitWatch()
    _watch.add(pidfd, owner)


def stop_watching(owner: Any) -> None:
    """End ``drop_arena_on_exit``'s watches of ``owner``."""
    if _watch is not None:
        _watch.forget(owner)


def map_arena(pidfd: int, pid: int, fd: int, address: int, size: int) -> MappedArena | None:
    """The arena the gateway's hello named (``HelloReply.arena``: its descriptor ``fd``, at ``address``,
    ``size`` bytes) mapped read-only here; None where it cannot be (its pieces are then read with
    ``process_vm_readv``).  Only a memfd sealed against shrinking, at least ``size`` bytes: what may
    never vanish under a copy (a SIGBUS here)."""
    if size <= 0 or address <= 0 or not hasattr(fcntl, "F_GET_SEALS"):
        return None
    try:
        mine = _take_fd(pidfd, pid, fd)
    except CrossMemoryError:
        return None
    try:
        st = os.fstat(mine)
        if fcntl.fcntl(mine, fcntl.F_GET_SEALS) & _SEALED != _SEALED or st.st_size < size:
            return None
        # One mapping a process for each arena, whatever its sessions (SGLang opens three): each mapping
        # has page tables of its own and counts in the resident size again.  Keyed by the memfd itself, which
        # a live mapping keeps from being reused, never by the gateway's pid or descriptor number.
        key = (st.st_dev, st.st_ino, address, size)
        with _pool_lock:
            arena = _arenas.get(key)
            if arena is None:
                arena = _arenas[key] = MappedArena(mmap.mmap(mine, size, mmap.MAP_SHARED, mmap.PROT_READ),
                                                   address, size)
        return arena
    except (OSError, ValueError, OverflowError):
        return None
    finally:
        os.close(mine)


def _spans(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """(destination, source, length) rows, uint64, each a piece that lies in one run of either side:
    the two sides cut at every run's end, vectorised."""
    lend, rend = np.cumsum(local[:, 1]), np.cumsum(remote[:, 1])
    ends = np.union1d(lend, rend)
    starts = np.concatenate((np.zeros(1, np.uint64), ends[:-1]))
    li, ri = np.searchsorted(lend, starts, "right"), np.searchsorted(rend, starts, "right")
    out = np.empty((len(ends), 3), np.uint64)
    out[:, 0] = local[li, 0] + (starts - (lend[li] - local[li, 1]))
    out[:, 1] = remote[ri, 0] + (starts - (rend[ri] - remote[ri, 1]))
    out[:, 2] = ends - starts
    return out


def _copy_spans(spans: np.ndarray) -> None:
    if _copier is not None:
        _copier.kvgate_copy_spans(spans.ctypes.data, len(spans))
        return
    for dst, src, n in spans.tolist():
        ctypes.memmove(dst, src, n)


def _copy_mapped(spans: np.ndarray, arena: MappedArena) -> None:
    """Copy ``spans`` (sources: the gateway's addresses, all inside ``arena``) out of the mapping, over
    two threads from ``SPLIT_BYTES`` on (each half of the bytes; a span may be cut at the middle)."""
    spans = spans.copy()
    spans[:, 1] += np.uint64((arena.local - arena.remote) % (1 << 64))  # (wraps: adding a negative)
    ends = np.cumsum(spans[:, 2])
    total = int(ends[-1])
    if total < SPLIT_BYTES:
        _copy_spans(spans)
        return
    half = total // 2
    i = int(np.searchsorted(ends, half))  # the span holding byte half - 1
    cut = half - (int(ends[i]) - int(spans[i, 2]))
    first, second = spans[: i + 1].copy(), spans[i:].copy()
    first[-1, 2] = cut
    second[0] += np.array((cut, cut, 0), np.uint64)
    second[0, 2] = int(spans[i, 2]) - cut
    other = _helper().submit(_copy_spans, second[1:] if second[0, 2] == 0 else second)
    try:
        _copy_spans(first)
    finally:
        other.result()


def read(pid: int, local: Runs, remote: Runs, arena: MappedArena | None = None) -> None:
    """Copy the bytes at ``remote`` (address, length) runs of process ``pid`` into the ``local`` runs of
    ours, in order (both sides hold the same number of bytes; either a list of pairs or an (n, 2)
    integer array); raises ``CrossMemoryError``.  Pieces that lie inside ``arena`` (``map_arena``'s, of
    the same process) are copied out of its mapping, the rest with ``process_vm_readv``."""
    local, remote = iovecs(local), iovecs(remote)
    total = int(local[:, 1].sum(dtype=np.int64))
    if total != int(remote[:, 1].sum(dtype=np.int64)):
        raise InvalidArgument(f"{total} bytes to read into, {int(remote[:, 1].sum(dtype=np.int64))} lent")
    if not total:
        return
    if arena is not None:
        spans = _spans(local, remote)
        src, n = spans[:, 1], spans[:, 2]
        base, size = np.uint64(arena.remote), np.uint64(arena.size)
        # inside: src >= base and src + n <= base + size, without a sum that could wrap
        inside = (src >= base) & (n <= size) & (src - base <= size - n)
        if inside.any():
            _copy_mapped(spans[inside], arena)
            if inside.all():
                return
            rest = spans[~inside]
            local, remote = rest[:, [0, 2]], rest[:, [1, 2]]
            total = int(rest[:, 2].sum(dtype=np.int64))
    if total < SPLIT_BYTES:
        _read_runs(pid, local, remote, 0, total)
        return
    # two threads, each half of the bytes (a run cut at the middle is read in two parts)
    half = total // 2
    other = _helper().submit(_read_runs, pid, local, remote, half, total)
    try:
        _read_runs(pid, local, remote, 0, half)
    finally:
        other.result()


class LentFile:
    """One object a gateway lent as its open file: ``fd`` (the gateway's) holds the payload at ``offset``;
    it goes into ``dest`` (exactly the payload's length) and must hash to ``expected``."""

    __slots__ = ("fd", "offset", "dest", "expected")

    def __init__(self, fd: int, offset: int, dest: memoryview, expected: int):
        self.fd, self.offset, self.dest, self.expected = fd, offset, dest, expected


def open_pidfd(pid: int) -> int | None:
    """A pidfd of process ``pid`` (the gateway's), for ``read_files``; None where there is none to have.
    The caller closes it."""
    if not files_supported:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _take_fd(pidfd: int, pid: int, fd: int) -> int:
    got = _libc.syscall(_NR_PIDFD_GETFD, pidfd, fd, 0)  # type: ignore[union-attr]
    if got < 0:
        e = ctypes.get_errno()
        raise CrossMemoryError(e, f"pidfd_getfd of fd {fd} of pid {pid}: {os.strerror(e)}")
    return got


def _read_file(pidfd: int, pid: int, f: LentFile) -> bool:
    """Whether ``f``'s payload is now in ``f.dest``, read from the page cache only and hashed right."""
    fd = _take_fd(pidfd, pid, f.fd)
    try:
        dest, done = f.dest, 0
        while done < len(dest):
            try:
                n = os.preadv(fd, [dest[done:]], f.offset + done, os.RWF_NOWAIT)
            except OSError:  # not cached (EAGAIN), or no RWF_NOWAIT here: the gateway reads it
                return False
            if n <= 0:
                return False
            done += n
        return payload_hash(dest) == f.expected
    finally:
        os.close(fd)


def _read_some(pidfd: int, pid: int, files: list[LentFile]) -> list[int]:
    return [i for i, f in enumerate(files) if not _read_file(pidfd, pid, f)]


def read_files(pidfd: int, pid: int, files: list[LentFile]) -> list[int]:
    """Read each lent file's payload into its ``dest`` (``pidfd``: ``open_pidfd(pid)``, the gateway's);
    the indexes (into ``files``) of those not read:
    not in the page cache any more, or a payload that did not hash right (the gateway must read those).
    Raises ``CrossMemoryError`` where this process may not take the gateway's descriptors (nothing of the
    call is then to be trusted).  Large calls are split over two threads, as ``read``."""
    if not files:
        return []
    total = sum(len(f.dest) for f in files)
    if total < SPLIT_BYTES or len(files) < 2:
        return _read_some(pidfd, pid, files)
    half, acc, cut = total // 2, 0, 0
    for cut, f in enumerate(files):
        if acc >= half:
            break
        acc += len(f.dest)
    cut = max(cut, 1)
    other = _helper().submit(_read_some, pidfd, pid, files[cut:])
    try:
        first = _read_some(pidfd, pid, files[:cut])
    finally:
        second = other.result()
    return first + [cut + i for i in second]
