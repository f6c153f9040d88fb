"""Rows of fixed-size columns found by a 128-bit digest: the storage of a card's index and of its dialogs.

A card holds millions of objects.  A Python object per key (a dict entry, an
entry object, the policy's bookkeeping) cost about 1.1 KiB per object,
measured on a 100,000-object card; here an object is one row of a few numpy
columns (structure of arrays), some 60 bytes.

- Rows are dense: a removed row is replaced by the last one (``on_move``
  tells the owner), so rows ``0..n-1`` are all live and a uniform sample of
  row numbers is a uniform sample of objects (``SampledPolicy`` relies on it).
  Row numbers are therefore not stable across removals: hold digests across
  an ``await``, never row numbers.
- A digest finds its row through an open-addressing table of int32 row
  numbers (linear probing, at most half full, no tombstones: a removal
  shifts its probe run back).  A slot holds the row number + 1, so 0 is
  empty and a new table needs no page written before use.  The digest's low 64 bits pick the home slot:
  digests are xxh3-128 outputs, uniform already.
- Growing never stops the loop for long.  Past ``RESERVE_FROM`` rows the
  columns live in address space reserved for ``RESERVE_ROWS`` rows
  (``MAP_NORESERVE``: a page costs memory only once written), so they grow
  without a copy; copying a million rows' columns took 140 ms.  The table
  doubles by migration instead of a rebuild (250 ms at a million rows): the
  new table takes new digests at once, the old one is still probed and
  moves into the new one a stretch at a time with each add and each
  ``find``.
- Columns below ``RESERVE_FROM`` rows grow by doubling; those of 64 KiB and
  more get anonymous mappings of their own, so an outgrown one goes back to
  the system at once instead of staying in the allocator's heap.

Batched calls (``find``, ``add_many``) run a few numpy operations per probe
round for the whole batch: a lookup of 1,000 keys is one call, not 1,000.
Scalar calls (``find1``, ``add1``, ``remove``) serve single writes and
deletes.

Not thread-safe: one owner, one thread (the event loop for a card's index;
a pool thread may build a fresh one that the loop then takes over whole).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kvgate import native
from kvgate.keys import DIGEST_BYTES, joined_digests

_DIGEST = struct.Struct("<QQ")
_MMAP_FROM = 64 << 10  # bytes; smaller columns come from the heap
# Probe rounds run batched until this few keys are still probing; those finish one by one in Python.
# Stopping after two rounds instead left a lookup's misses (their runs end at an empty slot, 2.5 probes
# on average at half load) to Python: 1,000 keys in a 200,000-row index took 0.66 ms when none was
# there, 0.25-0.30 ms this way (hits: 0.20-0.37 ms, now 0.14-0.17; benchmarks/index_probes.py).
_PROBED_ONE_BY_ONE = 8
# A batch is probed one slot for _ROUNDS rounds (four keys in five end there at half load), then what is
# left _WINDOW slots at once: each round is some twenty numpy calls of fixed cost, however few keys are
# left, and at 0.49 load a run is up to a dozen slots long.  1,000 keys (benchmarks/index_probes.py, medians
# in one run): present in a 1,000-row table 205 -> 119 us, absent 277 -> 150; in 200,000 rows present
# 102 -> 104, absent 247 -> 154 (2 rounds and 16 slots, or 3 and 8, measured no better).
_ROUNDS = 1
_WINDOW = 8
_STEPS = np.arange(_WINDOW)
# A slot holds its row's number + 1: 0 is empty, so a fresh mapping is an empty table with no page written.
_EMPTY = 0
_MOVED = -1  # an old table's slot whose row moved to the new table: probing goes on past it
RESERVE_FROM = 1 << 16  # rows
RESERVE_ROWS = 1 << 26  # rows of address space a large table's columns reserve (64 M: 4 GiB of it, unwritten)
MIGRATE_FROM = 1 << 16  # slots; a smaller table is rebuilt at once
# Fewer new rows than this are added one by one: the batched insert is some twenty numpy calls of fixed
# cost (into 100,000 rows: 32 digests 151 us batched where 46 one by one, 128 about even, 512 232 us
# where 392).
_ADDED_ONE_BY_ONE = 128
MIGRATE_PER_ADD = 64  # old slots moved with each add (the new table is full only after 4x as many adds)
MIGRATE_PER_FIND = 8192  # old slots moved with each batched find (a few hundred microseconds)
# Linux's MAP_NORESERVE (0x4000 on x86 and ARM; the mmap module does not name it before Python 3.13).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


def _load_probe() -> Any:
    """The compiled batch probe (``kvgate/_probe.c``): 1,000 digests found in a few microseconds where the
    numpy rounds of ``DigestRows._find_in`` take 100-200; None where it is not built (the numpy path
    answers the same)."""
    lib = native.load("_probe", keep_gil=True)  # a call of microseconds, on the event loop
    if lib is None:
        return None
    fn = lib.kvgate_probe_many
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    return fn


_probe_many = _load_probe()


def _probe_many_ok(half: np.ndarray) -> bool:
    """Whether the compiled probe can read ``half`` in place: uint64, one dimension, whole elements apart."""
    return (isinstance(half, np.ndarray) and half.dtype == np.uint64 and half.ndim == 1
            and half.strides[0] % 8 == 0)


ColumnSpec = dict[str, "tuple[Any, int] | Any"]  # name -> dtype, or (dtype, width) for a 2-D column


def empty_array(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array; a large one in its own anonymous mapping (given back whole when freed)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dt.itemsize
    if nbytes < _MMAP_FROM:
        return np.empty(shape, dt)
    return np.frombuffer(mmap.mmap(-1, nbytes), dt, count).reshape(shape)


def zeroed_array(size: int, dtype: Any) -> np.ndarray:
    """Zeros; a large array in its own fresh mapping, whose pages are written only as they are used."""
    dt = np.dtype(dtype)
    if size * dt.itemsize < _MMAP_FROM:
        return np.zeros(size, dt)
    return np.frombuffer(mmap.mmap(-1, size * dt.itemsize), dt, size)


def reserved_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """Zeroed address space for ``shape`` that costs memory only where written; None where it cannot be had."""
    if not _NORESERVE:
        return None
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    try:
        m = mmap.mmap(-1, count * dt.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except (OSError, ValueError):
        return None
    return np.frombuffer(m, dt, count).reshape(shape)


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


def key_digest_array(fkeys: list[bytes]) -> np.ndarray:
    """``digest_array(key_digests(fkeys))`` in one pass (``kvgate.keys.joined_digests``)."""
    return np.frombuffer(joined_digests(fkeys), "<u8").reshape(-1, 2)


def unique_digests(digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``(n, 2)`` digests and each row's index among them.

    By the high half alone, checked against the low half: a sort of one
    column, where ``np.unique(axis=0)`` took a second for a million rows.
    """
    hi_values, inv = np.unique(digests[:, 1], return_inverse=True)
    inv = inv.ravel()
    first = np.zeros(len(hi_values), np.int64)
    first[inv[::-1]] = np.arange(len(inv))[::-1]  # a row of each distinct high half
    if (digests[first[inv], 0] == digests[:, 0]).all():
        return digests[first], inv
    uniq, inv = np.unique(digests, axis=0, return_inverse=True)  # two digests share a high half: rare
    return uniq, inv.ravel()


