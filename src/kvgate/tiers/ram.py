"""The RAM tier's memory (``RamPages``): a bounded, preallocated, paged store of KV blocks.

Why preallocated: first-touch anonymous memory fills at about 0.5 GiB/s on
the gateway's machines (every 4 KiB page is a fault and a zeroing), while
memory that is already mapped copies at more than 10 GiB/s.  So the whole
arena is mapped and touched once at start, and blocks live in pages of it
forever after; nothing is allocated per block.

Why pages: blocks of one model are all the same size, so a fixed page size
(256 KiB by default) wastes little and makes allocation a list pop.  Free
pages are a stack that hands out increasing indices and takes freed runs back
in reverse, so the next object of the same size gets the same contiguous run:
uniform workloads keep one extent (one ``memcpy``) per object.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
import weakref
from typing import Callable, Iterator, Sequence

import numpy as np

from kvgate import memcopy
from kvgate.cards.objectformat import ObjectMeta
from kvgate.config import size_text
from kvgate.tiers.eviction import EvictionPolicy, Retention
from kvgate.tiers.policies import make_policy
from kvgate.tiers.events import CLEARED, RAM_TIER, REMOVED, STORED, TierChanges
from kvgate.tiers.usage import NamespaceUsage
from kvgate.errors import KvgateError

class RamTooLarge(KvgateError, MemoryError):
    """The arena asked for does not fit this machine's memory (the message says how much it has)."""


