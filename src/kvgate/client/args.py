"""The argument checks of every client call: run before anything is sent, so a wrong argument never costs the
connection.

Each check returns the argument in the form the operations use, or raises
``InvalidArgument`` (a ``ValueError`` and a ``TypeError``; ``BadKey`` for a key)
naming the argument and what was wrong with it.  Pure functions: ``kvgate.client.core`` calls them from the
caller's thread or task before the call waits for its client.
"""

from __future__ import annotations

import ctypes
import mmap
import operator
from typing import Any

import numpy as np

from kvgate.errors import BadKey, InvalidArgument
from kvgate.keys import MAX_KEY_BYTES, as_keys
from kvgate.types import MAX_SOURCE_CHARS
from kvgate.types import RETENTION_NAMES

Buffer = Any  # anything exporting a contiguous buffer: bytes, bytearray, memoryview, numpy array, mmap
MAX_POSITION = 1 << 63  # object headers hold positions as int64: the last key's position is below this


def check_keys(keys: Any) -> list[bytes]:
    """``keys`` as a list of bytes; ``InvalidArgument`` (``BadKey``) naming the first wrong one."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(f"keys must be a list of keys, not one {type(keys).__name__} ({keys!r:.60}): "
                        "pass [key] for a single key")
    try:
        keys = list(keys)
    except TypeError:
        raise InvalidArgument(f"keys must be a list of bytes or str keys, not {type(keys).__name__}") from None
    try:
        return as_keys(keys)
    except (BadKey, UnicodeEncodeError):
        pass
    for i, k in enumerate(keys):  # name the wrong one
        if not isinstance(k, (bytes, bytearray, str)):
            raise InvalidArgument(f"keys[{i}] is {type(k).__name__}: each key must be bytes or str")
        try:
            n = len(k.encode() if isinstance(k, str) else k)
        except UnicodeEncodeError:
            raise BadKey(f"keys[{i}] is a str that UTF-8 cannot encode: pass bytes") from None
        if n == 0:
            raise BadKey(f"keys[{i}] is empty: keys must not be empty")
        if n > MAX_KEY_BYTES:
            raise BadKey(f"keys[{i}] is {n} bytes; the limit is {MAX_KEY_BYTES}")
    raise AssertionError("as_keys refused keys that each pass its checks")  # pragma: no cover


def check_dialog(dialog: Any) -> bytes | None:
    if dialog is None or type(dialog) is bytes:
        return dialog
    if isinstance(dialog, (bytes, bytearray)):
        return bytes(dialog)
    hint = ": encode it (dialog.encode())" if isinstance(dialog, str) else ""
    raise InvalidArgument(f"dialog must be bytes or None, not {type(dialog).__name__}{hint}")


def check_source(source: Any) -> str | None:
    """A request's ``source`` (``HOST:PORT`` or ``HOST`` where its KV was computed; ``kvgate.protocol``): None
    or a str of at most ``MAX_SOURCE_CHARS`` (an empty one is None)."""
    if source is None or source == "":
        return None
    if not isinstance(source, str):
        raise InvalidArgument(f"source must be a str (HOST:PORT or HOST) or None, not {type(source).__name__}")
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidArgument(f"source is {len(source)} characters; the limit is {MAX_SOURCE_CHARS} (HOST:PORT)")
    return source


def check_retention(retention: Any) -> str:
    if not isinstance(retention, str) or retention not in RETENTION_NAMES:
        raise InvalidArgument(f"retention must be one of {', '.join(map(repr, RETENTION_NAMES))}, not {retention!r}")
    return retention


def check_position(position: Any, n: int) -> int:
    if isinstance(position, bool):
        raise InvalidArgument("position must be an int, not bool")
    try:
        position = operator.index(position)
    except TypeError:
        raise InvalidArgument(f"position must be an int, not {type(position).__name__}") from None
    if position < -1 or position > MAX_POSITION - n:
        raise InvalidArgument(f"position {position} is out of range: -1 (no position), or 0 to 2**63 - {n} "
                         f"for {n} keys (positions are stored as int64)")
    return position


def writable_address(view: memoryview) -> int:
    """The address of a writable byte view (a get's destination piece), 0 for an empty one: a third of
    numpy's time (0.45 us), for a view per piece."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


class Pieces:
    """Every key's destination of a get as pieces of one buffer:
    ``get_many(keys, into=Pieces(buffer, offsets, sizes))``.

    Row i of ``offsets`` and ``sizes`` (integer arrays of one shape, keys x pieces) says where key i's bytes
    go, filled in order as ``os.readv`` fills its buffers.  Made for an engine whose pages are fragments of
    one pool (SGLang's ``layer_first`` host pool: 2 x layers fragments a page): the pieces are checked
    against the buffer in one vectorised pass here, and where the client may read the gateway's memory a
    get reads into them with no Python step per piece.  A hit's entry in the get's result is the number of
    bytes written (views of the pieces would cost an object each).  Raises ``InvalidArgument`` naming the
    first piece that is not inside the buffer."""

    __slots__ = ("view", "offsets", "sizes")

    def __init__(self, buffer: Buffer, offsets: Any, sizes: Any):
        self.view = _byte_view(buffer, "the buffer of Pieces", writable=True)
        offsets, sizes = np.asarray(offsets), np.asarray(sizes)
        for name, a in (("offsets", offsets), ("sizes", sizes)):
            if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
                raise InvalidArgument(f"Pieces' {name} must be a 2-D integer array (keys x pieces), not "
                                      f"{a.ndim}-D {a.dtype}")
        if offsets.shape != sizes.shape or not sizes.shape[1]:
            raise InvalidArgument(f"Pieces' offsets {offsets.shape} and sizes {sizes.shape} must be of one shape, "
                                  "with at least one piece a key")
        n = self.view.nbytes
        # as int64: a uint64 past it wraps negative and is refused as such; no sum that could overflow
        offsets, sizes = offsets.astype(np.int64), sizes.astype(np.int64)
        bad = (offsets < 0) | (offsets > n) | (sizes < 0) | (sizes > n - np.clip(offsets, 0, n))
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise InvalidArgument(f"Pieces: piece [{i}][{j}] (offset {offsets[i, j]}, {sizes[i, j]} bytes) is "
                                  f"not inside the buffer of {n} bytes")
        empty = np.flatnonzero(sizes.sum(axis=1) == 0)
        if len(empty):
            raise InvalidArgument(f"Pieces: row {int(empty[0])} has no bytes: each key needs a destination")
        self.offsets, self.sizes = offsets, sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, rows: slice) -> Pieces:
        """Some rows (a slice), as a ``Pieces`` of the same buffer (not checked again)."""
        if not isinstance(rows, slice):
            raise InvalidArgument(f"Pieces are sliced by rows (pieces[a:b]), not indexed by {type(rows).__name__}")
        out = object.__new__(Pieces)
        out.view, out.offsets, out.sizes = self.view, self.offsets[rows], self.sizes[rows]
        return out

    def scatters(self) -> list[Scatter]:
        """One ``Scatter`` a row, each holding its row of iovecs (one array made for all of them)."""
        base = writable_address(self.view)
        iov = np.stack([self.offsets.astype(np.uint64) + np.uint64(base), self.sizes.astype(np.uint64)], axis=-1)
        return [Scatter(iov=row, owner=self.view, nbytes=t) for row, t in zip(iov, self.sizes.sum(axis=1).tolist())]


