"""Peer gateways against real processes: one gateway (``peers``) reads what another (``peer_listen``) holds.

Gateway A serves its tiers on ``peer_listen``; gateway B lists A in
``peers``, each with its own card.  What a client stored in A's RAM tier
only is found and read through B, verified, and copied into B's RAM tier so
that the next read is local; B never asks A for what it holds itself; a key
neither holds is a miss.  A's listener lets in only a peer with its token,
serves reads only, and refuses a batch over the limit without reading it;
A killed costs B misses within ``peer_timeout_ms``, never an error to its
client, and B then leaves it alone for a while instead of paying the
deadline on every lookup.  Connections that never say a hello cannot lock
a peer out: they are displaced at a full listener and closed after
``hello_timeout``; only a listener full of peers that said theirs refuses a
newcomer.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvgate import statview
from kvgate.cards.network import wire as w
from kvgate.gateway.peerserve import PEER_CONNECTIONS
from kvgate.gateway.status import render
from kvgate.keys import encode_namespace, full_key
from tests.helpers import GatewayProcess, free_port, hello_reply, peer_payload

pytestmark = pytest.mark.slow

NS = "peer-ns"
ABSENT = full_key(encode_namespace(NS), b"absent")


data = peer_payload


@pytest.fixture
def pair(tmp_path: Path):
    token = tmp_path / "peer.token"
    token.write_text("peer-secret\n")
    port = free_port()
    a = GatewayProcess(tmp_path, ["--max-bytes", "64M", "--shared-memory-size", "16M",
                                  "--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", str(token)],
                       card=tmp_path / "card-a", name="A")
    b = GatewayProcess(tmp_path, ["--max-bytes", "64M", "--shared-memory-size", "16M",
                                  "--peers", f"127.0.0.1:{port}", "--peer-token-file", str(token),
                                  "--peer-timeout-ms", "2000"], card=tmp_path / "card-b", name="B")
    a.start()
    b.start()
    try:
        yield a, b, port, token
    finally:
        b.cleanup()
        a.cleanup()


def peer_row(gw: GatewayProcess) -> dict:
    (row,) = gw.stats()["peers"]
    return row


def served(gw: GatewayProcess) -> dict:
    return gw.stats()["peer_listen"]


def test_a_gateway_reads_what_its_peer_holds(pair) -> None:
    a, b, port, _token = pair
    keys = [f"k{i}".encode() for i in range(6)]
    with a.client(NS) as c:
        assert c.put_many(keys, [data(i) for i in range(6)], retention="short") == [True] * 6  # A's RAM only
    with b.client(NS) as c:
        assert c.lookup(keys) == 6
        assert c.lookup([*keys[:2], b"nowhere", keys[3]]) == 2
        assert c.get_many(keys) == [data(i) for i in range(6)]
        row = peer_row(b)
        assert row["hits"] == 6 and row["bytes_read"] == 6 * len(data(0)), row
        # now in B's RAM tier: read there, A not asked again
        assert c.get_many(keys[:3]) == [data(i) for i in range(3)]
        assert peer_row(b)["gets"] == row["gets"]
        assert b.stats()["tiers"]["ram"]["objects"] == 6
        assert c.get_many([b"nowhere"]) == [None]
    served = a.stats()["peer_listen"]
    assert served["served_objects"] == 6 and served["refused"] == 0, served
    # kvgate stat shows both sides, within 80 columns
    for gw, named in ((b, f"127.0.0.1:{port}"), (a, "served on")):
        con = Console(width=80, record=True, color_system=None)
        con.print(statview.view(gw.stats()))
        text = con.export_text()
        assert named in text and max(len(line) for line in text.splitlines()) <= 80, text
    # B's own objects are B's: A is not asked for them
    with b.client(NS) as c:
        before = peer_row(b)["gets"]
        assert c.put_many([b"own"], [data(9)]) == [True]
        assert c.lookup([b"own"]) == 1 and c.get_many([b"own"]) == [data(9)]
        assert peer_row(b)["gets"] == before


def _hello(port: int, hello: w.Msg) -> tuple[w.Msg, socket.socket]:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(w.frame(hello))
    prefix = bytearray(w.PREFIX.size)
    w.recv_exact(s, memoryview(prefix))
    hlen, _ = w.parse_prefix(prefix, w.MAX_REPLY_HEADER, 0)
    return w.decode_reply(w.recv_body(s, hlen)), s


def _reply(s: socket.socket) -> w.Msg:
    prefix = bytearray(w.PREFIX.size)
    w.recv_exact(s, memoryview(prefix))
    hlen, blen = w.parse_prefix(prefix, w.MAX_REPLY_HEADER, 1 << 30)
    return w.decode_reply(w.recv_body(s, hlen))


def test_the_peer_listener_lets_in_only_a_peer_with_the_token_and_serves_reads_only(pair, tmp_path) -> None:
    a, _b, port, token = pair
    with a.client(NS) as c:
        assert c.put_many([b"secret"], [data(1)], retention="short") == [True]
    # no token, a wrong one, another card's serial, a request before the hello: refused, named
    for hello, named in ((w.Hello("peer"), "token"), (w.Hello("peer", token="guess"), "token"),
                         (w.Hello("some-card", token="peer-secret"), "peer listener"),
                         (w.ReadMany([b"x"]), "hello first")):
        reply, s = _hello(port, hello)
        s.close()
        assert isinstance(reply, w.Err) and named in reply.message, (hello, reply)
    # a peer with the token reads, and may not write, delete or clean
    reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
    assert isinstance(reply, w.Ok)
    s.sendall(w.frame(w.Clean()))
    reply = _reply(s)
    assert isinstance(reply, w.Err) and "exists_many, read_many and namespaces" in reply.message
    assert s.recv(1) == b""  # and the connection is closed
    s.close()
    # a batch over the limit is refused before a key of it is read
    reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
    s.sendall(w.frame(w.ReadMany([b"k"] * (w.MAX_BATCH + 1))))
    reply = _reply(s)
    assert isinstance(reply, w.Err) and "over the limit" in reply.message
    s.close()
    assert a.stats()["peer_listen"]["refused"] >= 6
    assert "refused" in a.log()
    # a gateway with another token gets misses, and its log says why
    other_token = tmp_path / "other.token"
    other_token.write_text("not-the-secret")
    c_gw = GatewayProcess(tmp_path, ["--max-bytes", "16M", "--shared-memory-size", "16M", "--peers",
                                     f"127.0.0.1:{port}", "--peer-token-file", str(other_token)],
                          card=tmp_path / "card-c", name="C")
    c_gw.start()
    try:
        with c_gw.client(NS) as c:
            assert c.lookup([b"secret"]) == 0 and c.get_many([b"secret"]) == [None]
        assert "token is wrong" in c_gw.log()
        assert peer_row(c_gw)["failures"] >= 1
    finally:
        c_gw.cleanup()


def test_a_dead_peer_costs_misses_within_the_deadline(pair) -> None:
    a, b, _port, _token = pair
    keys = [f"d{i}".encode() for i in range(4)]
    with a.client(NS) as c:
        assert c.put_many(keys, [data(i) for i in range(4)], retention="short") == [True] * 4
    with b.client(NS) as c:
        assert c.get_many(keys[:2]) == [data(0), data(1)]
        a.kill()
        t0 = time.monotonic()
        assert c.lookup(keys[2:]) == 0
        assert c.get_many(keys[2:]) == [None, None]
        assert time.monotonic() - t0 < 10
        assert c.get_many(keys[:2]) == [data(0), data(1)]  # what it pulled before is its own now
    row = peer_row(b)
    # the first call found it gone; the next ones were not made (it rests, doubling while it stays away)
    assert b.alive() and row["failures"] >= 1 and row["skipped"] >= 1 and row["resting_s"] > 0, row


def _silent(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def _closed_within(s: socket.socket, limit: float) -> float:
    """Seconds until the gateway closed ``s`` (nothing read but the close, or an ``Err``); fails past ``limit``."""
    s.settimeout(limit)
    t0 = time.monotonic()
    while True:
        got = s.recv(4096)
        if not got:
            return time.monotonic() - t0


def test_silent_connections_do_not_keep_a_peer_out(pair) -> None:
    a, b, port, _token = pair
    keys = [f"s{i}".encode() for i in range(3)]
    with a.client(NS) as c:
        assert c.put_many(keys, [data(i) for i in range(3)], retention="short") == [True] * 3
    extra = 8
    idle = _silent(port, PEER_CONNECTIONS + extra)  # the listener full, and then some, of connections saying nothing
    try:
        with b.client(NS) as c:  # B's lookup and pull each displace the oldest of them, at once
            assert c.lookup(keys) == 3
            assert c.get_many(keys) == [data(i) for i in range(3)]
        row = peer_row(b)
        assert row["hits"] == 3 and row["failures"] == 0, row
        got = served(a)
        assert got["served_objects"] == 3 and got["displaced"] >= extra + 1, got
        assert got["connections"] <= PEER_CONNECTIONS, got
        metrics = render(a.stats()).decode()  # the same counters on /metrics
        assert f"kvgate_peer_listen_displaced_total {float(got['displaced'])}" in metrics
        # the displaced ones were closed (the oldest first), not left open beside the new
        assert _closed_within(idle[0], 5) < 5
    finally:
        for s in idle:
            s.close()


def test_a_connection_without_a_hello_is_closed_after_hello_timeout(tmp_path: Path) -> None:
    token = tmp_path / "peer.token"
    token.write_text("peer-secret\n")
    port = free_port()
    a = GatewayProcess(tmp_path, ["--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", str(token),
                                  "--hello-timeout", "1s"], card=tmp_path / "card-a", name="A")
    a.start()
    try:
        (silent,) = _silent(port, 1)
        (dribbling,) = _silent(port, 1)
        dribbling.sendall(w.frame(w.Hello("peer", token="peer-secret"))[:3])  # a hello begun, never finished
        assert 0.5 < _closed_within(silent, 8) < 5
        assert _closed_within(dribbling, 8) < 5
        silent.close()
        dribbling.close()
        got = served(a)
        assert got["timed_out"] == 2 and got["connections"] == 0, got
        # a peer that says its hello at once is in, and stays in past hello_timeout between its requests
        reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
        assert isinstance(reply, w.Ok)
        time.sleep(1.5)
        s.sendall(w.frame(w.ExistsMany([ABSENT])))
        assert isinstance(_reply(s), w.Results)
        s.close()
    finally:
        a.cleanup()


def test_a_listener_full_of_peers_refuses_a_newcomer(pair) -> None:
    a, b, port, _token = pair
    peers = []
    try:
        for _ in range(PEER_CONNECTIONS):  # every slot a peer that said its hello, then idles
            reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
            assert isinstance(reply, w.Ok)
            peers.append(s)
        refused_before = served(a)["refused"]
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        reply = _reply(s)  # answered at once, before it says anything, and closed
        assert isinstance(reply, w.Err) and f"{PEER_CONNECTIONS} peer connections" in reply.message, reply
        assert s.recv(1) == b""
        s.close()
        got = served(a)
        assert got["refused"] == refused_before + 1 and got["displaced"] == 0, got
        assert got["connections"] == PEER_CONNECTIONS, got
        # a peer is never displaced: each still answers
        for s in peers[:3]:
            s.sendall(w.frame(w.ExistsMany([ABSENT])))
            assert isinstance(_reply(s), w.Results)
        # one leaves: its slot is free for the next
        peers.pop().close()
        deadline = time.monotonic() + 10
        while served(a)["connections"] >= PEER_CONNECTIONS:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
        assert isinstance(reply, w.Ok)
        peers.append(s)
    finally:
        for s in peers:
            s.close()


@pytest.fixture
def trio(tmp_path: Path):
    """B reads from two peers on one host, A1 and A2 (each with a peer listener of its own); B serves peers
    on another (loopback) address."""
    token = tmp_path / "peer.token"
    token.write_text("peer-secret\n")
    ports = [free_port(), free_port()]
    serving = [GatewayProcess(tmp_path, ["--max-bytes", "32M", "--shared-memory-size", "16M",
                                         "--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", str(token)],
                              card=tmp_path / f"card-a{i}", name=f"A{i}") for i, port in enumerate(ports, 1)]
    b = GatewayProcess(tmp_path, ["--max-bytes", "32M", "--shared-memory-size", "16M",
                                  "--peers", *(f"127.0.0.1:{p}" for p in ports), "--peer-token-file", str(token),
                                  "--peer-timeout-ms", "2000", "--peer-listen", f"127.0.0.2:{free_port()}"],
                       card=tmp_path / "card-b", name="B")
    for gw in (*serving, b):
        gw.start()
    try:
        yield serving, b, ports
    finally:
        for gw in (b, *serving):
            gw.cleanup()


def test_a_request_source_chooses_the_peer_asked(trio) -> None:
    (a1, a2), b, (p1, p2) = trio
    with a1.client(NS) as c:
        assert c.put_many([b"both", b"both-get"], [data(1), data(2)], retention="short") == [True, True]
    with a2.client(NS) as c:
        assert c.put_many([b"both", b"both-get", b"two", b"two-x", b"two-y", b"two-z"],
                          [data(1), data(2), data(3), data(4), data(5), data(6)], retention="short") == [True] * 6

    def rows() -> dict[str, dict]:
        return {row["address"]: row for row in b.stats()["peers"]}

    def asked() -> tuple[int, int]:
        r = rows()
        return r[f"127.0.0.1:{p1}"]["lookups"], r[f"127.0.0.1:{p2}"]["lookups"]

    source2 = f"127.0.0.1:{p2}"
    with b.client(NS) as c:
        # A2's host:port: A2 alone is asked (both hold the key; without a source A1, listed first, would be)
        assert c.lookup([b"both"], source=source2) == 1
        assert c.exists_many([b"two", b"nowhere"], source=source2) == [True, False]
        assert asked() == (0, 3)
        assert c.get_many([b"both-get"], source=source2) == [data(2)]  # (sized by a lookup of A2 first)
        assert served(a2)["served_objects"] == 1 and served(a1)["served_objects"] == 0
        assert rows()[f"127.0.0.1:{p1}"]["gets"] == 0 and asked() == (0, 4)
        # the host with another port (an engine's own, as llm-d names it): every peer on the host
        assert c.lookup([b"two-x"], source="127.0.0.1:8200") == 1
        assert asked() == (1, 5)
        # a host no peer is on: no peer asked, the source never dialled; counted, logged once a minute
        for _ in range(3):
            assert c.lookup([b"two-y"], source="10.255.0.7:8200") == 0
        assert c.get_many([b"two-y"], source="10.255.0.7:8200") == [None]
        # B's own host: its KV is here, no peer asked, and nothing to warn of
        assert c.lookup([b"two-y"], source="127.0.0.2:8200") == 0
        assert asked() == (1, 5)
        assert served(a2)["served_objects"] == 1
        sources = b.stats()["peer_sources"]
        assert sources == {"chosen": 4, "here": 1, "unknown": 4}, sources
        assert b.log().count("names no peer of this gateway") == 1
        metrics = render(b.stats()).decode()
        assert "kvgate_peer_unknown_sources_total 4.0" in metrics and "kvgate_peer_sourced_requests_total 4.0" in metrics
        # no source: every peer, as before
        assert c.lookup([b"two-z"]) == 1
        assert asked() == (2, 6)
    con = Console(width=80, record=True, color_system=None)
    con.print(statview.view(b.stats()))
    text = con.export_text()
    assert "4 unknown" in text and max(len(line) for line in text.splitlines()) <= 80, text


def _inputs(dtype: str) -> dict:
    """A namespace's inputs as the vLLM integration declares them (kvgate.integrations.vllm.settings), in part."""
    return {"model": "Qwen/Qwen3-0.6B", "dtype": dtype, "tokens_per_hash": 16, "blocks_per_chunk": 1,
            "tp_size": 1, "kv_cache_layout": "NHD"}


