"""The wire format of cards served over TCP (``kvgate://host:port/<serial>``).

Shared by the client (``kvgate.cards.network.card``) and the server
(``kvgate.cards.network.server``).  Every message is one frame::

    prefix   16 bytes  "<4sIQ": magic b"KVN1" (the version is its last byte),
                       header length, body length
    header   msgpack of one tagged struct below (msgspec; "op" names it)
    body     raw bytes (object files, payloads, snapshot pieces), or none

A connection starts with ``Hello`` naming the card's serial and the
client's ``num_dbs``; the server answers ``Ok`` or an ``Err`` naming the
serials it exports.  Then requests and replies alternate; ``ReadMany`` is
answered by one ``Item`` frame per object (its body: the object file as it
is on disk), ``WriteMany`` carries in its body each payload followed by one
byte, 1 to publish it or 0 to drop it (the client decides after it has sent
the payload, so a caller that gave up meanwhile publishes nothing).

Every length a peer announces is checked against a limit before anything is
allocated for it; a body is read into memory that grows only as its bytes
arrive, so a peer that lies about a length gets nothing but a timeout.
"""

from __future__ import annotations

import errno
import socket
import ssl
import struct
import time
from typing import Any, Union

import msgspec

from kvgate.cards.base import CardInUse, CardUnavailable, WriteAbandoned
from kvgate.cards.objectformat import ObjectCorrupt, ObjectMissing, ObjectTooNew
from kvgate.errors import KvgateError

MAGIC = b"KVN1"
PREFIX = struct.Struct("<4sIQ")
# A request header never needs more: a batch is at most MAX_BATCH keys of at
# most ~1.3 KiB (kvgate.keys) plus small fields.
MAX_REQUEST_HEADER = 8 << 20
# Replies carry stored_objects' headers and names' batches (a leaf directory).
MAX_REPLY_HEADER = 64 << 20
MAX_BATCH = 4096
MAX_HEADS = 1 << 20  # ids of one MergeHeads request
# Snapshots travel in pieces of at most this (one frame each).
SNAPSHOT_PIECE = 1 << 20
# The largest snapshot a client accepts back (an index of tens of millions of objects).
MAX_SNAPSHOT = 4 << 30
# Bodies are read into memory that grows by at most this per receive, so an
# announced length is never allocated before its bytes have arrived.
GROW_STEP = 1 << 20


class WireError(KvgateError, Exception):
    """The peer broke the protocol (bad magic, a length over a limit, a header that does not decode)."""


class Msg(msgspec.Struct, tag_field="op", omit_defaults=True, forbid_unknown_fields=False, array_like=False):
    pass


# ---- requests ---------------------------------------------------------------


class Hello(Msg, tag="hello"):
    serial: str
    num_dbs: int = 1
    token: str | None = None  # what a server started with a token requires (card_token_file)


class Check(Msg, tag="check"):
    pass


class Claim(Msg, tag="claim"):
    shared: bool
    holder: dict[str, Any] = {}


class CheckWritable(Msg, tag="check_writable"):
    pass


class ReadMany(Msg, tag="read_many"):
    keys: list[bytes]


class WriteItem(msgspec.Struct, array_like=True):
    key: bytes
    payload_len: int
    payload_hash: int
    dialog: bytes
    position: int
    created_ns: int


class WriteMany(Msg, tag="write_many"):
    items: list[WriteItem]


class ExistsMany(Msg, tag="exists_many"):
    keys: list[bytes]
    not_before_ns: int | None = None


class DeleteNamed(Msg, tag="delete_named"):
    digests: list[bytes]


class Discard(Msg, tag="discard"):
    """Delete a corrupt object, only if the file still starts with ``seen`` and is ``size`` bytes."""
    key: bytes
    seen: bytes
    size: int


class Names(Msg, tag="names"):
    """Open a listing on this connection (then ``NamesNext`` until ``done``)."""


class NamesNext(Msg, tag="names_next"):
    pass


class StoredObjects(Msg, tag="stored_objects"):
    digests: list[bytes]


class SnapshotBegin(Msg, tag="snapshot_begin"):
    pass


class SnapshotPiece(Msg, tag="snapshot_piece"):
    pass


class SnapshotCommit(Msg, tag="snapshot_commit"):
    pass


class SnapshotAbort(Msg, tag="snapshot_abort"):
    pass


class ReadSnapshot(Msg, tag="read_snapshot"):
    pass


class DropSnapshot(Msg, tag="drop_snapshot"):
    pass


class Clean(Msg, tag="clean"):
    pass


class FreeBytes(Msg, tag="free_bytes"):
    pass


class MergeHeads(Msg, tag="merge_heads"):
    ids: list[int]


class Namespaces(Msg, tag="namespaces"):
    """A peer listener's only request besides reads: the asker's namespaces and their inputs
    (``kvgate.keys.NamespaceBook``), answered with the listener's own (``Ok``)."""
    namespaces: dict[str, dict[str, Any]]


Request = Union[Hello, Check, Claim, CheckWritable, ReadMany, WriteMany, ExistsMany, DeleteNamed, Discard, Names,
                NamesNext, StoredObjects, SnapshotBegin, SnapshotPiece, SnapshotCommit, SnapshotAbort, ReadSnapshot,
                DropSnapshot, Clean, FreeBytes, MergeHeads, Namespaces]

