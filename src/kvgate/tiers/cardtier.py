"""The cards as one tier of the store (``kvgate.tiers.contract``): a ``CardSet`` and ``KeyFinder``'s rule.

Where a key is on the cards, and how a set of cards that changes under a
request still answers it, is ``kvgate.tiers.finder``'s and
``kvgate.tiers.cardset``'s business; this module batches a request's keys
per card (one I/O call per card, on that card's threads), reads again where
a key moved while it was read, and counts what the cards served.  It keeps
``long`` puts.

Threading contract: as the store's; every method runs on the event loop,
card I/O on each card's threads (``ManagedCard``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import AsyncIterator, Sequence

import numpy as np

from kvgate import memcopy
from kvgate.cards import ObjectMeta
from kvgate.cards.base import CachedObjectFile, close_files
from kvgate.config import Config
from kvgate.keys import key_digest
from kvgate.memcopy import MemoryFault
from kvgate.tiers.card import ManagedCard, TierHooks
from kvgate.tiers.catalog import expired
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.layout import UNSETTLED_LAYOUTS
from kvgate.tiers.contract import ABSENT, PRESENT, STORAGE, UNKNOWN, GetItem, Known, PutItem
from kvgate.tiers.counters import StoreCounters, TierCounters
from kvgate.tiers.finder import KeyFinder, found_on_cards, group_by_card
from kvgate.tiers.io import IoPool, gather_all
from kvgate.tiers.reads import CardRead, ReadOutcome
from kvgate.tiers.rows import key_digest_array
from kvgate.tiers.staging import Staging
from kvgate.types import Retention, SizeCode

log = logging.getLogger("kvgate.store")

# Open files lent at once (``CardTier.lend_files``), at most this share of the process's file limit:
# the rest is for cards, clients and the files reads open for a moment.
FILES_LENT_SHARE = 0.25


class _Where:
    """``Known.detail`` of the card tier: ``KeyFinder.find_many``'s answer for the keys asked."""

    __slots__ = ("where", "indexed", "digests")

    def __init__(self, where: list[ManagedCard | None], indexed: np.ndarray, digests: np.ndarray) -> None:
        self.where, self.indexed, self.digests = where, indexed, digests


