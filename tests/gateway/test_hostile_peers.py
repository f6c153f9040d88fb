"""Peers that try to hold what others need: nothing they do locks out an engine or grows the gateway.

One real gateway serves the Unix socket and a token-protected TCP listener
(bound to loopback, but with ``--auth-token-file``).  An attacker process (its
own pid; TCP from other loopback addresses than the clients) opens idle
connections past every limit, announces headers and bodies it never sends
(before and after hello), sends headers nested a million levels deep, and
garbage, on both listeners at once, round after round.  Meanwhile a local
engine connects afresh and puts and gets over the Unix socket, and a token
TCP client puts and gets inline: every call is byte-exact and quick.  After
it the gateway still runs, logged no traceback, and its RSS stayed under
``rss_bound_kib``.

The other tests take one limit or deadline at a time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest

from kvgate.client import Client, GatewayError
from kvgate.protocol import (
    MAGIC,
    PREAMBLE,
    VERSION,
    CountReply,
    Error,
    ErrorCode,
    HelloReply,
    PutReply,
)
from tests.helpers import GatewayProcess, free_port, kvgate_env, wait_until
from tests.gateway.test_protocol_fuzz import read_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TOKEN = "hostile-peers-token"
MAX_FRAME = 4 << 20
MAX_CONNECTIONS = 128
HELLO_TIMEOUT_S = 3.0
FRAME_TIMEOUT_S = 2.0
CALL_LIMIT_S = 5.0  # each client call under attack: generous for a loaded 2-core machine
STAGE = 64 << 10  # the gateway's staging buffer per connection (connection.STAGE_BYTES)
MAX_REFUSING = 64  # refused connections waited on at once (listeners.MAX_REFUSING)


def rss_bound_kib(base_kib: int) -> int:
    """What the attack may make the gateway hold beyond its warmed-up RSS: two listeners' inline byte
    budgets (2 x max_frame_bytes each), a staging buffer per connection of each listener and per refusal
    being answered, and 48 MiB for the interpreter's own growth (allocator, tasks, sockets)."""
    budgets = 2 * 2 * MAX_FRAME
    staging = (2 * MAX_CONNECTIONS + MAX_REFUSING) * STAGE
    return base_kib + (budgets + staging + (48 << 20)) // 1024


# ---- raw frames --------------------------------------------------------------------------------