# ---- replies ----------------------------------------------------------------


class Err(Msg, tag="err"):
    """``kind``: unavailable, in_use, missing, corrupt, too_new, os, bad_request."""
    kind: str
    message: str
    errno: int = 0
    filename: str | None = None
    holder: str = ""
    held_shared: bool = False
    want_shared: bool = False


class Ok(Msg, tag="ok"):
    value: Any = None


class Item(Msg, tag="item"):
    """One result of ``ReadMany``: ``err`` None and the object file as the body, or the error."""
    err: Err | None = None


class Results(Msg, tag="results"):
    """Per-object results of a batch: a value, or the error in ``errors`` at the same index."""
    values: list[Any]
    errors: list[Err | None]


Reply = Union[Err, Ok, Item, Results]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def frame(msg: Msg, body_len: int = 0) -> bytes:
    """Prefix and header of a frame whose ``body_len`` bytes of body the caller sends next."""
    header = _encoder.encode(msg)
    return PREFIX.pack(MAGIC, len(header), body_len) + header


def parse_prefix(raw: bytes | bytearray | memoryview, max_header: int, max_body: int) -> tuple[int, int]:
    magic, hlen, blen = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"not a kvgate card frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if hlen > max_header:
        raise WireError(f"frame header of {hlen} bytes is over the limit of {max_header}")
    if blen > max_body:
        raise WireError(f"frame body of {blen} bytes is over the limit of {max_body}")
    return hlen, blen


def decode_request(raw: bytes | memoryview) -> Request:
    try:
        return _request_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"request does not decode: {e}") from None


def decode_reply(raw: bytes | memoryview) -> Reply:
    try:
        return _reply_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"reply does not decode: {e}") from None


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ``deadline`` (monotonic) bounds the whole, beside the socket's own timeout."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer sent {got} of {n} bytes in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed the connection" + (f" after {got} of {n} bytes" if got else ""))
        got += k


def recv_body(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes into memory that grows as they arrive (never ``n`` at once for a peer that lies)."""
    buf = bytearray()
    while len(buf) < n:
        start = len(buf)
        buf.extend(bytes(min(GROW_STEP, n - start)))
        recv_exact(sock, memoryview(buf)[start:], deadline)
    return buf


def send_all(sock: socket.socket, bufs: list[Any]) -> None:
    """``sendmsg`` of every buffer, whole (no joining: payloads go to the kernel from where they are).
    Over TLS, which has no ``sendmsg``, each buffer is encrypted and sent in turn."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]  # (byte views: sendmsg counts bytes)
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + 1024])
        while sent and i < len(views):
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


# ---- errors -----------------------------------------------------------------

# Errors that say the card (its filesystem), not one object, is in trouble:
# the same judgement as DirectoryCard's, for failures the server meets itself.
CARD_ERRNOS = frozenset(
    e for e in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENODEV, errno.ENXIO,
                getattr(errno, "ESTALE", None), getattr(errno, "ENOTCONN", None),
                getattr(errno, "ENOMEDIUM", None))
    if e is not None
)


def to_err(exc: BaseException) -> Err:
    """The ``Err`` a server sends for an exception of a card method."""
    if isinstance(exc, CardInUse):
        return Err("in_use", str(exc), exc.errno or 0, exc.where, exc.holder, exc.held_shared, exc.want_shared)
    if isinstance(exc, CardUnavailable):
        return Err("unavailable", exc.strerror or str(exc), exc.errno or 0, _name(exc.filename))
    if isinstance(exc, WriteAbandoned):
        return Err("abandoned", "write abandoned: its caller stopped waiting")
    if isinstance(exc, ObjectTooNew):
        return Err("too_new", str(exc))
    if isinstance(exc, ObjectMissing):
        return Err("missing", str(exc))
    if isinstance(exc, ObjectCorrupt):
        return Err("corrupt", str(exc))
    if isinstance(exc, WireError):
        return Err("bad_request", str(exc))
    if isinstance(exc, OSError):
        kind = "unavailable" if exc.errno in CARD_ERRNOS else "os"
        return Err(kind, exc.strerror or str(exc), exc.errno or errno.EIO, _name(exc.filename))
    return Err("os", f"card server error: {exc!r}", errno.EIO)


def _name(filename: Any) -> str | None:
    return filename if isinstance(filename, str) else None


def from_err(err: Err, where: str) -> BaseException:
    """The exception a client raises (or returns, in a batch) for an ``Err``; ``where``: the card's URL."""
    kind, msg = err.kind, err.message
    if kind == "in_use":
        e: BaseException = CardInUse(where, err.holder or "holder unknown", err.held_shared, err.want_shared)
    elif kind == "unavailable":
        remote = f" (on the server: {err.filename})" if err.filename else ""
        e = CardUnavailable(err.errno or errno.ENOTCONN, msg + remote, where)
    elif kind == "abandoned":
        e = WriteAbandoned(where)
    elif kind == "too_new":
        e = ObjectTooNew(msg)
    elif kind == "missing":
        e = ObjectMissing(msg)
    elif kind == "corrupt":
        e = ObjectCorrupt(msg)
    elif kind == "bad_request":
        e = CardUnavailable(errno.EPROTO, f"card server refused a request ({msg}): are client and server "
                            "the same kvgate version?", where)
    else:
        e = OSError(err.errno or errno.EIO, msg, where)
    return e