class CardTier:
    """The store's card tier (``kvgate.tiers.contract.Tier``): ``set`` holds the cards, ``finder`` says
    where a key is.  ``counters``: the store's (its ``long`` row, with ``corrupt``, ``expired`` and
    ``files_lent``)."""

    name = "cards"
    medium = STORAGE
    keeps = frozenset({Retention.LONG})
    probes = True
    promote = False

    def __init__(self, cfg: Config, pool: IoPool, counters: StoreCounters, hooks: TierHooks) -> None:
        self.cfg = cfg
        self.pool = pool
        self.store_counters = counters
        self.counters = counters.long
        self.set = CardSet(cfg, pool, hooks)
        self.layout = self.set.layout  # where keys belong
        self.finder = KeyFinder(self.set)
        self.staging = Staging(2 * cfg.max_frame_bytes)
        self.files_lent = 0  # open now (lend_files, not yet return_files)
        self.files_lent_max = int(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * FILES_LENT_SHARE)

    async def start(self) -> None:
        await self.set.start()

    async def stop(self) -> None:
        await self.set.stop()

    # ---- presence -----------------------------------------------------------------

    def known(self, fkeys: list[bytes], dialog: bytes) -> Known:
        """Indexed on an active card: present; else unknown where a card would hold it, absent where none
        would (or the index knows it past the ttl).  One index call per card (``find_many``)."""
        where, indexed, digests = self.finder.find_many(fkeys, self.layout.cards_for(fkeys, dialog))
        state = np.where(indexed, PRESENT, UNKNOWN).astype(np.int8)
        if not indexed.all():  # (a lookup's keys are mostly indexed: no Python per key for those)
            rest = np.flatnonzero(~indexed).tolist()
            state[[i for i in rest if where[i] is None]] = ABSENT
        return Known(state, _Where(where, indexed, digests))

    async def find(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        k = self.known(fkeys, dialog)
        d: _Where = k.detail  # type: ignore[assignment]
        present = (k.state == PRESENT).tolist()
        if self.cfg.prepare_reads and d.indexed.any():  # once the answer is out (``prepare``)
            asyncio.get_running_loop().call_soon(self.finder.hint_reads,
                                                 found_on_cards(d.where, fkeys, d.digests, d.indexed), urgent)
        unknown = np.flatnonzero(k.state == UNKNOWN).tolist()
        if unknown:
            found = await self.finder.probe_each([fkeys[i] for i in unknown], [d.where[i] for i in unknown],
                                                 dialog, urgent)
            for i, f in zip(unknown, found):
                present[i] = f
        return present

    async def probe_prefix(self, fkeys: list[bytes], dialog: bytes, known: Known, start: int, end: int,
                           urgent: bool = False) -> int:
        d: _Where = known.detail  # type: ignore[assignment]
        return await self.finder.probe_prefix(fkeys[start:end], d.where[start:end], dialog, urgent)

    def prepare(self, fkeys: list[bytes], known: Known, present: np.ndarray, urgent: bool = False) -> None:
        """Hint the reads of the keys a lookup found on cards (``ManagedCard.hint_reads``)."""
        if not self.cfg.prepare_reads:
            return
        d: _Where = known.detail  # type: ignore[assignment]
        found = present & d.indexed
        ix = np.flatnonzero(found)
        if not ix.size:
            return
        hints = found_on_cards(d.where, fkeys, d.digests, found[: int(ix[-1]) + 1])
        if hints:
            self.finder.hint_reads(hints, urgent)

    def sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """From the card indexes, one call per card, not a probe per key."""
        out: list[int | None] = [None] * len(fkeys)
        where, indexed, digests = self.finder.find_many(fkeys, self.layout.cards_for(fkeys, dialog))
        for mc, idx in group_by_card((where[j], j) for j in np.flatnonzero(indexed).tolist()).values():
            rows = mc.index.find(digests[idx])
            found = rows >= 0  # (all of them: find_many found them just now)
            for j, p in zip(np.asarray(idx)[found].tolist(), mc.index.payload_of(rows[found])):
                out[j] = p
        return out

    async def find_sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """``sizes``, and for the keys no index holds the size in their header, read from their card (and
        while the card set settles, from the cards their slot had before)."""
        out = self.sizes(fkeys, dialog)
        for i, k in enumerate(fkeys):
            if out[i] is not None:
                continue
            home = self.layout.card_for(k, dialog)
            mc, _entry = self.finder.find(k, home)
            if mc is None:
                continue
            out[i] = await self._header_size(mc, k)
            if out[i] is None:
                for before in self.layout.earlier_homes(k, dialog, mc):
                    out[i] = await self._header_size(before, k)
                    if out[i] is not None:
                        break
        return out

    @staticmethod
    async def _header_size(mc: ManagedCard, fkey: bytes) -> int | None:
        (r,) = await mc.read([(fkey, memoryview(bytearray(0)))])
        if r.header is not None:
            return r.header.payload_len
        return r.needed if r.outcome is ReadOutcome.TOO_SMALL else None

    # ---- reads ----------------------------------------------------------------------

    async def read_into(self, items: list[GetItem], urgent: bool = False, own: bool = False, gets: bool = True,
                        ) -> tuple[list[int], list[int], list[ObjectMeta | None]]:
        """Each item from the card ``find_many`` says; a miss is read again where the key is now, or on the
        cards its slot had before (one round per card set change the mover has not settled, at most)."""
        n = len(items)
        sizes: list[int] = [SizeCode.MISS] * n
        needed = [0] * n
        metas: list[ObjectMeta | None] = [None] * n
        again: list[tuple[ManagedCard, int]] = []
        tried: dict[int, list[ManagedCard]] = {}  # item -> the cards that did not have it

        async def from_card(cs: ManagedCard, idx: list[int], last_try: bool = False) -> None:
            results = await cs.read([(items[i].fkey, items[i].dest) for i in idx], urgent, own)
            for i, r in zip(idx, results):
                if not last_try and r.outcome is ReadOutcome.MISSING:
                    lacked = tried.setdefault(i, [])
                    lacked.append(cs)
                    elsewhere = self.finder.elsewhere(items[i].fkey, items[i].dialog, lacked)
                    if elsewhere is not None:
                        again.append((elsewhere, i))
                        continue
                self._account_read(cs, items[i], r, i, sizes, needed, metas, gets)

        card_for = self.layout.card_for
        where, _indexed, _digests = self.finder.find_many([it.fkey for it in items],
                                                        [card_for(it.fkey, it.dialog) for it in items])
        groups = list(group_by_card(zip(where, range(n))).values())
        if len(groups) == 1:  # no task for the one part of most reads
            await from_card(*groups[0])
        elif groups:
            # Every part ends before the answer: one that failed must not leave others writing the dests.
            await gather_all(*(from_card(cs, idx) for cs, idx in groups))
        for round_ in range(UNSETTLED_LAYOUTS):
            if not again:
                break
            retry, again = again, []
            await gather_all(*(from_card(cs, idx, last_try=round_ == UNSETTLED_LAYOUTS - 1)
                               for cs, idx in group_by_card(retry).values()))
        return sizes, needed, metas

    def _account_read(self, cs: ManagedCard, it: GetItem, r: CardRead, i: int, sizes: list[int],
                      needed: list[int], metas: list[ObjectMeta | None], gets: bool = True) -> None:
        c, sc = self.counters if gets else TierCounters(), self.store_counters
        c.gets += 1
        if r.header is not None:
            if self.cfg.ttl is not None and expired(r.header.meta.created_ns, self.cfg.ttl):
                # not indexed (or not yet known to be this old): the header told
                sc.expired += 1
                c.misses += 1
                self._spawn_delete(cs, it.fkey)
                return
            sizes[i], metas[i] = r.header.payload_len, r.header.meta
            c.hits += 1
            self.counters.bytes_read += r.header.payload_len
            cs.catalog.note_hit(it.fkey, r.header.payload_len)
            return
        c.misses += 1
        if r.outcome is ReadOutcome.TOO_SMALL:
            sizes[i], needed[i] = SizeCode.TOO_SMALL, r.needed
        elif r.outcome is ReadOutcome.CORRUPT:
            sc.corrupt += 1
        cs.catalog.note_failed_read(it.fkey, r)

    @staticmethod
    def _spawn_delete(cs: ManagedCard, fkey: bytes) -> None:
        digest = key_digest(fkey)
        cs.catalog.note_gone_digest(digest)
        cs.catalog.let_go([digest])

    # ---- writes ---------------------------------------------------------------------

    async def write(self, items: list[PutItem], retention: Retention,
                    sources: dict[int, memoryview] | None = None) -> list[bool]:
        """Each item to its placement card, all cards at once; True once it is there and indexed.

        An item with no ``sources`` copy is staged in a buffer of ours
        first, within the staging budget, unless it lies in a client's region
        and its card ``writes_client_memory``: such a card reads a guarded
        region only through the kernel (``kvgate.gateway.shm``), and
        publishes only what it read before the write's guard was abandoned.
        Copies out of client memory are ``memcopy`` copies: ``MemoryFault``
        when the client shrank it (raised once every card's write has ended),
        and its card stores nothing of it then.
        """
        source = sources or {}
        from_client = {id(it) for it in items if id(it) not in source and it.in_region}
        card_ok = [False] * len(items)
        card_left: list[int] = []
        faults: list[MemoryFault] = []
        c = self.counters

        async def one_card(cs: ManagedCard, idx: list[int], last_try: bool = False) -> None:
            # What has no copy of ours is staged here, for this card: a card that writes client
            # memory itself (through the kernel) is given the client's bytes instead.
            direct = cs.card.writes_client_memory
            staged = [i for i in idx if id(items[i]) not in source
                      and not (direct and id(items[i]) in from_client)]
            buffers = await self.staging.take([len(items[i].src) for i in staged]) if staged else []
            written: list[int] = []
            try:
                if staged:
                    await self.pool.map_chunks(_stage, [(b, items[i]) for b, i in zip(buffers, staged)],
                                               min_chunk=2)
                src = {i: source.get(id(items[i]), items[i].src) for i in idx}
                src.update(zip(staged, buffers))
                results = await cs.write([(items[i].fkey, src[i], items[i].meta) for i in idx])
                # Indexed before the next await: the card's room for them passes from its writes in
                # flight to its index with no gap another put could fill (ManagedCard._take_room).
                if not last_try and not self.set.serves(cs):
                    card_left.extend(idx)  # removed while it wrote: the keys belong on another card now
                    return
                written = [i for i, r in zip(idx, results) if isinstance(r, int)]
                for r in results:
                    if isinstance(r, MemoryFault):
                        faults.append(r)
                    elif isinstance(r, BaseException):
                        log.debug("write to card %s failed: %s", cs.location, r)
                stayed = self.set.note_written(cs, [items[i].fkey for i in written],
                                               [r for r in results if isinstance(r, int)],
                                               [len(items[i].src) for i in written], [items[i].meta for i in written])
                for i, ok in zip(written, stayed):
                    card_ok[i] = ok
                c.sets += len(written)
                c.bytes_written += sum(len(items[i].src) for i in written)
            finally:
                if staged:
                    await self.staging.give_back(buffers)
            if staged and written:  # another put ran meanwhile, and may have evicted some of these
                present = cs.index.find(key_digest_array([items[i].fkey for i in written])) >= 0
                for i, there in zip(written, present.tolist()):
                    card_ok[i] = card_ok[i] and there

        async def every_card(groups: dict, last_try: bool = False) -> None:
            # Every card's write ends before any error leaves: they read the sources.
            await gather_all(*(one_card(cs, idx, last_try) for cs, idx in groups.values()))

        await every_card(group_by_card((self.layout.card_for(it.fkey, it.meta.dialog), i)
                                       for i, it in enumerate(items)))
        if card_left:  # once: a writer never notices a card removed under it
            await every_card(group_by_card((self.layout.card_for(items[i].fkey, items[i].meta.dialog), i)
                                           for i in card_left), last_try=True)
        if faults:  # the client shrank its region under the write: as a fault while staging says
            raise faults[0]
        return card_ok

    # ---- lending --------------------------------------------------------------------

    async def lend_files(self, fkeys: list[bytes], dialog: bytes, sizes: list[int],
                         urgent: bool = False) -> list[CachedObjectFile | None]:
        """The objects of ``fkeys`` as their files, open, for a client to read itself: one copy, made by the
        client, where a card read into a buffer of ours and the client's read of that cost two.  None for
        each key on a card that lends no files (``Card.lends_files``), not wholly in the page cache, at
        another size than ``sizes`` says, past its TTL, or past the files this process may hold open
        (``files_lent_max``).  Counted as hits now; every file goes back through ``return_files``.
        """
        out: list[CachedObjectFile | None] = [None] * len(fkeys)
        room = self.files_lent_max - self.files_lent
        if room <= 0 or not fkeys:
            return out
        take = list(range(min(room, len(fkeys))))
        card_for = self.layout.card_for
        where, _indexed, _digests = self.finder.find_many([fkeys[i] for i in take],
                                                        [card_for(fkeys[i], dialog) for i in take])
        groups = [(cs, idx) for cs, idx in group_by_card(zip(where, take)).values() if cs.card.lends_files]
        self.files_lent += len(take)  # held while opening: concurrent gets cannot pass the limit together

        async def one_card(cs: ManagedCard, idx: list[int]) -> None:
            for i, f in zip(idx, await cs.open_cached([fkeys[i] for i in idx], urgent)):
                out[i] = f

        try:
            await gather_all(*(one_card(cs, idx) for cs, idx in groups))
        except BaseException:
            close_files(out)
            self.files_lent -= len(take)
            raise
        c, ttl = self.counters, self.cfg.ttl
        for i, f in enumerate(out):
            if f is None:
                continue
            h = f.header
            if h.payload_len != sizes[i] or (ttl is not None and expired(h.meta.created_ns, ttl)):
                os.close(f.fd)  # get says what became of it
                out[i] = None
                continue
            self.store_counters.files_lent += 1
            c.gets += 1
            c.hits += 1
            c.bytes_read += h.payload_len
            where[i].catalog.note_hit(fkeys[i], h.payload_len)  # type: ignore[union-attr]
        self.files_lent -= sum(f is None for f in out[: len(take)])
        return out

    def return_files(self, files: Sequence[CachedObjectFile]) -> None:
        """Close the files ``lend_files`` lent (each once), their client done with them."""
        close_files(files)
        self.files_lent -= len(files)

    # ---- dropping -------------------------------------------------------------------

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        return await self.finder.delete(fkeys, dialog)

    async def clean(self) -> int:
        return await self.set.clean()

    async def clean_namespace(self, ns: bytes) -> int:
        return await self.set.clean_namespace(ns)

    async def held_keys(self, chunk: int = 10_000) -> AsyncIterator[tuple[str, list[bytes]]]:
        """Each card's rows with a key (tier: its serial; rows loaded from an index snapshot and not named
        since have none, ``kvgate.tiers.index``); a chunk of 10,000 rows holds the loop 3 ms at most,
        measured over a million rows."""
        for mc in list(self.set.cards):
            if not mc.index.keys or mc.serial is None:
                continue
            start = 0
            while start < len(mc.index):
                index = mc.index  # (a clean or a fresh index replaces it between chunks)
                found = index.held_keys(start, start + chunk)
                start += chunk
                if found:
                    yield mc.serial, found
                await asyncio.sleep(0)

    def status(self) -> dict:
        """The cards (one row each), the layout (``fingerprint``, ``storage_slots``, ``card_generation``),
        their I/O (``io_timeouts``, ``io_errors``, ``oldest_io_age_s``) and ``card_moves``."""
        cards = self.set
        return {
            "cards": cards.status(),
            "fingerprint": cards.fingerprint, "storage_slots": cards.slots, "card_generation": cards.generation,
            "io_timeouts": cards.io_timeouts, "io_errors": cards.io_errors, "oldest_io_age_s": cards.oldest_io_age(),
            "card_moves": {"objects": cards.mover.moved, "bytes": cards.mover.moved_bytes,
                           "failed": cards.mover.failed},
        }


def _stage(chunk: list[tuple[memoryview, PutItem]]) -> None:
    """Copy items' sources into staging buffers of ours (``memcopy``: a shrunk region is a ``MemoryFault``)."""
    for buf, it in chunk:
        memcopy.copy(buf, it.src)
