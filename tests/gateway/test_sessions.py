"""Sessions against real gateway processes: namespaces, one engine per gateway, admin
sessions, restarts, TCP and its token, shared storage and clean, retention classes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port, kvgate_env, run_kvgate
from kvgate.client import Client, GatewayError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

KEYS = [f"k{i}".encode() for i in range(10)]


def data_for(tag: str, i: int, size: int = 3000) -> bytes:
    seed = f"{tag}-{i}".encode()
    return (seed * (size // len(seed) + 1))[:size]


def _retry(fn, timeout: float = 5.0, exc=GatewayError):
    """Engine claims are released when the gateway notices a disconnect: allow it a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except exc:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---- namespaces -----------------------------------------------------------------


def test_namespaces_are_isolated(gateway) -> None:
    a_data = [data_for("A", i) for i in range(10)]
    with gateway.client("ns-A", engine_id="eng") as a:
        assert a.put_many(KEYS, a_data) == [True] * 10
        assert a.lookup(KEYS) == 10
    with gateway.client("ns-B", engine_id="eng") as b:
        assert b.lookup(KEYS) == 0
        assert b.exists_many(KEYS) == [False] * 10
        assert b.get_many(KEYS) == [None] * 10
        b_data = [data_for("B", i, 2000 + i) for i in range(10)]
        assert b.put_many(KEYS, b_data) == [True] * 10
        assert b.get_many(KEYS) == b_data
        assert b.delete_many(KEYS[:3]) == 3
    with gateway.client("ns-A", engine_id="eng") as a:
        assert a.lookup(KEYS) == 10
        assert a.get_many(KEYS) == a_data
    # namespaces that are prefixes of each other do not meet either ("ns-A" + "x" vs "ns-Ax")
    with gateway.client("ns-Ax", engine_id="eng") as ax:
        assert ax.lookup(KEYS) == 0


# ---- one engine per gateway -----------------------------------------------------------

HOLDER = r"""
import sys
from kvgate.client import Client
c = Client.connect(sys.argv[1], namespace="held", engine_id=sys.argv[2], timeout=30)
c.put_many([b"holder-key"], [b"holder-bytes"])
print("READY", flush=True)
sys.stdin.readline()
c.close()
"""


def test_second_engine_is_refused_with_the_first_engines_pid(gateway) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, gateway.socket, "engine-one"], env=kvgate_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY", holder.stderr.read()
        with pytest.raises(GatewayError) as ei:
            gateway.client("other", engine_id="engine-two")
        assert ei.value.code == "ENGINE_BUSY"
        assert str(holder.pid) in ei.value.message, ei.value.message
        assert "engine-one" in ei.value.message
        # a default engine id (this process's pid) is another engine too
        with pytest.raises(GatewayError) as ei:
            gateway.client("other")
        assert ei.value.code == "ENGINE_BUSY"

        # admin sessions work while an engine holds the gateway
        with gateway.admin() as adm:
            st = adm.stats()
        assert st["gateway"]["engine"]["engine_id"] == "engine-one"
        assert st["gateway"]["engine"]["pid"] == holder.pid
        assert st["gateway"]["engine"]["connections"] == 1

        # more connections of the same engine are fine, and see the same data
        with gateway.client("held", engine_id="engine-one") as c1, gateway.client("held", engine_id="engine-one") as c2:
            assert c1.get_many([b"holder-key"]) == [b"holder-bytes"]
            assert c2.put_many([b"second"], [b"xyz"]) == [True]
            assert c1.get_many([b"second"]) == [b"xyz"]
            assert gateway.stats()["gateway"]["engine"]["connections"] == 3
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(15)
    assert holder.returncode == 0, holder.stderr.read()

    # the first engine is gone: another engine is accepted
    c = _retry(lambda: gateway.client("other", engine_id="engine-two"))
    with c:
        assert c.put_many([b"x"], [b"y"]) == [True]
        with pytest.raises(GatewayError) as ei:
            gateway.client("held", engine_id="engine-one")
        assert ei.value.code == "ENGINE_BUSY" and str(os.getpid()) in ei.value.message
        assert gateway.stats()["gateway"]["engine"]["engine_id"] == "engine-two"
    assert "engine 'engine-one'" in gateway.log()


# ---- restart --------------------------------------------------------------------------


