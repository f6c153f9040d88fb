"""Moves objects to the card placement names for them now, after the card set changed.

A card joined: about 1/(N+1) of the slots now belong to it, and what its
old cards hold of those slots is still found there (``KeyFinder.find`` asks
every card's index) but would be lost with them.  A card drains: none of its
objects are where placement puts them any more.  ``CardMover`` copies such
objects to their new card, hottest first (``EvictionPolicy.hottest_first``),
and lets the old copy go once the new one is indexed (``CardSet.note_written``
deletes copies on other cards), so a drained card empties as its objects
land elsewhere.

Runs as one task on the gateway's loop, woken by each change of the card
set.  Its reads and writes run on the cards' own threads at normal (not
urgent) priority, a few objects per call, and at most ``rate`` bytes a
second, so an engine's restores keep their place in front of it.

A key names its content (a prefix's hash), so a copy that races a client's
write of the same key writes the same bytes: whichever lands last, the object
is right.

A card's index knows its objects by key digest, so the mover finds what is
misplaced from the index's columns at once (the slot of each row, from its
dialog or key digest, as ``slot_of`` computes it), and reads each object's
header to learn its full key before it copies it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from kvgate.config import Config
from kvgate.tiers.layout import CardLayout
from kvgate.tiers.card import ManagedCard
from kvgate.tiers.index import EXPIRING
from kvgate.tiers.io import IoPool
from kvgate.tiers.rows import join_digest
from kvgate.tiers.copyorder import OrderColumns

log = logging.getLogger("kvgate.long")

BATCH = 8  # objects per read or write call
RETRY_S = 1.0  # after a round that could not move everything (a card out of service, full)
RETRY_MAX_S = 30.0  # the longest wait between rounds that moved nothing


class MovingSet(Protocol):
    """What a ``CardMover`` reads of the card set it moves objects within (``kvgate.tiers.cardset.CardSet``),
    and what it tells it: an object written to its card (``note_written``), moved off a draining one
    (``note_moved``)."""

    cfg: Config
    pool: IoPool
    cards: list[ManagedCard]
    layout: CardLayout

    def is_draining(self, mc: ManagedCard) -> bool: ...

    def note_written(self, mc: ManagedCard, fkeys: list[bytes], stored: list[int], payload_lens: list[int],
                     metas: list) -> list[bool]: ...

    def note_moved(self, src: ManagedCard, dst: ManagedCard, nbytes: int) -> None: ...


class Misplaced:
    """A card's misplaced objects, hottest first: ``(key digest, destination card)`` by index or slice."""

    def __init__(self, digests: np.ndarray, dst: np.ndarray, cards: list[ManagedCard]) -> None:
        self.digests, self.dst, self.cards = digests, dst, cards

    def __len__(self) -> int:
        return len(self.dst)

    def __getitem__(self, i: slice) -> list[tuple[bytes, ManagedCard]]:
        d, dst = self.digests[i], self.dst[i]
        return [(join_digest(lo, hi), self.cards[c]) for (lo, hi), c in zip(d.tolist(), dst.tolist())]


@dataclass(frozen=True)
class _MoveColumns:
    """A copy of what ``CardMover.misplaced`` needs of a card's index, for a pool thread to read."""

    lo: np.ndarray
    hi: np.ndarray
    order: OrderColumns
    flags: np.ndarray | None  # with a ttl
    created: np.ndarray | None  # with a ttl
    expired_before: int  # ns; with a ttl


def _misplaced(cols: _MoveColumns, owner: np.ndarray, by_dialog: bool, mine: int) -> tuple[np.ndarray, np.ndarray]:
    """On a pool thread: ``(key digests, destination numbers)`` of the rows whose slot's card (``owner``:
    a number per slot, -1 none) is another than ``mine``, hottest first.  Rows past the ttl are left
    out (they are deleted at their next lookup, not moved)."""
    n = len(cols.lo)
    rows = np.arange(n)
    if cols.flags is not None and cols.created is not None:
        rows = rows[~(((cols.flags & EXPIRING) != 0) | (cols.created < cols.expired_before))]
    # slot_of: the dialog's digest under dialog placement (when there is one), else the key's.
    source = cols.hi[rows]
    if by_dialog:
        dialogs = cols.order.dialog_digests(rows)
        has = (dialogs[:, 0] != 0) | (dialogs[:, 1] != 0)
        source = np.where(has, dialogs[:, 1], source)
    dst = owner[(source % np.uint64(len(owner))).astype(np.int64)]
    away = (dst >= 0) & (dst != mine)
    order = cols.order.hottest_first(rows[away])
    dst_of = np.full(n, -1, np.int64)
    dst_of[rows[away]] = dst[away]
    digests = np.empty((len(order), 2), np.uint64)
    digests[:, 0], digests[:, 1] = cols.lo[order], cols.hi[order]
    return digests, dst_of[order]


