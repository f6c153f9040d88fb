"""The on-card object format, shared by every card kind.

An object is a header followed by the payload:

    offset  size  field
    0       4     magic  b"KVGO"
    4       2     format version (1)
    6       2     flags (0)
    8       4     header length (fixed part + full key)
    12      2     full key length
    14      2     reserved (0)
    16      8     payload length
    24      8     created, ns since the epoch
    32      8     position of the block in its dialog (-1: unknown)
    40      16    dialog digest (zeros: none)
    56      4     CRC32C of the payload
    60      4     CRC32C of bytes 0..59 and the full key
    64      n     full key

A reader knows the full key it asked for, so it knows the header length and
can read header and payload in one ``preadv``.  A header that does not match
the key asked for, a bad header CRC, a short object or a payload CRC that
fails are all the same thing to the caller: ``ObjectCorrupt``.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import crc32c

from kvgate.keys import NO_DIALOG

MAGIC = b"KVGO"
VERSION = 1
_FIXED = struct.Struct("<4sHHIHHQQq16sI")  # everything before the header CRC
_HCRC = struct.Struct("<I")
FIXED_SIZE = _FIXED.size + _HCRC.size  # 64
assert FIXED_SIZE == 64

# Payload CRCs run piece by piece, right after each piece is read or before it
# is written, while the piece is still in the CPU cache: one pass over memory
# instead of two.
CHECKSUM_PIECE = 256 << 10


class ObjectMissing(LookupError):
    """No object under that key."""


class ObjectCorrupt(ValueError):
    """The object exists but is not a whole, correct object for this key."""


class BufferTooSmall(ValueError):
    """The destination cannot hold the payload; ``needed`` says how much it must."""

    def __init__(self, needed: int):
        super().__init__(f"object payload is {needed} bytes, destination is smaller")
        self.needed = needed


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a card keeps beside the payload, for eviction and TTL."""

    dialog: bytes = NO_DIALOG
    position: int = -1
    created_ns: int = 0


@dataclass(frozen=True, slots=True)
class Header:
    header_len: int
    payload_len: int
    payload_crc: int
    meta: ObjectMeta
    full_key: bytes


def header_size(full_key: bytes) -> int:
    return FIXED_SIZE + len(full_key)


def pack_header(full_key: bytes, payload_len: int, payload_crc: int, meta: ObjectMeta) -> bytes:
    created = meta.created_ns or time.time_ns()
    fixed = _FIXED.pack(
        MAGIC, VERSION, 0, FIXED_SIZE + len(full_key), len(full_key), 0,
        payload_len, created, meta.position, meta.dialog, payload_crc,
    )
    hcrc = crc32c.crc32c(full_key, crc32c.crc32c(fixed))
    return fixed + _HCRC.pack(hcrc) + full_key


def parse_header(buf: bytes | bytearray | memoryview, expect_key: bytes | None = None) -> Header:
    """Check and decode a header.  ``expect_key=None`` accepts any key (scans)."""
    mv = memoryview(buf)
    if len(mv) < FIXED_SIZE:
        raise ObjectCorrupt("object shorter than its header")
    (magic, version, _flags, hlen, klen, _res, plen, created, position, dialog, pcrc) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ObjectCorrupt("bad magic")
    if version != VERSION:
        raise ObjectCorrupt(f"unknown object format version {version}")
    if hlen != FIXED_SIZE + klen or len(mv) < hlen:
        raise ObjectCorrupt("bad header length")
    key = bytes(mv[FIXED_SIZE:hlen])
    (hcrc,) = _HCRC.unpack_from(mv, _FIXED.size)
    if crc32c.crc32c(key, crc32c.crc32c(mv[: _FIXED.size])) != hcrc:
        raise ObjectCorrupt("header checksum mismatch")
    if expect_key is not None and key != expect_key:
        raise ObjectCorrupt("object holds another key")
    return Header(hlen, plen, pcrc, ObjectMeta(bytes(dialog), position, created), key)


def checksum(view: memoryview | bytes, value: int = 0) -> int:
    """CRC32C (hardware, releases the GIL on large buffers)."""
    return crc32c.crc32c(view, value)
