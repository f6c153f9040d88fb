"""Keeps the gateway's shared heads (``kvgate.heads``) and its cards' lists in step.

Every ``PERIOD_S`` the heads learned here since the last round go to every
active card that keeps a list (its ``heads`` channel,
``kvgate.cards.heads.HeadsChannel``), and what the cards hold comes back; a
card that missed a round (out of service, a failed write) gets the whole set
once it is back.  Before the gateway listens, one round reads the cards, so
a restarted gateway answers with the marks it gave before.

Runs on the loop; the card I/O runs on each card's threads with its
deadline.  A card answers with its whole list (up to ``CARD_MAX_HEADS``
ids) every round; what is new since that card's last answer is worked out
on the card's thread, so the loop merges only that (merging a whole
131,072-id list took 40 ms of the loop here).  A failure here never takes a
card out of service: the list is small and a round later is soon enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import numpy as np

from kvgate.cards.heads import HeadsChannel
from kvgate.heads import SharedHeads
from kvgate.tiers.card import ManagedCard
from kvgate.tiers.cardset import CardSet

log = logging.getLogger("kvgate.heads")

PERIOD_S = 2.0


class HeadSync:
    def __init__(self, heads: SharedHeads, card_set: CardSet) -> None:
        self.heads = heads
        self.card_set = card_set  # (its ``cards`` now, each round)
        self.rounds = 0
        self.errors = 0
        self._behind: set[str] = set()  # card serials that missed a round
        self._synced: set[str] = set()  # card serials that have had the whole set once
        self._answers: dict[str, np.ndarray] = {}  # card serial -> its list at its last answer, sorted

    async def sync_once(self) -> None:
        new = self.heads.take_new()
        cards = [cs for cs in self.card_set.cards if cs.active and cs.serial and cs.card.heads is not None]
        results = await asyncio.gather(*(self._one(cs, new) for cs in cards), return_exceptions=True)
        serials = {cs.serial for cs in self.card_set.cards}
        for gone in [s for s in self._answers if s not in serials]:  # a card that left the set: its list goes
            del self._answers[gone]
        missed = False
        for cs, r in zip(cards, results):
            if isinstance(r, BaseException):
                if not isinstance(r, (OSError, asyncio.TimeoutError)):
                    log.exception("shared heads: sync with card %s failed", cs.where, exc_info=r)
                self.errors += 1
                missed = True
                self._behind.add(cs.serial or "")
                log.debug("shared heads: card %s missed a round: %s", cs.where, r)
                continue
            answer, r = r
            self._answers[cs.serial or ""] = answer
            if cs.read_only:  # it was only read: it gets the whole set once it takes writes
                self._behind.add(cs.serial or "")
            else:
                self._behind.discard(cs.serial or "")
                self._synced.add(cs.serial or "")
            self.heads.merge(r)
        if missed or not cards:
            self.heads.put_back(new)
        self.rounds += 1

    async def _one(self, cs: ManagedCard, new: set[int]) -> tuple[np.ndarray, list[int]]:
        serial = cs.serial or ""
        if serial in self._behind or serial not in self._synced:
            new = self.heads.all()
        if cs.read_only:
            new = set()
        return await cs.io.run(_merge_on_card, cs.card.heads, new, self._answers.get(serial))

    async def run(self) -> None:
        next_round = time.monotonic()
        while True:
            next_round += PERIOD_S
            await asyncio.sleep(max(0.0, next_round - time.monotonic()))
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one round
                log.exception("shared heads: a sync round failed")


def _merge_on_card(channel: HeadsChannel, new: Collection[int],
                   last: np.ndarray | None) -> tuple[np.ndarray, list[int]]:
    """(the card's list, sorted; the ids in it not in ``last``), on the card's thread."""
    got = channel.merge(new)
    answer = np.fromiter(got, dtype=np.uint64, count=len(got))
    answer.sort()
    fresh = answer if last is None else np.setdiff1d(answer, last, assume_unique=True)
    return answer, fresh.tolist()
