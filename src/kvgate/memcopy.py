"""Copies that a shrunk shared-memory file cannot turn into SIGBUS, and the guard reads deliver through.

Why: the gateway maps files its clients own (a session region, a registered
/dev/shm file).  A client that shrinks such a file with ``ftruncate`` leaves
pages in our mapping with nothing behind them, and a user-space load or
store there (``numpy.copyto``, a hash, a memoryview assignment) is a SIGBUS
that kills the gateway.  ``process_vm_readv`` / ``process_vm_writev`` on our
own pid make the kernel do the copy between two ranges of our own address
space: a page that is gone makes it return EFAULT (or a short count), which
``copy`` raises as ``MemoryFault``.  ctypes releases the GIL for the call,
and copying within one's own process needs no ptrace permission.

Only client memory needs the kernel: ``gateway.shm`` registers the address
range of every guarded region it maps (``add_client_memory``) before any
request can address it, and removes it only once it is unmapped.  (A region
of a client that could stop the gateway anyway is not guarded: a shrunk page
there costs no more than the kill that client could send.)  A copy with neither
side in such a range is between buffers the gateway owns (RAM-tier pages,
scratch, inline reply and staging buffers), which no client can shrink, and
runs as ``numpy.copyto``: the same speed for 2 MiB pieces (4.9 GiB/s here),
but 3.2 GiB/s against 0.7 in 16 KiB pieces, where the call's fixed cost
rules.  Which side of a kernel copy is client memory matters too: see
``_vm_readv``.

Where a seccomp profile refuses the call (ENOSYS, EPERM), ``copy`` falls back
to ``numpy.copyto`` and ``check`` says once that a client shrinking its
region could then crash the gateway.

In-place memory (the region of a client that could stop the gateway anyway)
is copied in user space, one pass, under ``kvgate.memguard``'s guard where
the compiled helper is built (``copy`` asks it), unguarded where it is not.

``Abandon`` is how a read that may outlive its deadline delivers: the loop
abandons it before it answers the client, and no copy through it starts
after that, nor is one still running.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Any, Sequence

import numpy as np

from kvgate import memguard
from kvgate.errors import KvgateError
from kvgate.memguard import MemoryFault, region_gone  # noqa: F401  (MemoryFault: raised by copy, imported from here)
from kvgate.memguard import address as _address, overlaps as _in_client_memory, u8 as _u8

log = logging.getLogger("kvgate.memcopy")

IOV_MAX = 1024  # iovecs per side in one call (the kernel's UIO_MAXIOV)


class ReadAbandoned(KvgateError, OSError):
    """The caller stopped waiting for this read (deadline, or it went away); nothing more is delivered."""


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def syscall(name: str) -> Any:
    """A ``process_vm_readv``-shaped call of libc, or None where there is none (kvgate.client.crossmem uses it too)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


# Both copy from "local" iovecs to "remote" ones (writev) or back (readv).
# The kernel pins the remote pages, 16 at a time, and copies the local side
# as an ordinary user copy; pinning pages of a /dev/shm file is what is
# slow.  So client memory is the local side where one side is: measured, one
# thread, 2 MiB objects from anonymous memory into /dev/shm pages, readv
# 5.1 GiB/s (numpy.copyto 5.1), writev 3.7; back out of /dev/shm, writev
# 5.0, readv 3.7.
_vm_writev = syscall("process_vm_writev")
_vm_readv = syscall("process_vm_readv")
_PID = os.getpid()
_client = memguard.Ranges()  # every mapping of client memory (guarded regions)
_safe: bool | None = None if _vm_writev is not None and _vm_readv is not None else False  # None: not tried yet
_warned = False



def add_client_memory(start: int, size: int) -> None:
    """Say that ``[start, start + size)`` is mapped from a file a client can shrink."""
    _client.add(start, size)


def remove_client_memory(start: int, size: int) -> None:
    """Forget one range ``add_client_memory`` added; only once that mapping is gone."""
    _client.remove(start, size)


def in_client_memory(buf: Any) -> bool:
    """Whether any byte of ``buf`` lies in client memory (a mapping ``add_client_memory`` named)."""
    ranges = _client.spans
    if not ranges:
        return False
    b = _u8(buf)
    return bool(b.size) and _in_client_memory(ranges, [_address(b)], [b])


