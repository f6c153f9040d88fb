"""Whether one card is in service: the state machine its I/O outcomes drive.

Called only from the event loop by the ``ManagedCard`` that owns it, with
the outcome of each I/O (``note``) and of each health check (``checked``);
it does no I/O itself, never blocks, and logs its transitions.

``io_timeout_strikes`` I/Os in a row that fail or pass the deadline take a
card out of service; a card that is gone (``CardUnavailable``) goes out at
once.  Out of service, its lookups are misses and its writes fail at once.
A card that answers its check again comes back at once, or after
``IO_ERROR_COOLDOWN_S`` when I/O errors (not deadlines) took it out.  A card
that refuses writes as read-only (EROFS: a filesystem remounted read-only
after errors, a read-only export, a Redis replica) is not taken out: it goes
on serving reads, takes no writes, and is tried for writability every
``READ_ONLY_RECHECK_S``; taking it out would lose every conversation it
holds, and bringing it back would only fail its next write.  In cluster mode
the cluster may also hold a card out (``hold_out``: its agent stopped
reporting it alive); it stays out until released, then comes back at its
next passed check.
"""

from __future__ import annotations

import errno
import logging
import time
from enum import Enum
from typing import Callable

from kvgate.cards import BufferTooSmall, CardUnavailable, ObjectCorrupt, ObjectMissing

log = logging.getLogger("kvgate.long")

IO_ERROR_COOLDOWN_S = 10.0
READ_ONLY_RECHECK_S = 10.0
# After a deadline passed on a card, lookups send it no read hints for this
# many I/Os: its hint thread may be stuck with the rest.
SUSPECT_IOS = 1000


class Outcome(Enum):
    """What one I/O outcome meant for the card (``CardHealth.note``)."""

    OK = "ok"  # it answered (object-level answers included: missing, corrupt, too small)
    FULL = "full"  # ENOSPC: the medium holds less than thought; the owner shrinks and evicts
    READ_ONLY = "read_only"  # EROFS: serves reads, takes no writes
    STRIKE = "strike"  # an error or a deadline, counted toward taking it out


class CardHealth:
    """In service or not, read-only or not, and the I/O error counts of one card.

    ``describe()`` names the card for log lines ("card /mnt/a (serial)").
    """

    def __init__(self, strikes_allowed: int, describe: Callable[[], str]) -> None:
        self.strikes_allowed = strikes_allowed
        self.describe = describe
        self.active = False
        self.strikes = 0
        self.inactive_since = 0.0
        self.taken_out_by_error = False
        self.suspect = 0  # I/Os left during which the card gets no read hints
        self.read_only = False
        self.read_only_since = 0.0
        self.checks = 0  # health checks passed
        self.held_out: str | None = None  # why the cluster holds the card out of service (hold_out)
        self.errors = 0
        self.timeouts = 0

    def note(self, err: BaseException | None) -> Outcome:
        """Feed one I/O outcome; ``err`` None is success.

        Object-level answers (missing, corrupt, too small) are the card
        working; only OSErrors and deadlines count as strikes.
        """
        if err is None or isinstance(err, (ObjectMissing, ObjectCorrupt, BufferTooSmall)):
            self.strikes = 0
            if self.suspect:
                self.suspect -= 1
            return Outcome.OK
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            self.errors += 1
            return Outcome.FULL
        if isinstance(err, OSError) and err.errno == errno.EROFS:
            self.errors += 1
            self.strikes = 0  # it answered: the card works, for reads
            if not self.read_only:
                self.read_only, self.read_only_since = True, time.monotonic()
                log.warning("%s is read-only: it goes on serving reads and takes no writes; "
                            "writes are tried again every %.0f s", self.describe(), READ_ONLY_RECHECK_S)
            return Outcome.READ_ONLY
        if isinstance(err, TimeoutError):  # our deadline, or the medium's own (a Redis socket timeout)
            self.timeouts += 1
            self.suspect = SUSPECT_IOS
        else:
            self.errors += 1
        self.strikes += 1
        if self.active and (isinstance(err, CardUnavailable) or self.strikes >= self.strikes_allowed):
            self.take_out(f"{type(err).__name__}: {err}", by_error=not isinstance(err, TimeoutError))
        return Outcome.STRIKE

    def take_out(self, why: str, by_error: bool) -> None:
        self.active = False
        self.inactive_since = time.monotonic()
        self.taken_out_by_error = by_error
        log.warning("%s moved from active to inactive: %s", self.describe(), why)

    def bring_back(self) -> None:
        self.active = True
        self.strikes = 0
        log.warning("%s moved from inactive to active", self.describe())

    def hold_out(self, why: str) -> None:
        """Out of service, whatever its checks say, until ``release`` (cluster mode: reported dead)."""
        self.held_out = why
        if self.active:
            self.take_out(why, by_error=False)

    def release(self) -> None:
        """The cluster no longer holds the card out: back at its next passed check (within a second)."""
        if self.held_out is not None:
            self.held_out = None
            log.warning("%s is reported alive again", self.describe())

    def checked(self) -> None:
        """The card passed a health check (its label read back right)."""
        self.checks += 1

    def come_back_if_due(self) -> None:
        """Back in service after a passed check, unless I/O errors took it out less than the cooldown ago."""
        if self.active or self.held_out is not None:
            return
        if self.taken_out_by_error and time.monotonic() - self.inactive_since < IO_ERROR_COOLDOWN_S:
            return
        self.bring_back()

    def writable_again(self) -> None:
        self.read_only = False
        log.warning("%s takes writes again", self.describe())

    def recheck_due(self) -> bool:
        return self.read_only and time.monotonic() - self.read_only_since >= READ_ONLY_RECHECK_S

    def still_read_only(self) -> None:
        self.read_only_since = time.monotonic()

    @property
    def hints_ok(self) -> bool:
        """Whether the card may be sent read hints now (in service, no deadline passed lately)."""
        return self.active and not self.suspect