def test_a_peer_whose_engines_run_the_model_another_way_is_refused_by_name(pair) -> None:
    """Engine on A: the model in bfloat16; engine on B: the same model in float16, so another namespace.  B
    never asks A for its namespace's keys once the two told each other their namespaces, and both logs say
    that dtype is why; an engine of A's very namespace on B still pulls from A."""
    a, b, port, _token = pair
    ns_a, ns_b = "vllm|Qwen/Qwen3-0.6B|aaaa", "vllm|Qwen/Qwen3-0.6B|bbbb"
    keys = [f"k{i}".encode() for i in range(4)]
    with a.client(ns_a, namespace_inputs=_inputs("bfloat16")) as c:
        assert c.put_many(keys, [data(i) for i in range(4)], retention="short") == [True] * 4
    with b.client(ns_b, namespace_inputs=_inputs("float16")) as c:
        assert c.lookup(keys) == 0  # (asked: the namespaces are being told meanwhile)
        deadline = time.monotonic() + 10
        while not peer_row(b)["namespace_refused"] and time.monotonic() < deadline:
            assert c.lookup(keys) == 0
            time.sleep(0.05)
        row = peer_row(b)
        assert row["namespace_refused"] >= 4, row
        asked = row["lookups"]
        assert c.lookup(keys) == 0 and c.get_many(keys[:2]) == [None, None]
        row = peer_row(b)
        assert row["lookups"] == asked and row["gets"] == 2 and row["hits"] == 0, row  # not asked: no round trip
        assert "dtype" in row["namespace_difference"], row
    said_b = b.log()
    assert said_b.count(f"peer 127.0.0.1:{port} refused for namespace {ns_b!r}") == 1, said_b
    assert f"in namespace {ns_a!r}, which differs in dtype (\"float16\" here, \"bfloat16\" there)" in said_b, said_b
    said_a = a.log()
    assert (f"runs namespace {ns_b!r}, of the model this gateway's engines run in namespace {ns_a!r}, which differs "
            f"in dtype (\"bfloat16\" here, \"float16\" there)") in said_a, said_a
    assert served(a)["namespaces_differ"] == 1
    # an engine of A's namespace on B: not refused, it pulls
    with b.client(ns_a, namespace_inputs=_inputs("bfloat16")) as c:
        assert c.get_many(keys) == [data(i) for i in range(4)]
    metrics = render(b.stats()).decode()
    assert f'kvgate_peer_namespace_refused_total{{peer="127.0.0.1:{port}"}}' in metrics
    con = Console(width=100, record=True, color_system=None)
    con.print(statview.view(b.stats()))
    assert "refused:" in con.export_text()


