"""The tiered store: RAM tier in front of the long tier, as the gateway uses them.

Threading contract: every coroutine here runs on the event loop.  Bookkeeping
(RAM allocation, card indexes, counters) happens on the loop, so it needs no
locks; byte copies and card I/O run in ``IoPool`` threads, on RAM entries
pinned for the duration.  Bulk operations are split into at most
``thread_pool_size`` chunks, one pool call each: a batch of 32 objects costs
a handful of thread hand-offs, not 32.

Writes are write-through: a put of retention ``long`` is acknowledged once
the object is in the RAM tier *and* on its card, and still there when the
put answers (not evicted by its own batch, not larger than the card's
capacity), so what was acknowledged survives a gateway restart.  ``short``
stays in RAM only; ``none`` is not stored at all.

Reads answer by one rule, the same for lookup, exists, get, prewarm and
delete: a key is present when the RAM tier holds it, else where
``KeyFinder.find`` says (any card's index, whatever the dialog; else a probe
of its placement card for the request's dialog).  With ``ttl``, an object
older than that is a miss in every one of them.  A request's keys are
looked up in the card indexes at once (``KeyFinder.find_many``).

Changes: what each tier stores and drops is noted in ``changes``
(``kvgate.tiers.events``); ``held_keys`` lists what is held now, in
chunks.  Together they are what a gateway publishes as KV events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvgate import memcopy
from kvgate.memcopy import MemoryFault
from kvgate.latency import Latencies
from kvgate.cards import ObjectMeta
from kvgate.cards.base import CachedObjectFile, close_files
from kvgate.config import Config, ConfigError
from kvgate.keys import full_key, key_digest
from kvgate.tiers.io import IoPool, gather_all
from kvgate.tiers.card import ManagedCard, TierHooks, expired
from kvgate.tiers.cardset import UNSETTLED_LAYOUTS, CardSet
from kvgate.tiers.counters import StoreCounters, TierCounters
from kvgate.tiers.events import RAM_TIER, TierChanges
from kvgate.tiers.finder import FoundOnCard, KeyFinder, found_on_cards, group_by_card
from kvgate.tiers.holds import Holds
from kvgate.tiers.ram import RamTier, RamTooLarge, copy_into, copy_out
from kvgate.tiers.reads import CardRead, ReadOutcome
from kvgate.tiers.staging import BufferCache, Staging
from kvgate.tiers.usage import NamespaceUsage
from kvgate.types import Retention, SizeCode

log = logging.getLogger("kvgate.store")

CLEAN_RAM_BATCH = 4096  # RAM-tier entries a namespace's clean drops between two turns of the loop
LEND_SHARE = 0.25  # of the RAM tier, at most, pinned by lent replies at once (``TieredStore.lend_ram``)
REPLY_BUFFERS_KEEP = 128 << 20  # card parts of sent or lent replies kept for reuse: two 64 MiB gets' worth
# Open files lent at once (``TieredStore.lend_files``), at most this share of the process's file limit:
# the rest is for cards, clients and the files reads open for a moment.
FILES_LENT_SHARE = 0.25


@dataclass(slots=True)
class PutItem:
    fkey: bytes
    src: memoryview
    meta: ObjectMeta
    # src lies in a client's shared region (which it may write again once answered), not in a buffer of ours
    in_region: bool = False


@dataclass(slots=True)
class GetItem:
    fkey: bytes
    dialog: bytes
    dest: memoryview


@dataclass(slots=True)
class RamLoan:
    """A RAM-tier object lent to a reply (``TieredStore.lend_ram``): its pages stay put, unchanged, until
    it is given back; ``views`` hold its ``size`` bytes, in order."""

    size: int
    views: list[memoryview]
    entry: object  # the pinned ``ram.Entry``: for ``return_ram`` only


class TieredStore:
    """The RAM tier in front of the card set: puts, gets, lookups, lends, deletes (module docstring).

    Called by the gateway's operation handlers, on the event loop only; every
    coroutine keeps the loop free of copies and I/O by running them in
    ``pool``.  Nothing here blocks the loop but bookkeeping: a request waits
    on pool threads, not on other requests' bookkeeping.
    """

    def __init__(self, cfg: Config, pool: IoPool):
        self.cfg = cfg
        self.pool = pool
        self.counters = StoreCounters()
        self.usage = NamespaceUsage()
        self.changes = TierChanges()  # what the tiers store and drop (kvgate.tiers.events)
        try:
            self.ram = RamTier(cfg.max_bytes, cfg.ram_page_size, cfg.eviction_policy, ttl=cfg.ttl,
                               on_expired=self._count_expired, usage=self.usage, changes=self.changes)
        except RamTooLarge as e:
            raise ConfigError(f"config key 'max_bytes': {e}: lower max_bytes") from None
        self.holds = Holds()
        self.card_io_seconds = Latencies()
        self.long = CardSet(cfg, pool, TierHooks(self.usage, self.holds, on_corrupt=self._count_corrupt,
                                                 on_expired=self._count_expired, io_seconds=self.card_io_seconds,
                                                 changes=self.changes))
        self.finder = KeyFinder(self.long)
        self.staging = Staging(2 * cfg.max_frame_bytes)
        # The card part of replies sent or lent (what lend_ram cannot lend): the gateway's operations take
        # them, the card reads fill them, and they come back with the loans (return_ram).
        self.reply_buffers = BufferCache(REPLY_BUFFERS_KEEP)
        self.files_lent = 0  # open now (lend_files, not yet return_files)
        self.files_lent_max = int(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * FILES_LENT_SHARE)
        memcopy.check()

    def _count_expired(self, n: int) -> None:
        self.counters.expired += n

    async def start(self) -> None:
        await self.long.start()

    def _count_corrupt(self, n: int) -> None:
        self.counters.corrupt += n

    async def stop(self) -> None:
        await self.long.stop()

    # ---- put ------------------------------------------------------------------

    async def put(self, items: list[PutItem], retention: Retention) -> list[bool]:
        """Store items; True per item once it is where its retention asks (``_put``)."""
        stored = await self._put(items, retention)
        for it, ok in zip(items, stored):
            if ok:
                row = self.usage.row(it.fkey)
                row.sets += 1
                row.bytes_written += len(it.src)
        return stored

    async def _put(self, items: list[PutItem], retention: Retention) -> list[bool]:
        """Store items; True per item once it is where its retention asks.

        The RAM copy is made first and pinned while the card write runs from
        it: the card then writes bytes the gateway owns, so a write that runs
        past its deadline can never publish a client buffer that was reused
        after the client got its (failed) answer.  An item with no RAM copy
        in one piece (tier off or full, object larger than it, pages not
        contiguous) is staged in a buffer of ours first, within the staging
        budget, unless it lies in a client's region and its card
        ``writes_client_memory``: such a card reads a guarded region only
        through the kernel (``kvgate.gateway.shm``), and publishes only what
        it read before the write's guard was abandoned.  Copies out of
        client memory are ``memcopy`` copies: ``MemoryFault`` when the
        client shrank it, and its card stores nothing of it then.
        """
        if retention is Retention.NONE or not items:
            return [False] * len(items)
        klass = retention
        c = self.counters
        reservations = [self.ram.reserve(it.fkey, len(it.src), it.meta, klass) for it in items]
        copies = [(it, res) for it, res in zip(items, reservations) if res is not None]

        def copy_work(chunk: list) -> None:
            for it, res in chunk:
                copy_into(res.views(), it.src)

        try:
            await self.pool.map_chunks(copy_work, copies, min_chunk=2)
        except BaseException:
            for _it, res in copies:
                self.ram.abort(res)
            raise
        pinned = []
        for it, res in copies:
            self.ram.commit(res)
            c.ram.sets += 1
            c.ram.bytes_written += len(it.src)
            entry = self.ram.pin(it.fkey) if klass is Retention.LONG else None
            pinned.append(entry)
        if klass is not Retention.LONG:
            return [res is not None for res in reservations]

        source: dict[int, memoryview] = {}
        for (it, _res), entry in zip(copies, pinned):
            views = entry.views() if entry is not None else []
            if len(views) == 1:
                source[id(it)] = views[0]
        from_client = {id(it) for it in items if id(it) not in source and it.in_region}
        card_ok = [False] * len(items)
        card_left: list[int] = []
        faults: list[MemoryFault] = []

        async def one_card(cs: ManagedCard, idx: list[int], last_try: bool = False) -> None:
            # What has no RAM copy is staged here, for this card: a card that writes client
            # memory itself (through the kernel) is given the client's bytes instead.
            direct = cs.card.writes_client_memory
            staged = [i for i in idx if id(items[i]) not in source
                      and not (direct and id(items[i]) in from_client)]
            buffers = await self.staging.take([len(items[i].src) for i in staged]) if staged else []
            try:
                if staged:
                    await self.pool.map_chunks(_stage, [(b, items[i]) for b, i in zip(buffers, staged)],
                                               min_chunk=2)
                src = {i: source.get(id(items[i]), items[i].src) for i in idx}
                src.update(zip(staged, buffers))
                results = await cs.write([(items[i].fkey, src[i], items[i].meta) for i in idx])
                # Indexed before the next await: the card's room for them passes from its writes in
                # flight to its index with no gap another put could fill (ManagedCard._take_room).
                if not last_try and not self.long.serves(cs):
                    card_left.extend(idx)  # removed while it wrote: the keys belong on another card now
                    return
                for i, r in zip(idx, results):
                    it = items[i]
                    if isinstance(r, int):
                        card_ok[i] = self.long.note_written(cs, it.fkey, r, len(it.src), it.meta)
                        c.long.sets += 1
                        c.long.bytes_written += len(it.src)
                    elif isinstance(r, MemoryFault):
                        faults.append(r)
                    else:
                        log.debug("write to card %s failed: %s", cs.location, r)
            finally:
                if staged:
                    await self.staging.give_back(buffers)
            for i in idx:  # a later object of this batch may have evicted an earlier one
                card_ok[i] = card_ok[i] and items[i].fkey in cs.index

        async def every_card(groups: dict, last_try: bool = False) -> None:
            # Every card's write ends before any error leaves: they read the pinned RAM copies.
            await gather_all(*(one_card(cs, idx, last_try) for cs, idx in groups.values()))

        try:
            await every_card(group_by_card((self.long.card_for(it.fkey, it.meta.dialog), i)
                                           for i, it in enumerate(items)))
            if card_left:  # once: a writer never notices a card removed under it
                await every_card(group_by_card((self.long.card_for(items[i].fkey, items[i].meta.dialog), i)
                                               for i in card_left), last_try=True)
        finally:
            for entry in pinned:
                if entry is not None:
                    self.ram.unpin(entry)
        if faults:  # the client shrank its region under the write: as a fault while staging says
            raise faults[0]
        return card_ok

    # ---- get ------------------------------------------------------------------

    async def get(self, items: list[GetItem], urgent: bool = False, own: bool = False) -> tuple[list[int], list[int]]:
        """Fill each item's dest; returns (sizes, needed) with ``SizeCode.MISS`` / ``TOO_SMALL`` in sizes.

        ``urgent``: an engine on this host waits on it (``IoPool.run``).  ``own``: every dest is the
        gateway's own memory, which card reads may fill in place (``Abandon.own``).
        """
        c = self.counters
        sizes: list[int] = [SizeCode.MISS] * len(items)
        needed = [0] * len(items)
        ram_plans: list[tuple[int, GetItem, object]] = []
        misses: list[int] = []
        for i, it in enumerate(items):
            entry = self.ram.pin(it.fkey)
            c.ram.gets += 1
            if entry is None:
                c.ram.misses += 1
                misses.append(i)
            elif entry.size > len(it.dest):
                self.ram.unpin(entry)
                sizes[i], needed[i] = SizeCode.TOO_SMALL, entry.size
            else:
                ram_plans.append((i, it, entry))

        def copy_work(chunk: list) -> None:
            for _i, it, entry in chunk:
                copy_out(entry.views(), it.dest[: entry.size])

        async def from_ram() -> None:
            try:
                await self.pool.map_chunks(copy_work, ram_plans, min_chunk=2, urgent=urgent)
            finally:
                for _i, _it, entry in ram_plans:
                    self.ram.unpin(entry)
            for i, _it, entry in ram_plans:
                sizes[i] = entry.size
                c.ram.hits += 1
                c.ram.bytes_read += entry.size

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
                self._account_read(cs, items[i], r, i, sizes, needed)

        card_for = self.long.card_for
        where, _indexed, _digests = self.finder.find_many([items[i].fkey for i in misses],
                                                        [card_for(items[i].fkey, items[i].dialog) for i in misses])
        groups = group_by_card(zip(where, misses))
        # Every part ends before the answer: one that failed (a shrunk region)
        # must not leave others still writing the destinations.
        parts = [*([from_ram()] if ram_plans else []), *(from_card(cs, idx) for cs, idx in groups.values())]
        if len(parts) == 1:  # no task for the one part of most gets (all from RAM, or all from one card)
            await parts[0]
        elif parts:
            await gather_all(*parts)
        # A miss read again where the key is now, or on the cards its slot had before (one round per card
        # set change the mover has not settled, at most).
        for round_ in range(UNSETTLED_LAYOUTS):
            if not again:
                break
            retry, again = again, []
            await gather_all(*(from_card(cs, idx, last_try=round_ == UNSETTLED_LAYOUTS - 1)
                               for cs, idx in group_by_card(retry).values()))
        for it, size in zip(items, sizes):
            row = self.usage.row(it.fkey)
            row.gets += 1
            if size >= 0:
                row.hits += 1
                row.bytes_read += size
        return sizes, needed

    def _account_read(self, cs: ManagedCard, it: GetItem, r: CardRead, i: int, sizes: list[int],
                      needed: list[int]) -> None:
        c = self.counters
        c.long.gets += 1
        if r.header is not None:
            if self.cfg.ttl is not None and expired(r.header.meta.created_ns, self.cfg.ttl):
                # not indexed (or not yet known to be this old): the header told
                c.expired += 1
                c.long.misses += 1
                self._spawn_delete(cs, it.fkey)
                return
            sizes[i] = r.header.payload_len
            c.long.hits += 1
            c.long.bytes_read += r.header.payload_len
            cs.note_hit(it.fkey, r.header.payload_len)
            return
        c.long.misses += 1
        if r.outcome is ReadOutcome.TOO_SMALL:
            sizes[i], needed[i] = SizeCode.TOO_SMALL, r.needed
        elif r.outcome is ReadOutcome.CORRUPT:
            c.corrupt += 1
        cs.note_failed_read(it.fkey, r)

    @staticmethod
    def _spawn_delete(cs: ManagedCard, fkey: bytes) -> None:
        digest = key_digest(fkey)
        cs.note_gone_digest(digest)
        cs.spawn_delete([digest])

    # ---- lookups ----------------------------------------------------------------

    def lend_ram(self, fkeys: list[bytes], sizes: list[int]) -> list[RamLoan | None]:
        """The RAM-tier objects of ``fkeys``, pinned so that a reply can be sent straight from their pages;
        None for each key the RAM tier lacks, or holds at another size than ``sizes`` says (the reply's
        layout is made: read those with ``get``, which counts them).

        A reply of many MiB built by copying out of the tier costs a fresh
        buffer's page faults and the copy: 1.4 GiB/s here, against 3.6 for
        the loopback socket that carries it.  Counted as hits now; every
        loan goes back through ``return_ram``, on the loop, once its reply
        has gone (or failed).
        """
        c = self.counters
        out: list[RamLoan | None] = []
        for k, size in zip(fkeys, sizes, strict=True):
            # Replies held by slow or stalled clients must not pin the tier: past a share of it, an
            # object is copied out instead (its pin then lasts the copy), so puts always find pages.
            room = size <= self.lendable_bytes()
            entry = self.ram.pin(k) if room and self.ram.size_of(k) == size else None
            if entry is None:  # (or its ttl ran out between the two)
                out.append(None)
                continue
            self._count_lent(c.ram, k, entry.size)
            out.append(RamLoan(entry.size, entry.views(), entry))
        return out

    def lendable_bytes(self) -> int:
        """How many more RAM-tier bytes ``lend_ram`` would lend now."""
        return max(0, int(self.ram.capacity * LEND_SHARE) - self.ram.pinned_bytes)

    def return_ram(self, loans: list[RamLoan | None], buffers: Sequence[memoryview] = ()) -> None:
        """Unpin what ``lend_ram`` lent (each loan once), and keep ``buffers`` (``reply_buffers``'s,
        filled by card reads that have returned, sent or read by now) for the next reply."""
        for loan in loans:
            if loan is not None:
                self.ram.unpin(loan.entry)
        self.reply_buffers.give(buffers)

    async def lend_files(self, fkeys: list[bytes], dialog: bytes, sizes: list[int],
                         urgent: bool = False) -> list[CachedObjectFile | None]:
        """The card objects of ``fkeys`` as their files, open, for a client to read itself: one copy, made
        by the client, where a card read into a buffer of ours and the client's read of that cost two.
        None for each key on a card that lends no files (``Card.lends_files``), not wholly in the page
        cache, at another size than ``sizes`` says, past its TTL, or past the files this process may hold
        open (``files_lent_max``): read those with ``get``, which counts them.  Counted as hits now;
        every file goes back through ``return_files``, on the loop.
        """
        out: list[CachedObjectFile | None] = [None] * len(fkeys)
        room = self.files_lent_max - self.files_lent
        if room <= 0 or not fkeys:
            return out
        take = list(range(min(room, len(fkeys))))
        card_for = self.long.card_for
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
            c.ram.gets += 1
            c.ram.misses += 1
            c.files_lent += 1
            self._count_lent(c.long, fkeys[i], h.payload_len)
            where[i].note_hit(fkeys[i], h.payload_len)  # type: ignore[union-attr]
        self.files_lent -= sum(f is None for f in out[: len(take)])
        return out

    def _count_lent(self, tier: TierCounters, fkey: bytes, size: int) -> None:
        """A hit of ``tier`` lent to a reply (``lend_ram``, ``lend_files``), counted as ``get`` counts one."""
        tier.gets += 1
        tier.hits += 1
        tier.bytes_read += size
        row = self.usage.row(fkey)
        row.gets += 1
        row.hits += 1
        row.bytes_read += size

    def return_files(self, files: Sequence[CachedObjectFile]) -> None:
        """Close the files ``lend_files`` lent (each once), their client done with them."""
        close_files(files)
        self.files_lent -= len(files)

    def size_hints(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """Each key's payload size where this gateway knows it without touching a card, else None: the RAM
        tier's, then one index call per card for the rest (``KeyFinder.find_many``), not a probe per key."""
        out = [self.ram.size_of(k) for k in fkeys]
        rest = [i for i, s in enumerate(out) if s is None]
        if not rest:
            return out
        card_for = self.long.card_for
        where, indexed, digests = self.finder.find_many([fkeys[i] for i in rest],
                                                        [card_for(fkeys[i], dialog) for i in rest])
        for mc, idx in group_by_card((where[j], j) for j in np.flatnonzero(indexed).tolist()).values():
            rows = mc.index.find(digests[idx])
            found = rows >= 0  # (all of them: find_many found them just now)
            for j, p in zip(np.asarray(idx)[found].tolist(), mc.index.payload_of(rows[found])):
                out[rest[j]] = p
        return out

    def _known_prefix(self, fkeys: list[bytes], homes: list[ManagedCard | None], start: int, hint: bool = False,
                      ) -> tuple[int, list[ManagedCard], list[FoundOnCard]]:
        """From ``start``: how far the leading keys are known present without touching a card, the
        home cards of the run of keys after that which no tier knows (to probe), up to the next key
        that is known present or known missing, and (``hint``) the keys of the known prefix found on
        a card only, not in RAM, grouped by card.

        The card indexes answer for all the keys at once (``find_many``); a
        lookup runs this for 1,000s of keys on every engine step.  An empty
        RAM tier is not asked at all.
        """
        keys, homes = fkeys[start:], homes[start:]
        if self.ram.entries:
            in_ram = self.ram.contains
            ram = np.array([in_ram(k) for k in keys], bool)
            ask = np.flatnonzero(~ram)
            where_asked, indexed_asked, digests_asked = self.finder.find_many([keys[i] for i in ask],
                                                                            [homes[i] for i in ask])
            where: list[ManagedCard | None] = list(homes)
            for j, i in enumerate(ask.tolist()):
                where[i] = where_asked[j]
            indexed = np.zeros(len(keys), bool)
            indexed[ask] = indexed_asked
            digests = np.zeros((len(keys), 2), np.uint64)
            digests[ask] = digests_asked
            present = indexed | ram
        else:
            where, indexed, digests = self.finder.find_many(keys, homes)
            present = indexed
        misses = np.flatnonzero(~present)
        n = int(misses[0]) if misses.size else len(keys)
        hints = found_on_cards(where, keys, digests, indexed[:n]) if hint and n else []
        unknown: list[ManagedCard] = []
        for i in range(n, len(keys)):
            cs = where[i]
            if present[i] or cs is None:
                break
            unknown.append(cs)
        return start + n, unknown, hints

    async def lookup(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> int:
        """How many leading keys are present (the module's rule)."""
        self.counters.lookups += 1
        homes = self.long.cards_for(fkeys, dialog)
        n = 0
        while True:
            n, unknown, hints = self._known_prefix(fkeys, homes, n, self.cfg.prepare_reads)
            if hints:
                self._hint_later(hints, urgent)
            if not unknown:
                return n
            found = await self.finder.probe_prefix(fkeys[n : n + len(unknown)], unknown, dialog, urgent)
            n += found
            if found < len(unknown):
                return n

    def _hint_later(self, hints: list, urgent: bool) -> None:
        """Read hints once the answer is out: they serve the load that follows it, and their 30 µs
        (1,000 keys on one card) need not wait in front of the reply."""
        asyncio.get_running_loop().call_soon(self.finder.hint_reads, hints, urgent)

    async def exists(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        """Whether each key is present (the module's rule).  Counted as a lookup: it is the lookup of
        vLLM's tier, SGLang's backend and LMCache's adapter (``hold``), which never call ``lookup``."""
        self.counters.lookups += 1
        in_ram = self.ram.contains
        homes = self.long.cards_for(fkeys, dialog)
        present = [in_ram(k) for k in fkeys]
        ask = [i for i, p in enumerate(present) if not p]
        asked = [fkeys[i] for i in ask]
        where, indexed, digests = self.finder.find_many(asked, [homes[i] for i in ask])
        unknown: list[int] = []
        unknown_homes: list[ManagedCard | None] = []
        for j, i in enumerate(ask):
            cs = where[j]
            if indexed[j]:
                present[i] = True
            elif cs is not None:
                unknown.append(i)
                unknown_homes.append(cs)
        if self.cfg.prepare_reads and indexed.any():
            self._hint_later(found_on_cards(where, asked, digests, indexed), urgent)
        if unknown:
            found = await self.finder.probe_each([fkeys[i] for i in unknown], unknown_homes, dialog, urgent)
            for i, f in zip(unknown, found):
                present[i] = f
        return present

    async def hold(self, session: int, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        """Per key, whether it is present and now held for ``session`` (``kvgate.tiers.holds``)."""
        present = await self.exists(fkeys, dialog, urgent)
        held = iter(self.holds.hold(session, [k for k, p in zip(fkeys, present) if p]))
        return [p and next(held) for p in present]

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        n_ram = sum(self.ram.delete(k) for k in fkeys)
        n_long = await self.finder.delete(fkeys, dialog)
        return max(n_ram, n_long)

    async def prewarm(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Pull the leading run of present keys (the module's rule) into the RAM tier; returns how many are in RAM."""
        plans = []
        in_ram = 0
        for k, home in zip(fkeys, self.long.cards_for(fkeys, dialog)):
            if self.ram.contains(k):
                in_ram += 1
                continue
            cs, entry = self.finder.find(k, home)
            if cs is None:
                break
            if entry is not None:
                size = entry.payload_len
            else:  # no index holds it: ask its card (as lookup and get do)
                size = await self._unindexed_size(cs, k)
                if size is None:  # the card set changed and the mover has not settled it yet: cards of before
                    for before in self.long.earlier_homes(k, dialog, cs):
                        size = await self._unindexed_size(before, k)
                        if size is not None:
                            cs = before
                            break
                if size is None:
                    break
            # The meta is the header's once read (its creation time counts for the ttl in RAM too).
            res = self.ram.reserve(k, size, ObjectMeta(dialog=dialog, created_ns=time.time_ns()), Retention.LONG)
            if res is None:
                break
            plans.append((k, cs, res, size))

        async def one_card(cs: ManagedCard, group: list) -> int:
            dests = []
            for _k, _cs, res, size in group:
                views = res.views()
                dests.append(views[0] if len(views) == 1 else memoryview(bytearray(size)))
            results = await cs.read([(p[0], d) for p, d in zip(group, dests)], own=True)
            done = 0
            for (k, _cs, res, size), dest, r in zip(group, dests, results):
                header = r.header
                if header is not None and header.payload_len == size:
                    if self.cfg.ttl is not None and expired(header.meta.created_ns, self.cfg.ttl):
                        self.ram.abort(res)
                        self.counters.expired += 1
                        self._spawn_delete(cs, k)
                        continue
                    views = res.views()
                    if len(views) != 1:
                        await self.pool.run(copy_into, views, dest)
                    res.meta = header.meta
                    self.ram.commit(res)
                    cs.note_hit(k, size)
                    self.counters.long.bytes_read += size
                    done += 1
                    continue
                self.ram.abort(res)
                if r.outcome is ReadOutcome.CORRUPT:
                    self.counters.corrupt += 1
                if r.outcome in (ReadOutcome.CORRUPT, ReadOutcome.MISSING):
                    cs.note_gone(k)
            return done

        groups = group_by_card((p[1], p) for p in plans)
        done = await asyncio.gather(*(one_card(cs, group) for cs, group in groups.values()))
        return in_ram + sum(done)

    async def _unindexed_size(self, cs: ManagedCard, fkey: bytes) -> int | None:
        """Payload size of an object on the card, from its header (None: not there)."""
        (r,) = await cs.read([(fkey, memoryview(bytearray(0)))])
        if r.header is not None:
            return r.header.payload_len
        return r.needed if r.outcome is ReadOutcome.TOO_SMALL else None

    async def clean(self) -> int:
        n = self.ram.entries
        self.ram.clear()
        return max(n, await self.long.clean())

    async def clean_namespace(self, ns: bytes) -> tuple[int, int]:
        """Delete every object of namespace ``ns`` (its encoded form): from the RAM tier, in batches of
        ``CLEAN_RAM_BATCH`` with the loop let go between them, and from every card (batched in their I/O
        threads).  -> (objects dropped from RAM, objects deleted from cards)."""
        prefix = full_key(ns, b"")  # the length byte keeps "ab" from matching a namespace "abc"
        mine = [k for k in self.ram.keys() if k.startswith(prefix)]
        in_ram = 0
        for i in range(0, len(mine), CLEAN_RAM_BATCH):
            in_ram += sum(self.ram.delete(k) for k in mine[i : i + CLEAN_RAM_BATCH])
            await asyncio.sleep(0)
        return in_ram, await self.long.clean_namespace(ns)

    def card_states(self) -> list[ManagedCard]:
        """The cards of the set now, in service or not (head sync, the ready message)."""
        return self.long.cards

    # ---- for the gateway: it reaches the tiers only through these ----------------------

    @property
    def card_set(self) -> CardSet:
        """The card set itself, for what changes it: the admin's card operations, a cluster's view
        (``CardSource``), head sync's list of cards."""
        return self.long

    @property
    def fingerprint(self) -> str:
        """The key layout's fingerprint (placement over the cards in service): clients compare it."""
        return self.long.fingerprint

    @property
    def storage_patterns(self) -> list[str]:
        """The ``storage_devices`` entries in force."""
        return self.long.patterns

    async def apply_devices(self, patterns: list[str]) -> list[str]:
        """``storage_devices`` changed (SIGHUP): ``CardSet.apply_devices``; what could not be done."""
        return await self.long.apply_devices(patterns)

    def size_in_ram(self, fkey: bytes) -> int | None:
        """The payload size of ``fkey`` in the RAM tier (None: not there, or past the ttl)."""
        return self.ram.size_of(fkey)

    def status(self) -> dict:
        """The tiers' part of the gateway's status: ``ram`` (the RAM tier's row but its counters, which
        are ``counters.ram``), ``cards`` (one row each), the layout (``fingerprint``, ``storage_slots``,
        ``card_generation``), the cards' I/O (``io_timeouts``, ``io_errors``, ``oldest_io_age_s``) and
        ``card_moves``."""
        ram, cards = self.ram, self.long
        return {
            "ram": {"evictions": ram.evictions, "used_bytes": ram.used_bytes, "capacity_bytes": ram.capacity,
                    "objects": ram.entries, "pinned_bytes": ram.pinned_bytes},
            "cards": cards.status(),
            "fingerprint": cards.fingerprint, "storage_slots": cards.slots, "card_generation": cards.generation,
            "io_timeouts": cards.io_timeouts, "io_errors": cards.io_errors, "oldest_io_age_s": cards.oldest_io_age(),
            "card_moves": {"objects": cards.mover.moved, "bytes": cards.mover.moved_bytes,
                           "failed": cards.mover.failed},
        }

    async def held_keys(self, chunk: int = 10_000) -> AsyncIterator[tuple[str, list[bytes]]]:
        """Everything held now whose key is known, as ``(tier, full keys)`` of at most ``chunk`` keys: the
        RAM tier's entries (tier ``"ram"``), then each card's rows with a key (tier: its serial; rows
        loaded from an index snapshot and not named since have none, ``kvgate.tiers.index``).

        The loop is let go between chunks (a chunk of 10,000 card rows holds it 3 ms at most, measured
        over a million rows; the RAM tier's keys are copied once, 11 ms for a million entries, which
        at the default 256 KiB pages is a 256 GB tier), so what changes meanwhile may be missed or
        listed twice: a reader applies ``changes`` noted after it started on top of what this lists.
        """
        keys = self.ram.keys()  # a copy: safe across the awaits below
        for i in range(0, len(keys), chunk):
            yield RAM_TIER, keys[i : i + chunk]
            await asyncio.sleep(0)
        del keys
        for mc in list(self.long.cards):
            index = mc.index
            if not index.keys or mc.serial is None:
                continue
            start = 0
            while start < len(mc.index):
                index = mc.index  # (a clean or a fresh index replaces it between chunks)
                found = index.held_keys(start, start + chunk)
                start += chunk
                if found:
                    yield mc.serial, found
                await asyncio.sleep(0)


def _stage(chunk: list[tuple[memoryview, PutItem]]) -> None:
    """Copy items' sources into staging buffers of ours (``memcopy``: a shrunk region is a ``MemoryFault``)."""
    for buf, it in chunk:
        memcopy.copy(buf, it.src)
