"""Another user of the host, over every listener of a real gateway: it gets nothing.

The gateway runs as root (as the tests do) with its listeners as configured
by default: the Unix socket, TCP on loopback, HTTP on loopback.  A child
process runs as uid 65534 (``setpriv`` sets it before the exec) and tries
what a hostile local user would: open a session (an engine's, an admin's),
read a key, overwrite it, clean, prewarm over HTTP, take the one engine
session.  Then the real engine's hello still succeeds and reads its own
bytes.  The same with a token configured, the other user presenting none or
a wrong one.  And a gateway that cannot tell a loopback peer's uid (no
/proc/net/tcp in its mount namespace) keeps its TCP listener closed until
it has a token.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvgate.client import Client, GatewayError
from tests.helpers import free_port, kvgate_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="needs root and setpriv: the other user is made by setuid")]

NOBODY = 65534
# The child (setpriv) drops to uid and gid 65534, no other groups, before it runs the interpreter: a process
# of that user from its first instruction (as tests/gateway/test_client_errors.py does).
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
NS = "victim-ns"
KEY, GOOD = b"victim-key", b"the engine's own bytes" * 100

# Runs as uid 65534: every attempt's outcome as JSON, {"ok": true} where it got what it asked for.
ATTACK = r"""
import json, os, sys, urllib.error, urllib.request
assert os.getuid() == os.geteuid() == 65534, os.getuid()
from kvgate.client import Client

P = json.loads(sys.argv[1])
out = {}

def attempt(name, fn):
    try:
        out[name] = {"ok": True, "value": repr(fn())[:200]}
    except Exception as e:
        out[name] = {"ok": False, "type": type(e).__name__, "code": getattr(e, "code", None), "message": str(e)}

def engine_session(target):
    def go():
        with Client.connect(target, namespace=P["ns"], engine_id="attacker", token=P["token"], timeout=10) as c:
            got = c.get_many([P["key"].encode()])
            stored = c.put_many([P["key"].encode()], [b"attacker's bytes"])
            return got, stored, c.clean()
    return go

def admin_session(target):
    def go():
        with Client.connect(target, role="admin", want_shm=False, token=P["token"], timeout=10) as c:
            return c.clean()
    return go

