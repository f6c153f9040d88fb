"""Where each object belongs among the cards: the slot map over their serials, and the maps of before.

``CardLayout`` keeps the slot map (rendezvous placement over the serials of
the cards that take writes, ``kvgate.placement``), its fingerprint (what every
gateway sharing the cards must agree on), and the maps before each change
the mover has not settled yet.  It answers where a key belongs
(``card_for``, ``cards_for``), where it may still be while a change settles
(``earlier_homes``), and which card serves each slot (``slot_cards``).  Where
a key *is* (any index may hold it) is ``kvgate.tiers.finder``'s rule.

Who calls it: the card set (``CardSet``) re-maps it at each change of its
membership (``change``) and settles it after the mover's rounds
(``settle``); the card tier, the finder and the mover ask it where keys
belong.  Threading: every method runs on the gateway's event loop, does no
I/O and never blocks; it reads the set's cards by serial (``cards``, the
set's own mapping, never written here).
"""

from __future__ import annotations

import logging
from typing import Mapping

from kvgate.config import Config
from kvgate.errors import KvgateError
from kvgate.keys import NO_DIALOG, key_digest
from kvgate.placement import SlotMap, fingerprint, slot_of
from kvgate.tiers.card import ManagedCard

log = logging.getLogger("kvgate.long")

# How many changes back a miss still asks a slot's earlier card while the
# mover has not settled them (``CardLayout.earlier_homes``): each is one more card
# a miss may ask, and several changes within one move are rare.
UNSETTLED_LAYOUTS = 4


class LayoutMismatch(KvgateError, RuntimeError):
    """The configured key_layout_fingerprint differs from the cards found."""


class CardLayout:
    """The slot map, its fingerprint and the unsettled maps of before (module docstring).  ``cards``: the
    card set's cards by serial (read only)."""

    def __init__(self, cfg: Config, cards: Mapping[str, ManagedCard]) -> None:
        self.cfg = cfg
        self._cards = cards
        self.slot_map = SlotMap([], 1)
        self.fingerprint = ""
        # The slot maps before each change the mover has not settled yet (newest last): a key not in any
        # index (another gateway of a shared card wrote it) may still be on its slot's card of then.
        self._unsettled: list[SlotMap] = []

    @property
    def slots(self) -> int:
        return self.cfg.storage_slots

    # ---- changes ------------------------------------------------------------

    def remap(self, serials: list[str]) -> None:
        """Slots over ``serials`` (the cards that take writes).

        ``storage_slots`` is a fixed count, never the number of cards: tied
        to the card count, adding a card would move every key (a new slot
        count re-maps them all), and with a few slots rendezvous hashing
        leaves some cards with none (4 slots over 4 cards land one per card
        only 9 % of the time).
        """
        try:
            self.slot_map = SlotMap(serials, self.slots)
        except ValueError as e:
            raise LayoutMismatch(str(e)) from None
        self.fingerprint = fingerprint(self.slot_map, self.cfg.num_dbs, self.cfg.key_placement)
        log.info("Key layout fingerprint %s", self.fingerprint)
        n = len(self.slot_map.serials)
        if n > 1:
            shares = ", ".join(f"{self._cards[s].location}: {len(self.slot_map.slots_of(s))}"
                               for s in self.slot_map.serials)
            log.info("slots per card: %s", shares)
            if self.slot_map.slots < 16 * n:
                log.warning("storage_slots is %d for %d cards: shares are uneven (a card may get none); "
                            "16 slots per card or more spread the load", self.slot_map.slots, n)

    def change(self, serials: list[str]) -> None:
        """The set changed: the map in force becomes one of before (until ``settle``), ``serials`` get the slots."""
        self._unsettled = [*self._unsettled[-(UNSETTLED_LAYOUTS - 1):], self.slot_map]
        self.remap(serials)

    def settle(self) -> None:
        """The mover settled every change: misses no longer fall back to the cards slots had before."""
        self._unsettled.clear()

    @property
    def settling(self) -> bool:
        """Whether a change of the set is not settled yet (misses also ask ``earlier_homes``)."""
        return bool(self._unsettled)

    # ---- where keys belong -----------------------------------------------------

    def card_for(self, fkey: bytes, dialog: bytes) -> ManagedCard | None:
        """The card an object belongs on, or None when no card serves its slot now.

        An inactive card keeps its slots: its dialogs are misses until it is
        back, and are never written elsewhere where they would shadow it.
        """
        serial = self.slot_map.serial_of_slot(slot_of(key_digest(fkey), dialog, self.cfg.key_placement,
                                                      self.slot_map.slots))
        if serial is None:
            return None
        mc = self._cards[serial]
        return mc if mc.active else None

    def cards_for(self, fkeys: list[bytes], dialog: bytes) -> list[ManagedCard | None]:
        """``card_for`` of many keys of one request, computed once where placement allows.

        With dialog placement and a dialog mark, or a single slot, every key
        of the request lands on the same card: one hash instead of 1,000s.
        """
        if self._one_slot(dialog) or len(self.slot_map.serials) == 1:
            return [self.card_for(fkeys[0], dialog) if fkeys else None] * len(fkeys)
        return [self.card_for(k, dialog) for k in fkeys]

    def earlier_homes(self, fkey: bytes, dialog: bytes, home: ManagedCard | None) -> list[ManagedCard]:
        """While the mover settles changes: the cards ``fkey``'s slot had before, newest change first, each
        once, in service and other than ``home``: where to ask, in turn, when ``home`` does not hold it.

        So a join costs no hits of objects this gateway has not indexed (a
        shared card's objects another gateway wrote): until they are moved or
        the moves settle, a miss on the slot's new card asks its old ones (a
        slot that moved twice before the mover settled: both).
        """
        if not self._unsettled:
            return []
        slot = slot_of(key_digest(fkey), dialog, self.cfg.key_placement, self.slot_map.slots)
        out: list[ManagedCard] = []
        for before in reversed(self._unsettled):
            serial = before.serial_of_slot(slot % before.slots)
            mc = self._cards.get(serial) if serial is not None else None
            if mc is not None and mc is not home and mc.active and mc not in out:
                out.append(mc)
        return out

    def earlier_homes_of(self, fkeys: list[bytes], dialog: bytes, home: ManagedCard) -> list[list[ManagedCard]]:
        """``earlier_homes`` of many keys of one request, computed once where placement allows (as
        ``cards_for``)."""
        if not self._unsettled or not fkeys:
            return [[] for _ in fkeys]
        if self._one_slot(dialog):  # not "one card now": the maps of before may have had several
            return [self.earlier_homes(fkeys[0], dialog, home)] * len(fkeys)
        return [self.earlier_homes(k, dialog, home) for k in fkeys]

    def _one_slot(self, dialog: bytes) -> bool:
        """Whether every key of a request with this dialog mark lands in the same slot."""
        return self.slot_map.slots == 1 or (self.cfg.key_placement == "dialog" and dialog != NO_DIALOG)

    def slot_cards(self) -> list[ManagedCard | None]:
        """``card_for`` of every slot: the active card serving it, or None."""
        out: list[ManagedCard | None] = []
        for serial in self.slot_map.owner:
            mc = self._cards.get(serial) if serial is not None else None
            out.append(mc if mc is not None and mc.active else None)
        return out

    def slots_of(self, serial: str | None) -> int:
        """How many slots card ``serial`` serves now (0 for a draining or unknown card)."""
        return len(self.slot_map.slots_of(serial)) if serial in self.slot_map.serials else 0
