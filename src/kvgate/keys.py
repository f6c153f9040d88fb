"""Storage identities: namespaced keys, their digests, dialog marks, and what a namespace stands for.

A client names objects with its own keys (an engine's block hash, plus
whatever it adds: rank, fragment index, tenant salt).  The gateway never
trusts a client to stay inside its namespace: it prefixes every key with the
session's namespace itself, so two namespaces can use the same block hashes
and never meet.  The full key is what goes into each object's header; its
128-bit digest names the object on a card.

What a namespace stands for (``NamespaceBook``): an engine may say in its
hello what makes its KV what it is (model, dtype, layout, parallelism: the
inputs its namespace was derived from), so that two gateways whose engines
run one model differently can say how (``namespace_difference``) instead of
merely never finding each other's keys.
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import xxhash

from kvgate.errors import BadKey

MAX_NAMESPACE_BYTES = 255
MAX_KEY_BYTES = 1024
DIGEST_BYTES = 16
NO_DIALOG = bytes(DIGEST_BYTES)
MARK_KEYS = 512  # leading keys of a prompt the gateway looks at for its dialog mark (Client.dialog_mark)

# A key as the wire carries it, 1 to MAX_KEY_BYTES bytes: msgspec checks a whole list of them in C, in the
# protocol's decoder (a bad one is BAD_REQUEST naming its index) and in ``as_keys``.
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
_KEY_LIST = list[Key]


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


def joined_digests(fkeys: list[bytes]) -> bytes:
    """The ``key_digest`` of each key, one after the other (16 bytes each): by the compiled helper
    (``kvgate/_keys.c``) where it is built, one C loop (about 20 us per 1,000 keys, where ``key_digests``
    and a join took 75)."""
    if _keys is not None and type(fkeys) is list:
        return _keys.digests(fkeys)
    return b"".join(map(xxhash.xxh3_128_digest, fkeys))


def full_keys(namespace: bytes, keys: list[bytes]) -> list[bytes]:
    """``full_key(namespace, key)`` of every key of a checked list (``Key``s): one concatenation per
    key, in one C loop where ``kvgate/_keys.c`` is built (half the time of a list comprehension)."""
    prefix = full_key(namespace, b"")
    if _keys is not None and type(keys) is list:
        return _keys.prefixed(prefix, keys)
    return [prefix + k for k in keys]


def _load_keys_helper() -> Any:
    """The compiled ``kvgate._keys`` with python-xxhash's own XXH3_128bits (its extension exports it), or
    None where either is missing or the two disagree with ``xxhash.xxh3_128_digest`` on a probe."""
    try:
        import ctypes

        from xxhash import _xxhash  # type: ignore[attr-defined]

        from kvgate import _keys as helper  # type: ignore[attr-defined]
        helper.init(ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH3_128bits, ctypes.c_void_p).value)
    except (ImportError, OSError, AttributeError):
        return None
    probe = [b"", b"kvgate", bytes(range(256)) * 5]
    if helper.digests(probe) != b"".join(map(xxhash.xxh3_128_digest, probe)):
        return None
    return helper


_keys = _load_keys_helper()


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
    keys = keys if type(keys) is list else list(keys)
    try:
        # Types and lengths in two C-level passes (22 us per 1,000 keys, where sets of the types and of the
        # lengths took 67).  The join first: msgspec would take a str key for base64.
        b"".join(keys)
        return msgspec.convert(keys, _KEY_LIST)
    except (TypeError, msgspec.ValidationError):
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


# ---- what a namespace stands for ---------------------------------------------------

MAX_NAMESPACE_INPUTS = 64 << 10  # bytes of one namespace's inputs (a model of 100 layers names them in ~5 KiB)
NAMESPACES_KEPT = 256  # namespaces whose inputs a book keeps, the latest declared (an engine uses a few)
_SHOWN_CHARS = 80  # of a value, in a difference


def parse_namespace_inputs(text: str) -> dict[str, Any]:
    """A namespace's inputs as a hello carries them (a JSON object); ValueError naming what is wrong."""
    if len(text) > MAX_NAMESPACE_INPUTS:
        raise ValueError(f"namespace_inputs is {len(text)} characters; the limit is {MAX_NAMESPACE_INPUTS}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"namespace_inputs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"namespace_inputs must be a JSON object, not {type(value).__name__}")
    return value