def _segments(dst: list[np.ndarray], src: list[np.ndarray]) -> list[tuple[int, int, int, int, int]]:
    """The two byte streams cut into equal-length pieces, in order: (dst index, offset, src index, offset, length)."""
    out = []
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        dn, sn = dst[di].size, src[si].size
        n = min(dn - doff, sn - soff)
        if n:
            out.append((di, doff, si, soff, n))
        doff += n
        soff += n
        if doff == dn:
            di, doff = di + 1, 0
        if soff == sn:
            si, soff = si + 1, 0
    return out


def copy(dst: Any | Sequence[Any], src: Any | Sequence[Any]) -> None:
    """Copy the bytes of ``src`` into ``dst``; each is one buffer or a list of buffers read as one stream.

    Both streams must be equally long.  Raises ``MemoryFault`` when either
    side touches client memory that is gone (nothing is said about how much
    of ``dst`` was written then), never SIGBUS while the safe call works.
    Memory the gateway owns on both sides is copied in user space; so is
    in-place memory, under the helper's guard where it is built.
    """
    dsts = [_u8(b) for b in dst] if isinstance(dst, (list, tuple)) else [_u8(dst)]
    srcs = [_u8(b) for b in src] if isinstance(src, (list, tuple)) else [_u8(src)]
    total = sum(d.size for d in dsts)
    if total != sum(s.size for s in srcs):
        raise ValueError(f"copy of {sum(s.size for s in srcs)} bytes into {total}")
    if not total:
        return
    if len(dsts) == 1 and len(srcs) == 1:
        segments = [(0, 0, 0, 0, total)]
    else:
        segments = _segments(dsts, srcs)
    ranges, in_place = _client.spans, memguard.in_place_ranges()
    kernel = bool(ranges) and _safe is not False
    guard = bool(in_place) and memguard.faults is not None
    if kernel or guard:
        daddrs = [_address(d) for d in dsts]
        saddrs = [_address(s) for s in srcs]
        if kernel:
            into_client = _in_client_memory(ranges, daddrs, dsts)
            if into_client or _in_client_memory(ranges, saddrs, srcs):
                spans = [(daddrs[di] + do, saddrs[si] + so, n) for di, do, si, so, n in segments]
                if _kernel_copy(spans, into_client):
                    return
        if guard and (_in_client_memory(in_place, daddrs, dsts) or _in_client_memory(in_place, saddrs, srcs)):
            if memguard.copy_spans([(daddrs[di] + do, saddrs[si] + so, n) for di, do, si, so, n in segments]):
                return
    for di, do, si, so, n in segments:
        np.copyto(dsts[di][do : do + n], srcs[si][so : so + n])


def _kernel_copy(spans: list[tuple[int, int, int]], into_client: bool) -> bool:
    """Copy (destination address, source address, length) spans through the kernel, up to ``IOV_MAX`` a call.

    False when the kernel refuses the call.  ``into_client``: the
    destinations are client memory, so they are the local side
    (``process_vm_readv``); otherwise the sources are (``process_vm_writev``).
    """
    global _safe
    call, name = (_vm_readv, "process_vm_readv") if into_client else (_vm_writev, "process_vm_writev")
    for start in range(0, len(spans), IOV_MAX):
        batch = spans[start : start + IOV_MAX]
        n = len(batch)
        dsts, srcs = (Iovec * n)(), (Iovec * n)()
        want = 0
        for i, (d, s, size) in enumerate(batch):
            srcs[i].base, srcs[i].len = s, size
            dsts[i].base, dsts[i].len = d, size
            want += size
        done = call(_PID, dsts, n, srcs, n, 0) if into_client else call(_PID, srcs, n, dsts, n, 0)
        if done == want:
            continue
        if done < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM) and start == 0 and _safe is None:
                _safe = False
                return False
            if err != errno.EFAULT:
                raise OSError(err, f"{name}: {os.strerror(err)}")
            raise region_gone()
        raise region_gone(f"{done} of {want} bytes copied; ")
    return True