def test_objects_survive_a_clean_restart(gateway_factory) -> None:
    gw = gateway_factory(name="first")
    datas = [data_for("restart", i, 1000 * (i + 1)) for i in range(10)]
    c = gw.client("persist")
    assert c.put_many(KEYS, datas) == [True] * 10
    # SIGTERM with a client still connected: a clean exit, no traceback
    assert gw.stop() == 0
    c.close()
    log = gw.log()
    assert "kvgate stopped" in log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert not os.path.exists(gw.socket), "a clean stop removes the socket"

    gw2 = gateway_factory(card=gw.card, name="second")
    st = gw2.wait_scanned()
    assert st["cards"][0]["objects"] == 10
    assert st["tiers"]["ram"]["objects"] == 0
    with gw2.client("persist") as c:
        assert c.lookup(KEYS) == 10
        assert c.get_many(KEYS) == datas
        st = c.stats()
    assert st["tiers"]["long"]["hits"] == 10 and st["tiers"]["ram"]["hits"] == 0


# ---- TCP ------------------------------------------------------------------------------


def test_tcp_round_trip_inline(gateway_factory) -> None:
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--max-frame-bytes", "4M", "--max-bytes", "128M"])
    # sizes around and above one frame's worth of inline bytes (4 MiB frames, 3 MiB of payload each)
    sizes = [2, 1, 4096, 3 << 20, 1 << 20, (4 << 20) - 4096, 2 << 20, 100]
    datas = [os.urandom(s) for s in sizes]
    keys = [f"tcp-{i}".encode() for i in range(len(sizes))]
    with Client.connect(f"127.0.0.1:{port}", namespace="tcp-ns") as c:
        assert not c.local
        assert c.put_many(keys, datas) == [True] * len(keys)
        assert c.lookup(keys) == len(keys)
        got = c.get_many(keys + [b"absent"])
        assert [len(g) if g is not None else None for g in got] == sizes + [None]
        assert got == datas + [None]
        bufs = [bytearray(s + 10) for s in sizes]
        got = c.get_many(keys, into=bufs)
        assert [bytes(g) for g in got] == datas
    # the same objects over the Unix socket
    with gw.client("tcp-ns") as c:
        assert c.get_many(keys[:3]) == datas[:3]


def test_non_loopback_bind_without_token_refuses_to_start(tmp_path) -> None:
    r = run_kvgate("serve", "--storage-devices", str(tmp_path / "card"), "--port", str(free_port()),
                   "--bind-address", "0.0.0.0", "--metrics-port", "0", "--socket", str(tmp_path / "s.sock"),
                   "--max-bytes", "0", "--card-capacity", "1G", timeout=30)
    assert r.returncode != 0
    assert "bind_address" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "s.sock")