def namespace_family(namespace: str) -> str:
    """The engine kind a derived namespace begins with (``vllm|model|digest``: "vllm"); "" for a name a user
    chose without one."""
    head, sep, _ = namespace.partition("|")
    return head if sep else ""


def same_model(a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]) -> bool:
    """Whether two (namespace, inputs) are of one model (then their other inputs say why their KV differs)."""
    model = a[1].get("model")
    return model is not None and model == b[1].get("model")


def namespace_difference(here: tuple[str, dict[str, Any]], there: tuple[str, dict[str, Any]]) -> str:
    """How two namespaces' inputs differ, for a log line: ``dtype (float16 here, bfloat16 there)``, each
    input that differs, in name order."""
    fam_here, fam_there = namespace_family(here[0]), namespace_family(there[0])
    if fam_here != fam_there:
        return f"engine ({fam_here or 'unnamed'} here, {fam_there or 'unnamed'} there)"
    a, b = here[1], there[1]
    out = []
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            out.append(f"{name} ({_shown(a, name)} here, {_shown(b, name)} there)")
    return ", ".join(out) or "the namespace's name only (the same inputs: a namespace set by hand on one side)"


def _shown(inputs: dict[str, Any], name: str) -> str:
    if name not in inputs:
        return "not said"
    text = json.dumps(inputs[name], sort_keys=True, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


class NamespaceBook:
    """The inputs each namespace of this gateway's engines declared (``Hello.namespace_inputs``), kept to
    show peers (``kvgate.tiers.peertier``, ``kvgate.gateway.peerserve``).

    Written on the gateway's loop (a hello), read from any thread (a peer connection's): ``declare`` puts a
    new mapping in place of the old, which readers take whole (``items``), so no reader sees half of one.
    At most ``NAMESPACES_KEPT`` namespaces, the latest declared (a gateway serves one engine).
    """

    def __init__(self, limit: int = NAMESPACES_KEPT) -> None:
        self.limit = limit
        self._lock = threading.Lock()  # (writers only)
        self._book: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.version = 0  # bumped at each new namespace (a reader that told a peer an older one tells again)

    def declare(self, namespace: str, inputs: dict[str, Any]) -> None:
        with self._lock:
            if self._book.get(namespace) == inputs:
                return
            book = OrderedDict(self._book)
            book.pop(namespace, None)
            book[namespace] = inputs
            while len(book) > self.limit:
                book.popitem(last=False)
            self._book = book
            self.version += 1

    def get(self, namespace: str) -> dict[str, Any] | None:
        return self._book.get(namespace)

    def items(self) -> dict[str, dict[str, Any]]:
        """Every namespace's inputs, as one consistent mapping (a copy: the caller's to keep)."""
        return dict(self._book)

    def foreign(self, namespace: str, theirs: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
        """When ``namespace`` (one of ours) is not among ``theirs`` (another gateway's book) but theirs has
        its model in another: (that namespace, how it differs from ours).  None when theirs has ours too,
        has no namespace of its model, or ours has no inputs declared (nothing to compare)."""
        mine = self._book.get(namespace)
        if mine is None:
            return None
        other = counterpart(namespace, mine, theirs)
        return None if other is None else (other, namespace_difference((namespace, mine), (other, theirs[other])))


def counterpart(namespace: str, inputs: dict[str, Any], others: dict[str, dict[str, Any]]) -> str | None:
    """The namespace among ``others`` of the model ``namespace`` (with ``inputs``) stands for, when
    ``namespace`` itself is not among them: the engines behind ``others`` run that model another way."""
    if namespace in others:
        return None
    for other, their_inputs in others.items():
        if same_model((namespace, inputs), (other, their_inputs)):
            return other
    return None