def check() -> bool:
    """Whether copies are safe from SIGBUS here; says so once, at start, when they are not."""
    global _safe, _warned
    if _safe is None:
        dst, src = np.zeros(8, np.uint8), np.ones(8, np.uint8)
        probe = [(_address(dst), _address(src), 8)]
        if _kernel_copy(probe, False) and _kernel_copy(probe, True):
            _safe = True
    if not _safe and not _warned:
        _warned = True
        log.warning("process_vm_writev or process_vm_readv is refused here (a seccomp profile?): copies into "
                    "shared regions use plain memory copies, and a client that shrinks its region file can crash "
                    "the gateway")
    return bool(_safe)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux 4.14+: a read that fails rather than wait for the device


class Abandon:
    """Set by the loop when it stops waiting; checked by the worker before it publishes.

    ``copy`` is the publish of a read: a card reads into memory of its own
    and hands the bytes over only through it.  The lock makes "check, then
    copy" atomic with respect to ``abandon``: once ``abandon()`` returns, no
    copy is still writing into memory the client may now reuse, and none
    starts.  A copy holds the lock for one piece (about 1 MiB, well under a
    millisecond), never for I/O, so ``abandon`` never waits on a card.
    Writes poll ``abandoned`` before they publish, so a write straight out
    of client memory (``kvgate.cards.directory.write``) publishes only bytes it
    read before the answer; it needs no lock, and ``abandon`` never waits
    for its ``pwrite``, which may wait for the device.

    ``own``: the destinations are the gateway's own memory (a reply buffer,
    RAM-tier pages), which no client can unmap or write while the read runs.
    A card may then read cached bytes straight into them (``read_cached``),
    or receive a network card's payload into them (``recv_nowait``), and
    verify them there, saving the copy through its scratch.
    """

    __slots__ = ("_lock", "abandoned", "own")

    def __init__(self, own: bool = False) -> None:
        self._lock = threading.Lock()
        self.abandoned = False
        self.own = own

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True

    def read_cached(self, fd: int, dst: list[memoryview], offset: int) -> int | None:
        """``preadv`` into the buffers ``dst`` at ``offset`` of ``fd`` from the page cache only
        (``RWF_NOWAIT``), unless abandoned (``ReadAbandoned`` then): the bytes read, or None when none are
        cached (nothing is waited for: the caller reads them its usual way).  Held under the lock like
        ``copy``: a read that cannot wait for the device is a memory copy, so ``abandon`` still never
        waits on a card."""
        if _NOWAIT is None:
            return None
        with self._lock:
            if self.abandoned:
                raise ReadAbandoned(errno.ECANCELED, "read abandoned: its caller stopped waiting")
            try:
                # 0 is left to the caller's usual read too: that read, not this one, says the file is short
                return os.preadv(fd, dst, offset, _NOWAIT) or None
            except BlockingIOError:
                return None
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return None  # a filesystem without it: read the usual way
                if e.errno == errno.EFAULT:  # the kernel met a page of dst that is gone (a shrunk region)
                    raise region_gone() from None
                raise

    def recv_nowait(self, fd: int, dst: memoryview, hasher: Any) -> int | None:
        """``readv`` into ``dst`` of what the non-blocking socket ``fd`` holds now, and ``hasher.update`` of what
        landed, unless abandoned (``ReadAbandoned`` then): the bytes read (0: the peer closed), or None when none
        have arrived (the caller waits for them without the lock, then asks again).  Only for memory the
        gateway owns (``own``, never client memory).  Held under the lock like ``copy``: a receive that does
        not wait is a memory copy, so ``abandon`` never waits on the network; the hash too, so no byte of a
        destination is read once it is abandoned (its memory may be reused by then)."""
        with self._lock:
            if self.abandoned:
                raise ReadAbandoned(errno.ECANCELED, "read abandoned: its caller stopped waiting")
            try:
                n = os.readv(fd, [dst])
            except BlockingIOError:
                return None
            if n:
                hasher.update(dst[:n])
            return n

    def copy(self, dst: Any, src: Any) -> None:
        """``copy(dst, src)`` unless abandoned (``ReadAbandoned`` then); ``MemoryFault`` as ``copy``."""
        with self._lock:
            if self.abandoned:
                raise ReadAbandoned(errno.ECANCELED, "read abandoned: its caller stopped waiting")
            copy(dst, src)
