"""The default eviction policy: ``PrefixPolicy``, in whichever of its two orders a referee finds winning.

``PrefixPolicy`` keeps two orders of its dialogs at once: "prefix" (its
segments: one-off blocks first, blocks used again kept) and "recency" (LRU
by dialog).  Both cut a dialog from its tail, so what stays is always a
usable prefix.  ``AdaptivePolicy`` feeds every add and read to a
``Referee`` (kvgate.tiers.referee), which replays them on a sample of
dialogs in one small cache per order, and evicts in the order that would
have restored more lately.  It counts which order chose each eviction
(``decided``), so an operator can see what it followed.

Costs beside ``PrefixPolicy``'s: one more ordered-dict move per add or
read (the recency order), a test of the dialog digest's bits, and for the
sampled dialogs a few calls into the referee's small caches.  Same threading
as every policy: its owner calls it from one thread.
"""

from __future__ import annotations

from kvgate.tiers.eviction import Ident, PrefixPolicy, SkipFn
from kvgate.tiers.referee import EXPERTS, Referee


class AdaptivePolicy(PrefixPolicy):
    """``PrefixPolicy`` whose order follows its ``Referee``'s leader (see the module docstring)."""

    name = "adaptive"

    def __init__(self) -> None:
        super().__init__(EXPERTS[0])
        self.referee = Referee()
        self.decided = dict.fromkeys(EXPERTS, 0)  # evictions chosen under each order
        self._chosen: tuple[Ident, str] | None = None

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        super().add(ident, size, dialog, position, klass, tail)
        self._referee_saw(ident, tail, True)

    def touch(self, ident: Ident) -> None:
        super().touch(ident)
        self._referee_saw(ident, False, False)

    def _referee_saw(self, ident: Ident, tail: bool, added: bool) -> None:
        where = self.where(ident)
        if where is not None:
            k, dkey, position = where
            self.referee.referenced(ident, dkey, position, k, tail, added, len(self))
            self.order = self.referee.leader

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        victim = super().choose_victim(skip)
        self._chosen = None if victim is None else (victim, self.order)
        return victim

    def evictions_by_order(self) -> dict[str, int]:
        return dict(self.decided)

    def remove(self, ident: Ident) -> None:
        chosen = self._chosen
        if chosen is not None and chosen[0] == ident:
            self.decided[chosen[1]] += 1
            self._chosen = None
        super().remove(ident)
