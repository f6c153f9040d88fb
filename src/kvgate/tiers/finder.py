"""Where a key is: one rule for every lookup, exists, get, prewarm and delete.

A key is wherever an active card's index holds it, whatever dialog the
request names (its placement card is asked first); a key no index holds is
probed on its placement card for the request's dialog (the dialog's card, or
the key's own card when the request names none), and, while a change of the
card set is unsettled, on the card its slot had before
(``CardLayout.earlier_homes``).  With ``ttl``, an object the index knows to be
older is a miss, and is deleted.

Threading contract: every method runs on the gateway's event loop; the
``find`` family never blocks or waits (an engine's lookup of 1,000s of keys
is a few numpy calls per card); the ``probe`` family and ``delete`` wait for
card I/O on each card's own threads.
"""

from __future__ import annotations

import asyncio
from typing import Iterable, TypeVar

import numpy as np

from kvgate.keys import key_digest
from kvgate.tiers.card import ManagedCard
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.index import IndexEntry
from kvgate.tiers.rows import key_digest_array

T = TypeVar("T")

FoundOnCard = tuple[ManagedCard, list[bytes], np.ndarray]  # a card, keys its index holds, their digests


def found_on_cards(where: list[ManagedCard | None], fkeys: list[bytes], digests: np.ndarray,
                   found: np.ndarray) -> list[FoundOnCard]:
    """The keys ``found`` (a mask over the first keys) on their cards, per card (what lookups hint)."""
    idx = np.flatnonzero(found)
    if not idx.size:
        return []
    m = len(found)
    first = where[int(idx[0])]
    if len(idx) == m and where[:m].count(first) == m:  # the common case: the whole prefix on one card
        return [(first, fkeys[:m], digests[:m])] if first is not None else []
    groups = group_by_card((where[i], i) for i in idx.tolist())
    return [(mc, [fkeys[i] for i in ix], digests[ix]) for mc, ix in groups.values()]


def group_by_card(pairs: Iterable[tuple[ManagedCard | None, T]]) -> dict[int, tuple[ManagedCard, list[T]]]:
    """``(card, item)`` pairs as one list of items per card, keyed by ``id(card)``; items with no card are left out."""
    groups: dict[int, tuple[ManagedCard, list[T]]] = {}
    for card, item in pairs:
        if card is not None:
            groups.setdefault(id(card), (card, []))[1].append(item)
    return groups


def _run_end(cards: list, start: int, end: int) -> int:
    """Where the run of the same card that starts at ``start`` ends (at ``end`` at the latest)."""
    i = start + 1
    while i < end and cards[i] is cards[start]:
        i += 1
    return i