def frame(header: dict | bytes, body: bytes = b"", *, header_len: int | None = None, body_len: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else msgspec.msgpack.encode(header)
    return PREAMBLE.pack(MAGIC, VERSION, 0, len(h) if header_len is None else header_len,
                         len(body) if body_len is None else body_len) + h + body


def nested(levels: int, rid: int = 7) -> bytes:
    """A lookup whose keys are a list nested ``levels`` deep."""
    return b"\x83\xa2op\xa6lookup\xa2id" + bytes([rid]) + b"\xa4keys" + b"\x91" * levels + b"\xc0"


# ---- the attacker: its own process ----------------------------------------------------------------

ATTACK = r'''
import collections, json, os, socket, sys, time
import msgspec
from kvgate.protocol import MAGIC, PREAMBLE, PREAMBLE_SIZE, VERSION, decode_reply, parse_preamble

P = json.loads(sys.argv[1])
stats = collections.Counter()
held = []


def frame(h, body=b"", header_len=None, body_len=None):
    hb = h if isinstance(h, bytes) else msgspec.msgpack.encode(h)
    return PREAMBLE.pack(MAGIC, VERSION, 0, len(hb) if header_len is None else header_len,
                         len(body) if body_len is None else body_len) + hb + body


def nested(levels, rid=7):
    return b"\x83\xa2op\xa6lookup\xa2id" + bytes([rid]) + b"\xa4keys" + b"\x91" * levels + b"\xc0"


def connect(src=None):
    try:
        if src is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(P["socket"])
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(10)
            s.bind((src, 0))
            s.connect(("127.0.0.1", P["port"]))
        return s
    except OSError:
        stats["connect_failed"] += 1
        return None


def reply(s):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    try:
        pre = exact(PREAMBLE_SIZE)
        if pre is None:
            return None
        _k, hl, bl = parse_preamble(pre, 1 << 62)
        h = exact(hl)
        if bl:
            exact(bl)
        return decode_reply(h)
    except OSError:
        return None


def send(s, data):
    try:
        s.sendall(data)
        return True
    except OSError:
        stats["send_failed"] += 1
        return False


def hold(s):
    if s is not None:
        held.append((time.monotonic(), s))


def session(src=None, token=None):
    s = connect(src)
    if s is None:
        return None
    if not send(s, frame({"op": "hello", "id": 1, "role": "admin", "token": token})):
        return None
    r = reply(s)
    if type(r).__name__ != "HelloReply":
        stats["hello_refused:" + getattr(r, "code", "closed")] += 1
        s.close()
        return None
    return s


def check_deep(s, levels):
    """A nested header is answered BAD_REQUEST with its id, and the connection goes on."""
    if not send(s, frame(nested(levels))):
        return
    r = reply(s)
    if r is not None and type(r).__name__ == "Error" and r.code == "TOO_MANY_CONNECTIONS":
        stats["deep_refused"] += 1  # this process is past its own limits: fine
    elif r is not None and type(r).__name__ == "Error" and r.code == "BAD_REQUEST" and r.id == 7:
        send(s, frame({"op": "stats", "id": 8}))
        r = reply(s)
        stats["deep_ok" if r is not None and r.id == 8 else "deep_then_broken"] += 1
    else:
        stats["deep_bad:" + repr(r)[:100]] += 1


put_header = {"op": "put", "id": 3, "keys": [b"k"], "sizes": [P["max_frame"] - 200]}
end = time.monotonic() + P["seconds"]
print("started", flush=True)
while time.monotonic() < end:
    if P["mode"] == "flood":
        # idle connections, far past the per-peer and per-listener limits
        for _ in range(40):
            hold(connect())
            hold(connect("127.0.0.2"))
        # before hello: announce a 4 MiB header or a large body, send a byte, stall
        for _ in range(4):
            for src in (None, "127.0.0.3"):
                s = connect(src)
                if s is not None and send(s, PREAMBLE.pack(MAGIC, VERSION, 0, 4 << 20, 0) + b"\x83"):
                    hold(s)
                s = connect(src)
                if s is not None and send(s, frame(put_header, body_len=P["max_frame"] - 200) + b"x"):
                    hold(s)
        # garbage
        for src in (None, "127.0.0.6"):
            s = connect(src)
            if s is not None:
                send(s, os.urandom(3000))
                s.close()
    else:
        # after hello (Unix: no token needed; TCP: a peer that has the token): announce, send a little, stall
        for src, token in ((None, None), (None, None), ("127.0.0.4", P["token"])):
            s = session(src, token)
            if s is not None and send(s, frame(put_header, body_len=P["max_frame"] - 200) + b"y" * 1024):
                hold(s)
        s = session()
        if s is not None and send(s, PREAMBLE.pack(MAGIC, VERSION, 0, 3 << 20, 0) + b"\x83"):
            hold(s)
        # headers nested far past any decoder's depth, before hello (within the small-header limit) and after
        for src in (None, "127.0.0.5"):
            s = connect(src)
            if s is not None:
                check_deep(s, 60000)
                s.close()
        s = session()
        if s is not None:
            check_deep(s, 1000000)
            s.close()
        s = session("127.0.0.5", P["token"])
        if s is not None:
            check_deep(s, 1000000)
            s.close()
    # let the oldest go, as a flood would
    now = time.monotonic()
    while held and now - held[0][0] > 8:
        held.pop(0)[1].close()
    stats["rounds"] += 1
    time.sleep(0.3)  # the pace of the attack's rounds
print(json.dumps(stats), flush=True)
'''


def _attacker(gw: GatewayProcess, port: int, seconds: float, mode: str) -> subprocess.Popen:
    """``mode``: "flood" (idle connections, stalls before hello, garbage) or "sessions" (stalls after hello,
    nested headers); each in its own process, as the limits before hello are per process."""
    params = {"socket": gw.socket, "port": port, "token": TOKEN, "max_frame": MAX_FRAME, "seconds": seconds,
              "mode": mode}
    proc = subprocess.Popen([sys.executable, "-c", ATTACK, json.dumps(params)], env=kvgate_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started", proc.stderr.read()
    return proc


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def _hostile_gateway(gateway_factory, token_file: str, *extra: str) -> tuple[GatewayProcess, int]:
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--bind-address", "127.0.0.1", "--auth-token-file", token_file,
                          "--max-frame-bytes", str(MAX_FRAME), "--max-connections", str(MAX_CONNECTIONS),
                          "--hello-timeout", f"{HELLO_TIMEOUT_S}s", "--frame-timeout", f"{FRAME_TIMEOUT_S}s",
                          "--max-bytes", "128M", *extra])
    return gw, port


