"""The default eviction policy: ``PrefixPolicy``, in whichever of its two orders a referee finds winning.

``PrefixPolicy`` keeps two orders of its dialogs at once: "prefix" (its
segments: one-off blocks first, blocks used again kept) and "recency" (LRU
by dialog).  Both cut a dialog from its tail, so what stays is always a
usable prefix.  ``AdaptivePolicy`` feeds every add and read to a
``Referee`` (kvgate.tiers.referee), which replays them on a sample of
dialogs in one small cache per order, and evicts in the order that would
have restored more lately.  It counts which order chose each eviction
(``tally``), so an operator can see what it followed.

Costs beside ``PrefixPolicy``'s (which keeps both orders always): a test
of the dialog digest's bits per add or read, and for the sampled dialogs a
call into each of the referee's small caches (compiled where built):
1.3-1.5x ``PrefixPolicy`` per block of a replay, 0.61-0.70x what the
prefix order alone cost before the referee (benchmarks/eviction_cost.py,
docs/benchmarks.md).  Same threading as every policy: its owner calls it
from one thread.
"""

from __future__ import annotations

from kvgate.tiers.eviction import Ident, PrefixPolicy, SkipFn
from kvgate.tiers.referee import EXPERTS, OrderTally, Referee, sample_bits


class AdaptivePolicy(PrefixPolicy):
    """``PrefixPolicy`` whose order follows its ``Referee``'s leader (see the module docstring)."""

    name = "adaptive"

    def __init__(self) -> None:
        super().__init__(EXPERTS[0])
        self.referee = Referee(self.__len__)
        self.tally = OrderTally()  # evictions chosen under each order

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        super().add(ident, size, dialog, position, klass, tail)
        self._referee_saw(ident, tail)

    def touch(self, ident: Ident) -> None:
        super().touch(ident)
        self._referee_saw(ident, False)

    def _referee_saw(self, ident: Ident, tail: bool) -> None:
        """Tell the referee of an add or read, if the block's dialog is in its sample (a test of its bits:
        this runs for every block)."""
        where = self._where.get(ident)  # (class, segment, dialog key, position)
        if where is None:
            return
        referee = self.referee
        if referee.mask and sample_bits(where[2]) & referee.mask:
            return
        referee.referenced(ident, where[2], where[3], where[0], tail)
        self.order = referee.leader

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        victim = super().choose_victim(skip)
        self.tally.chose(victim, self.order)
        return victim

    def evictions_by_order(self) -> dict[str, int]:
        return dict(self.tally.counts)

    def remove(self, ident: Ident) -> None:
        self.tally.removed(ident)
        super().remove(ident)
