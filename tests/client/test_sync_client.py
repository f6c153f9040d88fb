"""Client against the other end of a socket: what it sends, what it makes of replies, and when it stays usable.

Each client here talks to the other end of a socket pair (or of a loopback
connection, where the test answers its hello): the test sees every byte the
client sent (none, for a refused call) and answers like a gateway, or plays
a scripted gateway that sends replies in small pieces.  Wrong arguments are
refused before anything is sent, and the client stays usable.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate import protocol as p
from kvgate.client import Client, GatewayError, ObjectTooLarge
from kvgate.client.transport import _PUT_HEADER_BYTES, _PUT_KEY_BYTES
from kvgate.keys import MAX_KEY_BYTES, BadKey


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(10)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def sent(peer: socket.socket) -> bytes:
    try:
        return peer.recv(1 << 20)
    except BlockingIOError:
        return b""


def answer(peer: socket.socket, reply) -> None:
    """Read one request frame and send ``reply`` with its id."""
    peer.setblocking(True)
    try:
        _kind, hlen, blen = p.parse_preamble(peer.recv(p.PREAMBLE_SIZE, socket.MSG_WAITALL), 1 << 30)
        req = p.decode_request(peer.recv(hlen, socket.MSG_WAITALL))
        if blen:
            peer.recv(blen, socket.MSG_WAITALL)
        reply.id = req.id
        peer.sendall(p.encode_frame(reply, 0, p.KIND_REPLY))
    finally:
        peer.setblocking(False)


@pytest.fixture
def framed():
    """A TCP client whose gateway (the test's end) said in its hello that a frame carries at most 1 MiB."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        peers = []

        def accept_and_answer() -> None:
            peer, _ = server.accept()
            peers.append(peer)
            answer(peer, p.HelloReply(session=1, max_frame_bytes=1 << 20))

        t = threading.Thread(target=accept_and_answer)
        t.start()
        c = Client.connect(f"127.0.0.1:{server.getsockname()[1]}", timeout=10)
        t.join(10)
    (b,) = peers
    yield c, b
    c.close()
    b.close()


def answered(peer: socket.socket, reply, call):
    """``call()`` while the peer answers its request with ``reply``."""
    t = threading.Thread(target=answer, args=(peer, reply))
    t.start()
    try:
        return call()
    finally:
        t.join(10)


KEYS = [b"a", b"b"]
BUFS = [b"xx", b"yy"]
NON_CONTIGUOUS = np.arange(16, dtype=np.uint8)[::2]

# (call, exception, words the message must contain)
REFUSED = [
    (lambda c: c.put_many(KEYS, BUFS, position=2**70), ValueError, ["position", "2**63"]),
    (lambda c: c.put_many(KEYS, BUFS, position=2**63 - 1), ValueError, ["position"]),  # the last key would be 2**63
    (lambda c: c.put_many(KEYS, BUFS, position=-2), ValueError, ["position", "-1"]),
    (lambda c: c.put_many(KEYS, BUFS, position=1.0), TypeError, ["position", "int"]),
    (lambda c: c.put_many(KEYS, BUFS, position=True), TypeError, ["position", "bool"]),
    (lambda c: c.put_many(KEYS, BUFS, retention="forever"), ValueError, ["retention", "'long'", "'forever'"]),
    (lambda c: c.put_many(KEYS, BUFS, retention=None), ValueError, ["retention"]),
    (lambda c: c.put_many(KEYS, BUFS, dialog="chat-1"), TypeError, ["dialog", "encode"]),
    (lambda c: c.put_many(KEYS, BUFS, dialog=5), TypeError, ["dialog", "int"]),
    (lambda c: c.put_many(KEYS, [b"x"]), ValueError, ["2 keys but 1 buffers"]),
    (lambda c: c.put_many(KEYS, [b"x", NON_CONTIGUOUS]), ValueError, ["buffers[1]", "contiguous"]),
    (lambda c: c.put_many(KEYS, [b"x", 7]), TypeError, ["buffers[1]", "int", "not a buffer"]),
    (lambda c: c.put_many([b"a"], b"xx"), TypeError, ["buffers", "list", "[buffer]"]),
    (lambda c: c.put_many(b"ab", BUFS), TypeError, ["keys", "list", "[key]"]),
    (lambda c: c.put_many([b"a", 1], BUFS), TypeError, ["keys[1]", "int"]),
    (lambda c: c.get_many("abc"), TypeError, ["keys", "list", "[key]"]),
    (lambda c: c.get_many(KEYS, into=[bytearray(2), b"yy"]), TypeError, ["destination buffers[1]", "read-only"]),
    (lambda c: c.get_many(KEYS, into=[bytearray(2)]), ValueError, ["2 keys but 1 destination buffers"]),
    (lambda c: c.get_many(KEYS, into=[bytearray(2), np.zeros((4, 4), np.uint8)[:, 1]]), ValueError,
     ["destination buffers[1]", "contiguous"]),
    (lambda c: c.get_many(KEYS, dialog="d"), TypeError, ["dialog"]),
    (lambda c: c.lookup("abc"), TypeError, ["keys", "str", "[key]"]),
    (lambda c: c.lookup(b"abc"), TypeError, ["keys", "bytes", "[key]"]),
    (lambda c: c.lookup(5), TypeError, ["keys", "int"]),
    (lambda c: c.lookup([b"a", b""]), BadKey, ["keys[1]", "empty"]),
    (lambda c: c.lookup([b"a", b"k" * (MAX_KEY_BYTES + 1)]), BadKey, ["keys[1]", str(MAX_KEY_BYTES)]),
    (lambda c: c.lookup(["a", "\udc80"]), BadKey, ["keys[1]", "UTF-8"]),
    (lambda c: c.lookup(KEYS, dialog="d"), TypeError, ["dialog"]),
    (lambda c: c.exists_many("abc"), TypeError, ["keys"]),
    (lambda c: c.exists_many(KEYS, dialog=1), TypeError, ["dialog"]),
    (lambda c: c.delete_many(b"abc"), TypeError, ["keys"]),
    (lambda c: c.delete_many([None]), TypeError, ["keys[0]", "NoneType"]),
    (lambda c: c.prewarm("abc"), TypeError, ["keys"]),
    (lambda c: c.prewarm(KEYS, dialog=[1]), TypeError, ["dialog"]),
    (lambda c: c.register_region(b"/dev/shm/x"), TypeError, ["path", "str"]),
]


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("call,exc,words", REFUSED)
def test_a_wrong_argument_is_named_and_nothing_is_sent(pair, local, call, exc, words) -> None:
    a, b = pair
    c = Client(a, local=local)
    with pytest.raises(exc) as ei:
        call(c)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    assert sent(b) == b""
    assert not c.broken
    assert answered(b, p.CountReply(count=2), lambda: c.lookup(KEYS)) == 2  # and the connection goes on


def test_the_widest_position_is_accepted(framed) -> None:
    c, b = framed
    assert c.max_frame_bytes == 1 << 20  # both in one frame
    assert answered(b, p.PutReply(stored=[True, True]),
                    lambda: c.put_many(KEYS, BUFS, position=2**63 - 2)) == [True, True]


def test_a_message_that_cannot_be_encoded_leaves_the_client_usable(pair) -> None:
    a, b = pair
    c = Client(a, local=False)
    with pytest.raises(TypeError):
        c._request(p.Lookup(keys=[b"a"], dialog=object()))  # past the checks: the encoder refuses it
    with pytest.raises(OverflowError):
        c._request(p.Put(keys=[b"a"], sizes=[1], position=2**70), body=[b"x"])
    assert sent(b) == b""
    assert not c.broken


def test_an_empty_object_is_refused_before_sending(pair) -> None:
    """The gateway stores no empty object (an engine's KV object never is): the whole put is refused here,
    so a put split over several frames cannot have stored the objects of its first frames."""
    a, b = pair
    c = Client(a, local=False)
    with pytest.raises(GatewayError) as ei:
        c.put_many([b"k1", b"k2"], [b"x", bytearray(0)])
    assert ei.value.code == p.ErrorCode.BAD_REQUEST and "buffers[1] is empty" in ei.value.message
    assert sent(b) == b""
    assert not c.broken


def test_a_header_larger_than_a_gateway_reads_is_refused_before_sending(pair) -> None:
    a, b = pair
    c = Client(a, local=False)
    keys = [i.to_bytes(4, "big") * 256 for i in range(5000)]  # 5,000 keys of 1 KiB: a 5 MiB header
    with pytest.raises(GatewayError) as ei:
        c.lookup(keys)
    assert ei.value.code == p.ErrorCode.TOO_LARGE and "5000 keys" in ei.value.message
    assert sent(b) == b""
    assert not c.broken


def test_an_object_larger_than_a_frame_is_refused_before_sending(framed) -> None:
    c, b = framed
    with pytest.raises(GatewayError) as ei:
        c.put_many([b"small", b"big"], [b"s", bytes(1 << 20)])
    assert ei.value.code == p.ErrorCode.TOO_LARGE
    for w in ("object 1", str(1 << 20), "max_frame_bytes"):
        assert w in ei.value.message
    assert sent(b) == b""  # not even the small one: the batch is refused whole
    assert not c.broken


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), min_size=1, max_size=40),
       sizes=st.data(), dialog=st.one_of(st.none(), st.binary(max_size=300)),
       position=st.integers(min_value=-1, max_value=2**63 - 41), retention=st.sampled_from(["long", "short", "none"]))
