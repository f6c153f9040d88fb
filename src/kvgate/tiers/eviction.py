"""Eviction policies, shared by the RAM tier and each card's index.

A policy only orders identities; it owns no bytes.  Its owner tells it what is
resident (``add``), what was read (``touch``) and what is gone (``remove``),
and asks it which object to drop next (``choose_victim``).  The owner does the
dropping and then calls ``remove``: ``choose_victim`` never changes the policy,
so an owner may decide not to evict after all.

Why a prefix policy.  An engine restores a prompt prefix from its first block
and stops at the first block it does not find.  A block whose predecessor is
gone is worth nothing, however recently it was used, yet plain LRU evicts a
dialog head first (the head is written and read before the tail, so it is
always older), and keeps whatever came last over the blocks that are read
again and again.  ``PrefixPolicy`` keeps blocks that were used again ahead of
one-off ones and cuts each dialog from its tail, so what stays is a usable
prefix of what is likely to be asked for (its docstring has the figures).

Retention classes: every object is ``SHORT`` or ``LONG``.  All short objects
go before any long one, whatever their age, in both policies.

Policies are not thread-safe: their owner calls them from one thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from enum import IntEnum
from typing import Any, Final, Union

from kvgate.keys import NO_DIALOG
from kvgate.types import STORED_CLASSES, Retention

Ident = Hashable
SkipFn = Callable[[Ident], bool]


SHORT: Final = Retention.SHORT
LONG: Final = Retention.LONG
_CLASSES: Final = len(STORED_CLASSES)
_MASK64: Final = (1 << 64) - 1


def _check_klass(klass: int) -> int:
    # Classes index a list: a bad value must fail loudly, not land in a wrong bucket.
    if not isinstance(klass, int) or isinstance(klass, bool) or not 0 <= klass < _CLASSES:
        raise ValueError(f"retention class must be 0 (short) or 1 (long), got {klass!r}")
    return int(klass)


class EvictionPolicy(ABC):
    """Orders resident objects for eviction.

    ``add``, ``touch`` and ``remove`` of unknown identities are tolerated:
    ``touch`` and ``remove`` do nothing, ``add`` of a known one replaces it.
    """

    name: str

    @abstractmethod
    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        """A new resident object (re-adding an ident replaces it).

        ``tail``: the object is the last block of its write (a request's last
        block, the least likely to be read again).

        ``size`` is there for policies that weigh objects by size; the two
        here count objects, since a tier's blocks are nearly all one size.
        """

    @abstractmethod
    def touch(self, ident: Ident) -> None:
        """The object was read (a hit)."""

    @abstractmethod
    def remove(self, ident: Ident) -> None:
        """The object is gone (deleted or evicted)."""

    @abstractmethod
    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        """The next object to evict, left in place; None if every object is skipped.

        ``skip(ident)`` True means the object is pinned (being read or
        written) and must not be chosen.
        """

    @abstractmethod
    def hottest_first(self) -> list[Ident]:
        """Every object, the one this policy would evict last first (what a card's mover copies first)."""

    def evictions_by_order(self) -> dict[str, int]:
        """Evictions chosen under each order, for a policy that switches between orders (none here)."""
        return {}

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, ident: object) -> bool: ...


class LruPolicy(EvictionPolicy):
    """Least recently used object first; all short objects before long ones."""

    name = "lru"

    def __init__(self) -> None:
        self._order: list[OrderedDict[Ident, None]] = [OrderedDict() for _ in range(_CLASSES)]
        self._klass: dict[Ident, int] = {}

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        k = _check_klass(klass)
        self.remove(ident)
        self._order[k][ident] = None
        self._klass[ident] = k

    def touch(self, ident: Ident) -> None:
        k = self._klass.get(ident)
        if k is not None:
            self._order[k].move_to_end(ident)

    def remove(self, ident: Ident) -> None:
        k = self._klass.pop(ident, None)
        if k is not None:
            del self._order[k][ident]

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        for order in self._order:
            if skip is None:
                if order:
                    return next(iter(order))
                continue
            for ident in order:
                if not skip(ident):
                    return ident
        return None

    def hottest_first(self) -> list[Ident]:
        return [ident for order in reversed(self._order) for ident in reversed(order)]

    def __len__(self) -> int:
        return len(self._klass)

    def __contains__(self, ident: object) -> bool:
        return ident in self._klass


