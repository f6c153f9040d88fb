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
bad fields, nested too deep) gets an ``Error`` and the connection goes on.
A frame over the frame limit whose header fits is the one exception to the
first rule on an established session: the gateway reads its header, answers
``TOO_LARGE`` with its id, drops the body and goes on (``FrameTooLarge``).
"""

from __future__ import annotations

import struct
import sys
from typing import Literal, Union

import msgspec

from kvgate.types import MAX_SOURCE_CHARS, SizeCode  # noqa: F401 - MAX_SOURCE_CHARS: part of the protocol
from kvgate.errors import KvgateError
from kvgate.keys import Key  # the decoder checks every key's length: the gateway need not

MAGIC = b"KG"
VERSION = 1
PREAMBLE = struct.Struct("<2sBBII")
PREAMBLE_SIZE = PREAMBLE.size  # 12
KIND_REQUEST = 0
KIND_REPLY = 1
MAX_HEADER_BYTES = 4 << 20  # 1000s of keys fit; bounds what a bad client makes us allocate

INLINE = -1  # region id meaning "bytes are in the frame body"
SESSION_REGION = 0
# Region id of a get whose bytes the client reads out of the gateway's memory itself
# (``process_vm_readv``): the reply names where they are and a loan the client gives back.
LENT = -2

# Get result sizes below zero, on the wire as their values (``kvgate.types.SizeCode``)
MISS = int(SizeCode.MISS)
NOT_DONE = int(SizeCode.NOT_DONE)
TOO_SMALL = int(SizeCode.TOO_SMALL)

# Retention on the wire: its name (``kvgate.types.Retention``; the gateway parses it at the edge)
WireRetention = Literal["none", "short", "long"]


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
    CARDS_REFUSED = "CARDS_REFUSED"  # a change of the card set that cannot be made (the message says why)
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
    # How this engine's keys name blocks, for the KV events the gateway publishes (kvgate.gateway.kvevents):
    # "vllm": a key is a block hash then a 4-byte big-endian group index (vLLM's offloading key); "": the
    # whole key is the block's hash.  block_size: tokens per key (0: not said).  Older gateways ignore both.
    block_keys: str = ""
    block_size: int = 0
    # What this namespace stands for (a JSON object: model, dtype, layout, parallelism; ``kvgate.keys.NamespaceBook``),
    # shown to peer gateways so that one whose engines run the same model another way is refused by name.
    namespace_inputs: str = ""


class RegisterRegion(_Msg, tag="register_region"):
    path: str = ""


class Put(_Msg, tag="put"):
    keys: list[Key] = []
    sizes: list[int] = []
    region: int = INLINE
    offsets: list[int] | None = None
    retention: WireRetention = "long"
    dialog: bytes | None = None
    position: int = -1  # position of keys[0] in its dialog; keys are consecutive


class Get(_Msg, tag="get"):
    keys: list[Key] = []
    region: int = INLINE
    # None: the gateway packs results from offset 0 of the region (or the body)
    offsets: list[int] | None = None
    capacities: list[int] | None = None
    dialog: bytes | None = None
    # LENT: the client can read card objects out of files the gateway lends it open (GetReply.files)
    files: bool = False
    source: str | None = None  # as Lookup.source


# ``source`` of a lookup, exists or get: "HOST:PORT" or "HOST" where the request's KV was computed (vLLM's
# kv_transfer_params.remote_kv_source): the gateway asks only its peers on that host, none when no peer of
# its own is there (it never connects to an address a request names).  None: every peer, as before.  Sent
# only when set (omit_defaults), and a gateway from before it ignores it (unknown fields are skipped): no new
# protocol version.  MAX_SOURCE_CHARS lives in kvgate.types (the tiers, below the protocol, bound it too).


class Lookup(_Msg, tag="lookup"):
    keys: list[Key] = []
    dialog: bytes | None = None
    source: str | None = None


class Exists(_Msg, tag="exists"):
    keys: list[Key] = []
    dialog: bytes | None = None
    source: str | None = None


class Delete(_Msg, tag="delete"):
    keys: list[Key] = []
    dialog: bytes | None = None


class Prewarm(_Msg, tag="prewarm"):
    keys: list[Key] = []
    dialog: bytes | None = None


class Hold(_Msg, tag="hold"):
    """Keep the present keys on their cards until released (``kvgate.tiers.holds``); ExistsReply: held."""

    keys: list[Key] = []
    dialog: bytes | None = None


class GiveBack(_Msg, tag="give_back"):
    """The client read what a ``LENT`` get lent it; CountReply: 1 if the loan was open, else 0."""

    loan: int = 0


class Release(_Msg, tag="release"):
    """End this session's holds on these keys; CountReply: how many it held."""

    keys: list[Key] = []
    dialog: bytes | None = None  # unused: holds are by key


