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
``MARGIN``, so a near tie does not make the owner flip back and forth.
A second pair of caches at half the size runs ahead while the owner fills
(a verdict needs evictions, then the time a block takes to come back), and
judges until the full-size pair has evicted a fill of its own.

Memory is bounded: each miniature cache holds at most twice ``MIN_BLOCKS``
blocks (the rate halves as the owner grows), and each remembers the
dialogs it has seen in one ``RecentKeys`` pair and a bounded table of
request cursors.  Cost: a sampled reference is a few ``PrefixPolicy``
calls; the rest cost one test of a digest's bits.

Owned by one policy, called from its thread (as the policies are).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Final

from kvgate.tiers.eviction import PrefixPolicy

EXPERTS: Final = PrefixPolicy.ORDERS


class _Trial:
    """One miniature cache per order, all of ``scale`` times the sampled share of the owner's capacity."""

    __slots__ = ("scale", "caches", "restored", "evicted", "capacity")

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.caches = [PrefixPolicy(e) for e in EXPERTS]
        self.restored = [0.0] * len(EXPERTS)  # decayed counts of blocks each would have restored
        self.evicted = 0
        self.capacity = 64

    def referenced(self, ident: Hashable, label: bytes, position: int, klass: int, tail: bool, broken: int) -> int:
        """One reference in every cache; ``broken``: a bit per cache whose prefix broke earlier in this request.
        Returns the bits of the caches whose prefix is broken now."""
        for i, cache in enumerate(self.caches):
            bit = 1 << i
            if ident in cache:
                if not broken & bit:
                    self.restored[i] += 1
                cache.touch(ident)
                continue
            broken |= bit
            cache.add(ident, 0, label, position, klass, tail=tail)
            while len(cache) > self.capacity:
                victim = cache.choose_victim()
                if victim is None:
                    break
                cache.remove(victim)
                self.evicted += 1
        return broken

    def leader(self, current: int, margin: float) -> int:
        """The order ahead by more than ``margin``, else ``current``."""
        best = max(range(len(EXPERTS)), key=self.restored.__getitem__)
        if best != current and self.restored[best] > self.restored[current] * (1 + margin) + 2:
            return best
        return current


class Referee:
    """See the module docstring.  The owner calls ``referenced`` for every add and read of a block, with the
    resident count it holds, and reads ``leader``."""

    MIN_BLOCKS = 2048  # the miniature caches' least capacity: sets the sampling rate
    MAX_SHIFT = 16  # a rate of at least 1/65,536
    MARGIN = 0.02  # the other order must be ahead by this much before the leader changes
    DECAY_FILLS = 32  # the counts halve every this many cache fills of sampled references
    INIT = EXPERTS[0]

    def __init__(self) -> None:
        self.shift = 0
        self._lead = EXPERTS.index(self.INIT)
        self.switches = 0
        # The full-size trial judges; the half-size one runs ahead (it fills at half the owner's size), so
        # its verdict is there when the owner's first evictions come, until the full one has evicted a fill.
        self._full = _Trial(1.0)
        self._trials = [self._full, _Trial(0.5)]
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
        if not self.shift:
            return True
        if isinstance(dkey, bytes):
            low = int.from_bytes(dkey[:4], "little")
        else:
            low = hash(dkey) & 0xFFFF_FFFF
        return not low & ((1 << self.shift) - 1)

    def referenced(self, ident: Hashable, dkey: Hashable, position: int, klass: int, tail: bool, added: bool,
                   resident: int) -> None:
        """Block ``ident`` (of dialog ``dkey`` at ``position``) was added (``added``) or read; the owner holds
        ``resident`` blocks."""
        if resident > (self.MIN_BLOCKS << (self.shift + 1)) and self.shift < self.MAX_SHIFT:
            self._halve_rate()
        if not self.sampled(dkey):
            return
        cursor = self._cursors.get(dkey)
        if cursor is None or position <= cursor[0]:  # a new request of this dialog starts from its head
            cursor = self._cursors[dkey] = [position, 0]
            if len(self._cursors) > 4 * self._full.capacity:
                self._cursors.popitem(last=False)
        else:
            cursor[0] = position
        self._cursors.move_to_end(dkey)
        label = dkey if isinstance(dkey, bytes) else b""
        for t, trial in enumerate(self._trials):
            trial.capacity = max(64, int((resident >> self.shift) * trial.scale))
            cursor[1] |= trial.referenced(ident, label, position, klass, tail, cursor[1] >> (2 * t) & 3) << (2 * t)
        self._until_decay -= 1
        if self._until_decay <= 0:
            self._until_decay = self._full.capacity * self.DECAY_FILLS
            for trial in self._trials:
                trial.restored = [r / 2 for r in trial.restored]
        judge = self._trials[-1]
        if len(self._trials) > 1 and self._full.evicted >= self._full.capacity:
            self._trials = [self._full]  # the half-size trial's work is done: the full one judges from now
            judge = self._full
        lead = judge.leader(self._lead, self.MARGIN)
        if lead != self._lead:
            self._lead = lead
            self.switches += 1

    def _halve_rate(self) -> None:
        """Sample half as many dialogs: drop the others' blocks from the miniature caches."""
        self.shift += 1
        for trial in self._trials:
            for cache in trial.caches:
                cache.young_adds = max(1, PrefixPolicy.young_adds >> self.shift)
                cache.reserve_from = max(1, PrefixPolicy.reserve_from >> self.shift)
                cache.remove_dialogs(lambda dkey: not self.sampled(dkey))
        for dkey in [d for d in self._cursors if not self.sampled(d)]:
            del self._cursors[dkey]