class Scatter:
    """One object's destination in pieces, filled in order (as ``os.readv`` fills its buffers): a get's
    ``into`` entry that is a list of buffers (``parts``, their flat byte views), or one row of a ``Pieces``
    (``owner``, the buffer, and ``iov``, its pieces' (address, length) rows).  ``nbytes``: their total.
    Each form makes the other on first use: the iovecs for a cross-memory read, the views for a copy out
    of the session region."""

    __slots__ = ("nbytes", "_parts", "_iov", "_owner")

    def __init__(self, parts: list[memoryview] | None = None, *, iov: np.ndarray | None = None,
                 owner: memoryview | None = None, nbytes: int = 0):
        self._parts, self._iov, self._owner = parts, iov, owner
        self.nbytes = sum(p.nbytes for p in parts) if parts is not None else nbytes

    @property
    def parts(self) -> list[memoryview]:
        if self._parts is None:
            assert self._owner is not None and self._iov is not None
            base = writable_address(self._owner)
            self._parts = [self._owner[a - base:a - base + n] for a, n in self._iov.tolist()]
        return self._parts

    def iov(self, n: int) -> np.ndarray:
        """The iovecs (an (k, 2) uint64 array) of the pieces the first ``n`` bytes fill, the last one cut."""
        if self._iov is None:
            self._iov = np.array([(writable_address(p), p.nbytes) for p in self._parts or ()],
                                 dtype=np.uint64).reshape(-1, 2)
        if n == self.nbytes:
            return self._iov
        ends = np.cumsum(self._iov[:, 1], dtype=np.int64)
        j = int(np.searchsorted(ends, n, "left")) + 1 if n else 0
        out = self._iov[:j].copy()
        if j:
            out[-1, 1] -= np.uint64(int(ends[j - 1]) - n)
        return out

    def filled(self, n: int) -> list[memoryview]:
        """The parts the first ``n`` bytes fill, the last one cut to what it holds."""
        if n == self.nbytes:
            return list(self.parts)  # a copy: the caller may change it
        out = []
        for p in self.parts:
            if n <= 0:
                break
            out.append(p[:n])
            n -= p.nbytes
        return out

    def result(self, n: int) -> list[memoryview] | int:
        """What a get returns for ``n`` bytes written here: the filled parts, or (a ``Pieces`` row) ``n``."""
        return n if self._owner is not None else self.filled(n)