class KeyFinder:
    """Where the keys of a request are, on the cards of one ``CardSet`` (the module's rule).

    Made by ``TieredStore`` beside its card set; it keeps no state of its
    own, so it sees every change of the set at once.
    """

    def __init__(self, card_set: CardSet) -> None:
        self.card_set = card_set
        self.layout = card_set.layout  # where keys belong

    def find(self, fkey: bytes, home: ManagedCard | None) -> tuple[ManagedCard | None, IndexEntry | None]:
        """Where ``fkey`` is by the module's rule; ``home``: its placement card for the request (``card_for``).

        ``(card, entry)``: an active card's index holds it (``home``'s
        first); ``(home, None)``: no index holds it, ask ``home``; ``(None,
        None)``: a miss without asking (no card serves it, or the index knows
        it is past the ttl).  One key; a request's keys go to ``find_many``.
        """
        digest = key_digest(fkey)
        mc, r = home, home.index.row(digest) if home is not None else -1
        if r < 0:
            for other in self.card_set.cards:
                if other is not home and other.active:
                    r = other.index.row(digest)
                    if r >= 0:
                        mc = other
                        break
            else:
                if home is not None and digest in home.catalog.leaving:
                    return None, None
                return home, None
        assert mc is not None
        if self.card_set.cfg.ttl is not None and mc.catalog.past_ttl(np.array([r]))[0]:
            mc.catalog.expire_rows(np.array([r]))
            return None, None
        return mc, mc.index.entry(r)

    def find_many(self, fkeys: list[bytes], homes: list[ManagedCard | None]
                  ) -> tuple[list[ManagedCard | None], np.ndarray, np.ndarray]:
        """``find`` of a request's keys at once: per key the card, and whether its index holds the key
        (and the keys' digests, ``digest_array``).

        ``(card, True)``: indexed on that card; ``(home, False)``: no index
        holds it, ask its home; ``(None, False)``: a miss without asking.
        Each card's index answers all the keys it is asked about in one
        call: a lookup of 1,000 keys on one card is a handful of numpy
        operations, not 1,000 probes.
        """
        n = len(fkeys)
        where: list[ManagedCard | None] = list(homes)
        indexed = np.zeros(n, bool)
        digests = key_digest_array(fkeys)
        if not n:
            return where, indexed, digests
        settled = np.zeros(n, bool)  # indexed, or known to be a miss
        first = homes[0]
        if homes.count(first) == n:  # one home for the whole request: dialog placement, or a single card
            if first is not None:
                self._look(first, np.arange(n), digests, where, indexed, settled, fkeys)
        else:
            for mc, ix in group_by_card(zip(homes, range(n))).values():
                self._look(mc, np.asarray(ix), digests, where, indexed, settled, fkeys)
        for mc in self.card_set.cards:
            rest = np.flatnonzero(~settled)
            if not rest.size:
                break
            if mc.active:
                self._look(mc, rest, digests, where, indexed, settled, fkeys)
        for i in np.flatnonzero(~settled).tolist():
            home = homes[i]
            if home is not None and home.catalog.leaving and key_digest(fkeys[i]) in home.catalog.leaving:
                where[i] = None
        return where, indexed, digests

    def _look(self, mc: ManagedCard, idx: np.ndarray, digests: np.ndarray, where: list[ManagedCard | None],
              indexed: np.ndarray, settled: np.ndarray, fkeys: list[bytes]) -> None:
        """Keys ``idx`` in ``mc``'s index: found ones are settled there (past the ttl: a miss, and deleted).
        An index that keeps keys (``kvgate.tiers.index``) learns those of rows loaded without one."""
        rows = mc.index.find(digests[idx])
        hit = rows >= 0
        if not hit.any():
            return
        idx, rows = idx[hit], rows[hit]
        if self.card_set.cfg.ttl is not None:
            old = mc.catalog.past_ttl(rows)
            if old.any():
                mc.catalog.expire_rows(rows[old])
                for i in idx[old].tolist():
                    where[i] = None
                settled[idx[old]] = True
                idx, rows = idx[~old], rows[~old]
        indexed[idx] = True
        settled[idx] = True
        if mc.index.keys:  # a numpy pass over the rows found; Python only for rows whose key is not known yet
            unnamed = mc.index.rows.klen[rows] == 0
            if unnamed.any():
                for i, r in zip(idx[unnamed].tolist(), rows[unnamed].tolist()):
                    mc.index.learn_key(r, fkeys[i])
        if len(idx) == len(where):
            where[:] = [mc] * len(where)
        else:
            for i in idx.tolist():
                where[i] = mc

    def elsewhere(self, fkey: bytes, dialog: bytes, tried: list[ManagedCard]) -> ManagedCard | None:
        """Where else to read ``fkey`` after the cards ``tried`` did not have it: the card whose index holds
        it now (the mover copied it there and deleted the copy just read from), else the next of its
        ``earlier_homes``; None: nowhere else."""
        home = self.layout.card_for(fkey, dialog)
        mc, entry = self.find(fkey, home)
        if mc is not None and mc not in tried and entry is not None:
            return mc
        return next((c for c in self.layout.earlier_homes(fkey, dialog, home) if c not in tried), None)

    async def probe_prefix(self, fkeys: list[bytes], homes: list[ManagedCard | None], dialog: bytes,
                           urgent: bool = False) -> int:
        """How many leading keys exist on their ``homes`` (the cards themselves are asked; where a home
        does not hold a key, its ``earlier_homes`` in turn)."""
        n = 0
        while n < len(fkeys):
            mc = homes[n]
            if mc is None:
                break
            end = _run_end(homes, n, len(fkeys))
            n += await mc.probe_prefix(fkeys[n:end], urgent)
            if n < end:
                n = await self._probe_earlier(fkeys, n, end, dialog, mc, urgent)
                if n < end:
                    break
        return n

    async def _probe_earlier(self, fkeys: list[bytes], start: int, end: int, dialog: bytes, home: ManagedCard,
                             urgent: bool) -> int:
        """From ``start``: how far the keys up to ``end`` (all of ``home``) are on their earlier homes."""
        if not self.layout.settling:
            return start
        earlier = self.layout.earlier_homes_of(fkeys[start:end], dialog, home)
        n, asked = start, []  # asked: cards that lacked key n
        while n < end:
            mc = next((c for c in earlier[n - start] if c not in asked), None)
            if mc is None:
                break
            stop = n + 1
            while stop < end and mc in earlier[stop - start]:
                stop += 1
            found = await mc.probe_prefix(fkeys[n:stop], urgent)
            if found:
                n, asked = n + found, []
            if n < stop:
                asked.append(mc)
        return n

    async def probe_each(self, fkeys: list[bytes], homes: list[ManagedCard | None], dialog: bytes,
                         urgent: bool = False) -> list[bool]:
        """Whether each key exists on its home card (the cards themselves are asked; no home: False; not on
        its home: its ``earlier_homes`` are asked in turn)."""
        out = [False] * len(fkeys)

        async def ask(pairs) -> None:
            async def one(mc: ManagedCard, idx: list[int]) -> None:
                for i, found in zip(idx, await mc.probe_each([fkeys[i] for i in idx], urgent)):
                    out[i] = found

            await asyncio.gather(*(one(mc, idx) for mc, idx in group_by_card(pairs).values()))

        await ask(zip(homes, range(len(fkeys))))
        if self.layout.settling:
            earlier = {i: self.layout.earlier_homes(fkeys[i], dialog, homes[i])
                       for i in range(len(fkeys)) if not out[i] and homes[i] is not None}
            level = 0
            while True:
                pairs = [(cards[level], i) for i, cards in earlier.items() if not out[i] and level < len(cards)]
                if not pairs:
                    break
                await ask(pairs)
                level += 1
        return out

    def hint_reads(self, found: list[FoundOnCard], urgent: bool = False) -> None:
        """Tell cards which of their objects a lookup just found (``ManagedCard.hint_reads``)."""
        for mc, fkeys, digests in found:
            mc.hint_reads(fkeys, urgent, digests)

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Delete keys from every card ``find`` could answer from; returns how many objects were there."""
        per_card: dict[int, tuple[ManagedCard, list[bytes]]] = {}
        for k, home in zip(fkeys, self.layout.cards_for(fkeys, dialog)):
            targets = [mc for mc in self.card_set.cards if mc.active and k in mc.index]
            for also in (home, *self.layout.earlier_homes(k, dialog, home)):
                if also is not None and also not in targets:
                    targets.append(also)
            for mc in targets:
                per_card.setdefault(id(mc), (mc, []))[1].append(k)
        return sum(await asyncio.gather(*(mc.delete(keys) for mc, keys in per_card.values())))
