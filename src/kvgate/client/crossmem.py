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


def _advance(runs: list[tuple[int, int]], i: int, off: int, n: int) -> tuple[int, int]:
    """Where a side stands (run ``i``, ``off`` bytes into it) after ``n`` more bytes."""
    while n:
        take = min(runs[i][1] - off, n)
        off += take
        n -= take
        if off == runs[i][1]:
            i, off = i + 1, 0
    return i, off


def _read_runs(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """One side's runs into the other's, equal in total, in calls of at most ``IOV_MAX`` runs a side.

    Each side's iovecs are built as one flat list of integers made into a ctypes array at once: a
    ``memcopy.Iovec`` per run cost about 1 us, as much as copying 8 KiB (a get of SGLang's pages reads
    thousands of fragments)."""
    li = ri = 0
    loff = roff = 0  # bytes of local[li] / remote[ri] already done
    while li < len(local):
        lflat: list[int] = []
        want_l = 0
        j = li
        off = loff
        while j < len(local) and len(lflat) < 2 * IOV_MAX:
            a, n = local[j]
            lflat += (a + off, n - off)
            want_l += n - off
            j += 1
            off = 0
        rflat: list[int] = []
        want_r = 0
        k = ri
        off = roff
        r_end = (ri, roff)  # where the remote side stands once this call's bytes are read
        while k < len(remote) and len(rflat) < 2 * IOV_MAX and want_r < want_l:
            a, n = remote[k]
            take = min(n - off, want_l - want_r)
            rflat += (a + off, take)
            want_r += take
            r_end = (k + 1, 0) if take == n - off else (k, off + take)
            k += 1
            off = 0
        nl, nr = len(lflat) // 2, len(rflat) // 2
        got = _readv(pid, (ctypes.c_size_t * len(lflat))(*lflat), nl, (ctypes.c_size_t * len(rflat))(*rflat), nr, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise CrossMemoryError(e, f"process_vm_readv of pid {pid}: {os.strerror(e)}")
        if got == 0:
            raise CrossMemoryError(errno.EFAULT, f"process_vm_readv of pid {pid} read nothing of "
                                                 f"{min(want_l, want_r)} bytes")
        if got == want_l == want_r:  # all of it: the common case
            li, loff = j, 0
            ri, roff = r_end
        else:
            li, loff = _advance(local, li, loff, got)
            ri, roff = _advance(remote, ri, roff, got)

def read(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """Copy the bytes at ``remote`` (address, length) runs of process ``pid`` into the ``local`` runs of
    ours, in order (both sides hold the same number of bytes); raises ``CrossMemoryError``."""
    total = sum(n for _, n in local)
    if total != sum(n for _, n in remote):
        raise InvalidArgument(f"{total} bytes to read into, {sum(n for _, n in remote)} lent")
    local = [r for r in local if r[1]]
    remote = [r for r in remote if r[1]]
    if not local:
        return
    if total < SPLIT_BYTES or len(local) < 2:
        _read_runs(pid, local, remote)
        return
    # split at an object boundary near the middle: each half reads its own runs, in parallel
    half, acc, cut = total // 2, 0, 0
    for cut, (_a, n) in enumerate(local):
        if acc + n > half:
            break
        acc += n
    cut = max(cut, 1)
    acc = sum(n for _, n in local[:cut])
    r1, r2, racc = [], [], 0
    for a, n in remote:
        if racc + n <= acc:
            r1.append((a, n))
        elif racc >= acc:
            r2.append((a, n))
        else:
            first = acc - racc
            r1.append((a, first))
            r2.append((a + first, n - first))
        racc += n
    other = _helper().submit(_read_runs, pid, local[cut:], r2)
    try:
        _read_runs(pid, local[:cut], r1)
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
