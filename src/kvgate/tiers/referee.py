"""Which eviction order would have restored more, lately, on this traffic: miniature caches as referees.

Neither order of ``PrefixPolicy`` wins everywhere.  "prefix" (one-off
blocks first, blocks used again kept) wins where dialogs come back after
long gaps or behind a scan of one-off prompts; "recency" (LRU by dialog)
wins where most dialogs come back once, soon, and never again: "prefix"
then keeps the dead second turns, marked used again, over the first turns
still waiting for theirs (`kvgate bench --trace gen:two-turns --in-process`:
0.49 of LRU at a cache of 10 %).

A ``Referee`` runs both orders side by side, each as a small cache of its
own, on the references of a sample of dialogs (a dialog is in when the low
``shift`` bits of its digest are zero; its blocks all in or all out, so a
sampled request is a whole prefix), scaled down by the same rate: the
miniature simulations of SHARDS (Waldspurger et al., FAST'15 and ATC'17).
Each counts the blocks it would have restored, by the engine's rule: the
leading blocks present, up to the first missing one.  The counts halve
every ``DECAY_FILLS`` cache fills, so the referee answers for the traffic
of late; ``leader`` switches only when the other order is ahead by
``MARGIN``, so a near tie does not make the owner flip back and forth,
and leaves the prefix order (where it starts) only on ``EVIDENCE`` too: a
lead worth a share of the cache, not one lucky request while the counts
are young.  The asymmetry is the cost of being wrong: following the
recency order lets go the dialogs the prefix order keeps for a late
return, which no later switch brings back.
A second pair of caches at half the size runs ahead while the owner fills
(a verdict needs evictions, then the time a block takes to come back), and
judges until each of the full-size pair's caches has evicted a fill.

Memory is bounded: each miniature cache holds at most twice ``MIN_BLOCKS``
blocks (the rate halves as the owner grows), and each remembers the
dialogs it has seen in one ``RecentKeys`` pair and a bounded table of
request cursors.  Cost: a sampled reference is one call into each
miniature cache, compiled where ``make install`` built ``kvgate/_mini.c``
(in Python the two cost about 12 us a reference on the public trace,
more than the tier's own policy; compiled, about 1), and the referee's
own bookkeeping (1.3-1.7 us); the rest cost one test of an int's bits, which
the owner makes before it builds anything (``mask``).  The sample shrinks
as the owner grows, so the cost per block falls with the tier's size.

The owner is the group of caches whose order it decides: one RAM tier's
policy, or all the cards of a gateway (their merit is the traffic's, not a
card's: a referee per card judged a quarter of the traffic on a quarter of
the room, and followed the worse order on some cards).  ``resident`` counts
what the owner holds, asked only for sampled references.  Called from the
owner's one thread (the RAM tier's lock holder; the cards' event loop).

``OrderTally`` counts which order chose each eviction, for the owner's
status.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final

import xxhash

from kvgate.tiers.eviction import Miniature, PrefixPolicy, miniature

EXPERTS: Final = PrefixPolicy.ORDERS
assert len(EXPERTS) == 2  # a leader's rival is "the other order" (``_Trial.leader``)
_PREFIX: Final = EXPERTS.index("prefix")  # the order a referee starts in; leaving it takes evidence


def sample_bits(dkey: Hashable) -> int:
    """The bits a dialog key is sampled by: a digest's first four bytes; for a lone object's 1-tuple, its
    number (a card's row digest) or a hash of its key (the RAM tier's full key: XXH3, the same in every
    process, where Python's hash of bytes is seeded per process); else Python's hash."""
    if isinstance(dkey, bytes):
        return int.from_bytes(dkey[:4], "little")
    if isinstance(dkey, tuple) and len(dkey) == 1:
        ident = dkey[0]
        if isinstance(ident, int):
            return ident
        if isinstance(ident, bytes):
            return xxhash.xxh3_64_intdigest(ident)
    return hash(dkey)


class _Trial:
    """One miniature cache per order (``kvgate.tiers.eviction.miniature``: compiled where built), all of
    ``scale`` times the sampled share of the owner's capacity."""

    __slots__ = ("scale", "caches", "restored", "evicted", "capacity")

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.caches: list[Miniature] = [miniature(order) for order in EXPERTS]
        self.restored = [0.0] * len(EXPERTS)  # decayed counts of blocks each would have restored
        self.evicted = 0
        self.capacity = 64

    def referenced(self, ident: Hashable, label: bytes, position: int, klass: int, tail: bool, broken: int) -> int:
        """One reference in every cache; ``broken``: a bit per cache whose prefix broke earlier in this request.
        Returns the bits of the caches whose prefix is broken now: a count changed where a bit is clear."""
        capacity = self.capacity
        first, second = self.caches  # unrolled: this runs for every sampled reference
        evicted = first.replay(ident, label, position, klass, tail, capacity)
        if evicted < 0:  # resident: restored, unless the request's prefix broke before it
            if not broken & 1:
                self.restored[0] += 1
        else:
            broken |= 1
            self.evicted += evicted
        evicted = second.replay(ident, label, position, klass, tail, capacity)
        if evicted < 0:
            if not broken & 2:
                self.restored[1] += 1
        else:
            broken |= 2
            self.evicted += evicted
        return broken

    def leader(self, current: int, margin: float, evidence: float) -> int:
        """The other order if its count is ahead of ``current``'s by more than ``margin`` of it and by more
        than ``evidence`` of a cache's blocks (at least 2), else ``current``."""
        restored = self.restored
        other = 1 - current
        if restored[other] > restored[current] * (1 + margin) + max(2, self.capacity * evidence):
            return other
        return current


class Referee:
    """See the module docstring.  The owner calls ``referenced`` for every add and read of a block whose
    dialog's ``sample_bits`` have none of ``mask`` set, and reads ``leader``."""

    # The miniature caches' least capacity: sets the sampling rate.  At 2048 the referee followed the
    # recency order for a third of the evictions of a cache of 20 % of the synthetic trace where the prefix
    # order was 7 % better, costing 2 % (0.981 of the better order in one pool, the same on four cards);
    # at 4096, 1.000 in both.  A larger sample costs more per block while the tier is small.
    MIN_BLOCKS = 4096
    MAX_SHIFT = 16  # a rate of at least 1/65,536
    MARGIN = 0.02  # the other order must be ahead by this much before the leader changes
    # Leaving the prefix order takes evidence too: the recency order ahead by this share of a cache's blocks
    # besides the margin (going back takes the margin alone).  On the public trace with a shared head at 5 %,
    # one returning dialog (request 122) put the full-size pair's recency order 67 blocks ahead, and at the
    # handover 60 requests later that lead of young counts (429 against 362) was past the margin; the owner
    # followed it for 500 requests in which both orders restored the same, and had let go the dialogs the
    # prefix order keeps for their return: 0.987 of the better order on cards, 0.991 in RAM.  At 0.04 (88
    # blocks there) it stays, 1.000.  A symmetric threshold held the owner in the recency order after the
    # prefix order led again (the same trace at 2 %: 0.996 -> 0.983 at 1/32); at 1/8, learning came late
    # where the recency order does win (gen:two-turns: down to 0.947).
    EVIDENCE = 0.04
    DECAY_FILLS = 32  # the counts halve every this many cache fills of sampled references
    # The half-size pair judges until the full-size pair's caches have evicted this many fills together (one
    # each).  At half that, the full pair's first counts took over too soon: on gen:two-turns of 4,000
    # requests at 10-20 % the leader went back to the prefix order at the handover (0.985-0.987 of the better
    # order; 0.996-0.998 now).
    HANDOVER_FILLS = 2
    # The owner's size is asked every this many sampled references (a card set's is a sum over its cards, a
    # microsecond at four), so the miniatures' capacity may lag the owner's by that many blocks.  At 16 the lag
    # moved one cell of the trace replay (the public trace with a shared head at 5 %, cards: 0.987 -> 0.981 of
    # the better order); at 4 every cell measured is what asking each time gives.
    RESIDENT_EVERY = 4

    def __init__(self, resident: Callable[[], int]) -> None:
        """``resident``: how many blocks the owner holds now."""
        self._resident = resident
        self._until_resident = 0  # sampled references until the owner's size is asked again (``_sized``)
        self.shift = 0
        self.mask = 0  # a dialog is in the sample when its sample bits have none of these set
        self._halve_above = self.MIN_BLOCKS << 1  # the owner's size past which the rate halves
        self._lead = _PREFIX
        self.switches = 0
        # The full-size trial judges; the half-size one runs ahead (it fills at half the owner's size), so
        # its verdict is there when the owner's first evictions come, until the full one has evicted
        # HANDOVER_FILLS fills.
        self._full = _Trial(1.0)
        self._half: _Trial | None = _Trial(0.5)
        self._until_decay = self.MIN_BLOCKS * self.DECAY_FILLS
        # dialog -> [last position referenced, 2 bits per trial: each cache whose prefix broke in this request]
        self._cursors: OrderedDict[Hashable, list[int]] = OrderedDict()

    @property
    def leader(self) -> str:
        return EXPERTS[self._lead]

    @property
    def restored(self) -> dict[str, float]:
        """Decayed counts of the blocks each order would have restored, at the owner's size."""
        return dict(zip(EXPERTS, self._full.restored))

    def sampled(self, dkey: Hashable) -> bool:
        """Whether a dialog (a digest, or a lone object's 1-tuple) is in the sample."""
        return not sample_bits(dkey) & self.mask

    def referenced(self, ident: Hashable, dkey: Hashable, position: int, klass: int, tail: bool) -> None:
        """Block ``ident`` (of dialog ``dkey``, sampled, at ``position``) was added or read."""
        self._until_resident -= 1
        if self._until_resident <= 0 and not self._sized(dkey):
            return  # the rate halved and this dialog left the sample
        cursors = self._cursors
        cursor = cursors.get(dkey)
        if cursor is None:
            cursor = cursors[dkey] = [position, 0]
            if len(cursors) > 4 * self._full.capacity:
                cursors.popitem(last=False)
        else:
            if position <= cursor[0]:  # a new request of this dialog starts from its head
                cursor[1] = 0
            cursor[0] = position
            cursors.move_to_end(dkey)
        label = dkey if dkey.__class__ is bytes else b""
        judge = full = self._full
        broken = full.referenced(ident, label, position, klass, tail, cursor[1] & 3) | cursor[1]
        counted = ~broken & 3  # the caches that counted a block restored
        half = self._half
        if half is not None:  # the half-size pair, until the handover (bits 2-3 of the cursor)
            got = half.referenced(ident, label, position, klass, tail, broken >> 2 & 3)
            broken |= got << 2
            if full.evicted < full.capacity * self.HANDOVER_FILLS:
                judge, counted = half, ~got & 3
            else:
                self._half = None  # its work is done: the full-size pair judges from now
                counted = 3
        cursor[1] = broken
        self._until_decay -= 1
        if self._until_decay <= 0:  # halving both counts never makes the other order lead
            self._until_decay = full.capacity * self.DECAY_FILLS
            full.restored = [r / 2 for r in full.restored]
            if half is not None:
                half.restored = [r / 2 for r in half.restored]
        if counted:  # the leader changes only with the counts
            lead = judge.leader(self._lead, self.MARGIN, self.EVIDENCE if self._lead == _PREFIX else 0.0)
            if lead != self._lead:
                self._lead = lead
                self.switches += 1

    def _sized(self, dkey: Hashable) -> bool:
        """Ask the owner's size and set the caches' capacities from it, halving the rate past
        ``_halve_above``; False if dialog ``dkey`` left the sample."""
        self._until_resident = self.RESIDENT_EVERY
        resident = self._resident()
        halved = resident > self._halve_above
        while resident > self._halve_above:
            self._halve_rate()
        scaled = resident >> self.shift
        self._full.capacity = scaled if scaled > 64 else 64
        if self._half is not None:
            self._half.capacity = max(64, int(scaled * self._half.scale))
        return not halved or self.sampled(dkey)

    def _halve_rate(self) -> None:
        """Sample half as many dialogs: drop the others' blocks from the miniature caches."""
        self.shift += 1
        self.mask = (1 << self.shift) - 1
        self._halve_above = self.MIN_BLOCKS << (self.shift + 1) if self.shift < self.MAX_SHIFT else 1 << 62
        for trial in (self._full, self._half):
            if trial is None:
                continue
            prefix = trial.caches[_PREFIX]
            prefix.young_adds = max(1, PrefixPolicy.young_adds >> self.shift)
            prefix.reserve_from = max(1, PrefixPolicy.reserve_from >> self.shift)
            for cache in trial.caches:
                cache.remove_dialogs(lambda dkey: not self.sampled(dkey))
        for dkey in [d for d in self._cursors if not self.sampled(d)]:
            del self._cursors[dkey]


class OrderTally:
    """Evictions chosen under each order, for an adaptive owner's status.

    The owner notes the victim it chose and the order it chose it in
    (``chose``); the eviction counts when that victim is removed
    (``removed``: a victim a delete took first, or one never removed, is not
    counted); ``moved`` follows a victim the owner renumbers (a card's row).
    """

    __slots__ = ("counts", "_victim", "_order")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(EXPERTS, 0)
        self._victim: Hashable | None = None
        self._order = EXPERTS[0]

    def chose(self, victim: Hashable | None, order: str) -> None:
        self._victim, self._order = victim, order

    def removed(self, ident: Hashable) -> None:
        if self._victim is not None and self._victim == ident:
            self.counts[self._order] += 1
            self._victim = None

    def moved(self, src: Hashable, dst: Hashable) -> None:
        if self._victim is not None and self._victim == src:
            self._victim = dst