def machine_memory() -> tuple[int, int]:
    """This machine's memory and what of it is available now (``MemTotal``, ``MemAvailable``), in bytes; 0, 0
    where ``/proc/meminfo`` cannot be read."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return 0, 0
    return found.get("MemTotal", 0), found.get("MemAvailable", 0)


def _too_large(size: int, why: str) -> RamTooLarge:
    total, available = machine_memory()
    has = f"this machine has {size_text(total)} of memory, {size_text(available)} available now" if total else \
        "this machine's memory could not be read"
    return RamTooLarge(f"a RAM tier of {size_text(size)} {why}; {has}")


_RESERVED = 0  # pages held, invisible to lookups
_VISIBLE = 1  # committed: found by pin/contains
_DROPPED = 2  # deleted, replaced or cleared while pinned: pages freed at last unpin
_FREED = 3  # pages back on the free stack


def _map_arena(size: int, shared: bool) -> tuple[mmap.mmap, int | None]:
    """The arena's memory, and a read-only descriptor of it (None: private memory, nothing to share).

    A memfd, sealed against shrinking and growing, so that a client of the gateway's own user may map it
    read-only and copy a get's pieces out of it itself (``kvgate.client.crossmem``): a memcpy, where
    ``process_vm_readv`` out of the same pages runs at 0.66 of one on these machines (7.1 ms against
    4.7 for 64 MiB, even from huge pages).  Such a client could read any of the gateway's memory anyway
    (kvgate.gateway.lending); the seals keep one that writes through the descriptor from shrinking the
    arena under the gateway (a SIGBUS), the descriptor lent is a read-only one.  Shared memory has no huge
    pages where the kernel keeps them from shmem (``shmem_enabled``: never, the default): the gateway's own
    copies in and out of the arena measured the same either way (``kvgate bench``'s RAM rows).  Without
    memfds (or ``/proc`` to reopen one read-only), or not ``shared`` (config ``shared_ram_arena``: a
    client's resident size counts the arena's pages it has read), private memory in huge pages.
    """
    fd = -1
    if shared:
        try:
            fd = os.memfd_create("kvgate-ram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            pass
    if fd >= 0:
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            reader = -1
        try:
            if reader >= 0:
                try:
                    return mmap.mmap(fd, size), reader
                except OSError:
                    os.close(reader)
                    raise
        finally:
            os.close(fd)  # the mapping (and the reader) keep it
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no transparent huge pages here: 4 KiB pages
    return mm, None


class Entry:
    """One object in the RAM tier, or a reservation for one (``Reservation``).

    ``extents`` are ``(start_page, n_pages)`` runs of the arena; together they
    hold ``size`` bytes, the last run possibly only partly used.  An object of
    size 0 holds no pages and has no extents.
    """

    __slots__ = ("full_key", "size", "meta", "klass", "extents", "pins", "_state", "_tier")

    def __init__(self, tier: RamPages, full_key: bytes, size: int, meta: ObjectMeta, klass: int,
                 extents: tuple[tuple[int, int], ...]):
        self.full_key = full_key
        self.size = size
        self.meta = meta
        self.klass = klass
        self.extents = extents
        self.pins = 0
        self._state = _RESERVED
        self._tier = tier

    @property
    def n_pages(self) -> int:
        return sum(n for _, n in self.extents)

    @property
    def visible(self) -> bool:
        return self._state == _VISIBLE

    def views(self) -> list[memoryview]:
        """One writable memoryview per extent, exactly ``size`` bytes in all.

        Safe to call from a copy thread: it reads only this entry's immutable
        extents and the arena, never the tier's bookkeeping.
        """
        if self._state == _FREED:
            raise ValueError("entry's pages were freed; pin it before using its views")
        page_size = self._tier.page_size
        arena = self._tier._mv
        out: list[memoryview] = []
        left = self.size
        for start, n in self.extents:
            length = min(n * page_size, left)
            begin = start * page_size
            out.append(arena[begin : begin + length])
            left -= length
        return out

    def __repr__(self) -> str:
        state = ("reserved", "visible", "dropped", "freed")[self._state]
        return f"<Entry {self.full_key!r} {self.size}B {state} pins={self.pins} extents={self.extents}>"


# A reservation is an entry that is not committed yet: same object, so commit
# just makes it visible.
Reservation = Entry


class RamPages:
    """The RAM tier's memory: preallocated pages, the entries in them, and policy-driven eviction
    (``kvgate.tiers.ramtier.RamTier`` is the tier the store asks, built on it).

    Threading contract: every method of this class (reserve, commit, abort,
    pin, unpin, delete, clear, the counters...) is called from ONE thread, the
    gateway's event loop, so the bookkeeping takes no locks.  Only the byte
    copies into a reservation's views or out of a pinned entry's views run in
    other threads (the I/O pool), with ``copy_into``/``copy_out``.  For those
    copies to be safe, the pages they touch must stay put:

    - a reservation is invisible to lookups and unknown to the eviction
      policy until ``commit``, so nothing can evict or replace it while it is
      being filled;
    - ``pin`` holds a visible entry: the policy never chooses it, and a
      ``delete``, replacing ``commit`` or ``clear`` makes it invisible at
      once but frees its pages only at its last ``unpin``.

    ``capacity`` is rounded down to whole pages; 0 (or less than a page)
    disables the tier: every ``reserve`` returns None.

    ``ttl`` (seconds, None: none): an entry whose ``meta.created_ns`` is
    older is a miss for ``pin``, ``contains`` and ``size_of``, which drop it
    on the spot (and tell ``on_expired``), so every way of asking agrees.

    ``changes``: where entries made visible (``stored``), dropped (``removed``:
    evicted, deleted, expired) and cleared are noted, as tier ``"ram"``
    (``kvgate.tiers.events``); a commit that replaces its key's entry is a
    ``stored`` only.  With nobody listening that is one attribute check.

    ``shared``: the arena lives in a sealed memfd that ``shared`` hands out for local clients to map
    read-only (``_map_arena``); otherwise, and where that cannot be, private memory.
    """

    def __init__(self, capacity: int, page_size: int = 256 << 10, policy: str = "prefix", ttl: float | None = None,
                 on_expired: Callable[[int], None] = lambda n: None, usage: NamespaceUsage | None = None,
                 changes: TierChanges | None = None, shared: bool = False):
        self.usage = usage if usage is not None else NamespaceUsage()
        self.changes = changes if changes is not None else TierChanges()
        if capacity < 0:
            raise ValueError("capacity cannot be negative")
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.ttl_ns = None if ttl is None else int(ttl * 1e9)
        self.on_expired = on_expired
        self.total_pages = capacity // page_size
        self.policy: EvictionPolicy = make_policy(policy)
        if self.total_pages:
            size = self.total_pages * page_size
            # Every page is touched below: an arena beyond the machine's memory would not fail here but
            # bring the OOM killer to this process (or another) while it starts.
            if size > machine_memory()[0] > 0:
                raise _too_large(size, "is more than the machine's memory")
            try:
                self._mm, self._shared_fd = _map_arena(size, shared)
            except OSError as e:  # ENOMEM: the kernel's overcommit rule, a ulimit -v, a cgroup
                raise _too_large(size, f"cannot be mapped ({e.strerror or e})") from None
            if self._shared_fd is not None:
                weakref.finalize(self, os.close, self._shared_fd)
            self._arena = np.frombuffer(self._mm, dtype=np.uint8)
            # Fault every page in now, while nobody waits (see module docstring).
            self._arena[:: mmap.PAGESIZE] = 0
            self._mv = memoryview(self._mm)
        else:
            self._mm, self._shared_fd = None, None
            self._arena = np.zeros(0, dtype=np.uint8)
            self._mv = memoryview(bytearray())
        # Popping from the end yields pages 0, 1, 2, ... on a fresh tier.
        self._free: list[int] = list(range(self.total_pages - 1, -1, -1))
        self._visible: dict[bytes, Entry] = {}
        self._used_bytes = 0
        self._visible_pages = 0
        self._pinned_pages = 0  # pages of visible entries that are pinned
        self._pinned_entries = 0  # visible entries that are pinned
        self._dropped_pinned_pages = 0  # pages of dropped entries, freed at their last unpin
        self._evictions = 0
        self._evicted_bytes = 0

    def shared(self) -> tuple[int, int, int] | None:
        """The arena as ``(fd, address, size)``: a read-only descriptor of the sealed memfd it lives in, and
        where it lies in this process, for a reader of this process's user to map
        (``kvgate.client.crossmem.MappedArena``); None where there is no arena or it is private memory."""
        if self._shared_fd is None:
            return None
        return self._shared_fd, int(self._arena.ctypes.data), self.capacity

    # -- counters ---------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Usable bytes: whole pages only."""
        return self.total_pages * self.page_size

    @property
    def used_bytes(self) -> int:
        """Payload bytes of visible entries."""
        return self._used_bytes

    @property
    def used_pages(self) -> int:
        """Pages not free: visible entries, reservations and pinned dropped entries."""
        return self.total_pages - len(self._free)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the pages pinned entries hold (copies and replies reading them), dropped ones included:
        what eviction cannot take back until they are unpinned."""
        return (self._pinned_pages + self._dropped_pinned_pages) * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def entries(self) -> int:
        return len(self._visible)

    @property
    def evictions(self) -> int:
        return self._evictions

    def evictions_by_order(self) -> dict[str, int]:
        """Evictions the policy chose under each of its orders ("adaptive"; empty under the others)."""
        return self.policy.evictions_by_order()

    @property
    def evicted_bytes(self) -> int:
        return self._evicted_bytes

    def __len__(self) -> int:
        return len(self._visible)

    # -- writing ----------------------------------------------------------

    def reserve(self, full_key: bytes, size: int, meta: ObjectMeta, klass: int) -> Reservation | None:
        """Pages for a new object of ``size`` bytes, evicting if needed.

        Returns None when the tier is disabled, the object is larger than the
        tier, or the pages cannot be found because too much is pinned or
        reserved; in the last case nothing is evicted in vain.
        """
        if size < 0:
            raise ValueError("size cannot be negative")
        klass = int(Retention.parse(klass))
        if self.total_pages == 0 or size > self.capacity:
            return None
        need = -(-size // self.page_size)
        if need > len(self._free):
            evictable = self._visible_pages - self._pinned_pages
            if len(self._free) + evictable < need:
                return None
            self._evict_until(need)
        return Entry(self, full_key, size, meta, klass, self._take(need))

    def commit(self, reservation: Reservation) -> None:
        """Make a filled reservation visible, replacing any entry of its key."""
        if reservation._tier is not self or reservation._state != _RESERVED:
            raise ValueError(f"not an open reservation of this tier: {reservation!r}")
        old = self._visible.get(reservation.full_key)
        if old is not None:
            self._unlink(old)
        reservation._state = _VISIBLE
        self._visible[reservation.full_key] = reservation
        self._used_bytes += reservation.size
        self.usage.ram(reservation.full_key, reservation.size, 1)
        self._visible_pages += reservation.n_pages
        meta = reservation.meta
        self.policy.add(reservation.full_key, reservation.size, meta.dialog, meta.position, reservation.klass,
                        tail=meta.tail)
        if self.changes.listening:
            self.changes.note(RAM_TIER, STORED, reservation.full_key)

    def abort(self, reservation: Reservation) -> None:
        """Give back the pages of a reservation that will not be committed."""
        if reservation._tier is not self or reservation._state != _RESERVED:
            raise ValueError(f"not an open reservation of this tier: {reservation!r}")
        reservation._state = _FREED
        self._release(reservation.extents)

    # -- reading ----------------------------------------------------------

    def pin(self, full_key: bytes) -> Entry | None:
        """A hit: the entry, pinned and marked used; a miss: None.

        The caller copies out of ``entry.views()`` (in any thread) and then
        calls ``unpin(entry)`` from the bookkeeping thread.
        """
        entry = self._live(full_key)
        if entry is None:
            return None
        if entry.pins == 0:
            self._pinned_pages += entry.n_pages
            self._pinned_entries += 1
        entry.pins += 1
        self.policy.touch(full_key)
        return entry

    def unpin(self, entry: Entry) -> None:
        if entry._tier is not self or entry.pins <= 0:
            raise ValueError(f"entry is not pinned: {entry!r}")
        entry.pins -= 1
        if entry.pins:
            return
        if entry._state == _VISIBLE:
            self._pinned_pages -= entry.n_pages
            self._pinned_entries -= 1
        elif entry._state == _DROPPED:
            entry._state = _FREED
            self._dropped_pinned_pages -= entry.n_pages
            self._release(entry.extents)

    def contains(self, full_key: bytes) -> bool:
        """Whether a visible entry exists; does not count as a use."""
        return self._live(full_key) is not None

    def contains_many(self, full_keys: list[bytes]) -> np.ndarray:
        """``contains`` of each key (bool array), without a Python call per key: a lookup asks this of 1,000s
        of keys on every engine step (a dict lookup and a truth test per key in C: 52 us per 1,000 keys
        where ``contains`` per key took 115, half of them present).  With a ttl, the entries found are
        checked as ``_live`` does."""
        got = list(map(self._visible.get, full_keys))
        present = np.frombuffer(bytearray(map(bool, got)), np.bool_) if got else np.zeros(0, np.bool_)
        if self.ttl_ns is not None and present.any():
            cutoff = time.time_ns() - self.ttl_ns
            for i in np.flatnonzero(present).tolist():
                if got[i].meta.created_ns < cutoff:  # (past it: dropped, as _live drops it)
                    present[i] = self._live(full_keys[i]) is not None
        return present

    __contains__ = contains

    def size_of(self, full_key: bytes) -> int | None:
        entry = self._live(full_key)
        return None if entry is None else entry.size

    def _live(self, full_key: bytes) -> Entry | None:
        """The visible entry of a key, None when there is none or it outlived the ttl (then dropped)."""
        entry = self._visible.get(full_key)
        if entry is not None and self.ttl_ns is not None and entry.meta.created_ns + self.ttl_ns < time.time_ns():
            self._unlink(entry)
            if self.changes.listening:
                self.changes.note(RAM_TIER, REMOVED, full_key)
            self.on_expired(1)
            return None
        return entry

    def iter_entries(self) -> Iterator[Entry]:
        """Visible entries, for stats and tests (do not mutate while iterating)."""
        return iter(self._visible.values())

    def keys(self) -> list[bytes]:
        """Keys of visible entries (a copy: safe to delete while iterating)."""
        return list(self._visible)

    # -- removing ---------------------------------------------------------

    def delete(self, full_key: bytes) -> bool:
        entry = self._visible.get(full_key)
        if entry is None:
            return False
        self._unlink(entry)
        if self.changes.listening:
            self.changes.note(RAM_TIER, REMOVED, full_key)
        return True

    def clear(self) -> None:
        """Drop every visible entry (pinned ones free their pages at last unpin).

        Open reservations are untouched: their owners still commit or abort.
        """
        for entry in list(self._visible.values()):
            self._unlink(entry)
        if self.changes.listening:
            self.changes.note(RAM_TIER, CLEARED, None)

    # -- internals --------------------------------------------------------

    def _is_pinned(self, full_key: bytes) -> bool:
        return self._visible[full_key].pins > 0

    def _evict_until(self, need: int) -> None:
        policy = self.policy
        while len(self._free) < need:
            # Passing no skip function lets the policy take its O(1) path.
            victim = policy.choose_victim(self._is_pinned if self._pinned_entries else None)
            if victim is None:  # reserve checked there was enough; be safe anyway
                raise RuntimeError("eviction policy found no victim although unpinned pages exist")
            entry = self._visible[victim]  # type: ignore[index]
            self._evictions += 1
            self._evicted_bytes += entry.size
            self._unlink(entry)
            if self.changes.listening:
                self.changes.note(RAM_TIER, REMOVED, victim)  # type: ignore[arg-type]

    def _unlink(self, entry: Entry) -> None:
        """Make a visible entry invisible; free its pages unless it is pinned."""
        del self._visible[entry.full_key]
        self.policy.remove(entry.full_key)
        self._used_bytes -= entry.size
        self.usage.ram(entry.full_key, -entry.size, -1)
        n_pages = entry.n_pages
        self._visible_pages -= n_pages
        if entry.pins:
            self._pinned_pages -= n_pages
            self._pinned_entries -= 1
            self._dropped_pinned_pages += n_pages
            entry._state = _DROPPED
        else:
            entry._state = _FREED
            self._release(entry.extents)

    def _take(self, n: int) -> tuple[tuple[int, int], ...]:
        """Pop ``n`` pages and coalesce them into extents, in pop order."""
        if n == 0:
            return ()
        free = self._free
        taken = free[-n:]
        del free[-n:]
        top = taken[-1]
        # Common case: the top of the stack is one descending run.
        if taken[0] == top + n - 1 and taken == list(range(top + n - 1, top - 1, -1)):
            return ((top, n),)
        extents: list[tuple[int, int]] = []
        start = prev = top
        for page in reversed(taken[:-1]):
            if page != prev + 1:
                extents.append((start, prev - start + 1))
                start = page
            prev = page
        extents.append((start, prev - start + 1))
        return tuple(extents)

    def _release(self, extents: Sequence[tuple[int, int]]) -> None:
        """Push pages back so that the next pops return them in the same order."""
        free = self._free
        for start, n in reversed(extents):
            free.extend(range(start + n - 1, start - 1, -1))


def copy_into(dst_views: Sequence[memoryview], src: memoryview | bytes | bytearray) -> None:
    """Scatter ``src`` into ``dst_views`` (a reservation's views), in order.

    ``src`` may be a client's region: the copy is ``memcopy.copy``, so a
    region shrunk under its mapping is a ``MemoryFault``, not a SIGBUS; it
    releases the GIL, so pool threads copy in parallel.  ``src`` must be
    exactly as long as the views together.
    """
    total = sum(v.nbytes for v in dst_views)
    size = memoryview(src).nbytes
    if size != total:
        raise ValueError(f"source is {size} bytes, destination views hold {total}")
    memcopy.copy(list(dst_views), src)


def copy_out(src_views: Sequence[memoryview], dst: memoryview | bytearray) -> int:
    """Gather ``src_views`` (a pinned entry's views) into the start of ``dst``.

    Returns the number of bytes copied; ``dst`` may be longer, never shorter.
    ``dst`` may be a client's region: see ``copy_into``.
    """
    total = sum(v.nbytes for v in src_views)
    d = np.frombuffer(dst, dtype=np.uint8)  # counts bytes whatever the format of dst
    if d.size < total:
        raise ValueError(f"destination is {d.size} bytes, the object is {total}")
    memcopy.copy(d[:total], list(src_views))
    return total