def byte_views(buffers: Any, what: str, n: int, writable: bool, *,
               scatter: bool = False) -> list[memoryview] | list[memoryview | Scatter]:
    """One flat byte view per buffer, checked: ``n`` of them, contiguous, writable when ``writable``.
    ``scatter``: an entry that is a list (or tuple) of buffers is a ``Scatter`` of their views, and
    ``buffers`` may be a ``Pieces`` (a ``Scatter`` a row)."""
    if scatter and isinstance(buffers, Pieces):
        if len(buffers) != n:
            raise InvalidArgument(f"{n} keys but {len(buffers)} rows of Pieces: pass one row per key")
        return buffers.scatters()
    if isinstance(buffers, (bytes, bytearray, memoryview, str, mmap.mmap)) or \
            (isinstance(buffers, np.ndarray) and buffers.ndim <= 1 and buffers.dtype != object):
        raise InvalidArgument(f"{what} must be a list of buffers, one per key, not one {type(buffers).__name__}: "
                        "pass [buffer] for a single key")
    try:
        buffers = list(buffers)
    except TypeError:
        raise InvalidArgument(f"{what} must be a list of buffers, one per key, not {type(buffers).__name__}") from None
    if len(buffers) != n:
        raise InvalidArgument(f"{n} keys but {len(buffers)} {what}: pass one per key")
    views: list = []
    for i, b in enumerate(buffers):
        if scatter and isinstance(b, (list, tuple)):
            parts = [p if type(p) is memoryview and p.format == "B" and p.ndim == 1 and p.c_contiguous
                     and not (writable and p.readonly) else _byte_view(p, f"{what}[{i}][{j}]", writable)
                     for j, p in enumerate(b)]  # (inline: a list may hold thousands)
            if not parts:
                raise InvalidArgument(f"{what}[{i}] is an empty list: pass the buffers its object fills, in order")
            views.append(Scatter(parts))
        else:
            views.append(_byte_view(b, f"{what}[{i}]", writable))
    return views


def _byte_view(b: Any, name: str, writable: bool) -> memoryview:
    try:
        v = memoryview(b)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{name} is {type(b).__name__}, not a buffer ({e}): pass bytes, bytearray, "
                              "memoryview, a numpy array or an mmap") from None
    if not v.c_contiguous:
        raise InvalidArgument(f"{name} is not contiguous: pass a contiguous buffer (numpy.ascontiguousarray)")
    if writable and v.readonly:
        raise InvalidArgument(f"{name} is read-only: a destination must be writable")
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")
