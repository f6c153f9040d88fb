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

Used by the client (``read``, ``read_files``, from the thread that runs its
copies); the gateway's side, letting its user's processes read it, is
``kvgate.gateway.lending``.  Linux only; elsewhere ``supported`` is False
and nothing here is called.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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


def read(pid: int, local: Runs, remote: Runs) -> None:
    """Copy the bytes at ``remote`` (address, length) runs of process ``pid`` into the ``local`` runs of
    ours, in order (both sides hold the same number of bytes; either a list of pairs or an (n, 2)
    integer array); raises ``CrossMemoryError``."""
    local, remote = iovecs(local), iovecs(remote)
    total = int(local[:, 1].sum(dtype=np.int64))
    if total != int(remote[:, 1].sum(dtype=np.int64)):
        raise InvalidArgument(f"{total} bytes to read into, {int(remote[:, 1].sum(dtype=np.int64))} lent")
    if not total:
        return
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
