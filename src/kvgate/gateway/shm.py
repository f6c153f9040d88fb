"""Shared-memory regions: where local clients' bulk bytes live.

Two kinds, both files under /dev/shm mapped by the gateway and the client:
- the session region, created by the gateway for each local session (mode
  0600, so only the gateway's uid can map it; the client is told its path);
- client regions, files a client already keeps its data in (vLLM keeps its
  CPU tier in ``/dev/shm/vllm_offload_<engine_id>.mmap``) and registers, so
  the gateway reads and writes them in place.  Only a regular file under
  /dev/shm owned by the connecting process's uid (SO_PEERCRED) is accepted.

Either file stays the client's to shrink, and a load or store in a page
shrunk away is SIGBUS, which would kill the gateway.  So a region is
*guarded* unless its client could stop the gateway anyway
(``could_stop_gateway``: a process of the gateway's own user, or root, in its
PID namespace, can kill it with a signal): the gateway never loads or stores
guarded memory from user space.  Every copy in or out goes through
``kvgate.memcopy``, which knows each guarded region's address range (a
``Region`` registers it for as long as it is mapped) and copies through the
kernel there, so a region shrunk under its mapping fails the request that
touched it (``MemoryFault``, a BAD_REQUEST naming the region) instead of
killing the gateway.  An unguarded region is read, hashed and written in
place like the gateway's own memory: one copy where the guard costs two
(docs/benchmarks.md).  ``in_place_regions: false`` guards every
region.

An unguarded (in-place) region is registered with ``memguard`` instead, as
in-place memory: every request that addresses one first checks its file is
still as long as the mapping (``Region.check_size``, one ``fstat``: the
common case, a file shrunk between requests, is a clean BAD_REQUEST naming
it), and the copies and hashes the gateway makes there during a request run
under the compiled helper's guard (``kvgate/_faults.c``): a file shrunk
meanwhile fails that request (``MemoryFault``), not the gateway.  A fault no
guard covers (or any, where the helper is not built) kills the process, and
``kvgate.gateway.faultlog`` writes a line naming the session, its client and
the file first.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import stat
import threading
import weakref

import numpy as np

from kvgate import memcopy, memguard, shmowners
from kvgate.gateway import faultlog
from kvgate.errors import KvgateError

SHM_DIR = shmowners.SHM_DIR
REGION_KIND = "region"  # session regions are owned files of this kind: kvgate-region.<pid>.<start>.<pidns>.<tag>

log = logging.getLogger("kvgate.shm")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_STEP = 8 << 20  # close() never waits; a closed mapping outlives it by one step at most
_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL for these calls
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
    _mincore = _libc.mincore
    _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _mincore.restype = ctypes.c_int
except (OSError, AttributeError):
    _madvise = _mincore = None


def _in_place_unmapped(base: int, size: int, slot: int | None) -> None:
    memguard.remove_in_place_memory(base, size)
    faultlog.forget(slot)


def _resident_runs(address: int, length: int, vec: ctypes.Array) -> list[tuple[int, int]]:
    """Byte ranges, relative to ``address``, of the runs of pages of ``length`` bytes there that their file
    has in memory (``mincore``; ``vec`` holds a byte per page); none when it fails."""
    pages = (length + _PAGE - 1) // _PAGE
    if _mincore(address, length, vec) != 0:
        return []
    resident = np.frombuffer(vec, np.uint8, pages) & 1
    edges = np.flatnonzero(np.diff(resident, prepend=0, append=0))
    return [(int(a) * _PAGE, min(int(b) * _PAGE, length)) for a, b in zip(edges[::2], edges[1::2])]


class RegionError(KvgateError, ValueError):
    """A region cannot be created, mapped or addressed as asked."""


class Region:
    """A mapped shared-memory file; a guarded one's address range is client memory to ``memcopy`` while it is
    mapped (the module's docstring says which are guarded)."""

    def __init__(self, path: str, size: int, mm: mmap.mmap, owned: bool, guarded: bool = True, *,
                 fd: int = -1, session: int = 0, pid: int | None = None):
        """``fd``: the file, open, for ``check_size`` (an in-place region keeps a duplicate of it);
        ``session``, ``pid``: whose region it is, for the line ``faultlog`` writes if it faults."""
        self.path = path
        self.size = size
        self.guarded = guarded
        self._mm = mm
        holder = ctypes.c_char.from_buffer(mm)
        self._base = ctypes.addressof(holder)
        del holder  # no buffer export left behind: close() must be able to unmap
        self._unmapped: weakref.finalize | None = None
        self._fd = -1
        if guarded:
            memcopy.add_client_memory(self._base, size)  # before any slice of it exists
            # Removed when the mapping goes: at close(), or when the last slice a
            # request held is released (a client that hangs up mid-request).
            self._unmapped = weakref.finalize(mm, memcopy.remove_client_memory, self._base, size)
        else:
            self._fd = os.dup(fd) if fd >= 0 else -1
            slot = faultlog.note(self._base, size, session, pid, path)  # (installs the guards' handler)
            memguard.add_in_place_memory(self._base, size)
            self._unmapped = weakref.finalize(mm, _in_place_unmapped, self._base, size, slot)
        self.view = memoryview(mm)
        self.owned = owned
        self._close_lock = threading.Lock()
        self._closed = False

    def populate_async(self) -> None:
        """Map the pages the client's file already has into this process's page tables, in the background.

        A fresh mapping of a client's region (a restarted engine's CPU tier)
        otherwise takes one page fault per 4 KiB page on its first transfer:
        with several I/O threads faulting on one file that is most of the time
        of a restore into fresh slots.  ``MADV_POPULATE_WRITE`` maps the pages
        in 8 MiB steps with the GIL released, each under an export of the
        mapping: close() never waits for a step (it runs on the event loop,
        and this thread may wait long for a CPU), it leaves the unmapping to
        the step's end, as it does for a request that still holds a slice.

        Only pages the file has (``mincore``): populating a hole would make
        the gateway allocate the client's memory, charged to the gateway, for
        a file of any size the client registers (an LMCache L1 of 1 GiB,
        populated whole by two sessions, took 7 s of CPU from the engine
        beside it: its TTFT doubled).  And at the lowest CPU priority
        (``SCHED_IDLE``), so an engine on the same cores never waits for it.
        Best effort: an older kernel or a failure just stops it.
        """
        if _madvise is None or _mincore is None or self.size == 0:
            return
        base = self._base

        def run() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
            except (OSError, AttributeError):
                pass
            vec = (ctypes.c_ubyte * (_POPULATE_STEP // _PAGE))()
            for off in range(0, self.size, _POPULATE_STEP):
                length = min(_POPULATE_STEP, self.size - off)
                try:
                    if self._closed:
                        return
                    hold = memoryview(self._mm)  # the mapping stays while this step runs
                except ValueError:  # closed meanwhile
                    return
                try:
                    for start, end in _resident_runs(base + off, length, vec):
                        if _madvise(base + off + start, end - start, _MADV_POPULATE_WRITE) != 0:
                            log.debug("populating %s stopped at %d: errno %d", self.path, off + start,
                                      ctypes.get_errno())
                            return
                finally:
                    hold.release()

        threading.Thread(target=run, name="kvgate-populate", daemon=True).start()

    def check_size(self) -> None:
        """For an in-place region, before a request touches it: ``RegionError`` (a BAD_REQUEST naming the
        file) when its file is shorter than the mapping now, instead of the SIGBUS the request would meet.

        One ``fstat`` on the region's own descriptor: 1.0-2.2 us measured here (1M calls on a /dev/shm
        file from Python, on a busy 2-core machine), against the 10s of us a put or get of even one block
        takes (a packed get checks twice).  A
        file shrunk after this check, during the request, fails it at the first guarded copy or hash that meets
        the gone pages (``kvgate.memguard``)."""
        if self._fd < 0:
            return
        try:
            now = os.fstat(self._fd).st_size
        except OSError:
            return  # closed meanwhile: the session is ending
        if now < self.size:
            raise RegionError(f"{self.path} is {now} bytes now, shorter than its mapping of {self.size}: keep "
                              "region files at their size while the gateway has them")

    def slice(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise RegionError(f"range [{offset}, {offset + length}) is outside the region of {self.size} bytes")
        return self.view[offset : offset + length]

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a request still holds a slice; the mapping and its range go when it does
        else:
            if self._unmapped is not None:
                self._unmapped()
        if self.owned:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def reap_dead_regions() -> int:
    """Remove session regions left by gateways that died (SIGKILL skips cleanup); -> how many.

    Session regions are owned files (``kvgate.shmowners``, kind ``region``): a region is garbage only
    when its gateway process is gone, told by pid and start time in our PID namespace, so a reused pid
    keeps its regions and a gateway in another namespace sharing /dev/shm never loses its regions to us
    (by the pid alone, a pid we cannot see looked dead).  Only this user's files are judged.
    """
    return len(shmowners.reap_dead_owners(REGION_KIND))


def could_stop_gateway(pid: int | None, uid: int | None) -> bool:
    """Whether the peer process ``pid`` (``uid``, from SO_PEERCRED) could kill this gateway with a signal.

    True for root and for the gateway's own user (real or saved uid: who
    ``kill`` lets through), when the peer sees our PID namespace: one made
    in a child namespace (a container) cannot name the gateway's pid, so
    it could not stop it, and its regions stay guarded.  Anything unknown
    (no credentials, a peer gone or not ours to inspect) is False.
    """
    if pid is None or uid is None or pid <= 0:
        return False
    _ruid, _euid, suid = os.getresuid()
    if uid not in (0, os.getuid(), suid):
        return False
    return _in_our_pid_namespace(pid)


def _in_our_pid_namespace(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except PermissionError:
        pass  # a root peer of a gateway that is not root: its status, readable by all, says
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):  # its pid in our namespace and in each one below it
                    return len(line.split()) == 2
    except OSError:
        pass
    return False


def create_session_region(tag: str, size: int, guarded: bool = True, session: int = 0,
                          pid: int | None = None) -> Region:
    """A fresh 0600 file under /dev/shm, its pages allocated up front (``session``, ``pid``: whose).

    ``posix_fallocate`` makes tmpfs allocate the pages now, so neither side
    pays first-touch page allocation in the middle of a transfer.
    """
    path = os.path.join(SHM_DIR, shmowners.owned_name(REGION_KIND, f"{tag}-{secrets.token_hex(6)}"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:  # no /dev/shm, or not ours to write: the hello is answered why, not cut off
        raise RegionError(f"cannot create a shared-memory region under {SHM_DIR}: {e.strerror or e}") from None
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise RegionError(f"cannot create a shared-memory region of {size} bytes: {e.strerror}") from None
    try:
        return Region(path, size, mm, owned=True, guarded=guarded, fd=fd, session=session, pid=pid)
    finally:
        os.close(fd)


def map_client_region(path: str, peer_uid: int | None, guarded: bool = True, session: int = 0,
                      pid: int | None = None) -> Region:
    """Map a client's file, after checking it is one the client may lend us (``session``, ``pid``: whose)."""
    real = os.path.realpath(path)
    if os.path.dirname(real) != SHM_DIR:
        raise RegionError(f"{path}: only files directly under {SHM_DIR} can be registered")
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise RegionError(f"{path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError(f"{path}: not a regular file")
        if peer_uid is None or st.st_uid != peer_uid:
            raise RegionError(f"{path}: owned by uid {st.st_uid}, not by the connecting process (uid {peer_uid})")
        if st.st_size == 0:
            raise RegionError(f"{path}: empty file")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        region = Region(real, st.st_size, mm, owned=False, guarded=guarded, fd=fd, session=session, pid=pid)
        region.populate_async()
        return region
    finally:
        os.close(fd)
