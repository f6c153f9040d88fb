"""Which cards a gateway in cluster mode holds out of service because their agents stopped reporting them.

An agent reports each card it serves under its lease (``alive/<serial>``);
the key goes when the lease lapses (the agent died, froze or lost etcd).
Liveness only ever changes health, never the view: a card held out keeps
its slots (its lookups are misses, its writes fail at once) and comes back
as soon as it is reported again, with everything it held.

Four rules keep liveness from costing conversations that are fine:

- A card is held out only after ``sick_polls`` polls in a row found it
  unreported (a keep-alive that came late is not a dead card).
- A lapsed lease is one observer's word (the agent's, or its link to etcd):
  a card is held out only when this gateway's own check of it fails too
  (``ViewFollower`` reads its label before it calls ``hold``).  A card on a
  shared filesystem whose agent died, or whose agent lost etcd, answers and
  stays in; it is asked again at each poll while it goes unreported.
- Only a card that was reported at least once since this gateway started is
  judged: a card registered by hand, with no agent, is never held out (its
  own I/O health still takes it out if it fails).
- Never every card at once: when every card of the set would be out, this
  gateway is the one cut off (from etcd's answers or from the agents' view),
  not the cards; the ones not yet held stay in, and it says so once.

Pure bookkeeping: fed by ``ViewFollower`` from the event loop with each poll
etcd answered; no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

log = logging.getLogger("kvgate.cluster")

INTERVAL_S: Final = 1.0  # an agent's round: its cards, and the registry when it leads
LIVENESS_TTL_S: Final = 5  # the lease of an agent's alive/ keys: a card unreported this long is not alive


class Liveness:
    """The cards held out of service for want of liveness reports (module docstring)."""

    def __init__(self, sick_polls: int) -> None:
        if sick_polls < 1:
            raise ValueError(f"sick_polls must be at least 1, got {sick_polls}")
        self.sick_polls = sick_polls
        self.seen: set[str] = set()  # reported alive at least once since this gateway started
        self.missed: dict[str, int] = {}  # polls in a row without a report, of cards seen before
        self.held: set[str] = set()
        self.everything_dead = False  # the last poll would have held every card out (said once)

    def observe(self, serials: Collection[str], alive: Collection[str]) -> tuple[set[str], set[str]]:
        """One poll: ``serials`` are the cards of the set, ``alive`` those reported now.

        Returns the cards that went unreported long enough to be held out (``hold`` the ones whose own check
        fails too) and the ones to release now.
        """
        cards = set(serials)
        release = set()
        for serial in cards:
            if serial in alive:
                self.seen.add(serial)
                self.missed.pop(serial, None)
                if serial in self.held:
                    release.add(serial)
            elif serial in self.seen:
                self.missed[serial] = self.missed.get(serial, 0) + 1
        for serial in [s for s in self.missed if s not in cards]:
            del self.missed[serial]
        self.held = (self.held & cards) - release
        sick = {s for s, n in self.missed.items() if n >= self.sick_polls} - self.held
        if sick and self.held | sick >= cards:
            if not self.everything_dead:
                log.error("every card looks dead from this gateway (%d not reported alive for %d polls): this "
                          "gateway is cut off, not the cards; none more is held out (their own I/O errors still "
                          "take them out)", len(sick), self.sick_polls)
            self.everything_dead = True
            sick = set()
        elif self.everything_dead and not sick:
            self.everything_dead = False
        return sick, release

    def hold(self, serials: Collection[str]) -> None:
        """Hold out these cards of ``observe``'s first set (they did not answer this gateway either)."""
        self.held |= set(serials) & set(self.missed)
