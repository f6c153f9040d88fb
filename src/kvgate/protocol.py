"""Wire messages between clients and the gateway.

A frame is a 12-byte preamble, a MessagePack header and an optional raw body:

    b"KG" | version u8 | kind u8 | header_len u32 LE | body_len u32 LE
    header: one message below (msgspec, tagged by ``op``)
    body:   inline payload bytes (TCP clients only), in key order

Local clients never put payload bytes in frames: they name ranges of a
shared-memory region (``region`` >= 0) that the gateway reads or fills.
Every request carries an ``id`` echoed by its reply, so a client may pipeline
requests and the gateway may answer them out of order.

Errors: a frame that cannot be parsed (bad magic, wrong version, oversized
lengths) gets an ``Error`` and the connection is closed, since the stream
cannot be resynchronised.  A well-framed request that is wrong (unknown op,
bad fields) gets an ``Error`` and the connection goes on.
"""

from __future__ import annotations

import struct
from typing import Literal, Union

import msgspec

MAGIC = b"KG"
VERSION = 1
PREAMBLE = struct.Struct("<2sBBII")
PREAMBLE_SIZE = PREAMBLE.size  # 12
KIND_REQUEST = 0
KIND_REPLY = 1
MAX_HEADER_BYTES = 4 << 20  # 1000s of keys fit; bounds what a bad client makes us allocate

INLINE = -1  # region id meaning "bytes are in the frame body"
SESSION_REGION = 0

# Get result sizes below zero
MISS = -1
NOT_DONE = -2  # did not fit in this reply / region: ask again
TOO_SMALL = -3  # the destination capacity is smaller than the object

Retention = Literal["none", "short", "long"]


class ErrorCode:
    BAD_FRAME = "BAD_FRAME"
    BAD_VERSION = "BAD_VERSION"
    TOO_LARGE = "TOO_LARGE"
    UNKNOWN_OP = "UNKNOWN_OP"
    BAD_REQUEST = "BAD_REQUEST"
    NO_SESSION = "NO_SESSION"
    NOT_AUTHORIZED = "NOT_AUTHORIZED"
    ENGINE_BUSY = "ENGINE_BUSY"
    UNSALTED_REFUSED = "UNSALTED_REFUSED"
    CLEAN_REFUSED = "CLEAN_REFUSED"
    TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"
    INTERNAL = "INTERNAL"


class _Msg(msgspec.Struct, tag_field="op", omit_defaults=True, forbid_unknown_fields=False):
    id: int = 0


# ---- requests ---------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    namespace: str = ""
    engine_id: str = ""
    role: Literal["engine", "admin"] = "engine"
    pid: int = 0
    token: str | None = None
    salted: bool = False
    want_shm: bool = True
    protocol: int = VERSION


class RegisterRegion(_Msg, tag="register_region"):
    path: str = ""


class Put(_Msg, tag="put"):
    keys: list[bytes] = []
    sizes: list[int] = []
    region: int = INLINE
    offsets: list[int] | None = None
    retention: Retention = "long"
    dialog: bytes | None = None
    position: int = -1  # position of keys[0] in its dialog; keys are consecutive


class Get(_Msg, tag="get"):
    keys: list[bytes] = []
    region: int = INLINE
    # None: the gateway packs results from offset 0 of the region (or the body)
    offsets: list[int] | None = None
    capacities: list[int] | None = None
    dialog: bytes | None = None


class Lookup(_Msg, tag="lookup"):
    keys: list[bytes] = []
    dialog: bytes | None = None


class Exists(_Msg, tag="exists"):
    keys: list[bytes] = []
    dialog: bytes | None = None


class Delete(_Msg, tag="delete"):
    keys: list[bytes] = []
    dialog: bytes | None = None


class Prewarm(_Msg, tag="prewarm"):
    keys: list[bytes] = []
    dialog: bytes | None = None


class Clean(_Msg, tag="clean"):
    pass


class Stats(_Msg, tag="stats"):
    pass