class Mark(_Msg, tag="mark"):
    keys: list[Key] = []  # a prompt's leading keys, from position 0


class Clean(_Msg, tag="clean"):
    """Delete objects.  An engine session: those of its own namespace (``namespace`` unset or its own).
    An admin session on the Unix socket: every namespace's, or ``namespace``'s only."""

    namespace: str | None = None


class Stats(_Msg, tag="stats"):
    pass


CARD_ACTIONS = ("list", "add", "drain", "undrain", "remove")


class Cards(_Msg, tag="cards"):
    """List or change the card set (an admin session on the local listener only)."""

    action: Literal["list", "add", "drain", "undrain", "remove"] = "list"
    target: str = ""  # add: a directory or Redis URL; otherwise a card's serial
    now: bool = False  # drain: leave at once, without copying what it holds
    # drain --now, remove: even when that leaves no card in service, or drops objects a running drain is
    # moving or has moved onto the card (refused with CARDS_REFUSED otherwise, saying what would be lost)
    force: bool = False


Request = Union[Hello, RegisterRegion, Put, Get, Lookup, Exists, Delete, Prewarm, Hold, Release, Mark, Clean, Stats,
                Cards, GiveBack]
REQUEST_OPS = ("hello", "register_region", "put", "get", "lookup", "exists", "delete", "prewarm", "hold", "release",
               "mark", "clean", "stats", "cards", "give_back")

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
    # The gateway's pid and whether this session may read lent objects out of its memory (``LENT``
    # gets): a local session of the gateway's own user, with cross_memory_gets on.
    pid: int = 0
    lends: bool = False
    # Where ``lends``: the RAM tier's arena as (file descriptor in the gateway, address there, size), a
    # read-only memfd the client maps (pidfd_getfd) to copy lent RAM-tier pieces out itself; None: not shared.
    arena: list[int] | None = None


class RegionReply(_Msg, tag="region_reply"):
    region: int = 0
    size: int = 0


class PutReply(_Msg, tag="put_reply"):
    stored: list[bool] = []


class GetReply(_Msg, tag="get_reply"):
    sizes: list[int] = []  # >= 0 hit, MISS, NOT_DONE or TOO_SMALL (then needed in `needed`)
    offsets: list[int] | None = None  # where each hit was placed, in pack mode
    needed: list[int] | None = None
    # LENT: per hit, in key order, (address, length) pairs of the gateway's memory holding it, flattened;
    # ``loan`` is given back (``GiveBack``) once they are read
    segments: list[int] | None = None
    # LENT with Get.files: per hit lent as an open file of the gateway's, (key index, file descriptor in
    # the gateway, payload offset, XXH3-64 of the payload) flattened; ``sizes`` says the payload's length,
    # ``segments`` leaves it out.  The client takes the descriptor (pidfd_getfd), reads, checks the hash.
    files: list[int] | None = None
    loan: int = 0  # 0: nothing to give back


class CountReply(_Msg, tag="count_reply"):
    count: int = 0


class ExistsReply(_Msg, tag="exists_reply"):
    present: list[bool] = []


class MarkReply(_Msg, tag="mark_reply"):
    mark: bytes | None = None  # the first key past the shared head; None: every key given is shared
    shared: int = 0  # leading keys that are shared heads
    heads: list[int] = []  # where the shared head's segments start (the first at 0); their marks are those keys


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict = {}


