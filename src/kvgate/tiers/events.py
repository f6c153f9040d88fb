"""What the tiers store and drop, as a stream of changes (``TierChanges``), for whoever publishes it.

Contract:

- Who emits: the RAM tier (tier ``"ram"``) and each card (tier = the card's
  serial), through the one ``TierChanges`` the store owns (``store.changes``).
- What: ``TierChange(tier, kind, fkeys)``: ``stored`` when objects become
  visible in the tier (a RAM commit; a card row added with its key known),
  ``removed`` when they go (eviction, delete, ttl expiry, a namespace's
  clean, a corrupt or missing object), ``cleared`` when the whole tier
  goes (a RAM clear, a card cleaned or leaving the set; ``fkeys`` empty).
  ``fkeys`` are full keys (``kvgate.keys.full_key``).  A card knows rows
  by digest; with events on it keeps each row's key (``CardIndex``), but
  rows loaded from its index snapshot at start have none until a put,
  probe, read or lookup of that key names it (then ``stored``), and keys longer
  than ``KEY_BYTES`` are never kept: their changes are not emitted
  (``TierChanges.unkept`` counts them).
- Batches: per-key notes made during one turn of the event loop are
  emitted together after it (``loop.call_soon``), one ``TierChange`` per
  run of the same tier and kind, in the order they happened: a put of 32
  objects is one ``stored`` per tier, not 32.
- Thread: the event loop only (where all tier bookkeeping runs).  Without a
  running loop (synchronous tests) notes are emitted at once.
- Callbacks run on the loop and must not block nor take long (they delay
  every request); one that raises is logged and unsubscribed, and the
  change that raised still reaches the others: a subscriber never breaks
  a put.
- Cost: with nobody subscribed ``listening`` is False and the tiers check
  only that attribute: no key is copied, no Python work per key is done.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Final, Literal

log = logging.getLogger("kvgate.tiers.events")

STORED: Final = "stored"
REMOVED: Final = "removed"
CLEARED: Final = "cleared"
RAM_TIER: Final = "ram"
KEY_BYTES: Final = 64  # longest client key (namespace excluded) a card's index keeps for its events

Kind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class TierChange:
    """One batch of one kind of change of one tier (module docstring)."""

    tier: str  # "ram", or a card's serial
    kind: Kind
    fkeys: list[bytes]  # full keys; empty for "cleared"


Callback = Callable[[TierChange], None]


class TierChanges:
    """The tiers' changes, fanned out to subscribers (module docstring).  One per store, on the loop only."""

    def __init__(self) -> None:
        self._subscribers: list[Callback] = []
        self.listening = False  # the one attribute the tiers' hot paths check
        self._pending: list[tuple[str, str, bytes | None]] = []
        self._flush_due = False
        self.unkept = 0  # card rows whose key was too long to keep: their changes are not emitted

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        """Call ``callback(change)`` for every change from now on; returns the function that unsubscribes."""
        self._subscribers.append(callback)
        self.listening = True

        def unsubscribe() -> None:
            self._drop(callback)

        return unsubscribe

    def _drop(self, callback: Callback) -> None:
        try:
            self._subscribers.remove(callback)
        except ValueError:
            pass
        self.listening = bool(self._subscribers)
        if not self.listening:
            self._pending.clear()

    # ---- noting -----------------------------------------------------------------------

    def note(self, tier: str, kind: str, fkey: bytes | None) -> None:
        """One key's change (None for ``cleared``), emitted with the rest of this loop turn's.  Callers
        check ``listening`` first."""
        self._pending.append((tier, kind, fkey))
        self._schedule()

    def note_many(self, tier: str, kind: str, fkeys: list[bytes]) -> None:
        """``note`` of many keys of one tier and kind."""
        if fkeys:
            self._pending.extend((tier, kind, k) for k in fkeys)
            self._schedule()

    def _schedule(self) -> None:
        if self._flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Emit what was noted, one ``TierChange`` per run of one tier and kind, in order."""
        self._flush_due = False
        pending, self._pending = self._pending, []
        i, n = 0, len(pending)
        while i < n:
            tier, kind, _ = pending[i]
            j = i
            while j < n and pending[j][0] == tier and pending[j][1] == kind:
                j += 1
            if kind == CLEARED:
                self.emit(TierChange(tier, CLEARED, []))
            else:
                self.emit(TierChange(tier, kind, [p[2] for p in pending[i:j]]))  # type: ignore[misc]
            i = j

    def emit(self, change: TierChange) -> None:
        """Hand ``change`` to every subscriber now; one that raises is logged and dropped."""
        for cb in list(self._subscribers):
            try:
                cb(change)
            except Exception:
                log.exception("a subscriber of the tiers' changes raised; it is unsubscribed")
                self._drop(cb)