def test_put_header_bounds_hold(keys, sizes, dialog, position, retention) -> None:
    """The client batches inline puts with these bounds: they must never be below the real header."""
    sz = [sizes.draw(st.integers(min_value=0, max_value=2**40)) for _ in keys]
    msg = p.Put(id=2**63 - 1, keys=keys, sizes=sz, region=p.INLINE, retention=retention, dialog=dialog,
                position=position)
    header = len(p.encode_frame(msg)) - p.PREAMBLE_SIZE
    assert header <= _PUT_HEADER_BYTES + len(dialog or b"") + sum(len(k) + _PUT_KEY_BYTES for k in keys)


def test_a_refusal_sent_before_the_request_was_read_is_the_gateways_answer(pair) -> None:
    """A gateway over its connection limit answers at once (id 0) and closes; the client says why."""
    a, b = pair
    b.sendall(p.encode_frame(p.Error(code=p.ErrorCode.TOO_MANY_CONNECTIONS, message="at most 2"), 0, p.KIND_REPLY))
    c = Client(a, local=True)
    with pytest.raises(GatewayError) as ei:
        c.stats()
    assert ei.value.code == p.ErrorCode.TOO_MANY_CONNECTIONS and ei.value.message == "at most 2"
    assert c.broken  # the gateway closes the connection after it


def test_a_refusal_the_gateway_sent_before_closing_is_read_when_the_send_fails(pair) -> None:
    a, b = pair
    b.sendall(p.encode_frame(p.Error(code=p.ErrorCode.TOO_MANY_CONNECTIONS, message="at most 2"), 0, p.KIND_REPLY))
    b.close()
    c = Client(a, local=True)
    with pytest.raises(GatewayError) as ei:
        c.put_many([b"k"], [bytes(4 << 20)])  # inline (no session region): the send hits the closed end
    assert ei.value.code == p.ErrorCode.TOO_MANY_CONNECTIONS
    assert c.broken


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
