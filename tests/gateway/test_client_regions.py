"""Client regions (/dev/shm files a client registers for in-place transfers): mapped ahead of use, but only
where the file has pages, so the gateway never allocates a client's memory it was not asked to write
(``Region.populate_async``); and a few per session, so one connection cannot spend the gateway's
descriptors and mappings."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
import uuid

import pytest

from kvgate.client import GatewayError
from kvgate.gateway import shm
from kvgate.gateway.operations import MAX_CLIENT_REGIONS

MIB = 1 << 20


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that starts at ``address``."""
    lines = open("/proc/self/smaps").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    return next(int(line.split()[1]) for line in lines[start + 1:] if line.startswith("Rss:"))


def test_the_gateway_maps_the_pages_a_region_has_and_allocates_none_of_its_holes() -> None:
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 64 * MIB)  # a sparse file: what a client that registers a huge region lends
        with mmap.mmap(fd, 64 * MIB) as mine:
            mine[: 8 * MIB] = b"\1" * (8 * MIB)  # the client wrote 8 MiB of it, and one page further on
            mine[40 * MIB] = 1
        before = os.fstat(fd).st_blocks * 512
        region = shm.map_client_region(path, os.getuid(), guarded=False)
        try:
            for t in [t for t in threading.enumerate() if t.name == "kvgate-populate"]:
                t.join(60)
            assert os.fstat(fd).st_blocks * 512 == before, "the gateway allocated pages of the client's file"
            assert before < 9 * MIB
            # what the file had is in the gateway's page tables already: no faults on the first transfer
            assert _rss_kib(region._base) >= 8 * 1024 + 4
        finally:
            region.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_session_registers_a_bounded_number_of_regions(gateway) -> None:
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, MIB)
        with mmap.mmap(fd, MIB) as mm, gateway.client() as c:
            for _ in range(MAX_CLIENT_REGIONS):
                c.register_region(path, mm)
            with pytest.raises(GatewayError) as e:
                c.register_region(path, mm)
            assert e.value.code == "BAD_REQUEST" and path in str(e.value), e.value
            assert f"at most {MAX_CLIENT_REGIONS} regions" in str(e.value), e.value
            assert c.put_many([b"k"], [b"v" * 100]) == [True]  # the session goes on
            with gateway.client() as other:  # and another session registers its own
                other.register_region(path, mm)
                assert other.get_many([b"k"]) == [b"v" * 100]
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_region_closed_while_it_is_populated_is_unmapped_when_the_step_ends() -> None:
    """close() does not wait for the populating thread (it runs on the event loop); the mapping goes once
    the thread's step is over, nothing is left mapped."""
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 256 * MIB)
        os.posix_fallocate(fd, 0, 256 * MIB)  # every page there: a populate of 32 steps
        region = shm.map_client_region(path, os.getuid(), guarded=False)
        base = region._base
        time.sleep(0.002)  # the thread is in a step then, in 8 runs of 10 here
        region.close()
        for t in [t for t in threading.enumerate() if t.name == "kvgate-populate"]:
            t.join(60)
        del region
        gc.collect()
        assert not any(line.startswith(f"{base:x}-") for line in open("/proc/self/maps")), "still mapped"
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_region_is_populated_at_idle_cpu_priority() -> None:
    """The populating thread runs at ``SCHED_IDLE``: an engine on the same cores never waits for it."""
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 256 * MIB)
        os.posix_fallocate(fd, 0, 256 * MIB)  # 32 steps: tens of ms to look at the thread
        before = {t.ident for t in threading.enumerate()}
        region = shm.map_client_region(path, os.getuid(), guarded=False)
        try:
            threads = [t for t in threading.enumerate() if t.name == "kvgate-populate" and t.ident not in before]
            assert len(threads) == 1, threads
            seen = set()
            while threads[0].is_alive():
                try:
                    seen.add(os.sched_getscheduler(threads[0].native_id))
                except OSError:  # ended meanwhile
                    break
                if os.SCHED_IDLE in seen:
                    break
            assert os.SCHED_IDLE in seen, f"policies seen: {seen}"
        finally:
            region.close()
            threads[0].join(60)
    finally:
        os.close(fd)
        os.unlink(path)
