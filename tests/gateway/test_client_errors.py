"""What the client says when a call or a connection is refused, against a real gateway.

A wrong argument is refused before anything is sent and the connection goes
on; a gateway over its connection limit is reported with its own reason; an
engine running as another user than the gateway is told who owns the socket
or the session's region, and how to fix it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests.helpers import free_port, kvgate_env
from kvgate.client import Client, GatewayError
from kvgate.keys import BadKey
from kvgate.protocol import ErrorCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ENGINE = "errors"
NS = "errors-ns"


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_refused_call_leaves_the_client_usable(gateway_factory, transport: str) -> None:
    port = free_port()
    gw = gateway_factory(["--port", str(port)])
    target = gw.socket if transport == "unix" else f"127.0.0.1:{port}"
    keys, bufs = [b"k0", b"k1"], [b"v0" * 100, b"v1" * 100]
    refused = [
        (lambda c: c.put_many(keys, bufs, position=2**70), ValueError),
        (lambda c: c.put_many(keys, bufs, retention="forever"), ValueError),
        (lambda c: c.put_many(keys, bufs, dialog="chat"), TypeError),
        (lambda c: c.put_many(keys, [b"x", np.arange(8, dtype=np.uint8)[::2]]), ValueError),
        (lambda c: c.put_many(keys, bufs[:1]), ValueError),
        (lambda c: c.put_many("k0", bufs), TypeError),
        (lambda c: c.get_many(keys, into=[bytearray(200), b"\0" * 200]), TypeError),
        (lambda c: c.lookup("abc"), TypeError),
        (lambda c: c.exists_many([b"k0", 1]), TypeError),
        (lambda c: c.delete_many([b""]), BadKey),
        (lambda c: c.prewarm(b"k0"), TypeError),
    ]
    with Client.connect(target, namespace=NS, engine_id=ENGINE) as c:
        for n, (call, exc) in enumerate(refused):
            with pytest.raises(exc):
                call(c)
            assert not c.broken
            key = f"after-{n}".encode()
            assert c.put_many([key], [key * 10], dialog=b"d", position=n) == [True]
            assert c.get_many([key], dialog=b"d") == [key * 10]
            assert c.lookup([key], dialog=b"d") == 1
        # the widest position the gateway stores is accepted
        assert c.put_many(keys, bufs, position=2**63 - 2) == [True, True]
        assert c.get_many(keys) == bufs
        assert not c.broken
    assert gw.alive() and "Traceback" not in gw.log()


def _connect_once_others_closed(target: str) -> Client:
    """Connect; a connection that just closed (the start-up probes, a client) counts until the gateway sees it."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return Client.connect(target, namespace=NS, engine_id=ENGINE)
        except GatewayError as e:
            if e.code != ErrorCode.TOO_MANY_CONNECTIONS or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_gateway_over_its_connection_limit_says_so(gateway_factory, transport: str) -> None:
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--max-connections", "2"])
    target = gw.socket if transport == "unix" else f"127.0.0.1:{port}"
    held = [_connect_once_others_closed(target) for _ in range(2)]
    try:
        for _ in range(5):
            with pytest.raises(GatewayError) as ei:
                Client.connect(target, namespace=NS, engine_id=ENGINE)
            assert ei.value.code == ErrorCode.TOO_MANY_CONNECTIONS
            assert "at most 2 connections" in ei.value.message
        held.pop().close()
        with _connect_once_others_closed(target) as c:
            assert c.put_many([b"k"], [b"v"]) == [True]
    finally:
        for c in held:
            c.close()


# ---- an engine of another user ------------------------------------------------------------------

NOBODY = 65534
CONNECT_AS_NOBODY = r"""
import json, sys
from kvgate.client import Client
try:
    Client.connect(sys.argv[1], namespace="errors-ns", engine_id="errors", timeout=10,
                   token=sys.argv[2] if len(sys.argv) > 2 else None).close()
    print(json.dumps({"type": None, "message": ""}))
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "message": str(e)}))
"""


def _connect_as_nobody(socket_path: str, *token: str) -> dict:
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          sys.executable, "-c", CONNECT_AS_NOBODY, socket_path, *token],
                         env=kvgate_env(), cwd="/", capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_engine_of_another_user_is_told_who_owns_the_socket_and_the_region(gateway_factory, tmp_path) -> None:
    sockdir = tempfile.mkdtemp(prefix="kvg-uid-", dir="/tmp")
    try:
        os.chmod(sockdir, 0o755)  # the directory lets anyone reach the socket: the socket's mode decides
        token = tmp_path / "token"
        token.write_text("errors-token\n")
        gw = gateway_factory(["--auth-token-file", str(token)], socket_path=os.path.join(sockdir, "gw.sock"))
        assert oct(os.stat(gw.socket).st_mode & 0o777) == "0o660"

        e = _connect_as_nobody(gw.socket)
        assert e["type"] == "NotPermitted", e  # kvgate.errors.NotPermitted, a PermissionError
        for words in (gw.socket, "uid 0", f"uid {NOBODY}", "mode 0660", "gateway's user", "group"):
            assert words in e["message"], (words, e["message"])

        os.chmod(gw.socket, 0o666)  # now the connection is let in, and the hello refused: not our user, no token
        e = _connect_as_nobody(gw.socket)
        assert e["type"] == "GatewayError", e
        for words in ("NOT_AUTHORIZED", f"uid {NOBODY}", "uid 0", "auth_token_file"):
            assert words in e["message"], (words, e["message"])

        # with the token the hello is let in, and the session's region is what fails
        e = _connect_as_nobody(gw.socket, "errors-token")
        assert e["type"] == "NotPermitted", e  # kvgate.errors.NotPermitted, a PermissionError
        for words in ("/dev/shm/kvgate-", "shared-memory region", "uid 0", f"uid {NOBODY}", "mode 0600",
                      "same user"):
            assert words in e["message"], (words, e["message"])

        # the gateway goes on serving its own user's engine
        deadline = time.monotonic() + 10
        while True:
            try:
                with gw.client(NS, engine_id=ENGINE) as c:
                    assert c.put_many([b"k"], [b"v"]) == [True] and c.get_many([b"k"]) == [b"v"]
                break
            except GatewayError:  # the refused engine's session may not be closed yet
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
