"""Storage identities: namespaced keys, their digests, and dialog marks.

A client names objects with its own keys (an engine's block hash, plus
whatever it adds: rank, fragment index, tenant salt).  The gateway never
trusts a client to stay inside its namespace: it prefixes every key with the
session's namespace itself, so two namespaces can use the same block hashes
and never meet.  The full key is what goes into each object's header; its
128-bit digest names the object on a card.
"""

from __future__ import annotations

import struct

import xxhash

MAX_NAMESPACE_BYTES = 255
MAX_KEY_BYTES = 1024
DIGEST_BYTES = 16
NO_DIALOG = bytes(DIGEST_BYTES)


class BadKey(ValueError):
    """A key or namespace the gateway refuses (too long, empty, wrong type)."""


def encode_namespace(namespace: str | bytes) -> bytes:
    raw = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    if not raw:
        raise BadKey("namespace must not be empty")
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise BadKey(f"namespace is {len(raw)} bytes; the limit is {MAX_NAMESPACE_BYTES}")
    return raw


def check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise BadKey("keys must be non-empty bytes")
    if len(key) > MAX_KEY_BYTES:
        raise BadKey(f"a key is {len(key)} bytes; the limit is {MAX_KEY_BYTES}")
    return bytes(key)


def full_key(namespace: bytes, key: bytes) -> bytes:
    """The storage identity: length-prefixed namespace, then the client's key.

    Length-prefixing keeps (ns="a", key="bc") apart from (ns="ab", key="c").
    """
    return struct.pack("<B", len(namespace)) + namespace + key


def split_full_key(fkey: bytes) -> tuple[bytes, bytes]:
    n = fkey[0]
    return fkey[1 : 1 + n], fkey[1 + n :]


def key_digest(fkey: bytes) -> bytes:
    """128-bit digest of a full key; names the object on a card."""
    return xxhash.xxh3_128_digest(fkey)


def dialog_digest(mark: bytes | None) -> bytes:
    """Fixed-size form of a dialog mark, as stored in object headers."""
    if not mark:
        return NO_DIALOG
    return xxhash.xxh3_128_digest(mark)


def as_key(key: bytes | str) -> bytes:
    """Client-side convenience: str keys are UTF-8."""
    return check_key(key.encode() if isinstance(key, str) else key)


def as_keys(keys) -> list[bytes]:
    """``as_key`` of a whole batch; one pass when every key is already fine bytes.

    Engines look up 1,000s of keys per scheduling step: the per-key checks
    are worth skipping when a bulk check proves them unnecessary.
    """
    keys = list(keys)
    if keys and all(type(k) is bytes for k in keys):
        lengths = list(map(len, keys))
        if min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES:
            return keys
    return [as_key(k) for k in keys]
