"""The safe copy: right bytes, scatter and gather, and a shrunk shared file is MemoryFault, not SIGBUS."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from kvgate import memcopy, memguard
from kvgate.memcopy import Abandon, MemoryFault, ReadAbandoned
from tests.helpers import kvgate_env


def _bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_copies_one_buffer_and_streams_of_pieces() -> None:
    src = _bytes(1, 3 << 20)
    dst = bytearray(len(src))
    memcopy.copy(dst, src)
    assert bytes(dst) == src.tobytes()
    # Pieces cut differently on each side, one of them empty: the streams line up.
    cuts_dst = [0, 5, 5, 4096, 1 << 20, len(src)]
    cuts_src = [0, 1000, 2 << 20, len(src)]
    out = np.zeros(len(src), np.uint8)
    memcopy.copy([out[a:b] for a, b in zip(cuts_dst, cuts_dst[1:])], [src[a:b] for a, b in zip(cuts_src, cuts_src[1:])])
    assert np.array_equal(out, src)
    with pytest.raises(ValueError):
        memcopy.copy(bytearray(3), b"four")


def test_more_pieces_than_one_call_takes() -> None:
    n = 3 * memcopy.IOV_MAX + 7
    src = _bytes(2, n * 16)
    out = np.zeros_like(src)
    memcopy.copy([out[i * 16 : (i + 1) * 16] for i in range(n)], src)
    assert np.array_equal(out, src)


@pytest.fixture
def shm_file():
    path = f"/dev/shm/kvgate-memcopy-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_shrunk_mapping_is_a_memory_fault_both_ways(shm_file: int) -> None:
    size = 4 << 20
    os.ftruncate(shm_file, size)
    mm = mmap.mmap(shm_file, size)
    view = memoryview(mm)
    base = np.frombuffer(view, np.uint8).ctypes.data
    memcopy.add_client_memory(base, size)  # as gateway.shm does for every region it maps
    src = _bytes(3, size)
    memcopy.copy(view, src)
    assert view[: 1 << 20] == src[: 1 << 20].tobytes()
    os.ftruncate(shm_file, 1 << 20)  # the last 3 MiB of the mapping are gone
    with pytest.raises(MemoryFault) as e:
        memcopy.copy(view, src)
    assert e.value.errno == errno.EFAULT
    with pytest.raises(MemoryFault):
        memcopy.copy(np.zeros(size, np.uint8), view)  # reading it too
    # One call takes IOV_MAX pieces: the first call's 1 MiB is there, the second call's is gone.
    pieces = [view[i << 10 : (i + 1) << 10] for i in range(2 * memcopy.IOV_MAX)]
    with pytest.raises(MemoryFault):
        memcopy.copy(pieces, src[: 2 << 20])
    assert view[: 1 << 20] == src[: 1 << 20].tobytes()
    for p in pieces:
        p.release()
    os.ftruncate(shm_file, 0)
    with pytest.raises(MemoryFault):
        memcopy.copy(view[:4096], src[:4096])
    assert memcopy.check()
    memcopy.remove_client_memory(base, size)


def _counting_kernel_calls(monkeypatch) -> list[str]:
    """The names of the kernel copies made from now on, in order."""
    calls: list[str] = []
    for name in ("_vm_writev", "_vm_readv"):
        real = getattr(memcopy, name)

        def counted(*args, _real=real, _name=name) -> int:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(memcopy, name, counted)
    return calls


def test_only_client_memory_is_copied_through_the_kernel(shm_file: int, monkeypatch) -> None:
    calls = _counting_kernel_calls(monkeypatch)
    src = _bytes(4, 1 << 20)
    own = np.zeros(len(src), np.uint8)
    memcopy.copy([own[: 1000], own[1000:]], src)  # both sides the gateway's own: a user-space copy
    assert np.array_equal(own, src) and calls == []
    os.ftruncate(shm_file, 2 << 20)
    mm = mmap.mmap(shm_file, 2 << 20)
    region = np.frombuffer(mm, np.uint8)
    memcopy.add_client_memory(region.ctypes.data + 4096, 8192)  # a range inside the mapping
    try:
        memcopy.copy(region[: 4096], src[: 4096])  # below the range: not client memory
        assert calls == []
        # Client memory is the local side of the call: the kernel pins the other side's pages, and
        # pinning pages of a /dev/shm file is the slow part.
        memcopy.copy(region[4000:4200], src[:200])  # overlaps the range's first byte
        assert calls == ["_vm_readv"]
        memcopy.copy(own[:100], region[12287:12387])  # reading it, overlapping its last byte
        assert calls == ["_vm_readv", "_vm_writev"]
        memcopy.copy(own[:100], region[12288:12388])  # just past it
        assert len(calls) == 2
        assert np.array_equal(region[4000:4200], src[:200]) and np.array_equal(own[:100], region[12287:12387])
    finally:
        memcopy.remove_client_memory(region.ctypes.data + 4096, 8192)
    memcopy.copy(region[4000:4200], src[:200])
    assert len(calls) == 2
    del region
    mm.close()


def test_a_region_is_client_memory_until_it_is_unmapped(monkeypatch) -> None:
    from kvgate.gateway import shm

    calls = _counting_kernel_calls(monkeypatch)
    before = memcopy._client.spans
    region = shm.create_session_region("memcopy-test", 1 << 20)
    assert len(memcopy._client.spans) == len(before) + 1
    src = _bytes(5, 4096)
    held = region.slice(0, 4096)
    memcopy.copy(held, src)
    assert len(calls) == 1 and bytes(held) == src.tobytes()
    region.close()  # a request still holds a slice (its client hung up): the mapping stays, and its range
    del region
    memcopy.copy(held, src)
    assert len(calls) == 2
    held.release()  # the mapping goes with the last slice, and so does its range: none pile up
    assert memcopy._client.spans == before
    again = shm.create_session_region("memcopy-test", 1 << 20)
    assert len(memcopy._client.spans) == len(before) + 1
    again.close()  # nothing holds a slice: unmapped, its range gone
    assert memcopy._client.spans == before
    again.close()
    assert memcopy._client.spans == before


def test_abandon_copies_until_abandoned_and_never_after() -> None:
    guard = Abandon()
    dst = bytearray(8)
    guard.copy(dst, b"abcdefgh")
    assert dst == b"abcdefgh"
    guard.abandon()
    with pytest.raises(ReadAbandoned):
        guard.copy(dst, b"ZZZZZZZZ")
    assert dst == b"abcdefgh"


@pytest.mark.parametrize("call", ["_vm_writev", "_vm_readv"])
def test_refused_syscall_falls_back_and_says_so(monkeypatch, caplog, call: str) -> None:
    def refused(*_args) -> int:
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(memcopy, call, refused)
    monkeypatch.setattr(memcopy, "_safe", None)
    monkeypatch.setattr(memcopy, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvgate.memcopy"):
        assert not memcopy.check()
    assert "can crash the gateway" in caplog.text
    dst = bytearray(5)
    memcopy.copy(dst, b"hello")  # plain copies from now on
    assert dst == b"hello"


GUARDED = r"""
import mmap, os, sys, uuid
import numpy as np, xxhash
from kvgate import memcopy, memguard
from kvgate.keys import payload_hasher
assert memguard.faults.kvgate_fault_install(2) == 0
path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.unlink(path)
os.ftruncate(fd, 4 << 20)
mm = mmap.mmap(fd, 4 << 20)
view = memoryview(mm)
base = memguard.address(np.frombuffer(mm, np.uint8))
memguard.add_in_place_memory(base, 4 << 20)
src = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
memcopy.copy([view[:4096], view[4096 : 1 << 20]], src)  # two pieces: one guarded call
assert bytes(view[: 1 << 20]) == src.tobytes()
h = memguard.hasher_for(view[: 1 << 20], payload_hasher)
assert type(h).__name__ == "GuardedHash", h
assert memguard.hash_with(view[: 1 << 20], payload_hasher) == xxhash.xxh3_64_intdigest(src.tobytes())
assert type(memguard.hasher_for(src, payload_hasher)).__name__ == "xxh3_64"  # gateway memory: the usual hasher
os.ftruncate(fd, 1 << 20)  # the client shrinks it: the pages past 1 MiB are gone
for attempt in range(3):  # again and again: the signal is unblocked after each jump
    for what, call in [("copy in", lambda: memcopy.copy(view[2 << 20 : 3 << 20], src)),
                       ("copy out", lambda: memcopy.copy(src, view[2 << 20 : 3 << 20])),
                       ("hash", lambda: memguard.hash_with(view[(1 << 20) - 4096 : 2 << 20], payload_hasher))]:
        try:
            call()
        except memcopy.MemoryFault as e:
            assert e.errno == 14, e
        else:
            sys.exit(f"{what}: no MemoryFault")
assert memguard.hash_with(view[: 1 << 20], payload_hasher) == xxhash.xxh3_64_intdigest(src.tobytes())
print("alive")
"""


@pytest.mark.slow
@pytest.mark.skipif(memguard.faults is None, reason="the C helper is not built here (make install builds it)")
def test_in_place_memory_is_copied_and_hashed_under_the_guard_and_a_shrunk_page_is_a_memory_fault() -> None:
    """In its own process (the guard's SIGBUS handler is process-wide): right bytes, the same hash as
    python-xxhash's, and a page shrunk away is MemoryFault for a copy in, a copy out and a hash, each time."""
    run = subprocess.run([sys.executable, "-c", GUARDED], env=kvgate_env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "alive", (run.returncode, run.stdout, run.stderr)
