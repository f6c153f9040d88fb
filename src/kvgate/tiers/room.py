"""What one card may hold, and the room its writes in flight take on its medium.

``CardRoom`` is bookkeeping only: ``ManagedCard`` reads the medium's free
space and evicts; the room says how much may be held (``capacity``), what
is left free on the medium (``reserve``), how far writes in flight may go
past the capacity before the eviction after them catches up (``slack``),
and which objects of a batch it can take at all (``plan``).

Why a batch takes its room before its first byte: started whole, a batch
larger than the medium's free room met ENOSPC halfway with nothing of it
indexed yet, and the card was lowered to a share of what was indexed: 0 (a
96 MiB batch to a 64 MiB tmpfs card stored nothing, then nor did the next
two, until the card was sized again).

Threading contract: the event loop only, like its card.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvgate.cards import Card
from kvgate.config import Config

log = logging.getLogger("kvgate.long")

DEFAULT_RESERVE_MAX = 1 << 30  # the most a card keeps free on its medium when card_reserve is not set
UNBOUNDED_SLACK = 1 << 62  # the slack of a configured capacity the medium has not refused yet


class CardRoom:
    """The capacity of one card, the reserve it leaves on its medium, and the bytes its writes in flight take.

    ``capacity``: what the card's index may hold.  A configured
    ``card_capacity``, or the card's objects plus its medium's free space
    less ``reserve`` (``size``), read at start and every ``resize``.
    ``writing``: bytes of writes under way, taken by ``plan`` and given back
    by the writer once it has indexed what it wrote.
    """

    def __init__(self, card: Callable[[], Card], cfg: Config, describe: Callable[[], str]) -> None:
        self._card = card  # the card as it is now (a relocated card is another object)
        self.cfg = cfg
        self.describe = describe
        self.capacity = 0
        self.reserve = 0  # what the card leaves free on its medium, as of its last free-space read
        self.writing = 0
        self._medium_full = False  # a configured capacity was found larger than the medium
        self._warned_empty = False  # said that it can hold nothing (said again only after it could hold some)

    @property
    def sized_by_medium(self) -> bool:
        """Whether the capacity follows the medium's free space (``card_capacity`` not set)."""
        return self.cfg.card_capacity is None

    def set(self, capacity: int, why_empty: str) -> None:
        """Set what the card may hold; say loudly when that becomes nothing (``why_empty``: cause and fix)."""
        self.capacity = max(0, capacity)
        if self.capacity == 0 and not self._warned_empty:
            self._warned_empty = True
            log.warning("%s can hold nothing: %s; long puts to it fail until it can", self.describe(), why_empty)
        elif self.capacity > 0 and self._warned_empty:
            self._warned_empty = False
            log.warning("%s can hold objects again: capacity %d bytes", self.describe(), self.capacity)

    def reserve_for(self, free: int, used: int) -> int:
        """What the card leaves free on its medium, given its free space now (and remembered: ``reserve``).

        ``card_reserve``, or by default a tenth of what the card could hold
        (its objects and the free space), at most ``DEFAULT_RESERVE_MAX``:
        a fixed 1 GiB left a 64 MiB tmpfs or a nearly full disk with no
        room at all, and a tenth of a large NVMe is more than a filesystem
        needs to stay fast.  Redis cards keep none (``Card.reserve_bytes``).
        """
        wanted = self.cfg.card_reserve
        if wanted is None:
            wanted = min(DEFAULT_RESERVE_MAX, (used + free) // 10)
        self.reserve = self._card().reserve_bytes(wanted)
        return self.reserve

    def size_at_start(self, free: int, used: int) -> None:
        """At start: what the index snapshot says the card holds plus what is free beyond the reserve, never
        less than it holds (the check against the card adds or takes back what it finds, and sizes the card
        again at its end: nothing is evicted on the snapshot's word)."""
        self.capacity = max(0, free - self.reserve_for(free, used)) + used

    def size(self, free: int, used: int) -> None:
        """A card sized by its medium: what it holds plus what is free, less the reserve."""
        reserve = self.reserve_for(free, used)
        self.set(used + free - reserve, self._card().why_empty(free, used, reserve))

    def shrink_to_medium(self, free: int, used: int) -> bool:
        """A write found the medium full: the capacity becomes at most what the card holds plus what is free
        now (less the reserve, for a card sized by its medium).  True when that lowered it.

        A configured capacity lowered so is the medium's own size from then
        on: writes take their room before they start (``slack`` 0).
        """
        reserve = self.reserve_for(free, used) if self.sized_by_medium else 0
        fits = used + free - reserve
        if fits >= self.capacity:
            return False
        self._medium_full = not self.sized_by_medium
        log.warning("%s is full; capacity lowered to %d bytes", self.describe(), max(0, fits))
        self.set(fits, self._card().why_empty(free, used, reserve))
        return True

    @property
    def slack(self) -> int:
        """What the medium takes beyond ``capacity``, which writes in flight may use until the eviction after
        them catches up.  A card sized by its medium: the reserve it keeps free there (none on Redis, whose
        free space already leaves the server its own).  A configured ``card_capacity``: room enough, as
        configured, until the medium runs full; from then on (``shrink_to_medium``) nothing."""
        if self.sized_by_medium:
            return self.reserve
        return 0 if self._medium_full else UNBOUNDED_SLACK

    def plan(self, sizes: list[int]) -> int:
        """How many leading objects of a batch (``sizes``: ``padded_object_size`` of each) the card can hold beside
        the writes in flight.  The batch is cut from its end: a restore needs a prefix, and a batch is a
        request's blocks in order."""
        room = self.capacity - self.writing
        total, n = 0, 0
        for s in sizes:
            if total + s > room:
                break
            total += s
            n += 1
        return n

    def evict_to(self, total: int) -> int:
        """What the index may hold while a batch of ``total`` bytes is written: the medium must have room for
        it beside the other writes in flight (``capacity`` plus ``slack``)."""
        return self.capacity + self.slack - self.writing - total
