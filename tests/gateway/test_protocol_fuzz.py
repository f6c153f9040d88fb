"""The bad-input bar: nothing a client sends stops the gateway or gets a wrong answer.

One gateway (``--max-frame-bytes 1M``, Unix socket and TCP) takes every kind of
malformed input over raw sockets.  Each input must get an ``Error`` reply (a
frame the gateway cannot parse is answered and the connection closed; a
well-framed wrong request is answered and the connection goes on) or a closed
connection.  Never an ``INTERNAL`` error: that means a handler blew up.  After
all of it the same process still runs, serves a normal client correctly,
logged no traceback, and its RSS grew by less than 200 MiB.
"""

from __future__ import annotations

import socket
import struct
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import GatewayProcess, free_port, wait_until
from kvgate.client import Client
from kvgate.keys import MAX_KEY_BYTES
from kvgate.protocol import (
    INLINE,
    KIND_REPLY,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE,
    PREAMBLE_SIZE,
    REQUEST_OPS,
    SESSION_REGION,
    VERSION,
    CountReply,
    Error,
    ErrorCode,
    GetReply,
    HelloReply,
    PutReply,
    decode_reply,
    parse_preamble,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MAX_FRAME = 1 << 20
SHM_SIZE = 1 << 20
RSS_GROWTH_LIMIT_KIB = 200 << 10
READ_TIMEOUT = 5.0


# ---- the gateway under attack -----------------------------------------------------


class Target:
    def __init__(self, gw: GatewayProcess, port: int):
        self.gw = gw
        self.port = port
        self.rss_before = 0

    def unix(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(READ_TIMEOUT)
        s.connect(self.gw.socket)
        return s

    def tcp(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=READ_TIMEOUT)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def connect(self, transport: str) -> socket.socket:
        return self.unix() if transport == "unix" else self.tcp()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    port = free_port()
    gw = GatewayProcess(tmp_path_factory.mktemp("fuzz"),
                        ["--max-frame-bytes", "1M", "--port", str(port), "--shared-memory-size", "1M"],
                        name="fuzz")
    gw.start()
    t = Target(gw, port)
    # warm up every code path once before the RSS baseline
    _round_trip(t)
    t.rss_before = gw.rss_kib()
    yield t
    gw.cleanup()


def _round_trip(t: Target, tag: str = "warm") -> None:
    """A normal client over both transports: put, lookup, get, exact bytes back."""
    payloads = [bytes([i]) * (1000 + 37 * i) for i in range(8)] + [b"\xa5" * (700 << 10)]
    keys = [f"{tag}-{i}".encode() for i in range(len(payloads))]
    with Client.connect(t.gw.socket, namespace="healthy", engine_id="fuzzer", timeout=30) as c:
        assert c.put_many(keys, payloads) == [True] * len(keys)
        assert c.lookup(keys + [b"absent"]) == len(keys)
        assert c.get_many(keys + [b"absent"]) == payloads + [None]
    with Client.connect(f"127.0.0.1:{t.port}", namespace="healthy-tcp", engine_id="fuzzer", timeout=30) as c:
        assert c.put_many(keys, payloads) == [True] * len(keys)
        assert c.get_many(keys) == payloads


def _assert_healthy(t: Target) -> None:
    assert t.gw.alive(), f"gateway died; stderr:\n{t.gw.log()}"
    _round_trip(t, tag=f"check-{time.monotonic_ns()}")


# ---- raw frames -------------------------------------------------------------------


def frame(header: dict | bytes, body: bytes = b"", *, magic: bytes = MAGIC, version: int = VERSION, kind: int = 0,
          header_len: int | None = None, body_len: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else msgspec.msgpack.encode(header)
    hl = len(h) if header_len is None else header_len
    bl = len(body) if body_len is None else body_len
    return PREAMBLE.pack(magic, version, kind, hl, bl) + h + body


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    """n bytes, or None when the peer closed first (after 0 or more bytes)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_reply(s: socket.socket):
    """The next reply frame, or None when the gateway closed the connection."""
    pre = _recv_exact(s, PREAMBLE_SIZE)
    if pre is None:
        return None
    kind, hlen, blen = parse_preamble(pre, 1 << 62)
    assert kind == KIND_REPLY, f"gateway sent frame kind {kind}"
    header = _recv_exact(s, hlen)
    assert header is not None, "gateway closed mid-reply"
    body = _recv_exact(s, blen) if blen else b""
    assert body is not None, "gateway closed mid-reply body"
    return decode_reply(header)


def call(s: socket.socket, header: dict | bytes, body: bytes = b""):
    s.sendall(frame(header, body))
    reply = read_reply(s)
    assert reply is not None, f"connection closed instead of a reply to {header!r}"
    return reply


def expect_error(s: socket.socket, header: dict | bytes, code: str, body: bytes = b"") -> Error:
    reply = call(s, header, body)
    assert isinstance(reply, Error), f"{header!r}: expected {code}, got {reply!r}"
    assert reply.code == code, f"{header!r}: expected {code}, got {reply.code}: {reply.message}"
    if isinstance(header, dict) and isinstance(header.get("id"), int):
        assert reply.id == header["id"]
    return reply


def expect_error_then_close(s: socket.socket, data: bytes, code: str) -> Error:
    s.sendall(data)
    reply = read_reply(s)
    assert isinstance(reply, Error) and reply.code == code, f"expected {code}, got {reply!r}"
    assert read_reply(s) is None, "connection should be closed after a frame error"
    return reply


def hello(s: socket.socket, namespace: str = "fuzz-ns", **fields) -> HelloReply:
    reply = call(s, {"op": "hello", "id": 1, "namespace": namespace, "engine_id": "fuzzer", **fields})
    assert isinstance(reply, HelloReply), reply
    return reply


def still_works(s: socket.socket, strict: bool = True) -> None:
    """The connection still answers a good request (strict: with a count, or NO_SESSION before hello)."""
    reply = call(s, {"op": "lookup", "id": 99, "keys": [b"nothing-here"]})
    assert isinstance(reply, (CountReply, Error)) and reply.id == 99, reply
    if isinstance(reply, CountReply):
        assert reply.count == 0
    elif strict:
        assert reply.code == ErrorCode.NO_SESSION, reply
    else:  # fuzzed sessions may be admin sessions (BAD_REQUEST for lookups) or refused ones
        assert reply.code in (ErrorCode.NO_SESSION, ErrorCode.BAD_REQUEST), reply


# ---- frame-level errors: answer, then close ------------------------------------------


@pytest.mark.parametrize("transport", ["unix", "tcp"])
@pytest.mark.parametrize(
    "data, code",
    [
        pytest.param(frame({"op": "hello"}, magic=b"XX"), ErrorCode.BAD_FRAME, id="bad-magic"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ErrorCode.BAD_FRAME, id="http"),
        pytest.param(frame({"op": "hello"}, version=2), ErrorCode.BAD_VERSION, id="version-2"),
        pytest.param(frame({"op": "hello"}, version=0), ErrorCode.BAD_VERSION, id="version-0"),
        pytest.param(frame({"op": "hello"}, version=255), ErrorCode.BAD_VERSION, id="version-255"),
        pytest.param(frame({"op": "hello"}, kind=9), ErrorCode.BAD_FRAME, id="unknown-kind"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, 0, 0), ErrorCode.TOO_LARGE, id="empty-header"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, MAX_HEADER_BYTES + 1, 0), ErrorCode.TOO_LARGE,
                     id="header-over-header-limit"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, MAX_FRAME + 1, 0), ErrorCode.TOO_LARGE,
                     id="header-over-frame-limit"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, 100, MAX_FRAME), ErrorCode.TOO_LARGE, id="body-over-frame-limit"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, 0xFFFFFFFF, 0xFFFFFFFF), ErrorCode.TOO_LARGE, id="max-u32"),
        pytest.param(PREAMBLE.pack(MAGIC, VERSION, 0, 16, 0xFFFFFFF0), ErrorCode.TOO_LARGE, id="sum-over-u32"),
    ],
)
def test_broken_frame_is_answered_and_closed(target: Target, transport: str, data: bytes, code: str) -> None:
    # the oversized ones send only the preamble: the gateway must answer without waiting for the bytes
    with target.connect(transport) as s:
        expect_error_then_close(s, data, code)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_broken_frame_after_a_session_closes_only_that_connection(target: Target, transport: str) -> None:
    with target.connect(transport) as other, target.connect(transport) as s:
        hello(other, engine_id="fuzzer")
        hello(s, engine_id="fuzzer")
        expect_error_then_close(s, PREAMBLE.pack(b"kg", VERSION, 0, 10, 0), ErrorCode.BAD_FRAME)
        still_works(other)


# ---- request-level errors: answer, go on ----------------------------------------------


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_unknown_op_and_requests_before_hello(target: Target, transport: str) -> None:
    with target.connect(transport) as s:
        expect_error(s, {"op": "frobnicate", "id": 7}, ErrorCode.UNKNOWN_OP)
        expect_error(s, {"op": "", "id": 8}, ErrorCode.UNKNOWN_OP)
        expect_error(s, {"id": 9}, ErrorCode.UNKNOWN_OP)  # no op at all
        expect_error(s, {"op": 12, "id": 10}, ErrorCode.UNKNOWN_OP)
        for i, op in enumerate(REQUEST_OPS):
            if op == "hello":
                continue
            expect_error(s, {"op": op, "id": 100 + i, "keys": [b"k"], "sizes": [1]}, ErrorCode.NO_SESSION)
        still_works(s)  # NO_SESSION again, but answered
        hello(s)
        expect_error(s, {"op": "frobnicate", "id": 11}, ErrorCode.UNKNOWN_OP)
        expect_error(s, {"op": "hello", "id": 12, "namespace": "again"}, ErrorCode.BAD_REQUEST)  # second hello
        still_works(s)
    # before hello nothing is held for a peer: a frame with a body is answered with its id, then closed
    with target.connect(transport) as s:
        s.sendall(frame({"op": "put", "id": 13, "keys": [b"k"], "sizes": [1]}, b"x"))
        reply = read_reply(s)
        assert isinstance(reply, Error) and reply.code == ErrorCode.NO_SESSION and reply.id == 13, reply
        assert read_reply(s) is None


def _nested(levels: int, rid: int) -> bytes:
    """A lookup whose keys are a list nested ``levels`` deep."""
    return b"\x83\xa2op\xa6lookup\xa2id" + bytes([rid]) + b"\xa4keys" + b"\x91" * levels + b"\xc0"


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_deeply_nested_headers_are_bad_requests(target: Target, transport: str) -> None:
    # the length-prefixed header keeps the stream in step: answered with its id, and the connection goes on
    with target.connect(transport) as s:
        expect_error(s, _nested(60_000, rid=21), ErrorCode.BAD_REQUEST)  # before hello: within 64 KiB
        hello(s)
        reply = expect_error(s, _nested(900_000, rid=22), ErrorCode.BAD_REQUEST)
        assert reply.id == 22 and "nested" in reply.message
        still_works(s)
    assert "Traceback" not in target.gw.log()


def test_clean_before_hello_deletes_nothing(target: Target) -> None:
    with Client.connect(target.gw.socket, namespace="keep", engine_id="fuzzer") as c:
        assert c.put_many([b"survivor"], [b"still here"]) == [True]
    with target.unix() as s:
        expect_error(s, {"op": "clean", "id": 3}, ErrorCode.NO_SESSION)
    with Client.connect(target.gw.socket, namespace="keep", engine_id="fuzzer") as c:
        assert c.get_many([b"survivor"]) == [b"still here"]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_bad_hello_refused_then_connection_goes_on(target: Target, transport: str) -> None:
    with target.connect(transport) as s:
        expect_error(s, {"op": "hello", "id": 2, "namespace": ""}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "hello", "id": 3, "namespace": "n" * 256}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "hello", "id": 4, "namespace": "n", "protocol": 99}, ErrorCode.BAD_VERSION)
        expect_error(s, {"op": "hello", "id": 5, "namespace": "n", "role": "root"}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "hello", "id": 6, "namespace": 17}, ErrorCode.BAD_REQUEST)
        # refused hellos leave no session behind
        expect_error(s, {"op": "lookup", "id": 7, "keys": [b"k"]}, ErrorCode.NO_SESSION)
        hello(s)
        still_works(s)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_wrong_field_types(target: Target, transport: str) -> None:
    with target.connect(transport) as s:
        hello(s)
        bad = [
            {"op": "put", "id": 2, "keys": [1, 2], "sizes": [0, 0]},
            {"op": "put", "id": 3, "keys": "abc", "sizes": [0]},
            {"op": "put", "id": 4, "keys": [b"a"], "sizes": "1"},
            {"op": "put", "id": 5, "keys": [b"a"], "sizes": [1.5]},
            {"op": "put", "id": 6, "keys": [b"a"], "sizes": [0], "retention": "forever"},
            {"op": "put", "id": 7, "keys": [b"a"], "sizes": [0], "region": "zero"},
            {"op": "put", "id": 8, "keys": [b"a"], "sizes": [0], "offsets": {"a": 1}},
            {"op": "put", "id": 9, "keys": [b"a"], "sizes": [1e30]},
            {"op": "get", "id": 10, "keys": [None]},
            {"op": "get", "id": 11, "keys": [b"a"], "capacities": [b"x"], "offsets": [0], "region": 0},
            {"op": "lookup", "id": 12, "keys": None},
            {"op": "lookup", "id": 13, "keys": [b"a"], "dialog": 5},
            {"op": "exists", "id": 14, "keys": [[b"a"]]},
            {"op": "delete", "id": 15, "keys": {"a": b"b"}},
            {"op": "prewarm", "id": 16, "keys": [True]},
            {"op": "register_region", "id": 17, "path": 42},
        ]
        for h in bad:
            expect_error(s, h, ErrorCode.BAD_REQUEST)
        # headers that are not a request map at all
        for raw in (msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode("hello"), b"\xc1", b"\x81",
                    msgspec.msgpack.encode({"op": "put", "id": "seven"})):
            reply = call(s, raw)
            assert isinstance(reply, Error) and reply.code in (ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP), reply
        still_works(s)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_bad_keys(target: Target, transport: str) -> None:
    with target.connect(transport) as s:
        hello(s)
        for op in ("lookup", "exists", "get", "delete", "prewarm"):
            expect_error(s, {"op": op, "id": 2, "keys": [b""]}, ErrorCode.BAD_REQUEST)
            expect_error(s, {"op": op, "id": 3, "keys": [b"ok", b"k" * (MAX_KEY_BYTES + 1)]}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "put", "id": 4, "keys": [b""], "sizes": [1]}, ErrorCode.BAD_REQUEST, body=b"x")
        expect_error(s, {"op": "put", "id": 5, "keys": [b"k" * (MAX_KEY_BYTES + 1)], "sizes": [1]},
                     ErrorCode.BAD_REQUEST, body=b"x")
        too_many = [i.to_bytes(3, "little") for i in range(65537)]
        expect_error(s, {"op": "lookup", "id": 6, "keys": too_many}, ErrorCode.TOO_LARGE)
        # the longest allowed key works, and nothing of the refused puts was stored
        longest = b"L" * MAX_KEY_BYTES
        reply = call(s, {"op": "put", "id": 7, "keys": [longest], "sizes": [3]}, b"abc")
        assert isinstance(reply, PutReply) and reply.stored == [True], reply
        reply = call(s, {"op": "exists", "id": 8, "keys": [longest, b"k" * 1024 + b"", b"x"]})
        assert reply.present == [True, False, False]


def test_region_offsets_outside_the_region(target: Target) -> None:
    with target.unix() as s:
        hr = hello(s)
        assert hr.shm_size == SHM_SIZE
        n = hr.shm_size
        bad_puts = [
            {"keys": [b"a"], "sizes": [100], "region": SESSION_REGION, "offsets": [n - 10]},
            {"keys": [b"a"], "sizes": [1], "region": SESSION_REGION, "offsets": [n]},
            {"keys": [b"a"], "sizes": [4], "region": SESSION_REGION, "offsets": [-1]},
            {"keys": [b"a"], "sizes": [2 ** 63 - 1], "region": SESSION_REGION, "offsets": [2]},
            {"keys": [b"a"], "sizes": [1], "region": SESSION_REGION, "offsets": [2 ** 64 - 1]},
            {"keys": [b"a"], "sizes": [1], "region": SESSION_REGION},  # no offsets
            {"keys": [b"a", b"b"], "sizes": [1, 1], "region": SESSION_REGION, "offsets": [0]},  # one offset short
            {"keys": [b"a"], "sizes": [1], "region": 7, "offsets": [0]},  # no such region
            {"keys": [b"a"], "sizes": [1], "region": -5, "offsets": [0]},
        ]
        for i, p in enumerate(bad_puts):
            expect_error(s, {"op": "put", "id": 10 + i, **p}, ErrorCode.BAD_REQUEST)
        bad_gets = [
            {"keys": [b"a"], "region": SESSION_REGION, "offsets": [n - 1], "capacities": [2]},
            {"keys": [b"a"], "region": SESSION_REGION, "offsets": [-8], "capacities": [4]},
            {"keys": [b"a"], "region": SESSION_REGION, "offsets": [0], "capacities": [-1]},
            {"keys": [b"a"], "region": SESSION_REGION, "offsets": [0]},  # no capacities
            {"keys": [b"a"], "region": INLINE, "offsets": [0], "capacities": [1]},  # offsets without a region
            {"keys": [b"a"], "region": 3},
        ]
        for i, g in enumerate(bad_gets):
            expect_error(s, {"op": "get", "id": 30 + i, **g}, ErrorCode.BAD_REQUEST)
        for i, path in enumerate(["/etc/passwd", "", "/dev/shm/../etc/passwd", "/dev/shm/no-such-file-kvgate-fuzz",
                                  "/dev/shm/a\x00b", "/dev/shm"]):
            expect_error(s, {"op": "register_region", "id": 50 + i, "path": path}, ErrorCode.BAD_REQUEST)
        # nothing was stored by any of it
        reply = call(s, {"op": "exists", "id": 60, "keys": [b"a", b"b"]})
        assert reply.present == [False, False]
        still_works(s)


def test_tcp_sessions_have_no_regions(target: Target) -> None:
    with target.tcp() as s:
        hr = hello(s)
        assert hr.shm_path is None
        expect_error(s, {"op": "put", "id": 2, "keys": [b"a"], "sizes": [1], "region": SESSION_REGION,
                         "offsets": [0]}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "get", "id": 3, "keys": [b"a"], "region": SESSION_REGION}, ErrorCode.BAD_REQUEST)
        expect_error(s, {"op": "register_region", "id": 4, "path": "/dev/shm/x"}, ErrorCode.BAD_REQUEST)
        still_works(s)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_put_sizes_that_do_not_add_up(target: Target, transport: str) -> None:
    with target.connect(transport) as s:
        hello(s)
        cases = [
            ({"keys": [b"s1", b"s2"], "sizes": [5, 5]}, b"x" * 20),  # body longer
            ({"keys": [b"s1", b"s2"], "sizes": [5, 5]}, b"x" * 9),  # body shorter
            ({"keys": [b"s1"], "sizes": [0]}, b"x"),
            ({"keys": [b"s1", b"s2"], "sizes": [10]}, b"x" * 10),  # fewer sizes than keys
            ({"keys": [b"s1"], "sizes": [5, 5]}, b"x" * 10),  # more sizes than keys
            ({"keys": [b"s1", b"s2"], "sizes": [-5, 15]}, b"x" * 10),  # negative size, right sum
            ({"keys": [b"s1"], "sizes": [-1]}, b""),
            ({"keys": [b"s1"], "sizes": [-(2 ** 63)]}, b""),
            ({"keys": [b"s1", b"s2"], "sizes": [1, 1], "position": 2 ** 63 - 1}, b"ab"),  # positions overflow int64
            ({"keys": [b"s1"], "sizes": [1], "position": 2 ** 64 - 1}, b"a"),
        ]
        for i, (h, body) in enumerate(cases):
            expect_error(s, {"op": "put", "id": 10 + i, **h}, ErrorCode.BAD_REQUEST, body=body)
        reply = call(s, {"op": "exists", "id": 40, "keys": [b"s1", b"s2"]})
        assert reply.present == [False, False]
        # an empty put is fine
        reply = call(s, {"op": "put", "id": 41, "keys": [], "sizes": []})
        assert isinstance(reply, PutReply) and reply.stored == []
        # a zero-length object is refused, alone or beside others, and nothing of its put is stored: an
        # engine's KV object is never empty, and one stored would be a hit whose load fails
        for i, (keys, sizes, body) in enumerate([([b"s0"], [0], b""), ([b"s2", b"s0"], [3, 0], b"abc")]):
            err = expect_error(s, {"op": "put", "id": 42 + i, "keys": keys, "sizes": sizes}, ErrorCode.BAD_REQUEST,
                               body=body)
            assert f"sizes[{sizes.index(0)}] is 0" in err.message and "no empty objects" in err.message, err
        reply = call(s, {"op": "get", "id": 44, "keys": [b"s0", b"s1", b"s2"]})
        assert isinstance(reply, GetReply) and reply.sizes == [-1, -1, -1]
        still_works(s)


# ---- truncated messages ---------------------------------------------------------------


def _connections(t: Target) -> int:
    with t.gw.admin() as a:
        return a.stats()["gateway"]["connections"] - 1  # minus this admin connection


def _wait_connections(t: Target, want: int, timeout: float = 5.0) -> None:
    wait_until(lambda: _connections(t) == want, timeout, lambda: f"{_connections(t)} connections open, not {want}")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_truncated_messages(target: Target, transport: str) -> None:
    put = {"op": "put", "id": 2, "keys": [b"t"], "sizes": [900_000]}
    full = frame(put, b"y" * 900_000)
    header_end = len(frame(put))
    cuts = [1, PREAMBLE_SIZE - 1, PREAMBLE_SIZE, PREAMBLE_SIZE + 3, header_end, header_end + 10, len(full) - 1]
    for with_session in (False, True):
        for cut in cuts:
            s = target.connect(transport)
            if with_session:
                hello(s)
            try:
                s.sendall(full[:cut])
            except (BrokenPipeError, ConnectionResetError):
                assert not with_session  # before hello a frame with a body is answered and closed at its preamble
            s.close()
    _wait_connections(target, 0)
    # each truncated body held part of the 2 MiB inline byte budget while it was read: none may be leaked,
    # or this 900 KB inline put (and every later one) would wait forever
    with target.tcp() as s:
        hello(s)
        s.sendall(full)
        s.settimeout(10)
        reply = read_reply(s)
        assert isinstance(reply, PutReply) and reply.stored == [True], reply
    # half-closing (EOF) mid-frame: the gateway closes its side too
    with target.connect(transport) as s:
        hello(s)
        s.sendall(full[: header_end + 5])
        s.shutdown(socket.SHUT_WR)
        assert read_reply(s) is None


# ---- hypothesis: random bytes and random well-framed garbage ----------------------------


_FIELDS = sorted({"keys", "sizes", "region", "offsets", "capacities", "retention", "dialog", "position", "namespace",
                  "engine_id", "role", "pid", "token", "salted", "want_shm", "protocol", "path", "id", "op"})

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1),
    st.integers(min_value=-3, max_value=SHM_SIZE + 3), st.floats(allow_nan=True), st.text(max_size=20),
    st.binary(max_size=40), st.sampled_from(["long", "short", "none", "engine", "admin", "/dev/shm/x"]),
)
_value = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
_keys = st.lists(st.binary(min_size=0, max_size=24), max_size=6)


@st.composite
def garbage_request(draw) -> tuple[bytes, bytes]:
    """A well-framed request whose header is anything from nearly valid to nonsense."""
    style = draw(st.integers(0, 9))
    if style == 0:
        header = draw(st.binary(min_size=1, max_size=64))  # not necessarily MessagePack
    elif style == 1:
        header = msgspec.msgpack.encode(draw(_value))  # MessagePack, maybe not a map
        if not header:
            header = b"\xc0"
    else:
        h: dict = {"op": draw(st.one_of(st.sampled_from(REQUEST_OPS), st.text(max_size=10), _leaf))}
        if draw(st.booleans()):
            h["id"] = draw(st.one_of(st.integers(min_value=0, max_value=2 ** 64 - 1), _leaf))
        if h["op"] in ("put", "get", "lookup", "exists", "delete", "prewarm") and draw(st.booleans()):
            h["keys"] = draw(_keys)
            if h["op"] == "put" and draw(st.booleans()):
                h["sizes"] = draw(st.lists(st.integers(-2, 64), min_size=len(h["keys"]), max_size=len(h["keys"])))
        if h["op"] == "hello" and draw(st.booleans()):
            h["namespace"] = draw(st.text(min_size=1, max_size=10))
            h["engine_id"] = "fuzzer"
        for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=5, unique=True)):
            if name not in h:
                h[name] = draw(_value)
        try:
            header = msgspec.msgpack.encode(h)
        except (OverflowError, msgspec.EncodeError):
            header = msgspec.msgpack.encode({"op": "lookup"})
    body = b""
    if draw(st.integers(0, 3)) == 0:
        body = draw(st.binary(max_size=200))
    return header, body


def _check_reply(reply, sent: bytes) -> None:
    assert reply is not None, f"connection closed after a well-framed request {sent[:200]!r}"
    if isinstance(reply, Error):
        assert reply.code != ErrorCode.INTERNAL, f"INTERNAL for {sent[:200]!r}: {reply.message}"


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def _random_bytes_case(t: Target, transport: str, data: bytes) -> None:
    with t.connect(transport) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return  # already answered and closed
        replies = []
        while True:
            r = read_reply(s)  # raises (test failure) on a malformed reply or a timeout
            if r is None:
                break
            replies.append(r)
            assert len(replies) < 1000
        for r in replies:
            if isinstance(r, Error):
                assert r.code != ErrorCode.INTERNAL, f"INTERNAL for {data[:200]!r}: {r.message}"


_preamble_then_junk = st.builds(
    lambda hl, bl, junk: PREAMBLE.pack(MAGIC, VERSION, 0, hl, bl) + junk,
    st.integers(0, 80), st.integers(0, 80), st.binary(max_size=200),
)
_random_stream = st.one_of(st.binary(max_size=300), _preamble_then_junk,
                           st.builds(lambda v, rest: struct.pack("<2sB", MAGIC, v) + rest,
                                     st.integers(0, 255), st.binary(max_size=100)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport, examples", [("unix", 900), ("tcp", 600)])
def test_random_byte_streams(target: Target, transport: str, examples: int) -> None:
    @fuzz_settings(examples)
    @given(data=_random_stream)
    def run(data: bytes) -> None:
        _random_bytes_case(target, transport, data)

    run()
    assert target.gw.alive(), target.gw.log()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport, examples", [("unix", 120), ("tcp", 80)])
def test_random_well_framed_garbage_on_reused_connections(target: Target, transport: str, examples: int) -> None:
    @fuzz_settings(examples)
    @given(reqs=st.lists(garbage_request(), min_size=1, max_size=20), hello_first=st.booleans())
    def run(reqs: list[tuple[bytes, bytes]], hello_first: bool) -> None:
        with target.connect(transport) as s:
            session = False
            if hello_first:
                reply = call(s, {"op": "hello", "id": 1, "namespace": "fuzz-ns", "engine_id": "fuzzer"})
                assert isinstance(reply, (HelloReply, Error))
                session = isinstance(reply, HelloReply)
            for header, body in reqs:
                data = frame(header, body)
                if body and not session:  # before hello a frame with a body is answered, then closed
                    s.sendall(data)
                    reply = read_reply(s)
                    assert isinstance(reply, Error) and reply.code == ErrorCode.NO_SESSION, reply
                    assert read_reply(s) is None
                    return
                s.sendall(data)
                reply = read_reply(s)
                _check_reply(reply, data)
                session = session or isinstance(reply, HelloReply)
            still_works(s, strict=False)

    run()
    assert target.gw.alive(), target.gw.log()


# ---- after all of it ------------------------------------------------------------------------


def test_zz_gateway_survived_everything(target: Target) -> None:
    """Runs last in this module: same process, serves correctly, no traceback, RSS bounded."""
    _wait_connections(target, 0)
    _assert_healthy(target)
    rss_after = target.gw.rss_kib()
    growth = rss_after - target.rss_before
    assert growth < RSS_GROWTH_LIMIT_KIB, f"RSS grew by {growth} KiB ({target.rss_before} -> {rss_after})"
    log = target.gw.log()
    assert "Traceback" not in log and "handler failed" not in log, log[-5000:]
    st_ = target.gw.stats()
    assert st_["gateway"]["engine"] is None  # every engine claim was released