class DigestRows:
    """Dense rows with a ``lo``/``hi`` digest and the owner's columns; see the module docstring.

    Owned by one ``CardIndex`` (or a ``SampledPolicy``'s dialog table) and
    called on the event loop only; nothing here does I/O, and a call costs
    microseconds (``find`` of 1,000 digests: about 0.25 ms).

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
        self.row_bytes = sum(dt.itemsize * (width or 1) for dt, width in self._spec.values())
        self.on_move = on_move
        self.n = 0
        self.cap = 0
        for name in self._spec:
            setattr(self, name, self._column(name, 0))
        self.slots = np.zeros(8, np.int32)
        self.mask = 7
        # While the table doubles: the table being emptied into ``slots``, and how far it is.
        self._old: np.ndarray | None = None
        self._old_mask = 0
        self._migrated = 0
        self.stable = stable
        self._holes: list[int] = []
        if capacity:
            self._grow_rows(capacity)
            self._grow_slots(capacity)

    # ---- storage ---------------------------------------------------------------

    def _column(self, name: str, cap: int, reserved: bool = False) -> np.ndarray | None:
        dtype, width = self._spec[name]
        shape = (cap, width) if width else (cap,)
        return reserved_array(shape, dtype) if reserved else empty_array(shape, dtype)

    def _grow_rows(self, need: int) -> None:
        cap = max(16, self.cap)
        while cap < need:
            cap *= 2
        reserved: dict[str, np.ndarray | None] = {}
        if cap > RESERVE_FROM:  # once; after that a copy only past RESERVE_ROWS
            big = max(cap, RESERVE_ROWS)
            reserved = {name: self._column(name, big, reserved=True) for name in self._spec}
            if all(col is not None for col in reserved.values()):
                cap = big
            else:  # no reserved address space here: plain doubling
                reserved = {}
        for name in self._spec:
            old = getattr(self, name)
            col = reserved.get(name)
            if col is None:
                col = self._column(name, cap)
            col[: self.n] = old[: self.n]
            setattr(self, name, col)
        self.cap = cap

    def _grow_slots(self, need: int) -> None:
        if self._holes:  # the table must not take holes back in: rebuild it from the live rows
            raise AssertionError("a stable table grows only while it has no holes")
        size = len(self.slots)
        while need > self.MAX_LOAD * size:
            size *= 2
        if size == len(self.slots):
            return
        self._finish_migration()
        slots = zeroed_array(size, np.int32)
        if len(self.slots) < MIGRATE_FROM:
            self.slots, self.mask = slots, size - 1
            self._slot_all(np.arange(self.n, dtype=np.int32))
            return
        self._old, self._old_mask, self._migrated = self.slots, self.mask, 0
        self.slots, self.mask = slots, size - 1

    def migrate(self, count: int) -> None:
        """Move up to ``count`` slots of the old table into the new one (while the table doubles)."""
        old = self._old
        if old is None:
            return
        start, stop = self._migrated, min(self._migrated + count, len(old))
        stretch = old[start:stop]
        live = stretch > 0
        rows = stretch[live] - 1
        stretch[live] = _MOVED  # empty slots stay empty: they end the old table's probe runs
        self._migrated = stop
        if rows.size:
            self._slot_all(rows.astype(np.int32))
        if stop == len(old):
            self._old = None

    def _finish_migration(self) -> None:
        if self._old is not None:
            self.migrate(len(self._old))

    def _reserve(self, more: int) -> None:
        need = self.n + more
        if need > self.cap:
            self._grow_rows(need)
        if need > self.MAX_LOAD * len(self.slots):
            self._grow_slots(need)

    def nbytes(self) -> int:
        """Bytes the rows in use and the tables take."""
        return self.n * self.row_bytes + self.slots.nbytes + (self._old.nbytes if self._old is not None else 0)

    # ---- finding ---------------------------------------------------------------

    def find1(self, lo: int, hi: int) -> int:
        """The row of one digest, or -1."""
        r = self._probe(self.slots, lo & self.mask, lo, hi)
        if r < 0 and self._old is not None:
            r = self._probe(self._old, lo & self._old_mask, lo, hi)
        return r

    def _probe(self, slots: np.ndarray, i: int, lo: int, hi: int) -> int:
        los, his, mask = self.lo, self.hi, len(slots) - 1
        while True:
            v = slots.item(i)
            if v == _EMPTY:
                return -1
            if v > 0 and los.item(v - 1) == lo and his.item(v - 1) == hi:
                return v - 1
            i = (i + 1) & mask

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The rows of many digests (int64, -1 where absent)."""
        n = len(lo)
        out = np.full(n, -1, np.int64)
        if n == 0 or self.n == 0:
            return out
        if self._old is not None:
            self.migrate(MIGRATE_PER_FIND)
        if _probe_many is not None and _probe_many_ok(lo) and _probe_many_ok(hi):
            old = self._old
            _probe_many(self.slots.ctypes.data, self.mask, None if old is None else old.ctypes.data, self._old_mask,
                        self.lo.ctypes.data, self.hi.ctypes.data, lo.ctypes.data, lo.strides[0] // 8,
                        hi.ctypes.data, hi.strides[0] // 8, n, out.ctypes.data)
            return out
        self._find_in(self.slots, lo, hi, np.arange(n), out)
        if self._old is not None:
            self._find_in(self._old, lo, hi, np.flatnonzero(out < 0), out)
        return out

    def _find_in(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray, active: np.ndarray,
                 out: np.ndarray) -> None:
        mask = len(slots) - 1
        los, his = self.lo, self.hi
        a_lo, a_hi = lo[active], hi[active]  # the digests still probed, carried along (not gathered each round)
        pos = (a_lo & np.uint64(mask)).astype(np.intp)
        rounds = 0
        while active.size > _PROBED_ONE_BY_ONE and rounds < _ROUNDS:
            v = slots[pos].astype(np.intp)  # (gathers by an intp index: an int32 one is converted on each)
            rr = np.maximum(v - 1, 0)  # (empty and moved slots point at row 0: their ``hit`` is masked off)
            hit = (v > 0) & (los[rr] == a_lo) & (his[rr] == a_hi)
            out[active[hit]] = rr[hit]
            go_on = (v != _EMPTY) & ~hit
            active, pos, a_lo, a_hi = active[go_on], (pos[go_on] + 1) & mask, a_lo[go_on], a_hi[go_on]
            rounds += 1
        if active.size > _PROBED_ONE_BY_ONE:
            # The tail (a tenth of the keys, on probe runs up to a dozen slots at half load): the next
            # _WINDOW slots of each at once, the first hit or empty slot of each row ends its probe.
            k = np.arange(active.size)
            v = slots[(pos[:, None] + _STEPS) & mask].astype(np.intp)
            rr = np.maximum(v - 1, 0)
            hit = (v > 0) & (los[rr] == a_lo[:, None]) & (his[rr] == a_hi[:, None])
            stop = hit | (v == _EMPTY)
            first = stop.argmax(axis=1)
            ended, found = stop[k, first], hit[k, first]
            out[active[found]] = rr[k[found], first[found]]
            rest = ~ended  # no hit nor empty slot in the window: probed on one by one past it
            active, pos, a_lo, a_hi = active[rest], (pos[rest] + _WINDOW) & mask, a_lo[rest], a_hi[rest]
        for j, p, dlo, dhi in zip(active.tolist(), pos.tolist(), a_lo.tolist(), a_hi.tolist()):
            out[j] = self._probe(slots, p, dlo, dhi)

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
        while slots.item(i) != _EMPTY:
            i = (i + 1) & mask
        slots[i] = r + 1
        if self._old is not None:
            self.migrate(MIGRATE_PER_ADD)
        return r

    def add_many(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """New rows for distinct digests that have none (the caller checked); returns their row numbers."""
        if self._holes or len(lo) < _ADDED_ONE_BY_ONE:
            return np.array([self.add1(int(a), int(b)) for a, b in zip(lo.tolist(), hi.tolist())], np.int32)
        k = len(lo)
        self._reserve(k)
        self._finish_migration()
        rows = np.arange(self.n, self.n + k, dtype=np.int32)
        self.lo[self.n : self.n + k] = lo
        self.hi[self.n : self.n + k] = hi
        self.n += k
        self._slot_all(rows)
        return rows

    def _slot_all(self, rows: np.ndarray) -> None:
        """Put ``rows`` (absent from the new table) into it, all at once."""
        slots, mask = self.slots, self.mask
        pending = rows
        pos = (self.lo[rows] & np.uint64(mask)).astype(np.int64)
        if len(rows) > 4096 and not slots.any():
            # An empty table (a load, a rebuild): in order of home slot, each row takes the first
            # slot at or past its home that the rows before it left free, which is what inserting
            # them one by one in that order gives.  One sort instead of a round per probe step.
            order = np.argsort(pos, kind="stable")
            home = pos[order]
            step = np.arange(len(home))
            at = np.maximum.accumulate(home - step) + step
            fits = at <= mask
            slots[at[fits]] = rows[order[fits]] + 1
            pending, pos = rows[order[~fits]], np.zeros(int((~fits).sum()), np.int64)  # past the end: wrap
        # A round per probe step: every row tries its slot, one winner per slot, the rest move on.
        while pending.size:
            free = np.flatnonzero(slots[pos] == _EMPTY)
            placed = np.zeros(len(pending), bool)
            if free.size:
                _, first = np.unique(pos[free], return_index=True)
                won = free[first]
                slots[pos[won]] = pending[won] + 1
                placed[won] = True
            # Every key not placed now finds its slot taken (by a winner, or before): one step on.
            keep = ~placed
            pending, pos = pending[keep], (pos[keep] + 1) & mask

    def _slot_of(self, row: int) -> tuple[np.ndarray, int]:
        """(table, slot) that holds ``row``."""
        lo = self.lo.item(row)
        for slots in (self.slots, self._old):
            if slots is None:
                continue
            mask = len(slots) - 1
            i = lo & mask
            while True:
                v = slots.item(i)
                if v == row + 1:
                    return slots, i
                if v == _EMPTY:
                    break
                i = (i + 1) & mask
        raise KeyError(row)

    def remove(self, row: int) -> int:
        """Remove ``row``; the last row moves into its place (``stable``: it stays a hole).  Returns the row
        that moved (-1: none did)."""
        slots, i = self._slot_of(row)
        if slots is self.slots:
            self._unslot(i)
        else:  # in the old table: probing must go on past it
            slots[i] = _MOVED
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
        slots, i = self._slot_of(last)
        slots[i] = row + 1
        if self.on_move is not None:
            self.on_move(last, row)
        return last

    def _unslot(self, i: int) -> None:
        """Empty slot ``i`` of the new table and shift the rest of its probe run back (no tombstones)."""
        slots, los, mask = self.slots, self.lo, self.mask
        j = i
        while True:
            j = (j + 1) & mask
            v = slots.item(j)
            if v == _EMPTY:
                break
            if _stays(los.item(v - 1) & mask, i, j):
                continue
            slots[i] = v
            i = j
        slots[i] = _EMPTY

    def clear(self) -> None:
        self.n = 0
        self._holes.clear()
        self._old = None
        self.slots[:] = _EMPTY

    def __len__(self) -> int:
        """Rows in use."""
        return self.n - len(self._holes)


def _stays(home: int, i: int, j: int) -> bool:
    """Whether an entry at slot ``j`` whose home is ``home`` must stay when slot ``i`` empties (i before j)."""
    if i <= j:
        return i < home <= j
    return home > i or home <= j