class CardsReply(_Msg, tag="cards_reply"):
    generation: int = 0  # changes of the card set since the gateway started
    fingerprint: str = ""  # the key layout now
    cards: list[dict] = []  # one row per card, as in the stats
    message: str = ""  # what the change did


Reply = Union[Error, HelloReply, RegionReply, PutReply, GetReply, CountReply, ExistsReply, MarkReply, StatsReply,
              CardsReply]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_loose_decoder = msgspec.msgpack.Decoder()


class FrameError(KvgateError, Exception):
    """The stream is broken; reply with ``code`` and close."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class FrameTooLarge(FrameError):
    """A well-formed preamble announcing more than the frame limit; its lengths let a reader skip it."""

    def __init__(self, message: str, header_len: int, body_len: int):
        super().__init__(ErrorCode.TOO_LARGE, message)
        self.header_len = header_len
        self.body_len = body_len


class RequestError(KvgateError, Exception):
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
        raise FrameTooLarge(f"frame of {header_len + body_len} bytes (limit {max_frame_bytes}, max_frame_bytes)",
                            header_len, body_len)
    return kind, header_len, body_len


def decode_request(header: bytes | memoryview) -> Request:
    """The request in ``header``; raises RequestError (never anything else) for a wrong one."""
    try:
        return _request_decoder.decode(header)
    except msgspec.DecodeError as e:
        raise _explain(header, e) from None
    except RecursionError:
        # msgspec recurses per nesting level (skipped fields too) and stops at the interpreter's recursion
        # limit: that is the depth bound; the length-prefixed frame keeps the stream in step, so the
        # connection goes on
        raise _too_deep(header) from None


def _too_deep(header: bytes | memoryview) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST,
                        f"header nested deeper than {sys.getrecursionlimit()} levels; requests are a few levels deep",
                        _peek_id(header))


_MSGPACK_INT = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_PEEK_ENTRIES = 16


def _peek_id(header: bytes | memoryview) -> int:
    """The ``id`` of a map header, read without decoding nested values (0 when not found first).

    Only top-level entries with scalar values are read, and the scan stops at
    the first container: the id of an undecodable header is worth a few
    steps, never a walk over what made it undecodable.  Encoders put ``op``
    and ``id`` first.
    """
    buf = bytes(header[: 1 << 10])

    def read_str(i: int) -> tuple[bytes, int] | None:
        b = buf[i] if i < len(buf) else None
        if b is None:
            return None
        if 0xA0 <= b <= 0xBF:
            n, i = b - 0xA0, i + 1
        elif b == 0xD9 and i + 1 < len(buf):
            n, i = buf[i + 1], i + 2
        else:
            return None
        return buf[i : i + n], i + n

    if not buf or not 0x81 <= buf[0] <= 0x8F:
        return 0
    i = 1
    for _ in range(min(buf[0] - 0x80, _PEEK_ENTRIES)):
        key = read_str(i)
        if key is None or key[1] >= len(buf):
            return 0
        name, i = key
        b = buf[i]
        if b <= 0x7F:
            value, i = b, i + 1
        elif b >= 0xE0:
            value, i = b - 0x100, i + 1
        elif b in _MSGPACK_INT:
            fmt = _MSGPACK_INT[b]
            size = struct.calcsize(fmt)
            if i + 1 + size > len(buf):
                return 0
            value, i = struct.unpack_from(fmt, buf, i + 1)[0], i + 1 + size
        elif (s := read_str(i)) is not None:
            value, i = s
        else:
            return 0
        if name == b"id":
            return value if isinstance(value, int) and value >= 0 else 0
    return 0


def _explain(header: bytes | memoryview, err: msgspec.DecodeError) -> RequestError:
    """Tell an unknown op from bad fields, and recover the id for the reply."""
    try:
        loose = _loose_decoder.decode(header)
    except msgspec.DecodeError:
        return RequestError(ErrorCode.BAD_REQUEST, f"header is not valid MessagePack: {err}")
    except RecursionError:
        return _too_deep(header)
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