Request = Union[Hello, RegisterRegion, Put, Get, Lookup, Exists, Delete, Prewarm, Clean, Stats]
REQUEST_OPS = ("hello", "register_region", "put", "get", "lookup", "exists", "delete", "prewarm", "clean", "stats")

# ---- replies ------------------------------------------------------------------


class Error(_Msg, tag="error"):
    code: str = ErrorCode.INTERNAL
    message: str = ""


class HelloReply(_Msg, tag="hello_reply"):
    session: int = 0
    gateway_version: str = ""
    shm_path: str | None = None
    shm_size: int = 0
    max_frame_bytes: int = 0
    fingerprint: str = ""
    placement: str = ""


class RegionReply(_Msg, tag="region_reply"):
    region: int = 0
    size: int = 0


class PutReply(_Msg, tag="put_reply"):
    stored: list[bool] = []


class GetReply(_Msg, tag="get_reply"):
    sizes: list[int] = []  # >= 0 hit, MISS, NOT_DONE or TOO_SMALL (then needed in `needed`)
    offsets: list[int] | None = None  # where each hit was placed, in pack mode
    needed: list[int] | None = None


class CountReply(_Msg, tag="count_reply"):
    count: int = 0


class ExistsReply(_Msg, tag="exists_reply"):
    present: list[bool] = []


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict = {}


Reply = Union[Error, HelloReply, RegionReply, PutReply, GetReply, CountReply, ExistsReply, StatsReply]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_loose_decoder = msgspec.msgpack.Decoder()


class FrameError(Exception):
    """The stream is broken; reply with ``code`` and close."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class RequestError(Exception):
    """A well-framed but wrong request: reply with ``code`` and go on."""

    def __init__(self, code: str, message: str, request_id: int = 0):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def encode_frame(msg: _Msg, body_len: int = 0, kind: int = KIND_REQUEST) -> bytes:
    """Preamble + header; the caller sends ``body_len`` body bytes after it."""
    header = _encoder.encode(msg)
    return PREAMBLE.pack(MAGIC, VERSION, kind, len(header), body_len) + header


def parse_preamble(buf: bytes | memoryview, max_frame_bytes: int) -> tuple[int, int, int]:
    """-> (kind, header_len, body_len); raises FrameError."""
    magic, version, kind, header_len, body_len = PREAMBLE.unpack(buf)
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_FRAME, "not a kvgate frame (bad magic)")
    if version != VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, f"protocol version {version} is not supported (this gateway speaks {VERSION})")
    if kind not in (KIND_REQUEST, KIND_REPLY):
        raise FrameError(ErrorCode.BAD_FRAME, f"unknown frame kind {kind}")
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise FrameError(ErrorCode.TOO_LARGE, f"header of {header_len} bytes (limit {MAX_HEADER_BYTES})")
    if header_len + body_len > max_frame_bytes:
        raise FrameError(ErrorCode.TOO_LARGE, f"frame of {header_len + body_len} bytes (limit {max_frame_bytes})")
    return kind, header_len, body_len


def decode_request(header: bytes | memoryview) -> Request:
    try:
        return _request_decoder.decode(header)
    except msgspec.DecodeError as e:
        raise _explain(header, e) from None


def _explain(header: bytes | memoryview, err: msgspec.DecodeError) -> RequestError:
    """Tell an unknown op from bad fields, and recover the id for the reply."""
    try:
        loose = _loose_decoder.decode(header)
    except msgspec.DecodeError:
        return RequestError(ErrorCode.BAD_REQUEST, f"header is not valid MessagePack: {err}")
    if not isinstance(loose, dict):
        return RequestError(ErrorCode.BAD_REQUEST, "header must be a map")
    rid = loose.get("id", 0)
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    op = loose.get("op")
    if op not in REQUEST_OPS:
        return RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}", rid)
    return RequestError(ErrorCode.BAD_REQUEST, f"bad {op} request: {err}", rid)


def decode_reply(header: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(header)
