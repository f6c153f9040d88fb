"""Inline bytes (TCP): bodies are received straight into their destination, and nothing else changes.

The gateway reads a frame body into a buffer of its own with ``recv_into``;
the client receives each object of a get reply straight into the caller's
buffer, skipping the gaps between packed results (against a scripted
gateway: tests/client/test_sync_client.py).  These tests pin down what that must not
break: bodies that arrive in pieces, pipelined frames sharing one ``recv``,
too-small buffers, the connection limit, and a stop while a body is half
received.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.helpers import free_port, read_reply
from kvgate import protocol as p
from kvgate.client import Client, ObjectTooLarge

pytestmark = [pytest.mark.timeout(60)]


# ---- a real gateway over TCP ------------------------------------------------------------------


@pytest.fixture
def tcp_gateway(gateway_factory):
    port = free_port()
    gw = gateway_factory(["--port", str(port), "--max-frame-bytes", "8M", "--max-bytes", "128M",
                          "--max-connections", "3"])
    return gw, port


def _frame(msg, body: bytes = b"") -> bytes:
    return p.encode_frame(msg, len(body)) + body


@pytest.mark.slow
def test_bodies_in_pieces_and_frames_sharing_a_read(tcp_gateway) -> None:
    gw, port = tcp_gateway
    datas = [os.urandom(n) for n in (3 << 20, 1, 70 << 10, 2, 5000)]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(_frame(p.Hello(id=1, namespace="inline", engine_id="inline")))
        assert isinstance(read_reply(s)[0], p.HelloReply)
        # one big body dribbled in pieces, with pauses: the gateway must keep filling where it stopped
        frame = _frame(p.Put(id=2, keys=[b"big"], sizes=[len(datas[0])]), datas[0])
        for i in range(0, len(frame), 1 << 20):
            s.sendall(frame[i : i + (1 << 20)])
            time.sleep(0.05)  # the point: the gateway sees the body in separate reads
        assert read_reply(s)[0].stored == [True]
        # small frames back to back in one send: several preambles, headers and bodies in one read
        s.sendall(b"".join(_frame(p.Put(id=10 + i, keys=[f"k{i}".encode()], sizes=[len(d)]), d)
                           for i, d in enumerate(datas[1:])))
        replies = dict((r.id, r) for r, _ in (read_reply(s) for _ in datas[1:]))
        assert all(replies[10 + i].stored == [True] for i in range(len(datas) - 1))
    keys = [b"big"] + [f"k{i}".encode() for i in range(len(datas) - 1)]
    with Client.connect(f"127.0.0.1:{port}", namespace="inline", engine_id="inline") as c:
        assert c.get_many(keys) == datas
        bufs = [bytearray(len(d) + 7) for d in datas]
        got = c.get_many(keys + [b"absent"], into=bufs + [bytearray(1)])
        assert [None if g is None else bytes(g) for g in got] == datas + [None]
        with pytest.raises(ObjectTooLarge) as ei:
            c.get_many(keys, into=[bytearray(len(d) + 7) for d in datas[:2]] + [bytearray(10)] + bufs[3:])
        assert ei.value.index == 2 and ei.value.needed == len(datas[2])
        assert c.get_many(keys[2:3]) == datas[2:3]  # still in step


@pytest.mark.slow
def test_connection_limit_and_stop_with_a_body_half_received(tcp_gateway) -> None:
    gw, port = tcp_gateway
    held = [Client.connect(f"127.0.0.1:{port}", namespace="inline", engine_id="inline") for _ in range(2)]
    half = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        half.sendall(_frame(p.Hello(id=1, namespace="inline", engine_id="inline")))
        assert isinstance(read_reply(half)[0], p.HelloReply)
        body = os.urandom(4 << 20)
        half.sendall(_frame(p.Put(id=2, keys=[b"half"], sizes=[len(body)]), body)[: 2 << 20])
        # a fourth connection is over the limit of 3: answered, then closed
        with socket.create_connection(("127.0.0.1", port), timeout=20) as extra:
            reply, _ = read_reply(extra)
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_MANY_CONNECTIONS
            assert extra.recv(1) == b""
        # SIGTERM while a body is half received and clients are connected: a clean exit
        assert gw.stop() == 0
        log = gw.log()
        assert "kvgate stopped" in log and "Traceback" not in log and "ERROR" not in log, log
    finally:
        half.close()
        for c in held:
            c.close()


# ---- replies sent from the RAM tier's own pages -----------------------------------------------


def _ram_pinned(gw) -> int:
    return gw.stats()["tiers"]["ram"]["pinned_bytes"]


@pytest.mark.slow
def test_a_reply_sent_from_the_ram_tier_keeps_its_bytes_while_the_client_is_slow(tcp_gateway) -> None:
    """A get reply goes out from the RAM tier's pages: while a client takes its time reading it, those
    objects are replaced and the whole tier is written over, and the client still reads exactly the bytes
    it asked for; once the reply is out, nothing stays pinned."""
    gw, port = tcp_gateway
    keys = [f"lent-{i}".encode() for i in range(3)]
    before = [os.urandom(2 << 20) for _ in keys]
    with Client.connect(f"127.0.0.1:{port}", namespace="inline", engine_id="inline") as c:
        assert all(c.put_many(keys, before, retention="short"))
        slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply stalls in the gateway's send
        slow.connect(("127.0.0.1", port))
        slow.settimeout(20)
        with slow:
            slow.sendall(_frame(p.Hello(id=1, namespace="inline", engine_id="inline")))
            assert isinstance(read_reply(slow)[0], p.HelloReply)
            slow.sendall(_frame(p.Get(id=2, keys=keys, region=p.INLINE)))
            deadline = time.monotonic() + 10
            while _ram_pinned(gw) < 3 * (2 << 20) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _ram_pinned(gw) >= 3 * (2 << 20), "the reply's objects are not held while it is sent"
            # replace them, then write the tier (128 MiB) over twice: no page of the stalled reply is reused
            assert all(c.put_many(keys, [os.urandom(2 << 20) for _ in keys], retention="short"))
            filler = os.urandom(4 << 20)
            for i in range(64):
                c.put_many([f"fill-{i}".encode()], [filler], retention="short")
            reply, body = read_reply(slow)
        assert isinstance(reply, p.GetReply), reply
        assert list(reply.sizes) == [len(b) for b in before]
        assert [body[o : o + s] for o, s in zip(reply.offsets, reply.sizes)] == before
        assert _ram_pinned(gw) == 0
        # a client that goes away mid-reply gives its objects back too
        for _ in range(2):
            gone = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            gone.connect(("127.0.0.1", port))
            gone.sendall(_frame(p.Hello(id=1, namespace="inline", engine_id="inline")))
            read_reply(gone)
            gone.sendall(_frame(p.Get(id=2, keys=[f"fill-{i}".encode() for i in range(60, 64)], region=p.INLINE)))
            time.sleep(0.2)
            gone.close()
        deadline = time.monotonic() + 10
        while _ram_pinned(gw) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ram_pinned(gw) == 0
        assert c.get_many([b"fill-63"]) == [filler]


@pytest.mark.slow
def test_a_reply_mixes_ram_objects_card_objects_and_misses_in_order(gateway_factory, tmp_path) -> None:
    """RAM-tier pages and card reads share one reply body, each object at its offset."""
    port = free_port()
    card = tmp_path / "card"
    gw = gateway_factory(["--port", str(port), "--max-bytes", "16M", "--storage-devices", str(card)])
    datas = [os.urandom(n) for n in (1 << 20, 3 << 20, 5, 300 << 10, 2 << 20)]
    keys = [f"mixed-{i}".encode() for i in range(len(datas))]
    with Client.connect(f"127.0.0.1:{port}", namespace="inline", engine_id="inline") as c:
        assert all(c.put_many(keys, datas, retention="long"))
        # push the first ones out of the RAM tier (short objects would go first): they are read from the card
        for i in range(8):
            c.put_many([f"push-{i}".encode()], [os.urandom(2 << 20)], retention="long")
        st = gw.stats()["tiers"]
        assert st["long"]["objects"] >= len(keys)
        got = c.get_many([keys[0], b"absent", *keys[1:], b"absent-too"])
        assert got == [datas[0], None, *datas[1:], None]
        st2 = gw.stats()["tiers"]
        assert st2["long"]["hits"] > st["long"]["hits"], "no object came from the card"
        assert _ram_pinned(gw) == 0