class CardMover:
    """Copies misplaced objects to their placement card; see the module docstring.

    ``after_round(settled)`` is called after each pass over the cards (the
    card set lets fully drained cards go then); ``settled``: the pass found
    nothing left to move, and the card set's changes so far are done.  ``moved`` / ``moved_bytes`` count
    what landed on its new card.
    """

    def __init__(self, cards: MovingSet, rate_bytes_per_s: int, after_round: Callable[[bool], None]) -> None:
        self.cards = cards
        self.rate = rate_bytes_per_s
        self.after_round = after_round
        self.moved = 0
        self.moved_bytes = 0
        self.failed = 0
        self._wake = asyncio.Event()
        self._started = time.monotonic()
        self._budget_bytes = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._started, self._budget_bytes = time.monotonic(), 0
            retry_s = RETRY_S
            while True:
                self._wake.clear()
                moved = self.moved
                try:
                    left = await self._round()
                except Exception:  # noqa: BLE001 - the mover must outlive any one round
                    log.exception("card mover: a round failed")
                    left = True
                self.after_round(not left and not self._wake.is_set())
                if not left:
                    break
                # Each round copies the card's index columns and sorts them: rounds that move nothing (a
                # card out of service, a full one) come less and less often; a change or progress resets.
                retry_s = RETRY_S if self.moved > moved else min(2 * retry_s, RETRY_MAX_S)
                try:
                    await asyncio.wait_for(self._wake.wait(), retry_s)
                except (asyncio.TimeoutError, TimeoutError):
                    pass
                if self._wake.is_set():
                    retry_s = RETRY_S
                await asyncio.sleep(0)  # never a loop that does not yield

    async def misplaced(self, src: ManagedCard) -> Misplaced:
        """``src``'s objects whose placement card is another card in service, hottest first.

        The loop takes one consistent copy of the index columns this needs
        (a memcpy: about 10 ms at a million rows); working out each row's
        card and the copy order from it runs on a pool thread (it held the
        loop 36 ms at 200,000 rows, so seconds at ten million).
        """
        index = src.index
        n = index.rows.n
        targets = self.cards.layout.slot_cards()
        cards = list({id(mc): mc for mc in targets if mc is not None}.values())
        if not n or not cards:
            return Misplaced(np.empty((0, 2), np.uint64), np.empty(0, np.int64), cards)
        number = {id(mc): i for i, mc in enumerate(cards)}
        owner = np.array([number[id(mc)] if mc is not None else -1 for mc in targets], np.int64)
        rows = index.rows
        ttl = self.cards.cfg.ttl
        cols = _MoveColumns(rows.lo[:n].copy(), rows.hi[:n].copy(), index.policy.order_columns(copy=True),
                            rows.flags[:n].copy() if ttl is not None else None,
                            rows.created[:n].copy() if ttl is not None else None,
                            time.time_ns() - int(ttl * 1e9) if ttl is not None else 0)
        digests, dst = await self.cards.pool.run(_misplaced, cols, owner, self.cards.cfg.key_placement == "dialog",
                                                 number.get(id(src), -2))
        return Misplaced(digests, dst, cards)

    async def _round(self) -> bool:
        """One pass over every card; True when something could not be moved (and is worth trying again)."""
        # A slot whose card is out of service has nothing moved to it now: what belongs there waits for it.
        left = any(serial is not None and mc is None
                   for serial, mc in zip(self.cards.layout.slot_map.owner, self.cards.layout.slot_cards()))
        for src in list(self.cards.cards):
            if not src.active:
                left = left or self.cards.is_draining(src)
                continue
            todo = await self.misplaced(src)
            for i in range(0, len(todo), BATCH):
                if src not in self.cards.cards or not src.active:
                    left = True
                    break
                left = await self._move(src, todo[i : i + BATCH]) or left
            if self.cards.is_draining(src) and src.index:
                left = True  # some of it had nowhere to go yet (its card out of service)
            if self._wake.is_set():  # the card set changed again: start over with the new placement
                return True
        return left

    async def _move(self, src: ManagedCard, batch: list[tuple[bytes, ManagedCard]]) -> bool:
        """Copy one batch; True when some of it did not land."""
        wanted = [(d, dst) for d, dst in batch if src.index.has(d) and dst.active and not dst.read_only]
        if not wanted:
            return bool(batch)
        # The index knows digests; a read names the full key, which the header holds.
        found = await src.stored_objects([d for d, _dst in wanted])
        reads = []
        for (digest, dst), obj in zip(wanted, found):
            if obj is None:
                src.catalog.note_gone_digest(digest)
            elif src.index.has(digest):
                reads.append((obj.full_key, dst, memoryview(bytearray(obj.payload_len))))
        if not reads:
            return True
        results = await src.read([(fkey, buf) for fkey, _dst, buf in reads], own=True)
        by_dst: dict[int, tuple[ManagedCard, list]] = {}
        for (fkey, dst, buf), r in zip(reads, results):
            if r.header is not None:
                by_dst.setdefault(id(dst), (dst, []))[1].append((fkey, buf[: r.header.payload_len], r.header.meta))
            else:
                src.catalog.note_failed_read(fkey, r)
        failed = len(batch) - len(reads)
        for dst, items in by_dst.values():
            results = await dst.write(items)
            done = [i for i, r in enumerate(results) if isinstance(r, int)]
            failed += len(items) - len(done)
            stayed = self.cards.note_written(dst, [items[i][0] for i in done], [results[i] for i in done],
                                             [len(items[i][1]) for i in done], [items[i][2] for i in done])
            for i, ok in zip(done, stayed):
                if ok:
                    nbytes = len(items[i][1])
                    self.cards.note_moved(src, dst, nbytes)
                    self.moved += 1
                    self.moved_bytes += nbytes
                    self._budget_bytes += nbytes
                else:
                    failed += 1
        self.failed += failed
        await self._pace()
        return failed > 0

    async def _pace(self) -> None:
        """Sleep as long as it takes to stay within ``rate`` bytes a second since the mover woke."""
        ahead = self._budget_bytes / self.rate - (time.monotonic() - self._started)
        if ahead > 0:
            await asyncio.sleep(ahead)