class RecentKeys:
    """Which identities were seen lately: a pair of rotating Bloom filters.

    A block that comes back after it was evicted is the best sign that it will
    come back again (on the Mooncake synthetic trace, a block used twice is
    used a third time 84 % of the time, one used once only 42 %), so the
    prefix policy remembers identities well past their eviction.  Exact
    memory (an ordered dict of keys) would cost about 100 bytes per identity
    remembered; the filters cost 16 bits per identity, at a false positive
    rate well under 1 %, which only ever promotes a block one step early.

    ``add`` fills the current filter; once it holds the ``span`` identities
    it was sized for, it becomes the previous one and a new one starts (sized
    at the ``span`` of that moment), so an identity is remembered for between
    one and two spans of additions.

    The probes are one call into ``kvgate/_recent.c`` where it is built
    (``_remember``; the Python path sets and reads the same bits).
    """

    __slots__ = ("span", "_current", "_previous", "_count")

    _BITS_PER_KEY = 16

    def __init__(self, span: int) -> None:
        self.span = max(1, span)
        self._previous: bytearray | None = None
        self._current = bytearray(self.span * self._BITS_PER_KEY // 8)
        self._count = 0

    def add(self, ident: Ident) -> bool:
        """Remember ``ident``; whether it was remembered already (one hash for both questions)."""
        found = _remember(ident, self._current, self._previous, True)
        if found & 1:  # already in: the span counts distinct identities
            return True
        self._count += 1
        if self._count >= len(self._current) * 8 // self._BITS_PER_KEY:
            self._previous, self._count = self._current, 0
            self._current = bytearray(self.span * self._BITS_PER_KEY // 8)
        return bool(found)

    def __contains__(self, ident: object) -> bool:
        return bool(_remember(ident, self._current, self._previous, False))


_HASHES: Final = 4
_FIRST_SPAN: Final = 4096  # identities a prefix policy's first RecentKeys filter is sized for


def _probe(bits: bytearray, h1: int, h2: int) -> bool:
    nbits = len(bits) * 8
    for k in range(_HASHES):
        i = (h1 + k * h2) % nbits
        if not bits[i >> 3] >> (i & 7) & 1:
            return False
    return True


def _remember_py(ident: object, current: bytearray, previous: bytearray | None, add: bool) -> int:
    """``RecentKeys``' probes: bit 0 ``ident`` is in ``current``, bit 1 in ``previous``; ``add`` sets its bits
    in ``current`` where bit 0 is clear.  The compiled ``kvgate._recent.remember`` does the same in one call
    (same hash, same bits), where it is built."""
    # Python's hash of an int is the int itself: mix it (splitmix64's finalizer), or neighbouring
    # identities would share their bits.  Double hashing: probe k at h1 + k * h2, h2 odd.
    h = hash(ident) & _MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    h ^= h >> 31
    h1, h2 = h & 0xFFFF_FFFF, (h >> 32) | 1
    found = _probe(current, h1, h2) | (previous is not None and _probe(previous, h1, h2)) << 1
    if add and not found & 1:
        nbits = len(current) * 8
        for k in range(_HASHES):
            i = (h1 + k * h2) % nbits
            current[i >> 3] |= 1 << (i & 7)
    return found


def _compiled_remember() -> Callable[[object, bytearray, bytearray | None, bool], int] | None:
    try:
        from kvgate import _recent  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _recent.remember


_remember = _compiled_remember() or _remember_py


class _Dialog:
    """The resident blocks of one dialog in one segment, by position.

    Several objects may share a position (one per rank or fragment of the same
    block), so each position holds an insertion-ordered set.  Blocks arrive in
    position order, so ``insort`` almost always appends and removing the tail
    pops: both O(1) in the common case, O(dialog length) at worst.
    """

    __slots__ = ("positions", "at", "added")

    def __init__(self) -> None:
        self.positions: list[int] = []  # sorted, unique
        self.at: dict[int, dict[Ident, None]] = {}
        self.added = 0  # the owner's add count when a block last joined

    def add(self, position: int, ident: Ident) -> None:
        idents = self.at.get(position)
        if idents is None:
            idents = self.at[position] = {}
            if not self.positions or position > self.positions[-1]:
                self.positions.append(position)
            else:
                insort(self.positions, position)
        idents[ident] = None

    def remove(self, position: int, ident: Ident) -> None:
        idents = self.at[position]
        del idents[ident]
        if not idents:
            del self.at[position]
            if self.positions[-1] == position:
                self.positions.pop()
            else:
                del self.positions[bisect_left(self.positions, position)]

    def __bool__(self) -> bool:
        return bool(self.positions)

    def from_tail(self) -> Iterator[tuple[int, dict[Ident, None]]]:
        for position in reversed(self.positions):
            yield position, self.at[position]


def _dialog_key(ident: Ident, dialog: bytes, position: int) -> tuple[Hashable, int]:
    """A block's dialog key and position: its dialog's digest; a block without a dialog or a position is a
    one-block dialog of its own, a 1-tuple of its ident (never equal to a digest), at 0."""
    if position < 0 or dialog == NO_DIALOG or not dialog:
        return (ident,), 0
    return bytes(dialog), position


class Segment(IntEnum):
    """Where the prefix policy keeps a block; lower segments are evicted first."""

    TAIL = 0  # the last block of a write, not read since
    NEW = 1  # seen once: written, not read since, not remembered from before
    REUSED = 2  # seen at least twice: read, or written again while remembered


_SEGMENTS: Final = len(Segment)
# The segments as plain ints: for the policies' hot paths (an IntEnum member costs an attribute lookup and
# a slower compare each time) and a card's numpy columns (kvgate.tiers.copyorder, kvgate.tiers.sampled).
TAIL: Final = int(Segment.TAIL)
NEW: Final = int(Segment.NEW)
REUSED: Final = int(Segment.REUSED)


def _replay(cache: Any, ident: Ident, label: bytes, position: int, klass: int, tail: bool, capacity: int) -> int:
    """A referee's miniature cache (``PrefixPolicy`` or ``DialogLru``) sees a reference: read if resident
    (returns -1), else added and cut back to ``capacity`` objects (returns how many it evicted).  The compiled
    ``kvgate._mini.Miniature.replay`` does the same in one C call."""
    if ident in cache:
        cache.touch(ident)
        return -1
    cache.add(ident, 0, label, position, klass, tail)
    evicted = 0
    while len(cache) > capacity:
        victim = cache.choose_victim()
        if victim is None:
            break
        cache.remove(victim)
        evicted += 1
    return evicted


class PrefixPolicy(EvictionPolicy):
    """Blocks used again stay; one-off blocks go first, tails before heads.

    What a restore needs is a usable prefix of blocks that will be asked for
    again.  Counted on the Mooncake synthetic trace (benchmarks/data): a block
    used once is used again 42 % of the time, one used twice 84 %; the last
    block of a request (its unique question) only 5 %.  Reuse distances are
    long (median 233 requests, several times what a cache of 5-20 % of the
    blocks holds), so plain LRU keeps whatever came last and loses the blocks
    that are read again and again (tests/tiers/test_trace_replay.py counts
    these figures).  So:

    - Three segments per retention class, evicted in order: ``TAIL`` (the
      last block of a write, not read since), ``NEW`` (seen once), ``REUSED``
      (seen twice or more: read, or written again while ``RecentKeys`` still
      remembers it, which covers 2-4x the resident count).
    - ``REUSED`` may hold at most ``reused_share`` of the objects; past that
      its coldest blocks are demoted to the cold end of ``NEW``, so a burst of
      new dialogs can still stay long enough to be used a second time.
    - Inside a segment, dialogs are ordered by last use and each is cut from
      its tail, so what stays is a usable prefix whatever order the blocks
      were written or read in; a shared head (a system prompt, kept apart from
      the conversations by its dialog mark) is read by every request and so
      stays in ``REUSED`` ahead of any conversation's tail.
    - All short objects go before any long one.

    Pinned objects: the first pass never chooses a block below a pinned one
    of its dialog in the same segment; only when that finds nothing does a
    second pass take any unpinned object, in the same order.

    Objects without a dialog, or with an unknown position (-1), are each a
    one-block dialog of their own.

    Costs: ``add``/``touch``/``remove`` O(1) for blocks arriving and leaving
    in position order (O(dialog length) at worst), plus a few hash probes;
    ``choose_victim`` O(1) when nothing is pinned.
    """

    name = "prefix"
    reused_share = 0.98
    reserve_from = 100  # objects
    young_adds = 64  # or 1/64 of the objects, if more

    ORDERS: Final = ("prefix", "recency")

    def __init__(self, order: str = "prefix") -> None:
        if order not in self.ORDERS:
            raise ValueError(f"unknown order {order!r}; choose one of {', '.join(self.ORDERS)}")
        # Which dialog loses its last block next: "prefix" (the segments, below) or "recency" (the dialog
        # used least recently, whatever its segment: LRU by dialog).  Both orders are always kept, so an
        # owner may switch at any time (``kvgate.tiers.adaptive``).
        self.order = order
        # Per class, dialogs by last use (a block placed, or read): the "recency" order.
        self._recency: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(_CLASSES)]
        self._segments: list[list[OrderedDict[Hashable, _Dialog]]] = [
            [OrderedDict() for _ in range(_SEGMENTS)] for _ in range(_CLASSES)
        ]
        self._reused = [0] * _CLASSES
        # ident -> (class, segment, dialog key, position).  A lone object's
        # dialog key is a 1-tuple holding the ident: never equal to a digest.
        self._where: dict[Ident, tuple[int, int, Hashable, int]] = {}
        # (class, dialog key) -> all its resident blocks, whatever their segment:
        # the segments choose which dialog loses a block, this says which block.
        self._whole: dict[tuple[int, Hashable], _Dialog] = {}
        self._recent = RecentKeys(_FIRST_SPAN)
        self._adds = 0

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        k = _check_klass(klass)
        again = self._seen(ident) or ident in self._where
        self.remove(ident)
        dkey, position = _dialog_key(ident, dialog, position)
        segment = REUSED if again else TAIL if tail else NEW
        self._adds += 1
        self._place(ident, k, segment, dkey, position)

    def touch(self, ident: Ident) -> None:
        where = self._where.get(ident)
        if where is None:
            return
        k, segment, dkey, _ = where
        self._recency[k].move_to_end(dkey)
        if segment == REUSED:
            self._segments[k][segment].move_to_end(dkey)
        else:
            self._move(ident, REUSED)
        self._seen(ident)

    def remove(self, ident: Ident) -> None:
        if ident in self._where:
            self._unplace(ident)

    def _place(self, ident: Ident, k: int, segment: int, dkey: Hashable, position: int) -> None:
        """A block joins its dialog (the dialog is used last now) and a segment."""
        whole = self._whole.get((k, dkey))
        if whole is None:
            whole = self._whole[(k, dkey)] = _Dialog()
            self._recency[k][dkey] = None
        else:
            self._recency[k].move_to_end(dkey)
        whole.add(position, ident)
        self._join(ident, k, segment, dkey, position)

    def _move(self, ident: Ident, segment: int, cold: bool = False) -> None:
        """A resident block into another segment; its dialog's blocks and place by last use stay as they are."""
        k, old, dkey, position = self._where[ident]
        dialogs = self._segments[k][old]
        d = dialogs[dkey]
        d.remove(position, ident)
        if not d:
            del dialogs[dkey]
        if old == REUSED:
            self._reused[k] -= 1
        self._join(ident, k, segment, dkey, position, cold)

    def _join(self, ident: Ident, k: int, segment: int, dkey: Hashable, position: int, cold: bool = False) -> None:
        dialogs = self._segments[k][segment]
        d = dialogs.get(dkey)
        if d is None:
            d = dialogs[dkey] = _Dialog()
            if cold:
                dialogs.move_to_end(dkey, last=False)
        elif not cold:
            # A demoted block joins its dialog's group where it is: a dialog
            # being written must not turn cold because its head was demoted.
            dialogs.move_to_end(dkey)
        if not cold:
            d.added = self._adds
        d.add(position, ident)
        self._where[ident] = (k, segment, dkey, position)
        if segment == REUSED:
            self._reused[k] += 1
            self._demote(k)

    def _unplace(self, ident: Ident) -> None:
        k, segment, dkey, position = self._where.pop(ident)
        dialogs = self._segments[k][segment]
        d = dialogs[dkey]
        d.remove(position, ident)
        if not d:
            del dialogs[dkey]
        whole = self._whole[(k, dkey)]
        whole.remove(position, ident)
        if not whole:
            del self._whole[(k, dkey)]
            del self._recency[k][dkey]
        if segment == REUSED:
            self._reused[k] -= 1

    def _demote(self, k: int) -> None:
        """Keep REUSED within its share: its coldest tail block goes to the cold end of NEW."""
        n = len(self._where)
        # A reserve for new dialogs only means something once there are many
        # objects: with a handful, it would demote the very blocks being read.
        limit = max(1, int(n * self.reused_share)) if n >= self.reserve_from else n
        reused = self._segments[k][REUSED]
        while self._reused[k] > limit and reused:
            d = next(iter(reused.values()))
            self._move(next(iter(d.at[d.positions[-1]])), NEW, cold=True)

    def _seen(self, ident: Ident) -> bool:
        """Remember the block; whether it was remembered already.

        Each filter is sized, when it starts, at three times the resident
        count, so the pair remembers 3-6x what is resident: a block evicted a
        while ago is still known when it comes back.  (2x and 4x each did
        worse on the trace replay; see the class docstring.)"""
        self._recent.span = 3 * max(len(self._where), 1024)
        return self._recent.add(ident)

    def _order(self) -> Iterator[_Dialog]:
        """Dialogs in eviction order, each as its whole resident blocks.

        Per class: TAIL then NEW, coldest first, but only groups that took no
        block in the last ``young_adds`` adds; then REUSED; then the young
        groups.  Blocks reach the owner one at a time, with evictions between
        them: without the wait, a dialog being written into a small NEW
        segment would lose each block to the next one, and every restore
        would start with a hole.
        """
        whole = self._whole
        if self.order == "recency":
            for k, recency in enumerate(self._recency):
                for dkey in recency:
                    yield whole[(k, dkey)]
            return
        young_after = self._adds - max(self.young_adds, len(self._where) // 64)
        for k, segments in enumerate(self._segments):
            for segment in (TAIL, NEW):
                for dkey, d in segments[segment].items():
                    if d.added > young_after:
                        break  # ordered by last add: the rest are young too
                    yield whole[(k, dkey)]
            for dkey in segments[REUSED]:
                yield whole[(k, dkey)]
            for segment in (TAIL, NEW):
                for dkey, d in segments[segment].items():
                    if d.added > young_after:
                        yield whole[(k, dkey)]

    def _coldest(self) -> _Dialog | None:
        """The first dialog of ``_order``, written out: the victim's when nothing is pinned, the common case
        (a generator made for each victim was a tenth of the policy's time)."""
        whole = self._whole
        if self.order == "recency":
            for k, recency in enumerate(self._recency):
                for dkey in recency:
                    return whole[(k, dkey)]
            return None
        young_after = self._adds - max(self.young_adds, len(self._where) // 64)
        for k, segments in enumerate(self._segments):
            young = None
            for segment in (TAIL, NEW):
                for dkey, d in segments[segment].items():
                    if d.added <= young_after:
                        return whole[(k, dkey)]
                    if young is None:
                        young = dkey  # ordered by last add: the rest are young too
                    break
            for dkey in segments[REUSED]:
                return whole[(k, dkey)]
            if young is not None:
                return whole[(k, young)]
        return None

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        # The victim is always the last resident block of the chosen dialog, in
        # whatever segment it is: a block whose successor is still resident
        # never goes first, so what stays of every dialog is a prefix.
        if skip is None:
            d = self._coldest()
            return None if d is None else next(iter(d.at[d.positions[-1]]))
        # Pass 1: whole prefixes only; a pinned block shields the ones below it.
        for d in self._order():
            for _position, idents in d.from_tail():
                shielded = False
                for ident in idents:
                    if skip(ident):
                        shielded = True
                    else:
                        return ident
                if shielded:
                    break
        # Pass 2: anything unpinned, same order.
        for d in self._order():
            for _position, idents in d.from_tail():
                for ident in idents:
                    if not skip(ident):
                        return ident
        return None

    def hottest_first(self) -> list[Ident]:
        # Long before short; in each, dialogs used again (most recent first),
        # then the ones seen once, then tails; each dialog once (at its
        # hottest place), from its head, so a copy cut short still leaves
        # usable prefixes.  Not the reverse of the eviction order: that
        # spares young dialogs for a while, which says nothing of reuse.
        out: list[Ident] = []
        seen: set[tuple[int, Hashable]] = set()
        for k in reversed(range(_CLASSES)):
            for segment in (REUSED, NEW, TAIL):
                for dkey in reversed(self._segments[k][segment]):
                    if (k, dkey) not in seen:
                        seen.add((k, dkey))
                        d = self._whole[(k, dkey)]
                        out += [ident for p in d.positions for ident in d.at[p]]
        return out

    def remove_dialogs(self, drop: Callable[[Hashable], bool]) -> None:
        """Remove every object whose dialog key (a digest; a lone object's 1-tuple) ``drop`` says yes to."""
        for ident in [i for i, where in self._where.items() if drop(where[2])]:
            self._unplace(ident)

    replay = _replay  # as a referee's miniature cache (kvgate.tiers.referee)

    def where(self, ident: Ident) -> tuple[int, Hashable, int] | None:
        """(class, dialog key, position) of a resident object; None if unknown."""
        where = self._where.get(ident)
        return None if where is None else (where[0], where[2], where[3])

    def segment_of(self, ident: Ident) -> Segment | None:
        """The segment an object is in (None if unknown): for stats and tests."""
        where = self._where.get(ident)
        return None if where is None else Segment(where[1])

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, ident: object) -> bool:
        return ident in self._where


class DialogLru:
    """``PrefixPolicy``'s recency order alone: dialogs by last use (a block placed, or read), each cut from
    its tail; short objects before long ones.  It evicts exactly as ``PrefixPolicy("recency")`` does
    (tests/tiers/test_eviction.py) without keeping the segments, the filters or the other order: a
    referee's miniature cache of that order (``kvgate.tiers.referee``) at a fraction of the cost.
    No pins: ``choose_victim`` takes no skip.  One thread, as every policy.
    """

    def __init__(self) -> None:
        self._recency: list[OrderedDict[Hashable, _Dialog]] = [OrderedDict() for _ in range(_CLASSES)]
        self._where: dict[Ident, tuple[int, Hashable, int]] = {}  # ident -> (class, dialog key, position)

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        k = _check_klass(klass)
        self.remove(ident)
        dkey, position = _dialog_key(ident, dialog, position)
        dialogs = self._recency[k]
        d = dialogs.get(dkey)
        if d is None:
            d = dialogs[dkey] = _Dialog()
        else:
            dialogs.move_to_end(dkey)
        d.add(position, ident)
        self._where[ident] = (k, dkey, position)

    def touch(self, ident: Ident) -> None:
        where = self._where.get(ident)
        if where is not None:
            self._recency[where[0]].move_to_end(where[1])

    def remove(self, ident: Ident) -> None:
        where = self._where.pop(ident, None)
        if where is None:
            return
        k, dkey, position = where
        dialogs = self._recency[k]
        d = dialogs[dkey]
        d.remove(position, ident)
        if not d:
            del dialogs[dkey]

    def choose_victim(self) -> Ident | None:
        for dialogs in self._recency:
            for d in dialogs.values():
                return next(iter(d.at[d.positions[-1]]))
        return None

    replay = _replay

    def remove_dialogs(self, drop: Callable[[Hashable], bool]) -> None:
        """Remove every object whose dialog key (a digest; a lone object's 1-tuple) ``drop`` says yes to."""
        for ident in [i for i, where in self._where.items() if drop(where[1])]:
            self.remove(ident)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, ident: object) -> bool:
        return ident in self._where


Miniature = Union[PrefixPolicy, DialogLru]  # or the compiled kvgate._mini.Miniature: the same calls


def miniature(order: str) -> Miniature:
    """A referee's miniature cache of one order (kvgate.tiers.referee): ``replay``, ``remove_dialogs``,
    ``choose_victim``, ``len`` and ``in``.  The compiled ``kvgate._mini.Miniature`` where it is built (the
    same victims: tests/tiers/test_eviction.py), else ``PrefixPolicy("prefix")`` or ``DialogLru``."""
    if order not in PrefixPolicy.ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(PrefixPolicy.ORDERS)}")
    if _Compiled is not None:
        return _Compiled(order, NO_DIALOG, PrefixPolicy.young_adds, PrefixPolicy.reserve_from,  # type: ignore[no-any-return]
                         PrefixPolicy.reused_share, _FIRST_SPAN)
    return PrefixPolicy("prefix") if order == "prefix" else DialogLru()


def _compiled_miniature() -> Any:
    try:
        from kvgate._mini import Miniature as compiled  # type: ignore[import-not-found]
    except ImportError:
        return None
    return compiled


_Compiled = _compiled_miniature()