def test_tcp_token_required_when_configured(gateway_factory, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--bind-address", "127.0.0.1", "--auth-token-file", str(token_file)])
    target = f"127.0.0.1:{port}"
    # a token presented must be the gateway's, whoever presents it (root here, let in without one)
    for bad in ("wrong", "s3cret-token-but-longer", ""):
        with pytest.raises(GatewayError) as ei:
            Client.connect(target, namespace="tok", token=bad, timeout=10)
        assert ei.value.code == "NOT_AUTHORIZED" and "auth_token_file" in ei.value.message
    with pytest.raises(GatewayError) as ei:
        Client.connect(target, role="admin", want_shm=False, token="wrong", timeout=10)
    assert ei.value.code == "NOT_AUTHORIZED"
    # without one, the kernel tells this loopback peer is root: let in (other users: test_other_users)
    with Client.connect(target, role="admin", want_shm=False, timeout=10) as c:
        assert c.stats()["gateway"]["pid"] == gw.pid
    with Client.connect(target, namespace="tok", token="s3cret-token", timeout=10) as c:
        assert c.put_many([b"a"], [b"alpha"]) == [True]
        assert c.get_many([b"a"]) == [b"alpha"]
    # the Unix socket is local: no token there
    with gw.client("tok") as c:
        assert c.get_many([b"a"]) == [b"alpha"]
    # the CLI passes the token too
    r = run_kvgate("stat", "--address", target, "--json", "--token-file", str(token_file))
    assert r.returncode == 0, r.stderr
    (tmp_path / "wrong").write_text("wrong\n")
    r = run_kvgate("stat", "--address", target, "--json", "--token-file", str(tmp_path / "wrong"))
    assert r.returncode != 0 and "NOT_AUTHORIZED" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_non_loopback_bind_with_token(gateway_factory, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-0.0.0.0")
    port = free_port()
    gateway_factory(["--port", str(port), "--bind-address", "0.0.0.0", "--auth-token-file", str(token_file)])
    with pytest.raises(GatewayError) as ei:
        Client.connect(f"127.0.0.1:{port}", namespace="n", token="tok-wrong", timeout=10)
    assert ei.value.code == "NOT_AUTHORIZED"
    with Client.connect(f"127.0.0.1:{port}", namespace="n", token="tok-0.0.0.0", timeout=10) as c:
        assert c.put_many([b"k"], [b"v"]) == [True]


# ---- shared storage and clean -------------------------------------------------------------


def test_shared_storage_refuses_clean(gateway_factory) -> None:
    gw = gateway_factory(["--shared-storage", "true"])
    datas = [data_for("shared", i) for i in range(10)]
    with gw.client("shared") as c:
        assert c.put_many(KEYS, datas) == [True] * 10
    r = run_kvgate("clean", "--socket", gw.socket)
    assert r.returncode != 0
    assert "CLEAN_REFUSED" in r.stderr + r.stdout
    with gw.client("shared") as c:
        assert c.lookup(KEYS) == 10
        assert c.get_many(KEYS) == datas
        with pytest.raises(GatewayError) as ei:
            c.clean()
        assert ei.value.code == "CLEAN_REFUSED"
        assert c.lookup(KEYS) == 10
    assert "nothing was deleted" in gw.log()
    assert gw.stats()["cards"][0]["objects"] == 10


def test_shared_storage_with_start_clean_refuses_to_start(tmp_path) -> None:
    card = tmp_path / "card"
    r = run_kvgate("serve", "--storage-devices", str(card), "--shared-storage", "true", "--start-clean", "true",
                   "--port", "0", "--metrics-port", "0", "--socket", str(tmp_path / "s.sock"), "--max-bytes", "0")
    assert r.returncode != 0
    assert "start_clean" in r.stderr and "shared_storage" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "s.sock")


# ---- retention ---------------------------------------------------------------------------


def test_retention_classes(gateway_factory) -> None:
    gw = gateway_factory(name="ret1")
    n_keys, s_keys, l_keys = [b"n0", b"n1"], [b"s0", b"s1"], [b"l0", b"l1"]
    vals = [b"v0" * 500, b"v1" * 700]
    with gw.client("ret") as c:
        assert c.put_many(n_keys, vals, retention="none") == [False, False]
        assert c.put_many(s_keys, vals, retention="short") == [True, True]
        assert c.put_many(l_keys, vals, retention="long") == [True, True]
        assert c.lookup(n_keys) == 0
        assert c.get_many(n_keys) == [None, None]
        assert c.lookup(s_keys) == 2
        assert c.get_many(s_keys) == vals
        assert c.get_many(l_keys) == vals
        st = c.stats()
    assert st["tiers"]["ram"]["objects"] == 4
    assert st["tiers"]["long"]["objects"] == 2  # short never reaches a card
    assert st["tiers"]["ram"]["hits"] == 4
    with gw.client("ret") as c:  # the client refuses it; the gateway's own refusal: test_protocol_fuzz
        with pytest.raises(ValueError, match="retention"):
            c.put_many([b"x"], [b"y"], retention="forever")
    assert gw.stop() == 0

    gw2 = gateway_factory(card=gw.card, name="ret2")
    with gw2.client("ret") as c:
        assert c.lookup(s_keys) == 0
        assert c.get_many(s_keys) == [None, None]
        assert c.get_many(n_keys) == [None, None]
        assert c.lookup(l_keys) == 2
        assert c.get_many(l_keys) == vals


def test_helper_reports_a_gateway_that_cannot_start(gateway_factory) -> None:
    with pytest.raises(RuntimeError) as ei:
        gateway_factory(["--max-bytes", "lots"], name="broken")
    msg = str(ei.value)
    assert "exited with code 2" in msg and "max_bytes" in msg and "lots" in msg


def test_second_gateway_on_a_busy_socket_is_refused_and_leaves_it_alone(gateway_factory, tmp_path) -> None:
    gw = gateway_factory(name="first")
    with gw.client("busy") as c:
        assert c.put_many([b"k"], [b"v"]) == [True]
    r = run_kvgate("serve", "--storage-devices", str(tmp_path / "other-card"), "--socket", gw.socket,
                   "--port", "0", "--metrics-port", "0", "--max-bytes", "0", "--card-capacity", "1G")
    assert r.returncode != 0
    assert "already listening" in r.stderr, r.stderr
    # the running gateway keeps its socket: new clients still reach it
    assert os.path.exists(gw.socket)
    with gw.client("busy") as c:
        assert c.get_many([b"k"]) == [b"v"]
    assert gw.alive()
