"""Inline bytes (TCP): bodies are received straight into their destination, and nothing else changes.

The gateway reads a frame body into a buffer of its own with ``recv_into``;
the client receives each object of a get reply straight into the caller's
buffer, skipping the gaps between packed results.  These tests pin down what
that must not break: bodies that arrive in pieces, pipelined frames sharing one
``recv``, gaps and too-small buffers, the connection limit, and a stop while a
body is half received.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from tests.helpers import free_port
from kvgate import protocol as p
from kvgate.client import Client, ObjectTooLarge

pytestmark = [pytest.mark.timeout(60)]


# ---- the client against a scripted gateway --------------------------------------------------


def _scripted_gateway(sock: socket.socket, body: bytes, sizes: list[int], offsets: list[int]) -> threading.Thread:
    """Answers every request on ``sock`` with the same packed get reply."""

    def recv_exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return bytes(buf)

    def serve() -> None:
        try:
            while True:
                _kind, hlen, blen = p.parse_preamble(recv_exact(p.PREAMBLE_SIZE), 1 << 30)
                req = p.decode_request(recv_exact(hlen))
                recv_exact(blen)
                frame = p.encode_frame(p.GetReply(id=req.id, sizes=sizes, offsets=offsets), len(body), p.KIND_REPLY)
                for i in range(0, len(frame + body), 3):  # in small pieces: every read must go on where it stopped
                    sock.sendall((frame + body)[i : i + 3])
        except (ConnectionError, OSError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_packed_reply_is_received_into_the_buffers_around_gaps() -> None:
    a, b = socket.socketpair()
    # hit of 5 at 0, a 3-byte gap, a miss, hit of 4 at 8, a 2-byte gap, an empty hit at 14, a 6-byte gap at the end
    body = b"AAAAA" + b"xxx" + b"BBBB" + b"yy" + b"zzzzzz"
    _scripted_gateway(b, body, sizes=[5, p.MISS, 4, 0], offsets=[0, 0, 8, 14])
    with a, b:
        c = Client(a, local=False)
        keys = [b"a", b"b", b"c", b"d"]
        dst = [bytearray(8), bytearray(b"\x01" * 8), bytearray(4), bytearray(1)]
        got = c.get_many(keys, into=dst)
        assert [None if g is None else bytes(g) for g in got] == [b"AAAAA", None, b"BBBB", b""]
        assert dst == [bytearray(b"AAAAA\0\0\0"), bytearray(b"\x01" * 8), bytearray(b"BBBB"), bytearray(1)]
        # a buffer too small for its object: the error names it, and the stream stays in step
        with pytest.raises(ObjectTooLarge) as ei:
            c.get_many(keys, into=[bytearray(8), bytearray(8), bytearray(3), bytearray(1)])
        assert (ei.value.index, ei.value.needed) == (2, 4)
        assert not c.broken
        # a read-only destination is refused before anything is sent
        with pytest.raises(TypeError):
            c.get_many(keys, into=[b"12345678", bytearray(8), bytearray(8), bytearray(8)])
        assert not c.broken
        assert c.get_many(keys) == [b"AAAAA", None, b"BBBB", b""]


def test_a_reply_placing_bytes_outside_its_body_breaks_the_client() -> None:
    a, b = socket.socketpair()
    _scripted_gateway(b, b"AAAA", sizes=[4, 4], offsets=[0, 2])  # overlapping results
    with a, b:
        c = Client(a, local=False)
        with pytest.raises(ConnectionError):
            c.get_many([b"a", b"b"], into=[bytearray(4), bytearray(4)])
        assert c.broken


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
            time.sleep(0.05)
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