def _timed(what: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    took = time.monotonic() - t0
    assert took < CALL_LIMIT_S, f"{what} took {took:.1f} s under attack"
    return out


# ---- everything at once -----------------------------------------------------------------------------


def test_engines_keep_working_while_both_listeners_are_attacked(gateway_factory, token_file) -> None:
    gw, port = _hostile_gateway(gateway_factory, token_file)
    tcp_target = f"127.0.0.1:{port}"
    big = [os.urandom(1 << 20), os.urandom(300 << 10)]
    small = [os.urandom(100 << 10) for _ in range(4)]
    tcp = Client.connect(tcp_target, namespace="tcp", engine_id="engine", token=TOKEN, timeout=30)
    try:
        # warm every path once, then the baseline
        with Client.connect(gw.socket, namespace="local", engine_id="engine", timeout=30) as eng:
            assert eng.put_many([b"w0", b"w1", b"w2", b"w3"], small) == [True] * 4
        assert tcp.put_many([b"b0", b"b1"], big) == [True, True]
        assert tcp.get_many([b"b0", b"b1"]) == big
        base = gw.rss_kib()
        peak = base
        attackers = [_attacker(gw, port, 14, mode) for mode in ("flood", "sessions")]
        rounds = 0
        try:
            while any(a.poll() is None for a in attackers):
                keys = [f"e{rounds}-{i}".encode() for i in range(4)]
                eng = _timed("a local engine's connect", Client.connect, gw.socket, "local", engine_id="engine",
                             timeout=30)
                with eng:
                    assert _timed("a local put", eng.put_many, keys, small) == [True] * 4
                    assert _timed("a local get", eng.get_many, keys + [b"w0"]) == small + [small[0]]
                tkeys = [f"t{rounds}-0".encode(), f"t{rounds}-1".encode()]
                assert _timed("a TCP put", tcp.put_many, tkeys, big) == [True, True]
                assert _timed("a TCP get", tcp.get_many, tkeys + [b"b0"]) == big + [big[0]]
                if rounds % 3 == 0:  # a new TCP connection with the token gets in too
                    fresh = _timed("a TCP connect", Client.connect, tcp_target, "tcp", token=TOKEN,
                                   engine_id="engine", timeout=30)
                    with fresh:
                        assert _timed("a fresh TCP get", fresh.get_many, tkeys) == big
                peak = max(peak, gw.rss_kib())
                rounds += 1
            outs = [a.communicate(timeout=30) for a in attackers]
        finally:
            for a in attackers:
                if a.poll() is None:
                    a.kill()
                    a.wait()
        for a, (out, err) in zip(attackers, outs):
            assert a.returncode == 0, err
        flood, sessions = (json.loads(out.strip().splitlines()[-1]) for out, _err in outs)
        stats = {"flood": flood, "sessions": sessions}
        assert rounds >= 5, rounds
        assert flood["rounds"] >= 3 and sessions["rounds"] >= 3, stats
        # every nested header was answered BAD_REQUEST with its id (both listeners, before and after hello),
        # unless the attacker was past its own limits
        assert sessions["deep_ok"] + sessions.get("deep_refused", 0) == 4 * sessions["rounds"], stats
        assert sessions["deep_ok"] >= 2 * sessions["rounds"], stats
        assert not [k for k in sessions if k.startswith("deep_bad") or k == "deep_then_broken"], stats
        # the attack hit the limits (its idle connections pushed each other out, or were refused), and the
        # pre-hello stalls never got a session
        st = gw.stats()
        assert st["gateway"]["refused_connections"] + st["gateway"]["displaced_connections"] > 0, st["gateway"]
        # what the attacker held is released: hello and frame deadlines closed the rest
        closed_by = time.monotonic() + HELLO_TIMEOUT_S + FRAME_TIMEOUT_S + 10
        back_by = closed_by + 15
        # the TCP client and the admin asking
        wait_until(lambda: gw.stats()["gateway"]["connections"] <= 2, closed_by - time.monotonic(),
                   lambda: f"connections still open: {gw.stats()['gateway']}", interval=0.2)
        # On 2 shared cores the attackers' own processes can starve the card's I/O past its deadline, and
        # a card with io_timeout_strikes of those is out of service (misses, never wrong bytes) until its
        # next health check: the acknowledged objects are all there once it is back.
        wait_until(lambda: all(c["active"] for c in gw.stats()["cards"]), back_by - time.monotonic(),
                   lambda: f"a card out of service: {gw.stats()['cards']}", interval=0.2)
        got = tcp.get_many([b"b0", b"b1"])
        while got != big and time.monotonic() < back_by:  # a read queued behind the attack's may time out
            time.sleep(0.5)
            got = tcp.get_many([b"b0", b"b1"])
        st = gw.stats()
        assert got == big, ([g is not None for g in got], st["io_timeouts"], st["io_errors"], st["cards"])
        peak = max(peak, gw.rss_kib())
        bound = rss_bound_kib(base)
        print(f"\nRSS: base {base >> 10} MiB, peak {peak >> 10} MiB under attack, bound {bound >> 10} MiB; "
              f"{rounds} client rounds, attackers {stats}")
        assert peak < bound, f"RSS peaked at {peak} KiB (base {base} KiB, bound {bound} KiB)"
    finally:
        tcp.close()
    assert gw.alive()
    log = gw.log()
    assert "Traceback" not in log and "handler failed" not in log, log[-5000:]


# ---- one limit at a time -----------------------------------------------------------------------------


def test_a_full_listener_answers_the_hello_with_too_many_connections(gateway_factory, token_file) -> None:
    gw, port = _hostile_gateway(gateway_factory, token_file, "--max-connections", "3")
    held = [Client.connect(gw.socket, namespace="n", engine_id="engine", timeout=30) for _ in range(3)]
    try:
        # the client reads a clear refusal, answered to its own hello (its id)
        with pytest.raises(GatewayError) as ei:
            Client.connect(gw.socket, namespace="n", engine_id="engine", timeout=30)
        assert ei.value.code == ErrorCode.TOO_MANY_CONNECTIONS
        assert "Unix socket serves at most 3 connections (max_connections)" in ei.value.message
        # the TCP listener has its own limit: local engines filling theirs do not lock TCP clients out, and back
        tcp = [Client.connect(f"127.0.0.1:{port}", namespace="n", engine_id="engine", token=TOKEN, timeout=30)
               for _ in range(3)]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(frame({"op": "hello", "id": 41, "token": TOKEN}))
            r = read_reply(s)
            assert isinstance(r, Error) and r.code == ErrorCode.TOO_MANY_CONNECTIONS and r.id == 41, r
            assert "TCP listener serves at most 3" in r.message
            assert read_reply(s) is None
        # a peer that says nothing is refused too, with id 0, after a short wait
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            r = read_reply(s)
            assert isinstance(r, Error) and r.code == ErrorCode.TOO_MANY_CONNECTIONS and r.id == 0, r
        for c in tcp:
            c.close()
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the gateway saw the close
            try:
                held.append(Client.connect(gw.socket, namespace="n", engine_id="engine", timeout=30))
                break
            except GatewayError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        for c in held:
            c.close()


def test_idle_connections_never_keep_out_a_client_that_says_hello(gateway_factory, token_file) -> None:
    """300 idle loopback connections from this process (past the per-peer cap and the listener's
    max_connections), then a token client of the same address: it gets its session at once, each time,
    while an attacker keeps opening new idle connections.  Each new connection closes the oldest one still
    waiting for its hello, never one that said hello."""
    import threading

    from kvgate.gateway.listeners import PENDING_PER_PEER

    gw, port = _hostile_gateway(gateway_factory, token_file)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    stop = threading.Event()
    churned: list[socket.socket] = []

    def reconnect() -> None:  # the attacker: new idle connections as fast as it can, from the same address
        while not stop.is_set():
            try:
                churned.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except OSError:
                pass
            if len(churned) > 400:
                churned.pop(0).close()

    attacker = threading.Thread(target=reconnect, daemon=True)
    attacker.start()
    try:
        for i in range(20):
            with _timed(f"connect {i} past idle connections", Client.connect, f"127.0.0.1:{port}", namespace="n",
                        engine_id="engine", token=TOKEN, timeout=30) as c:
                assert c.put_many([b"k%d" % i], [b"v"]) == [True]
        # the oldest idle ones were closed, without a reply
        for s in idle[:PENDING_PER_PEER]:
            s.settimeout(10)
            assert read_reply(s) is None
    finally:
        stop.set()
        attacker.join(10)
        for s in idle + churned:
            s.close()
    st = gw.stats()["gateway"]
    assert st["displaced_connections"] >= 300 - PENDING_PER_PEER, st
    assert st["refused_connections"] == 0, st


def test_announced_frames_that_stall_are_closed_and_release_what_they_held(gateway_factory, token_file) -> None:
    gw, port = _hostile_gateway(gateway_factory, token_file)
    base = gw.rss_kib()
    stalled = []
    try:
        # before hello: a header over the small-header limit, or any body, is refused at its preamble
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(PREAMBLE.pack(MAGIC, VERSION, 0, 4 << 20, 0) + b"\x83")
            r = read_reply(s)
            assert isinstance(r, Error) and r.code == ErrorCode.TOO_LARGE and "before hello" in r.message, r
        # after hello: two sessions announce a whole frame's body each (all of the TCP budget) and stall
        for i in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(frame({"op": "hello", "id": 1, "token": TOKEN, "namespace": "n", "engine_id": "engine"}))
            assert isinstance(read_reply(s), HelloReply)
            s.sendall(frame({"op": "put", "id": 2, "keys": [b"s"], "sizes": [MAX_FRAME - 200]},
                            body_len=MAX_FRAME - 200) + b"z" * 1000)
            stalled.append(s)
        # a third session's put still goes through at once (a connection holds at most half the budget;
        # the other stalled one waits for its share) and is answered long before the stalls are closed
        with Client.connect(f"127.0.0.1:{port}", namespace="n", engine_id="engine", token=TOKEN, timeout=30) as c:
            data = os.urandom(MAX_FRAME - 4096)
            assert _timed("a put while two bodies stall", c.put_many, [b"big"], [data]) == [True]
            assert c.get_many([b"big"]) == [data]
            # the stalled ones are closed by the frame deadline, with a reason
            t0 = time.monotonic()
            for s in stalled:
                r = read_reply(s)
                assert isinstance(r, Error) and r.code == ErrorCode.BAD_FRAME and "frame_timeout" in r.message, r
                assert read_reply(s) is None
            assert time.monotonic() - t0 < FRAME_TIMEOUT_S + 2 + 5
            assert c.get_many([b"big"]) == [data]
    finally:
        for s in stalled:
            s.close()
    assert gw.rss_kib() - base < 4 * MAX_FRAME // 1024 + (32 << 10)
    log = gw.log()
    assert "Traceback" not in log, log


def test_a_put_over_the_frame_limit_is_answered_and_the_session_goes_on(gateway_factory, token_file) -> None:
    gw, port = _hostile_gateway(gateway_factory, token_file)
    base = gw.rss_kib()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(frame({"op": "hello", "id": 1, "token": TOKEN, "namespace": "n", "engine_id": "engine"}))
        assert isinstance(read_reply(s), HelloReply)
        # 10 frames' worth of body: sent whole, as a client does, while the answer comes
        size = 10 * MAX_FRAME
        chunk = os.urandom(1 << 20)
        s.sendall(frame({"op": "put", "id": 9, "keys": [b"huge"], "sizes": [size]}, body_len=size))
        for _ in range(size // len(chunk)):
            s.sendall(chunk)
        r = read_reply(s)
        assert isinstance(r, Error) and r.code == ErrorCode.TOO_LARGE and r.id == 9, r
        assert str(MAX_FRAME) in r.message and "max_frame_bytes" in r.message
        # the connection is in step: the next requests are answered
        s.sendall(frame({"op": "put", "id": 10, "keys": [b"fits"], "sizes": [5]}, b"hello"))
        r = read_reply(s)
        assert isinstance(r, PutReply) and r.id == 10 and r.stored == [True], r
        s.sendall(frame({"op": "lookup", "id": 11, "keys": [b"fits", b"huge"]}))
        r = read_reply(s)
        assert isinstance(r, CountReply) and r.id == 11 and r.count == 1, r
    # the body was dropped through a small buffer, never allocated
    assert gw.rss_kib() - base < (MAX_FRAME >> 10) * 2, (base, gw.rss_kib())
    # the client sees the refusal as an error, and its connection goes on
    with Client.connect(f"127.0.0.1:{port}", namespace="n", engine_id="engine", token=TOKEN, timeout=30) as c:
        with pytest.raises(GatewayError) as ei:
            c.put_many([b"huge"], [bytes(MAX_FRAME + 1)])
        assert ei.value.code == ErrorCode.TOO_LARGE
        assert c.get_many([b"fits"]) == [b"hello"]


def test_announced_headers_after_hello_are_not_allocated_past_the_budget(gateway_factory, token_file) -> None:
    gw, _port = _hostile_gateway(gateway_factory, token_file)
    with gw.client("n", engine_id="engine") as c:  # warm the paths, then the baseline
        assert c.put_many([b"w"], [b"x" * 1000]) == [True]
    base = gw.rss_kib()
    sessions = []
    try:
        for _ in range(24):  # 24 x 4 MiB announced, 1 byte sent: each would be a 4 MiB buffer
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(gw.socket)
            sessions.append(s)
            s.sendall(frame({"op": "hello", "id": 1, "role": "admin"}))
            assert isinstance(read_reply(s), HelloReply)
            s.sendall(PREAMBLE.pack(MAGIC, VERSION, 0, MAX_FRAME - 1, 0) + b"\x83")
        time.sleep(0.5)  # the point: time for the gateway to take whatever it would take for them
        grown = gw.rss_kib() - base
        # at most two frames' worth (the Unix socket's budget) is held, not 24 x 4 MiB
        assert grown < (2 * MAX_FRAME + (16 << 20)) // 1024, f"RSS grew by {grown} KiB"
        with gw.client("n", engine_id="engine") as c:  # engines work meanwhile (through shared memory)
            assert _timed("a local put", c.put_many, [b"k"], [b"v" * 5000]) == [True]
            assert c.get_many([b"k"]) == [b"v" * 5000]
    finally:
        for s in sessions:
            s.close()
    assert "Traceback" not in gw.log()
