"""In-place regions (the default for a client of the gateway's own user): a shrunk file is refused before a
request touches it; shrunk during a request, the copies and hashes the gateway makes there run under the
compiled helper's guard and fail that request only; a fault no guard covers kills the gateway after its log
names the region.

Real processes and real signals: a Python process that maps a region and faults in it (with the compiled
helper and without), and a real gateway (in-place regions on) whose client truncates its session region or
a registered region before a put or get, or while the gateway copies a get into it (out of the RAM tier, and
1,000 objects off a card while another client reads the same objects).  The guarded case
(``in_place_regions: false``) is ``test_shrunk_regions``.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kvgate.client import GatewayError
from kvgate.gateway import faultlog
from kvgate.protocol import SESSION_REGION, Get, Put
from tests.gateway.test_shrunk_regions import BIG, SMALL, _payload, _raw, _refused, _still_serves
from tests.helpers import kvgate_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAULT = r"""
import logging, os, sys, uuid
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvgate.gateway import faultlog, shm
if sys.argv[1] == "fallback":
    faultlog._lib = None  # as where no C compiler built the helper
path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 1 << 20)
region = shm.map_client_region(path, os.getuid(), guarded=False, session=7, pid=4242)
print(path, flush=True)
os.ftruncate(fd, 0)
os.unlink(path)
region.view[65536]  # a load where the file no longer is: SIGBUS
"""


def _fault(mode: str) -> tuple[subprocess.CompletedProcess, str]:
    run = subprocess.run([sys.executable, "-c", FAULT, mode], env=kvgate_env(), capture_output=True, text=True,
                         timeout=60)
    return run, run.stdout.strip()


@pytest.mark.skipif(faultlog._lib is None, reason="the C helper is not built here (make install builds it)")
def test_a_fault_in_an_in_place_region_is_named_before_the_process_dies_of_it() -> None:
    run, path = _fault("helper")
    assert run.returncode == -signal.SIGBUS, (run.returncode, run.stderr)
    line = re.search(r"kvgate: SIGBUS at (0x[0-9a-f]+) in the in-place region of session 7 \(pid 4242, (\S+)\): "
                     r"its client shrank the file under the mapping; the gateway dies \(in_place_regions: false "
                     r"guards against this\)", run.stderr)
    assert line and line.group(2) == path, run.stderr
    assert "Fatal Python error: Bus error" in run.stderr, run.stderr  # handed on to faulthandler: the stacks


def test_without_the_helper_the_region_s_range_is_logged_and_faulthandler_says_bus_error() -> None:
    run, path = _fault("fallback")
    assert run.returncode == -signal.SIGBUS, (run.returncode, run.stderr)
    m = re.search(rf"in-place region of session 7 \(pid 4242, {re.escape(path)}\) mapped at (0x[0-9a-f]+)-"
                  r"(0x[0-9a-f]+)", run.stderr)
    assert m, run.stderr
    assert "Fatal Python error: Bus error" in run.stderr and "kvgate: SIGBUS" not in run.stderr, run.stderr


def test_an_in_place_session_region_shrunk_before_a_request_is_refused_by_name(gateway_factory) -> None:
    gw = gateway_factory()  # in-place regions on: this process is the gateway's own user
    stored = {b"small": _payload(1, SMALL), b"big": _payload(2, BIG)}
    with gw.client() as c:
        assert c.stats()["gateway"]["sessions_in_place"] == 1
        assert c.put_many(list(stored), list(stored.values())) == [True, True]
    with gw.client() as c:
        (path,) = glob.glob(f"/dev/shm/kvgate-region.{gw.pid}.*")
        os.truncate(path, 0)
        for req in (Put(keys=[b"new"], sizes=[SMALL], region=SESSION_REGION, offsets=[0]),
                    Get(keys=[b"small"], region=SESSION_REGION, offsets=[0], capacities=[SMALL]),
                    Get(keys=[b"small", b"big"], region=SESSION_REGION)):
            with pytest.raises(GatewayError) as e:
                _raw(c, req)
            _refused(e, path)
            assert "shorter than its mapping" in str(e.value), e.value
    _still_serves(gw, stored)


def test_an_in_place_registered_region_shrunk_before_a_request_is_refused_by_name(gateway_factory) -> None:
    gw = gateway_factory()
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4 << 20)
        mm = mmap.mmap(fd, 4 << 20)
        small = memoryview(mm)[:SMALL]
        small[:] = _payload(3, SMALL)
        with gw.client() as c:
            c.register_region(path, mm)
            assert c.put_many([b"small"], [small]) == [True]
            os.ftruncate(fd, 1 << 20)  # shorter than the gateway's mapping, though these pages are still there
            with pytest.raises(GatewayError) as e:
                c.put_many([b"new"], [small])
            _refused(e, path)
            with pytest.raises(GatewayError) as e:
                c.get_many([b"small"], into=[small])
            _refused(e, path)
        assert gw.alive(), gw.log()
        assert "kvgate: SIGBUS" not in gw.log()
    finally:
        os.close(fd)
        os.unlink(path)


def _shrink_mid_get(gw, c, path: str, rid: int, get, grow_to: int, attempts: int = 40) -> tuple[int, int]:
    """Gets (``get()``, one request) while another thread truncates ``path`` to 0 a few milliseconds in, the
    file grown back to ``grow_to`` before each: (requests refused by the size check before they copied,
    requests failed mid-copy).  Each refusal names the region; stops at the first mid-copy failure."""
    before = during = 0
    for attempt in range(attempts):
        os.truncate(path, grow_to)
        cut = threading.Timer((attempt % 8) * 0.002, os.truncate, (path, 0))
        cut.start()
        try:
            get()
        except GatewayError as e:
            assert e.code == "BAD_REQUEST" and path in str(e), e
            if "when it was mapped" in str(e):  # the copy met the gone pages (MemoryFault)
                during += 1
            else:
                before += 1  # the size check, before any byte was touched
        cut.join()
        assert gw.alive(), gw.log_tail()
        if during:
            break
    return before, during


@pytest.mark.skipif(faultlog._lib is None, reason="the C helper is not built here (make install builds it)")
@pytest.mark.parametrize("which", ["registered", "session"])
def test_a_region_shrunk_while_the_gateway_copies_into_it_fails_that_get_only(gateway_factory, which: str) -> None:
    """The race the size check cannot close: the file shrinks after the check, during the copy of a get out
    of the RAM tier.  The copy runs under the helper's guard: that get fails naming the region, the gateway
    serves on."""
    size = 48 << 20
    gw = gateway_factory(["--max-bytes", "128M", "--shared-memory-size", "64M"])
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        with gw.client(timeout=20) as c:
            if which == "registered":
                rid, shrunk = c.register_region(path, mm), path
            else:
                rid, (shrunk,) = SESSION_REGION, glob.glob(f"/dev/shm/kvgate-region.{gw.pid}.*")
            stored = _payload(4, size)
            assert c.put_many([b"big"], [stored]) == [True]
            get = lambda: _raw(c, Get(keys=[b"big"], region=rid, offsets=[0], capacities=[size]))  # noqa: E731
            before, during = _shrink_mid_get(gw, c, shrunk, rid, get, 64 << 20 if which == "session" else size)
        assert during == 1, f"40 shrinks and none met the copy ({before} refused before it)"
        log = gw.log()
        assert "kvgate: SIGBUS" not in log and "Traceback" not in log, log[-3000:]
        _still_serves(gw, {b"big": stored})
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.skipif(faultlog._lib is None, reason="the C helper is not built here (make install builds it)")
def test_a_registered_region_truncated_in_the_middle_of_1000_card_gets_fails_its_client_only(gateway_factory) -> None:
    """1,000 objects read from a card straight into a registered in-place region (in_place_regions at its
    default): the client truncates the region mid-get.  Its get fails naming the region; another client's gets
    of the same objects meanwhile all come back right; the gateway stays up and the card takes no strike."""
    n, size = 1000, 64 << 10
    gw = gateway_factory(["--max-bytes", "4M"])  # the RAM tier holds a few: the rest is read off the card
    keys = [b"obj-%04d" % i for i in range(n)]
    payloads = [_payload(100 + i, size) for i in range(n)]
    with gw.client() as c:
        for i in range(0, n, 100):
            assert c.put_many(keys[i : i + 100], payloads[i : i + 100]) == [True] * 100
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    stop, seen = threading.Event(), []

    def other_client() -> None:
        with gw.client(timeout=30) as c2:
            while not stop.is_set():
                sample = keys[::97]
                seen.append(c2.get_many(sample) == [payloads[keys.index(k)] for k in sample])

    try:
        os.ftruncate(fd, n * size)
        mm = mmap.mmap(fd, n * size)
        other = threading.Thread(target=other_client)
        other.start()
        try:
            with gw.client(timeout=30) as c:
                rid = c.register_region(path, mm)
                assert c.stats()["gateway"]["sessions_in_place"] >= 1, "the default is in place for our own user"
                get = lambda: _raw(c, Get(keys=keys, region=rid, offsets=[i * size for i in range(n)],  # noqa: E731
                                          capacities=[size] * n))
                before, during = _shrink_mid_get(gw, c, path, rid, get, n * size)
        finally:
            stop.set()
            other.join(30)
        assert during == 1, f"40 shrinks and none met the reads ({before} refused before them)"
        assert seen and all(seen), f"the other client saw wrong bytes in {seen.count(False)} of {len(seen)} gets"
        with gw.client() as c:
            cards = c.stats()["cards"]
        assert [(card["errors"], card["timeouts"]) for card in cards] == [(0, 0)], cards
        log = gw.log()
        assert "kvgate: SIGBUS" not in log and "Traceback" not in log, log[-3000:]
        _still_serves(gw, dict(zip(keys[:3], payloads[:3])))
    finally:
        os.close(fd)
        os.unlink(path)
