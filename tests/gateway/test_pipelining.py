"""Pipelining: many requests in flight on one connection, answered by id."""

from __future__ import annotations

import socket

import pytest

from kvgate import protocol as p
from tests.helpers import read_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_pipelined_requests_are_all_answered_by_id(gateway):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(gateway.socket)
        s.sendall(p.encode_frame(p.Hello(id=1, namespace="pipe", engine_id="pipe", want_shm=False)))
        hello, _ = read_reply(s)
        assert isinstance(hello, p.HelloReply)
        # 20 puts with inline bodies, then 20 lookups and a stats, all sent before reading anything
        frames = []
        for i in range(20):
            body = bytes([i]) * (1000 + i)
            frames.append(p.encode_frame(p.Put(id=100 + i, keys=[f"k{i}".encode()], sizes=[len(body)]), len(body)) + body)
        frames += [p.encode_frame(p.Lookup(id=200 + i, keys=[f"k{i}".encode()])) for i in range(20)]
        frames.append(p.encode_frame(p.Stats(id=999)))
        s.sendall(b"".join(frames))
        replies = {}
        for _ in range(len(frames)):
            reply, _ = read_reply(s)
            assert reply.id not in replies, "a request was answered twice"
            replies[reply.id] = reply
    assert set(replies) == {*range(100, 120), *range(200, 220), 999}
    assert all(replies[100 + i].stored == [True] for i in range(20))
    # a lookup pipelined behind its put may run before the put finished; it can only say 0 or 1
    assert all(replies[200 + i].count in (0, 1) for i in range(20))
    assert isinstance(replies[999], p.StatsReply)
    with gateway.client("pipe", engine_id="pipe") as c:
        keys = [f"k{i}".encode() for i in range(20)]
        assert c.lookup(keys) == 20
        got = c.get_many(keys)
        assert got == [bytes([i]) * (1000 + i) for i in range(20)]
