"""A client that shrinks a shared-memory file the gateway maps gets an error; the gateway lives on.

Its session region or a registered /dev/shm file, truncated with ``ftruncate``,
then used for puts and gets: served from the RAM tier and from the card, with
the RAM tier on and off.  Before, the gateway's copies touched the vanished
pages and died of SIGBUS.

The gateway guards the regions of clients that could not stop it anyway
(another user's, or another PID namespace's).  This test process is the
gateway's own user, so the first tests guard every region
(``--in-place-regions false``); the last one is a client of another user, on
the defaults.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest

from kvgate.client import GatewayError
from kvgate.protocol import SESSION_REGION, Get, Put
from tests.helpers import kvgate_env

NOBODY = 65534

pytestmark = pytest.mark.timeout(90)

SMALL = 64 << 10  # fits the 1 MiB RAM tier
BIG = 2 << 20  # does not: on the card only, and staged for its card write
# "1M": small objects come from RAM, big ones from the card; "0": everything from the card.
RAM = pytest.mark.parametrize("ram", ["1M", "0"])
GUARDED = ["--in-place-regions", "false"]  # every region guarded, this process's too


def _payload(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _refused(excinfo: pytest.ExceptionInfo, path: str) -> None:
    err = excinfo.value
    assert err.code == "BAD_REQUEST", err
    assert path in str(err), err


def _still_serves(gw, stored: dict[bytes, bytes]) -> None:
    """The gateway is alive and a new client gets every byte right and stores anew."""
    assert gw.alive(), gw.log()
    with gw.client() as c:
        assert c.get_many(list(stored)) == list(stored.values())
        fresh = _payload(9, SMALL)
        assert c.put_many([b"after"], [fresh]) == [True]
        assert c.get_many([b"after"]) == [fresh]
    assert "Traceback" not in gw.log()


def _raw(c, msg):
    """One request as the wire carries it: the client library would itself touch the vanished pages."""
    return c._request(msg)


@RAM
def test_a_client_that_shrinks_its_session_region_gets_an_error(gateway_factory, ram: str) -> None:
    gw = gateway_factory(["--max-bytes", ram, *GUARDED])
    stored = {b"small": _payload(1, SMALL), b"big": _payload(2, BIG)}
    with gw.client() as c:
        assert c.put_many(list(stored), list(stored.values())) == [True, True]
    with gw.client() as c:
        (path,) = glob.glob(f"/dev/shm/kvgate-region.{gw.pid}.*")  # this client's session region
        os.truncate(path, 0)
        with pytest.raises(GatewayError) as e:
            _raw(c, Put(keys=[b"new"], sizes=[SMALL], region=SESSION_REGION, offsets=[0]))
        _refused(e, path)
        with pytest.raises(GatewayError) as e:
            _raw(c, Put(keys=[b"new-big"], sizes=[BIG], region=SESSION_REGION, offsets=[0]))
        _refused(e, path)
        for key, size in ((b"small", SMALL), (b"big", BIG)):
            with pytest.raises(GatewayError) as e:
                _raw(c, Get(keys=[key], region=SESSION_REGION, offsets=[0], capacities=[size]))
            _refused(e, path)
        with pytest.raises(GatewayError) as e:  # both at once, packed by the gateway
            _raw(c, Get(keys=[b"small", b"big"], region=SESSION_REGION))
        _refused(e, path)
        assert c.exists_many([b"new", b"new-big"]) == [False, False]  # a refused put stores nothing
    _still_serves(gw, stored)


@RAM
def test_a_client_that_shrinks_a_registered_region_gets_an_error(gateway_factory, ram: str) -> None:
    gw = gateway_factory(["--max-bytes", ram, *GUARDED])
    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    size = 4 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        small, big = memoryview(mm)[:SMALL], memoryview(mm)[1 << 20 : (1 << 20) + BIG]
        stored = {b"small": _payload(3, SMALL), b"big": _payload(4, BIG)}
        small[:], big[:] = stored[b"small"], stored[b"big"]
        with gw.client() as c:
            c.register_region(path, mm)
            assert c.put_many(list(stored), [small, big]) == [True, True]  # in place, from the region
            os.ftruncate(fd, 0)
            # From here on this process must not touch those pages either: the
            # client passes buffers inside the region by offset, untouched.
            with pytest.raises(GatewayError) as e:
                c.put_many([b"new"], [small])
            _refused(e, path)
            with pytest.raises(GatewayError) as e:
                c.put_many([b"new-big"], [big])
            _refused(e, path)
            with pytest.raises(GatewayError) as e:
                c.get_many([b"small"], into=[small])
            _refused(e, path)
            with pytest.raises(GatewayError) as e:
                c.get_many([b"big"], into=[big])
            _refused(e, path)
            assert c.exists_many([b"new", b"new-big"]) == [False, False]
        _still_serves(gw, stored)
    finally:
        os.close(fd)
        os.unlink(path)


SHRINK_AS_NOBODY = r"""
import json, mmap, os, sys
import numpy as np
from kvgate.client import Client, GatewayError

path, small, big = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4 << 20)
mm = mmap.mmap(fd, 4 << 20)
rng = np.random.default_rng(5)
a, b = memoryview(mm)[:small], memoryview(mm)[1 << 20 : (1 << 20) + big]
a[:], b[:] = rng.integers(0, 256, small, dtype=np.uint8).tobytes(), rng.integers(0, 256, big, dtype=np.uint8).tobytes()
out = {}
with Client.connect(sys.argv[1], namespace="shrink-ns", engine_id="nobody", want_shm=False, timeout=20,
                    token=sys.argv[5]) as c:
    c.register_region(path, mm)
    out["stored"] = c.put_many([b"a", b"b"], [a, b])
    os.ftruncate(fd, 0)
    for name, call in (("put small", lambda: c.put_many([b"n1"], [a])), ("put big", lambda: c.put_many([b"n2"], [b])),
                       ("get small", lambda: c.get_many([b"a"], into=[a])),
                       ("get big", lambda: c.get_many([b"b"], into=[b]))):
        try:
            call()
            out[name] = "answered"
        except GatewayError as e:
            out[name] = e.code + ": " + str(e)
os.unlink(path)
print(json.dumps(out))
"""


@RAM
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_client_of_another_user_that_shrinks_its_region_gets_an_error_on_the_defaults(gateway_factory, tmp_path,
                                                                                        ram: str) -> None:
    """Its region is guarded (it could not kill the gateway), though this user's regions are used in place.
    (Another user gets a session only with the gateway's token.)"""
    sockdir = tempfile.mkdtemp(prefix="kvg-shrink-", dir="/tmp")
    try:
        os.chmod(sockdir, 0o755)
        (tmp_path / "token").write_text("shrink-token\n")
        gw = gateway_factory(["--max-bytes", ram, "--auth-token-file", str(tmp_path / "token")],
                             socket_path=os.path.join(sockdir, "gw.sock"))
        os.chmod(gw.socket, 0o666)
        path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
        run = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                              "-c", SHRINK_AS_NOBODY, gw.socket, path, str(SMALL), str(BIG), "shrink-token"],
                             env=kvgate_env(), cwd="/", capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr + gw.log()
        out = json.loads(run.stdout)
        assert out.pop("stored") == [True, True], out
        for name, answer in out.items():
            assert answer.startswith("BAD_REQUEST") and path in answer, (name, answer)
        with gw.client() as c:  # this user's session: in place, and said so
            assert c.stats()["gateway"]["sessions_in_place"] == 1
        _still_serves(gw, {})
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
