"""Rows of fixed-size columns found by a 128-bit digest: the storage of a card's index and of its dialogs.

A card holds millions of objects.  A Python object per key (a dict entry, an
entry object, the policy's bookkeeping) cost about 1.1 KiB per object,
measured on a 100,000-object card; here an object is one row of a few numpy
columns (structure of arrays), some 50 bytes.

- Rows are dense: a removed row is replaced by the last one (``on_move``
  tells the owner), so rows ``0..n-1`` are all live and a uniform sample of
  row numbers is a uniform sample of objects (``SampledPolicy`` relies on it).
  Row numbers are therefore not stable across removals: hold digests across
  an ``await``, never row numbers.
- A digest finds its row through an open-addressing table of int32 row
  numbers (linear probing, at most half full, no tombstones: a removal
  shifts its probe run back).  The digest's low 64 bits pick the home slot:
  digests are xxh3-128 outputs, uniform already.
- Columns grow by doubling into anonymous ``mmap`` memory, so the memory of
  an outgrown column goes back to the system at once instead of staying in
  the allocator's heap (where it would count in the gateway's RSS).

Batched calls (``find``, ``add_many``) run a few numpy operations per probe
round for the whole batch: a lookup of 1,000 keys is one call, not 1,000.
Scalar calls (``find1``, ``add1``, ``remove``) serve single writes and
deletes.

Not thread-safe: one owner, one thread (the event loop for a card's index;
a pool thread may build a fresh one that the loop then takes over whole).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from kvgate.keys import DIGEST_BYTES

_DIGEST = struct.Struct("<QQ")
_MMAP_FROM = 64 << 10  # bytes; smaller columns come from the heap
# Probe rounds run batched before the few keys still probing finish one by one:
# past two rounds almost every key is answered (at most half the slots are in use).
_BATCHED_ROUNDS = 2

ColumnSpec = dict[str, "tuple[Any, int] | Any"]  # name -> dtype, or (dtype, width) for a 2-D column


def empty_array(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array; a large one in its own anonymous mapping (given back whole when freed)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dt.itemsize
    if nbytes < _MMAP_FROM:
        return np.empty(shape, dt)
    return np.frombuffer(mmap.mmap(-1, nbytes), dt, count).reshape(shape)


def split_digest(digest: bytes) -> tuple[int, int]:
    """(low, high) 64-bit halves of a 16-byte digest."""
    return _DIGEST.unpack(digest)


def join_digest(lo: int, hi: int) -> bytes:
    return _DIGEST.pack(lo, hi)


def digest_array(digests: list[bytes]) -> np.ndarray:
    """``(n, 2)`` uint64 (low, high) halves of 16-byte digests."""
    if not digests:
        return np.empty((0, 2), np.uint64)
    return np.frombuffer(b"".join(digests), "<u8").reshape(-1, 2)


class DigestRows:
    """Dense rows with a ``lo``/``hi`` digest and the owner's columns; see the module docstring.

    Columns are attributes (``rows.payload[r]``) and are replaced when the
    rows grow: look them up on the object, never keep one across an add.
    ``on_move(src, dst)`` runs after row ``src`` was copied into ``dst``
    (the last row filling a removed one).  With ``stable`` a removed row is
    left as a hole for a later add instead, and row numbers never change
    (rows are then not dense: ``n`` is a high-water mark).
    """

    MAX_LOAD = 0.5

    def __init__(self, columns: ColumnSpec, on_move: Callable[[int, int], None] | None = None,
                 capacity: int = 0, stable: bool = False) -> None:
        self._spec: dict[str, tuple[np.dtype, int]] = {"lo": (np.dtype(np.uint64), 0),
                                                        "hi": (np.dtype(np.uint64), 0)}
        for name, spec in columns.items():
            dtype, width = spec if isinstance(spec, tuple) else (spec, 0)
            self._spec[name] = (np.dtype(dtype), width)
        self.on_move = on_move
        self.n = 0
        self.cap = 0
        for name in self._spec:
            setattr(self, name, self._column(name, 0))
        self.slots = np.full(8, -1, np.int32)
        self.mask = 7
        self.stable = stable
        self._holes: list[int] = []
        if capacity:
            self._grow_rows(capacity)
            self._grow_slots(capacity)

    # ---- storage ---------------------------------------------------------------

    def _column(self, name: str, cap: int) -> np.ndarray:
        dtype, width = self._spec[name]
        return empty_array((cap, width) if width else cap, dtype)

    def _grow_rows(self, need: int) -> None:
        cap = max(16, self.cap)
        while cap < need:
            cap *= 2
        for name in self._spec:
            old = getattr(self, name)
            new = self._column(name, cap)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)
        self.cap = cap

    def _grow_slots(self, need: int) -> None:
        if self._holes:  # the table must not take holes back in: rebuild it from the live rows
            raise AssertionError("a stable table grows only while it has no holes")
        size = len(self.slots)
        while need > self.MAX_LOAD * size:
            size *= 2
        if size == len(self.slots):
            return
        slots = empty_array(size, np.int32)
        slots.fill(-1)
        self.slots, self.mask = slots, size - 1
        self._slot_all(np.arange(self.n, dtype=np.int32))

    def _reserve(self, more: int) -> None:
        need = self.n + more
        if need > self.cap:
            self._grow_rows(need)
        if need > self.MAX_LOAD * len(self.slots):
            self._grow_slots(need)

    def nbytes(self) -> int:
        """Bytes the columns and the table take (allocated, not only used)."""
        return sum(getattr(self, name).nbytes for name in self._spec) + self.slots.nbytes

    # ---- finding ---------------------------------------------------------------

    def find1(self, lo: int, hi: int) -> int:
        """The row of one digest, or -1."""
        return self._probe_from(lo & self.mask, lo, hi)

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The rows of many digests (int64, -1 where absent)."""
        n = len(lo)
        out = np.full(n, -1, np.int64)
        if n == 0 or self.n == 0:
            return out
        slots, mask = self.slots, self.mask
        pos = (lo & np.uint64(mask)).astype(np.int64)
        active = np.arange(n)
        for _ in range(_BATCHED_ROUNDS):
            r = slots[pos].astype(np.int64)
            occupied = r >= 0
            rr = np.where(occupied, r, 0)
            hit = occupied & (self.lo[rr] == lo[active]) & (self.hi[rr] == hi[active])
            out[active[hit]] = r[hit]
            go_on = occupied & ~hit
            active, pos = active[go_on], (pos[go_on] + 1) & mask
            if not active.size:
                return out
        for j, p in zip(active.tolist(), pos.tolist()):
            out[j] = self._probe_from(p, int(lo[j]), int(hi[j]))
        return out

    def _probe_from(self, i: int, lo: int, hi: int) -> int:
        slots, los, his, mask = self.slots, self.lo, self.hi, self.mask
        while True:
            r = slots.item(i)
            if r < 0:
                return -1
            if los.item(r) == lo and his.item(r) == hi:
                return r
            i = (i + 1) & mask

    def digest(self, row: int) -> bytes:
        return join_digest(self.lo.item(row), self.hi.item(row))

    def digests(self, rows: np.ndarray) -> list[bytes]:
        """The 16-byte digests of ``rows``."""
        both = np.empty((len(rows), 2), "<u8")
        both[:, 0] = self.lo[rows]
        both[:, 1] = self.hi[rows]
        raw = both.tobytes()
        return [raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]

    # ---- adding and removing ---------------------------------------------------------

    def add1(self, lo: int, hi: int) -> int:
        """A new row for a digest that has none (the caller checked); its other columns are unset."""
        if self._holes:
            r = self._holes.pop()
        else:
            self._reserve(1)
            r = self.n
            self.n = r + 1
        self.lo[r] = lo
        self.hi[r] = hi
        slots, mask = self.slots, self.mask
        i = lo & mask
        while slots.item(i) >= 0:
            i = (i + 1) & mask
        slots[i] = r
        return r

    def add_many(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """New rows for distinct digests that have none (the caller checked); returns their row numbers."""
        if self._holes:
            return np.array([self.add1(int(a), int(b)) for a, b in zip(lo.tolist(), hi.tolist())], np.int32)
        k = len(lo)
        self._reserve(k)
        rows = np.arange(self.n, self.n + k, dtype=np.int32)
        self.lo[self.n : self.n + k] = lo
        self.hi[self.n : self.n + k] = hi
        self.n += k
        self._slot_all(rows)
        return rows

    def _slot_all(self, rows: np.ndarray) -> None:
        """Put ``rows`` (absent from the table) into it, all at once: a round per probe step."""
        slots, mask = self.slots, self.mask
        pending = rows
        pos = (self.lo[rows] & np.uint64(mask)).astype(np.int64)
        while pending.size:
            free = np.flatnonzero(slots[pos] < 0)
            placed = np.zeros(len(pending), bool)
            if free.size:
                _, first = np.unique(pos[free], return_index=True)
                won = free[first]
                slots[pos[won]] = pending[won]
                placed[won] = True
            # Every key not placed now finds its slot taken (by a winner, or before): one step on.
            keep = ~placed
            pending, pos = pending[keep], (pos[keep] + 1) & mask

    def _slot_of(self, row: int) -> int:
        slots, mask = self.slots, self.mask
        i = self.lo.item(row) & mask
        while slots.item(i) != row:
            i = (i + 1) & mask
        return i

    def remove(self, row: int) -> int:
        """Remove ``row``; the last row moves into its place (``stable``: it stays a hole).  Returns the row
        that moved (-1: none did)."""
        self._unslot(self._slot_of(row))
        if self.stable:
            self._holes.append(row)
            return -1
        last = self.n - 1
        self.n = last
        if row == last:
            return -1
        for name in self._spec:
            col = getattr(self, name)
            col[row] = col[last]
        self.slots[self._slot_of(last)] = row
        if self.on_move is not None:
            self.on_move(last, row)
        return last

    def _unslot(self, i: int) -> None:
        """Empty slot ``i`` and shift the rest of its probe run back (no tombstones)."""
        slots, los, mask = self.slots, self.lo, self.mask
        j = i
        while True:
            j = (j + 1) & mask
            r = slots.item(j)
            if r < 0:
                break
            if _stays(los.item(r) & mask, i, j):
                continue
            slots[i] = r
            i = j
        slots[i] = -1

    def clear(self) -> None:
        self.n = 0
        self._holes.clear()
        self.slots.fill(-1)

    def __len__(self) -> int:
        """Rows in use."""
        return self.n - len(self._holes)


def _stays(home: int, i: int, j: int) -> bool:
    """Whether an entry at slot ``j`` whose home is ``home`` must stay when slot ``i`` empties (i before j)."""
    if i <= j:
        return i < home <= j
    return home > i or home <= j