def test_a_hello_with_namespace_inputs_that_are_not_a_json_object_is_refused(pair) -> None:
    from kvgate import protocol as p
    from kvgate.client import Client
    from kvgate.errors import InvalidArgument

    a, _b, _port, _token = pair
    with pytest.raises(InvalidArgument, match="namespace_inputs must be a JSON object"):
        Client.connect(a.socket, namespace="x", namespace_inputs="[1, 2]")
    # a client that skips the checks: the gateway refuses the hello, naming the field, and serves on
    reply = hello_reply(a.socket, p.Hello(id=1, namespace="x", namespace_inputs="not json", want_shm=False))
    assert reply.code == p.ErrorCode.BAD_REQUEST and "namespace_inputs is not JSON" in reply.message, reply
    with a.client("x") as c:
        assert c.lookup([b"k"]) == 0



def test_the_namespaces_request_is_a_peers_only_and_a_flood_of_them_costs_little(pair) -> None:
    """Without the token a ``namespaces`` request is refused like any other; a peer with it that tells
    10,000 namespaces gets this gateway's own back, at most 16 of its are compared, and A serves on."""
    a, _b, port, _token = pair
    with a.client("vllm|m|mine", namespace_inputs={"model": "m", "dtype": "float16"}) as c:
        assert c.lookup([b"k"]) == 0
    flood = {f"vllm|m|{i}": {"model": "m", "dtype": f"d{i}"} for i in range(10_000)}
    reply, s = _hello(port, w.Namespaces(flood))  # no hello first
    s.close()
    assert isinstance(reply, w.Err) and "expected a hello first" in reply.message, reply
    reply, s = _hello(port, w.Hello("peer", token="peer-secret"))
    try:
        assert isinstance(reply, w.Ok), reply
        s.sendall(w.frame(w.Namespaces(flood)))
        reply = _reply(s)
    finally:
        s.close()
    assert isinstance(reply, w.Ok) and reply.value == {"vllm|m|mine": {"model": "m", "dtype": "float16"}}, reply
    assert served(a)["namespaces_differ"] == 16  # the first 16 only, each logged once
    assert a.log().count("of the model this gateway's engines run in namespace 'vllm|m|mine'") == 16
    with a.client("vllm|m|mine") as c:
        assert c.lookup([b"k"]) == 0
