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
from collections.abc import Sequence

import xxhash

from kvgate.errors import BadKey

MAX_NAMESPACE_BYTES = 255
MAX_KEY_BYTES = 1024
DIGEST_BYTES = 16
NO_DIALOG = bytes(DIGEST_BYTES)
MARK_KEYS = 512  # leading keys of a prompt the gateway looks at for its dialog mark (Client.dialog_mark)




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


def key_digests(fkeys: list[bytes]) -> list[bytes]:
    """``key_digest`` of many keys: a C-level map, without a Python call per key (63-79 us per 1,000 keys
    where calling ``key_digest`` took 133-142; ``benchmarks/index_probes.py``)."""
    return list(map(xxhash.xxh3_128_digest, fkeys))


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
    # Sets of the types and lengths: two C-level passes (39 us per 1,000 keys, where a generator over
    # the types and min/max over the lengths took 72).
    if keys and set(map(type, keys)) == {bytes}:
        lengths = set(map(len, keys))
        if min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES:
            return keys
    return [as_key(k) for k in keys]


class DialogMark:
    """What the gateway says about a prompt's leading keys (``Client.dialog_mark``).

    ``mark``: the conversation's mark, the first key past the shared head;
    None when every key given is part of a shared head.  ``shared``: how many
    leading keys (positions ``0 .. shared-1``) belong to heads shared by many
    dialogs, such as a system prompt.  ``heads``: where those split into
    segments (a system prompt, then a document many conversations ask
    about), as ``(first position, mark)`` pairs, the first at position 0:
    each segment is stored and looked up with its own mark, so every
    conversation finds it, and the rest with ``mark``.
    """

    __slots__ = ("mark", "shared", "heads")

    def __init__(self, mark: bytes | None, shared: int, heads: Sequence[tuple[int, bytes]] = ()):
        if shared < 0:
            raise ValueError(f"shared must be >= 0, got {shared}")
        heads = tuple((int(p), bytes(m)) for p, m in heads)
        if shared and (not heads or heads[0][0] != 0 or any(
                not a[0] < b[0] < shared for a, b in zip(heads, heads[1:]))):
            raise ValueError(f"heads must start at 0 and rise below shared ({shared}): {heads!r}")
        self.mark = mark
        self.shared = shared
        self.heads = heads if shared else ()

    def dialog_at(self, position: int) -> bytes | None:
        """The dialog to send with the key at ``position`` (-1: unknown, the conversation's)."""
        if not 0 <= position < self.shared:
            return self.mark
        mark = self.heads[0][1]
        for start, m in self.heads:
            if start > position:
                break
            mark = m
        return mark

    def spans(self, position: int, n: int) -> list[tuple[int, int, bytes | None]]:
        """Keys at positions ``position .. position+n-1`` as runs ``(start, end, dialog)``, relative to the batch."""
        if n <= 0:
            return []
        if position < 0 or position >= self.shared:
            return [(0, n, self.mark)]
        cuts = [p - position for p, _ in self.heads if position < p < position + n]
        if position + n > self.shared:
            cuts.append(self.shared - position)
        runs, start = [], 0
        for cut in cuts + [n]:
            runs.append((start, cut, self.dialog_at(position + start)))
            start = cut
        return runs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DialogMark) and (self.mark, self.shared, self.heads) == (
            other.mark, other.shared, other.heads)

    def __hash__(self) -> int:
        return hash((self.mark, self.shared, self.heads))

    def __repr__(self) -> str:
        return f"DialogMark(mark={self.mark!r}, shared={self.shared}, heads={self.heads!r})"


def payload_hasher() -> "xxhash.xxh3_64":
    """The payload hash every card header records and every reader checks (a card's read, a client
    reading a lent file), incremental: ``h.update(piece)`` per piece, then ``h.intdigest()``."""
    return xxhash.xxh3_64()


def payload_hash(view: memoryview | bytes) -> int:
    """The payload hash of a whole buffer at once.

    Through ``update``, which releases the GIL on large buffers (more than
    64 KiB in python-xxhash 4, 100 KB in 3.x), where the one-shot ``xxh3_64_intdigest``
    holds it: measured here, two threads hashing one-shot ran no faster than
    one, and the gateway's event loop waited meanwhile.
    """
    h = xxhash.xxh3_64()
    h.update(view)
    return h.intdigest()
