"""Shared-memory regions: where local clients' bulk bytes live.

Two kinds, both files under /dev/shm mapped by the gateway and the client:
- the session region, created by the gateway for each local session (mode
  0600, so only the gateway's uid can map it; the client is told its path);
- client regions, files a client already keeps its data in (vLLM keeps its
  CPU tier in ``/dev/shm/vllm_offload_<engine_id>.mmap``) and registers, so
  the gateway reads and writes them in place.  Only a regular file under
  /dev/shm owned by the connecting process's uid (SO_PEERCRED) is accepted.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat

SHM_DIR = "/dev/shm"


class RegionError(ValueError):
    """A region cannot be created, mapped or addressed as asked."""


class Region:
    def __init__(self, path: str, size: int, mm: mmap.mmap, owned: bool):
        self.path = path
        self.size = size
        self._mm = mm
        self.view = memoryview(mm)
        self.owned = owned

    def slice(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise RegionError(f"range [{offset}, {offset + length}) is outside the region of {self.size} bytes")
        return self.view[offset : offset + length]

    def close(self) -> None:
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a request still holds a slice; the mapping goes when it does
        if self.owned:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def reap_dead_regions() -> int:
    """Remove session regions left by gateways that died (SIGKILL skips cleanup).

    Session regions are named ``kvgate-<gateway pid>-...``; a region whose
    gateway pid is gone is garbage.  Returns how many were removed.
    """
    removed = 0
    for name in os.listdir(SHM_DIR):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "kvgate" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def create_session_region(tag: str, size: int) -> Region:
    """A fresh 0600 file under /dev/shm, its pages allocated up front.

    ``posix_fallocate`` makes tmpfs allocate the pages now, so neither side
    pays first-touch page allocation in the middle of a transfer.
    """
    path = os.path.join(SHM_DIR, f"kvgate-{os.getpid()}-{tag}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise RegionError(f"cannot create a shared-memory region of {size} bytes: {e.strerror}") from None
    os.close(fd)
    return Region(path, size, mm, owned=True)


def map_client_region(path: str, peer_uid: int | None) -> Region:
    """Map a client's file, after checking it is one the client may lend us."""
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
        return Region(real, st.st_size, mm, owned=False)
    finally:
        os.close(fd)
