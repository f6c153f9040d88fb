"""Inline bytes (TCP): bodies are received straight into their destination, and nothing else changes.

The gateway reads a frame body into a buffer of its own with ``recv_into``;
the client receives each object of a get reply straight into the caller's
buffer, skipping the gaps between packed results (against a scripted
gateway: tests/test_client.py).  These tests pin down what that must not
break: bodies that arrive in pieces, pipelined frames sharing one ``recv``,
too-small buffers, the connection limit, and a stop while a body is half
received.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.helpers import free_port
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


def _read_reply(s: socket.socket):
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "the gateway closed the connection"
            buf += chunk
        return bytes(buf)

    _kind, hlen, blen = p.parse_preamble(exact(p.PREAMBLE_SIZE), 1 << 62)
    return p.decode_reply(exact(hlen)), exact(blen) if blen else b""


@pytest.mark.slow
def test_bodies_in_pieces_and_frames_sharing_a_read(tcp_gateway) -> None:
    gw, port = tcp_gateway
    datas = [os.urandom(n) for n in (3 << 20, 1, 70 << 10, 0, 5000)]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(_frame(p.Hello(id=1, namespace="inline", engine_id="inline")))
        assert isinstance(_read_reply(s)[0], p.HelloReply)
        # one big body dribbled in pieces, with pauses: the gateway must keep filling where it stopped
        frame = _frame(p.Put(id=2, keys=[b"big"], sizes=[len(datas[0])]), datas[0])
        for i in range(0, len(frame), 1 << 20):
            s.sendall(frame[i : i + (1 << 20)])
            time.sleep(0.05)  # the point: the gateway sees the body in separate reads
        assert _read_reply(s)[0].stored == [True]
        # small frames back to back in one send: several preambles, headers and bodies in one read
        s.sendall(b"".join(_frame(p.Put(id=10 + i, keys=[f"k{i}".encode()], sizes=[len(d)]), d)
                           for i, d in enumerate(datas[1:])))
        replies = dict((r.id, r) for r, _ in (_read_reply(s) for _ in datas[1:]))
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
        assert isinstance(_read_reply(half)[0], p.HelloReply)
        body = os.urandom(4 << 20)
        half.sendall(_frame(p.Put(id=2, keys=[b"half"], sizes=[len(body)]), body)[: 2 << 20])
        # a fourth connection is over the limit of 3: answered, then closed
        with socket.create_connection(("127.0.0.1", port), timeout=20) as extra:
            reply, _ = _read_reply(extra)
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
