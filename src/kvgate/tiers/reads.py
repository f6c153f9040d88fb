"""A card's reads as the tiers see them: what one came to (``CardRead``), and which were prepared lately.

``ManagedCard.read`` answers a ``CardRead`` per object, turned from what the
card kind answered (a ``Header`` or an exception) in one place (``CardRead.of``);
the tiered store decides on its ``outcome``.  ``RecentlyPrepared`` keeps
``ManagedCard.hint_reads`` from preparing the same objects on every lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvgate.cards import BufferTooSmall, Header, ObjectCorrupt, ObjectMissing, ObjectTooNew


class ReadOutcome(Enum):
    """What one object's read from a card came to."""

    HIT = "hit"  # the payload is in the destination; ``header`` says what it was
    MISSING = "missing"  # not on the card
    TOO_SMALL = "too_small"  # the destination is smaller than the object; ``needed`` bytes are
    CORRUPT = "corrupt"  # a bad object, deleted: the destination holds garbage
    TOO_NEW = "too_new"  # written by a newer kvgate, left in place: a miss here
    FAILED = "failed"  # the card failed or passed its deadline; ``error`` says how


@dataclass(slots=True)
class CardRead:
    """One object's read (``ManagedCard.read``)."""

    outcome: ReadOutcome
    header: Header | None = None
    needed: int = 0
    error: BaseException | None = None

    @classmethod
    def of(cls, r: Header | BaseException) -> CardRead:
        """From what a card's ``read_many_into`` answers for one object."""
        if isinstance(r, Header):
            return cls(ReadOutcome.HIT, header=r)
        if isinstance(r, BufferTooSmall):
            return cls(ReadOutcome.TOO_SMALL, needed=r.needed, error=r)
        if isinstance(r, ObjectTooNew):  # before ObjectMissing, which it is a kind of
            return cls(ReadOutcome.TOO_NEW, error=r)
        if isinstance(r, ObjectMissing):
            return cls(ReadOutcome.MISSING, error=r)
        if isinstance(r, ObjectCorrupt):
            return cls(ReadOutcome.CORRUPT, error=r)
        return cls(ReadOutcome.FAILED, error=r)


class RecentlyPrepared:
    """Which objects a card prepared for reading lately (``ManagedCard.hint_reads``), by key digest.

    Each lookup an engine makes of a waiting prompt found the same objects,
    and preparing them cost the card's hint thread a path walk (a ``stat``)
    each: on 2 shared cores, 10 ms of CPU per 1,000 keys, taken from the
    loop, lookups of 6.7 ms instead of 1.3 ms.  Once prepared, a file's
    dentry and inode stay cached for far longer than ``PERIOD_S``.  Two bit
    tables of ``BITS`` entries, two bits per digest, switched every period,
    so a digest is remembered for one to two periods; a false "prepared"
    (under 1 % while fewer than 50,000 objects a period are prepared) only
    skips a hint.
    """

    BITS = 1 << 20
    PERIOD_S = 30.0

    def __init__(self) -> None:
        self._current = np.zeros(self.BITS, bool)
        self._previous = np.zeros(self.BITS, bool)
        self._since = time.monotonic()

    def _bits(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo = digests[:, 0]
        mask = np.uint64(self.BITS - 1)
        return (lo & mask).astype(np.int64), ((lo >> np.uint64(20)) & mask).astype(np.int64)

    def fresh(self, digests: np.ndarray) -> np.ndarray:
        """Which of ``digests`` (``digest_array``) were not prepared lately."""
        now = time.monotonic()
        if now - self._since > self.PERIOD_S:
            self._previous, self._current = self._current, self._previous
            self._current[:] = False
            self._since = now
        a, b = self._bits(digests)
        seen = (self._current[a] & self._current[b]) | (self._previous[a] & self._previous[b])
        return ~seen

    def note(self, digests: np.ndarray) -> None:
        a, b = self._bits(digests)
        self._current[a] = True
        self._current[b] = True