def http(method, path, body=None):
    def go():
        headers = {"Content-Type": "application/json"}
        if P["token"] is not None:
            headers["Authorization"] = "Bearer " + P["token"]
        req = urllib.request.Request(f"http://127.0.0.1:{P['metrics_port']}{path}", data=body, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {e.read().decode()}") from None
    return go

attempt("unix_engine", engine_session(P["socket"]))
attempt("unix_admin", admin_session(P["socket"]))
attempt("tcp_engine", engine_session(f"127.0.0.1:{P['port']}"))
attempt("tcp_admin", admin_session(f"127.0.0.1:{P['port']}"))
prewarm = json.dumps({"namespace": P["ns"], "keys": [P["key"]]}).encode()
attempt("http_prewarm", http("POST", "/v1/cache/prewarm", prewarm))
attempt("http_metrics", http("GET", "/metrics"))
print(json.dumps(out))
"""


def _attack(gw, port: int, metrics_port: int, token: str | None, socket_path: str) -> dict:
    params = {"socket": socket_path, "port": port, "metrics_port": metrics_port, "token": token, "ns": NS,
              "key": KEY.decode()}
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", ATTACK, json.dumps(params)], env=kvgate_env(), cwd="/",
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("configured, presented", [(None, None), ("the-real-token", None),
                                                   ("the-real-token", "a-wrong-token")],
                         ids=["no-token", "token-none-presented", "token-wrong-presented"])
@pytest.mark.parametrize("socket_mode", [0o660, 0o666], ids=["socket-0660", "socket-0666"])
def test_another_user_gets_nothing_over_any_listener(gateway_factory, tmp_path, configured, presented,
                                                     socket_mode) -> None:
    sockdir = tempfile.mkdtemp(prefix="kvg-other-", dir="/tmp")
    os.chmod(sockdir, 0o755)  # the directory lets anyone reach the socket: its mode, then the hello decide
    port, mport = free_port(), free_port()
    args = ["--port", str(port), "--metrics-port", str(mport)]  # loopback, as by default
    if configured:
        (tmp_path / "token").write_text(configured + "\n")
        args += ["--auth-token-file", str(tmp_path / "token")]
    gw = gateway_factory(args, socket_path=os.path.join(sockdir, "gw.sock"))
    try:
        os.chmod(gw.socket, socket_mode)  # 0666: as if the other user were in the socket's group
        with gw.client(NS, engine_id="engine") as c:
            assert c.put_many([KEY], [GOOD]) == [True]

        got = _attack(gw, port, mport, presented, gw.socket)

        for name in ("unix_engine", "unix_admin", "tcp_engine", "tcp_admin", "http_prewarm"):
            assert not got[name]["ok"], (name, got[name])
        for name in ("tcp_engine", "tcp_admin"):
            assert got[name]["code"] == "NOT_AUTHORIZED", (name, got[name])
            assert "auth_token_file" in got[name]["message"], (name, got[name])
            if presented is None:
                assert f"uid {NOBODY}" in got[name]["message"], (name, got[name])
        for name in ("unix_engine", "unix_admin"):
            if socket_mode == 0o660:  # the socket's mode refuses connect() already
                assert got[name]["type"] == "NotPermitted", (name, got[name])  # a PermissionError
            else:  # let in by the mode, refused at the hello (SO_PEERCRED)
                assert got[name]["code"] == "NOT_AUTHORIZED", (name, got[name])
        assert "HTTP 401" in got["http_prewarm"]["message"] and "auth_token_file" in got["http_prewarm"]["message"]
        # /metrics: anyone on the host without a token (documented), the token's holders only with one
        assert got["http_metrics"]["ok"] == (configured is None), got["http_metrics"]

        # the real engine: its hello succeeds (no ENGINE_BUSY), its bytes are its own, nothing was cleaned
        # or prewarmed
        with gw.client(NS, engine_id="engine") as c:
            assert c.get_many([KEY]) == [GOOD]
            st = c.stats()
        assert st["tiers"]["ram"]["objects"] == 1 and st["cards"][0]["objects"] == 1
        log = gw.log()
        assert "hello refused" in log and "clean:" not in log and "Traceback" not in log, log
        assert gw.alive()
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_token_holder_of_another_user_gets_in(gateway_factory, tmp_path) -> None:
    """The token is what lets another user in, over loopback TCP as beyond it; its engine session then
    cleans only its own namespace."""
    (tmp_path / "token").write_text("the-real-token\n")
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--auth-token-file", str(tmp_path / "token")])
    with gw.client("other-ns", engine_id="engine") as c:
        assert c.put_many([b"theirs"], [b"kept"]) == [True]
    script = r"""
import os, sys
assert os.getuid() == 65534
from kvgate.client import Client
with Client.connect(sys.argv[1], namespace="nobody-ns", engine_id="engine", token="the-real-token", timeout=10) as c:
    assert c.put_many([b"mine"], [b"v"]) == [True]
    assert c.get_many([b"mine"]) == [b"v"]
    print(c.clean())
"""
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", script, f"127.0.0.1:{port}"], env=kvgate_env(), cwd="/",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    with gw.client("other-ns", engine_id="engine") as c:
        assert c.get_many([b"theirs"]) == [b"kept"]
    assert "with the token" in gw.log()


def _blind_gateway(tmp_path, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    """A gateway that cannot tell a loopback peer's uid: it runs in a mount namespace of its own with an
    empty /proc (no /proc/net/tcp), as a host without procfs there would.  -> (process, socket, log)."""
    sock, log = str(tmp_path / "blind.sock"), tmp_path / "blind.log"
    serve = [sys.executable, "-m", "kvgate", "serve", "--storage-devices", str(tmp_path / "card"),
             "--create-card-dirs", "true", "--max-bytes", "16M", "--socket", sock, *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh",
                                 *serve], env=kvgate_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_until(lambda: "ready:" in log.read_text() or proc.poll() is not None, 30, lambda: log.read_text())
    assert proc.poll() is None, log.read_text()
    return proc, sock, log


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_where_uids_cannot_be_told_the_tcp_listener_opens_only_with_a_token(tmp_path) -> None:
    port, mport = free_port(), free_port()
    proc, sock, log = _blind_gateway(tmp_path, "--port", str(port), "--metrics-port", str(mport))
    try:
        text = log.read_text()
        assert f"the TCP listener on 127.0.0.1:{port} stays closed" in text and "auth_token_file" in text, text
        assert "/proc/net/tcp cannot be read" in text, text
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with Client.connect(sock, namespace=NS, engine_id="engine", timeout=30) as c:  # the socket serves
            assert c.put_many([KEY], [GOOD]) == [True]
        # HTTP: /metrics answers; a prewarm cannot be told to come from the gateway's user: 401
        req = urllib.request.Request(f"http://127.0.0.1:{mport}/v1/cache/prewarm", method="POST",
                                     data=json.dumps({"namespace": NS, "keys": [KEY.decode()]}).encode())
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=10)
        assert ei.value.code == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        assert proc.wait(15) == 0

    (tmp_path / "token").write_text("the-real-token\n")
    proc, sock, log = _blind_gateway(tmp_path, "--port", str(port), "--metrics-port", "0",
                                     "--auth-token-file", str(tmp_path / "token"))
    try:
        assert "stays closed" not in log.read_text()
        with Client.connect(f"127.0.0.1:{port}", namespace=NS, engine_id="engine", token="the-real-token",
                            timeout=30) as c:
            assert c.get_many([KEY]) == [GOOD]
        # root, but the kernel does not say so here: without the token it is refused
        with pytest.raises(GatewayError) as ei:
            Client.connect(f"127.0.0.1:{port}", namespace=NS, engine_id="engine", timeout=30)
        assert ei.value.code == "NOT_AUTHORIZED" and "auth_token_file" in ei.value.message
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
