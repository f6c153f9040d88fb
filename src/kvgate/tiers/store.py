"""The tiered store: an ordered list of tiers, the RAM tier in front of the cards, as the gateway uses them.

Each tier speaks one contract (``kvgate.tiers.contract``: know, find, read
into, write, delete, list and the changes it notes); the store asks them in
order and owns what crosses them: a put written through, a prewarm read from
below into the front tier, holds, loans, the counters.

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
stays in RAM only; ``none`` is not stored at all.  In general: every tier
that ``keeps`` the retention writes it, the tiers below the front one from
the front one's copy, and the put is acknowledged by the last of them.

Reads answer by the contract's one rule, the same for lookup, exists, get,
prewarm and delete: a key is present when some tier holds it (the RAM tier,
else any card's index whatever the dialog, else a probe of its placement
card for the request's dialog), and is read from the first that does; what
no tier knows without I/O is asked of the tiers' media in order.  With
``ttl``, an object older than that is a miss in every one of them.  A
request's keys are looked up in each tier at once (``Tier.known``).

Peers: the peer tiers (``kvgate.tiers.peertier``) come last, after the
tiers of this gateway's own (``local``).  Which they are, which of them a
request's ``source`` picks, and when one that left is closed is the
``PeerSet``'s (``kvgate.tiers.peerset``); ``set_peers`` replaces ``tiers``
(a new list, never changed in place, so a call that took it goes on with it).

Changes: what each tier stores and drops is noted in ``changes``
(``kvgate.tiers.events``); ``held_keys`` lists what is held now, in
chunks.  Together they are what a gateway publishes as KV events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from kvgate import memcopy
from kvgate.cards import ObjectMeta
from kvgate.cards.base import CachedObjectFile
from kvgate.config import Config, ConfigError
from kvgate.keys import NamespaceBook
from kvgate.latency import Latencies
from kvgate.tiers.card import ManagedCard, TierHooks
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.cardtier import CardTier
from kvgate.tiers.contract import ABSENT, PRESENT, UNKNOWN, GetItem, Known, PutItem, Tier
from kvgate.tiers.counters import StoreCounters
from kvgate.tiers.events import TierChanges
from kvgate.tiers.holds import Holds
from kvgate.tiers.io import IoPool, gather_all
from kvgate.tiers.ram import RamTooLarge, copy_into
from kvgate.tiers.peerset import PeerSet
from kvgate.tiers.peertier import PeerTier
from kvgate.tiers.ramtier import RamLoan, RamTier
from kvgate.tiers.staging import BufferCache
from kvgate.tiers.usage import NamespaceUsage
from kvgate.types import Retention, SizeCode

__all__ = ["GetItem", "PutItem", "RamLoan", "TieredStore"]

log = logging.getLogger("kvgate.store")

REPLY_BUFFERS_KEEP = 128 << 20  # card parts of sent or lent replies kept for reuse: two 64 MiB gets' worth


class TieredStore:
    """The tiers in order, asked by one rule: puts, gets, lookups, lends, deletes (module docstring).

    Called by the gateway's operation handlers, on the event loop only; every
    coroutine keeps the loop free of copies and I/O by running them in
    ``pool``.  Nothing here blocks the loop but bookkeeping: a request waits
    on pool threads, not on other requests' bookkeeping.
    """

    def __init__(self, cfg: Config, pool: IoPool, namespaces: NamespaceBook | None = None):
        """``namespaces``: what the gateway's engines' namespaces stand for, told to the peers (its sessions
        write it)."""
        self.cfg = cfg
        self.pool = pool
        self.counters = StoreCounters()
        self.usage = NamespaceUsage()
        self.changes = TierChanges()  # what the tiers store and drop (kvgate.tiers.events)
        try:
            self.ram = RamTier(cfg, pool, self.counters.ram, self.usage, self.changes, self._count_expired)
        except RamTooLarge as e:
            raise ConfigError(f"config key 'max_bytes': {e}: lower max_bytes") from None
        self.holds = Holds()
        self.card_io_seconds = Latencies()
        self.cards = CardTier(cfg, pool, self.counters, TierHooks(
            self.usage, self.holds, on_corrupt=self._count_corrupt, on_expired=self._count_expired,
            io_seconds=self.card_io_seconds, changes=self.changes))
        self.peerset = PeerSet(cfg, namespaces)  # read only, last: asked only for what we lack
        self.tiers: list[Tier] = [self.ram, self.cards, *self.peerset.peers]  # fastest first: the order reads ask them
        self.local = 2  # the tiers that are this gateway's own (what it serves to peers: never a peer's)
        # The card part of replies sent or lent (what lend_ram cannot lend): the gateway's operations take
        # them, the card reads fill them, and they come back with the loans (return_ram).
        self.reply_buffers = BufferCache(REPLY_BUFFERS_KEEP)
        memcopy.check()

    def _count_expired(self, n: int) -> None:
        self.counters.expired += n

    def _count_corrupt(self, n: int) -> None:
        self.counters.corrupt += n

    async def start(self) -> None:
        await self.cards.start()

    async def stop(self) -> None:
        await self.cards.stop()
        self.peerset.close()

    # ---- peers --------------------------------------------------------------------

    @property
    def peers(self) -> list[PeerTier]:
        return self.peerset.peers

    def set_peers(self, addresses: Sequence[str]) -> None:
        """The peer gateways (HOST:PORT of their peer listeners) asked from now on, in this order
        (``PeerSet.replace``); ``tiers`` becomes a new list.  On the loop."""
        if self.peerset.replace(addresses):
            self.tiers = [*self.tiers[: self.local], *self.peerset.peers]

    def note_source(self, source: str | None) -> None:
        """Count a request's ``source`` (``PeerSet.note_source``): the gateway's operations, once a request."""
        self.peerset.note_source(source)

    def _tiers_for(self, source: str | None) -> list[Tier]:
        """This gateway's own tiers, then the peers ``source`` picks (``PeerSet.for_source``)."""
        if not source:
            return self.tiers
        return [*self.tiers[: self.local], *self.peerset.for_source(source)]

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
        """Store items in every tier that keeps ``retention``; True per item once the last of them has it.

        The RAM copy is made first and pinned while the tiers below write
        from it: they then write bytes the gateway owns, so a card write that
        runs past its deadline can never publish a client buffer that was
        reused after the client got its (failed) answer.  An item with no
        RAM copy in one piece (tier off or full, object larger than it,
        pages not contiguous) is written from the client's bytes, which a
        card stages first (``CardTier.write``).
        """
        if not items or retention not in self.ram.keeps:
            return [False] * len(items)
        below = [t for t in self.tiers[1:] if retention in t.keeps]
        stored, pinned = await self.ram.write_pinned(items, retention, pin=bool(below))
        if not below:
            return stored
        try:
            sources: dict[int, memoryview] = {}
            for it, entry in zip(items, pinned):
                views = entry.views() if entry is not None else []
                if len(views) == 1:
                    sources[id(it)] = views[0]
            for tier in below:
                stored = await tier.write(items, retention, sources)
        finally:
            self.ram.unpin(pinned)
        return stored

    # ---- get ------------------------------------------------------------------

    async def get(self, items: list[GetItem], urgent: bool = False, own: bool = False,
                  source: str | None = None) -> tuple[list[int], list[int]]:
        """Fill each item's dest; returns (sizes, needed) with ``SizeCode.MISS`` / ``TOO_SMALL`` in sizes.

        ``urgent``: an engine on this host waits on it (``IoPool.run``).  ``own``: every dest is the
        gateway's own memory, which card reads may fill in place (``Abandon.own``).  ``source``: where the
        request's KV was computed, which chooses the peers asked (``PeerSet.for_source``).
        """
        tiers = self._tiers_for(source)  # the one list this get asks (``served`` indexes it)
        with self.peerset.using():
            sizes, needed, metas, served = await self._read(items, 0, urgent, own, tiers=tiers)
        # (a pass over the items only where some tier promotes: none does without peers)
        if any(t.promote for t in tiers) and any(t >= 0 and tiers[t].promote for t in served):
            await self._promote([(it, size, meta) for it, size, meta, t in zip(items, sizes, metas, served)
                                 if t >= 0 and tiers[t].promote], own)
        for it, size in zip(items, sizes):
            row = self.usage.row(it.fkey)
            row.gets += 1
            if size >= 0:
                row.hits += 1
                row.bytes_read += size
        return sizes, needed

    async def _promote(self, served: list[tuple[GetItem, int, ObjectMeta | None]], own: bool) -> None:
        """Copy objects a ``promote`` tier (a peer) served into the RAM tier, kept ``short``: the engine's next
        load of them is local, and this gateway's cards stay for what its own engine stored."""
        puts = [PutItem(it.fkey, it.dest[:size], meta, in_region=not own)
                for it, size, meta in served if size >= 0 and meta is not None]
        if puts:
            await self.ram.write(puts, Retention.SHORT)

    async def _read(self, items: list[GetItem], first: int, urgent: bool = False, own: bool = False,
                    gets: bool = True, stop: int | None = None, tiers: list[Tier] | None = None,
                    ) -> tuple[list[int], list[int], list[ObjectMeta | None], list[int]]:
        """Read items from the tiers ``first`` to ``stop`` (default: all) by the contract's rule: each from the
        first tier that knows it, or from the first that ``probes``; every tier's part at once.  A miss where
        a tier thought it held the key (evicted meanwhile) is read again from the tiers after it.  ->
        ``(sizes, needed, metas, served)``: ``served`` the index of the tier that answered each (-1: none)
        in ``tiers`` (default: ``self.tiers`` as it is now: asked throughout, whatever ``set_peers`` does)."""
        n = len(items)
        tiers = self.tiers if tiers is None else tiers
        stop = len(tiers) if stop is None else stop
        sizes: list[int] = [SizeCode.MISS] * n
        needed = [0] * n
        metas: list[ObjectMeta | None] = [None] * n
        served = [-1] * n
        parts = self._route(items, list(range(n)), first, gets, stop, tiers)
        while parts:
            done: list[tuple[int, list[int], tuple]] = []

            async def part(t: int, idx: list[int]) -> None:
                done.append((t, idx, await tiers[t].read_into([items[i] for i in idx], urgent, own, gets)))

            if len(parts) == 1:  # no task for the one part of most gets (all from RAM, or all from one card)
                await part(*next(iter(parts.items())))
            else:  # every part ends before the answer: one that failed must not leave others writing dests
                await gather_all(*(part(t, idx) for t, idx in parts.items()))
            parts = {}
            for t, idx, (s, nd, m) in done:
                fell = [i for i, si in zip(idx, s) if si == SizeCode.MISS]
                for i, si, ni, mi in zip(idx, s, nd, m):
                    sizes[i], needed[i], metas[i] = si, ni, mi
                    if si >= 0:
                        served[i] = t
                if fell and t + 1 < stop:
                    for t2, idx2 in self._route(items, fell, t + 1, gets, stop, tiers).items():
                        parts.setdefault(t2, []).extend(idx2)
        return sizes, needed, metas, served

    def _route(self, items: list[GetItem], idx: list[int], first: int, gets: bool = True,
               stop: int | None = None, tiers: list[Tier] | None = None) -> dict[int, list[int]]:
        """Which tier of ``tiers`` (default ``self.tiers``; ``first`` on) each item is read from: the first that
        knows it without I/O, else the first that probes; items no such tier takes are misses (counted as such
        by the tiers they pass)."""
        tiers = self.tiers if tiers is None else tiers
        out: dict[int, list[int]] = {}
        left = idx
        for t in range(first, len(tiers) if stop is None else stop):
            if not left:
                break
            tier = tiers[t]
            if tier.probes:
                out[t] = left
                break
            held = np.zeros(len(left), bool)
            for dialog, pos in _by_dialog([items[i].dialog for i in left]).items():
                known = tier.known([items[left[p]].fkey for p in pos], dialog)
                held[pos] = known.state == PRESENT
            taken = [i for i, h in zip(left, held.tolist()) if h]
            if gets:
                passed = len(left) - len(taken)
                tier.counters.gets += passed  # asked, by the rule, and not there
                tier.counters.misses += passed
            if taken:
                out[t] = taken
            left = [i for i, h in zip(left, held.tolist()) if not h]
        return out

    # ---- lends ------------------------------------------------------------------

    def lend_ram(self, fkeys: list[bytes], sizes: list[int]) -> list[RamLoan | None]:
        """The RAM-tier objects of ``fkeys``, pinned so that a reply can be sent straight from their pages
        (``RamTier.lend``); None for each key it would not lend (read those with ``get``, which counts
        them).  Every loan goes back through ``return_ram``, on the loop, once its reply has gone."""
        loans = self.ram.lend(fkeys, sizes)
        for k, loan in zip(fkeys, loans):
            if loan is not None:
                self._count_lent(k, loan.size)
        return loans

    def lendable_bytes(self) -> int:
        """How many more RAM-tier bytes ``lend_ram`` would lend now."""
        return self.ram.lendable_bytes()

    def shared_ram(self) -> tuple[int, int, int] | None:
        """The RAM tier's arena as ``(fd, address, size)`` for a reader of the gateway's user to map
        read-only, so that it copies what ``lend_ram`` lends itself (``RamPages.shared``); None: not here."""
        return self.ram.shared()

    def return_ram(self, loans: list[RamLoan | None], buffers: Sequence[memoryview] = ()) -> None:
        """Unpin what ``lend_ram`` lent (each loan once), and keep ``buffers`` (``reply_buffers``'s,
        filled by card reads that have returned, sent or read by now) for the next reply."""
        self.ram.give_back(loans)
        self.reply_buffers.give(buffers)

    async def lend_files(self, fkeys: list[bytes], dialog: bytes, sizes: list[int],
                         urgent: bool = False) -> list[CachedObjectFile | None]:
        """The card objects of ``fkeys`` as their files, open, for a client to read itself
        (``CardTier.lend_files``); None for each key not lent (read those with ``get``, which counts
        them).  Counted as hits now (a RAM-tier miss first); every file goes back through
        ``return_files``, on the loop."""
        files = await self.cards.lend_files(fkeys, dialog, sizes, urgent)
        ram = self.counters.ram
        for k, f in zip(fkeys, files):
            if f is not None:
                ram.gets += 1
                ram.misses += 1
                self._count_lent(k, f.header.payload_len)
        return files

    def return_files(self, files: Sequence[CachedObjectFile]) -> None:
        """Close the files ``lend_files`` lent (each once), their client done with them."""
        self.cards.return_files(files)

    @property
    def files_lent(self) -> int:
        """Files ``lend_files`` lent and not yet returned."""
        return self.cards.files_lent

    def _count_lent(self, fkey: bytes, size: int) -> None:
        """A hit lent to a reply, in its namespace's row, as ``get`` counts one."""
        row = self.usage.row(fkey)
        row.gets += 1
        row.hits += 1
        row.bytes_read += size

    # ---- lookups ----------------------------------------------------------------

    def size_hints(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """Each key's payload size where a tier knows it without I/O, else None (``Tier.sizes``, each tier
        asked for the keys the ones before it do not know)."""
        out: list[int | None] = [None] * len(fkeys)
        rest = list(range(len(fkeys)))
        for tier in self.tiers:
            if not rest:
                break
            for i, size in zip(rest, tier.sizes([fkeys[i] for i in rest], dialog)):
                out[i] = size
            rest = [i for i in rest if out[i] is None]
        return out

    def _known_prefix(self, fkeys: list[bytes], dialog: bytes, start: int, urgent: bool, tiers: list[Tier],
                      ) -> tuple[int, int, list[tuple[Tier, list[bytes], Known, np.ndarray]]]:
        """From ``start``: how far the leading keys are known present by some tier without I/O, where the
        run of keys after that which no tier knows of ends (to probe), and what each tier was asked
        (``(tier, keys, Known, their positions)``).  Tiers that found keys of the prefix ``prepare``
        them once the answer is out.

        Each tier answers all its keys at once (``Tier.known``): a lookup runs
        this for 1,000s of keys on every engine step.
        """
        keys = fkeys[start:]
        m = len(keys)
        every = np.arange(m)
        state = np.full(m, ABSENT, np.int8)  # the best any tier said: PRESENT > UNKNOWN > ABSENT
        asked: list[tuple[Tier, list[bytes], Known, np.ndarray]] = []
        for tier in tiers:
            pos = np.flatnonzero(state != PRESENT) if asked else every
            if not pos.size:
                break
            if pos.size == m:  # (whole arrays: a lookup's keys are mostly in one tier or none)
                known = tier.known(keys, dialog)
                asked.append((tier, keys, known, every))
                state = np.maximum(state, known.state)
                continue
            sub = [keys[i] for i in pos.tolist()]
            known = tier.known(sub, dialog)
            asked.append((tier, sub, known, pos))
            state[pos] = np.maximum(state[pos], known.state)
        missing = np.flatnonzero(state != PRESENT)
        n = int(missing[0]) if missing.size else m
        if n:
            loop = asyncio.get_running_loop()
            for tier, sub, known, pos in asked:
                found = (known.state == PRESENT) & (pos < n)
                if found.any():
                    # once the answer is out: a read hint serves the load that follows it, and its 30 µs
                    # (1,000 keys on one card) need not wait in front of the reply
                    loop.call_soon(tier.prepare, sub, known, found, urgent)
        known_after = np.flatnonzero(state[n:] != UNKNOWN)
        end = n + int(known_after[0]) if known_after.size else m
        return start + n, start + end, asked

    async def lookup(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False,
                     source: str | None = None) -> int:
        """How many leading keys are present (the module's rule; ``source`` chooses the peers, ``PeerSet.for_source``)."""
        self.counters.lookups += 1
        tiers = self._tiers_for(source)
        with self.peerset.using():
            return await self._lookup(fkeys, dialog, urgent, tiers)

    async def _lookup(self, fkeys: list[bytes], dialog: bytes, urgent: bool, tiers: list[Tier]) -> int:
        n = 0
        while True:
            base = n
            n, end, asked = self._known_prefix(fkeys, dialog, n, urgent, tiers)
            if n == end:  # the next key is known missing by every tier (or there is none)
                return n
            # The run n:end no tier knows of: asked of the media of the tiers that cannot tell, in order.
            for tier, sub, known, pos in asked:
                if n == end:
                    break
                j = int(np.searchsorted(pos, n - base))
                if j < len(pos) and pos[j] == n - base and known.state[j] == UNKNOWN:
                    n += await tier.probe_prefix(sub, dialog, known, j, j + end - n, urgent)
            if n < end:
                return n

    async def exists(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False, local: bool = False,
                     source: str | None = None) -> list[bool]:
        """Whether each key is present (the module's rule; ``local``: in this gateway's own tiers, not its
        peers'; ``source`` chooses the peers, ``PeerSet.for_source``).  Counted as a lookup: it is the lookup of
        vLLM's tier, SGLang's backend and LMCache's adapter (``hold``), which never call ``lookup``."""
        self.counters.lookups += 1
        present = np.zeros(len(fkeys), bool)
        tiers = self._tiers_for(source)
        with self.peerset.using():
            for tier in tiers[: self.local] if local else tiers:
                ask = np.flatnonzero(~present)
                if not ask.size:
                    break
                sub = fkeys if ask.size == len(fkeys) else [fkeys[i] for i in ask.tolist()]
                present[ask] = await tier.find(sub, dialog, urgent)
        return present.tolist()

    async def read_for_peer(self, items: list[GetItem]) -> tuple[list[int], list[ObjectMeta | None]]:
        """A peer gateway's pull: each item read from this gateway's own tiers (never passed on to its peers:
        two gateways that list each other must not pull in a loop) into ``dest``, a buffer of ours.
        Counted as gets.  -> (sizes, metas)."""
        sizes, _needed, metas, _served = await self._read(items, 0, own=True, stop=self.local)
        return sizes, metas

    async def hold(self, session: int, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        """Per key, whether it is present and now held for ``session`` (``kvgate.tiers.holds``)."""
        present = await self.exists(fkeys, dialog, urgent)
        held = iter(self.holds.hold(session, [k for k, p in zip(fkeys, present) if p]))
        return [p and next(held) for p in present]

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Delete the keys from every tier; how many objects there were (the most any tier held)."""
        return max([await tier.delete(fkeys, dialog) for tier in self.tiers])

    async def prewarm(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Read the leading run of present keys (the module's rule) into the front tier; returns how many of
        them are there now."""
        front = self.ram
        in_front = (front.known(fkeys, dialog).state == PRESENT).tolist()
        sizes: list[int | None] = [None] * len(fkeys)
        rest = [i for i, f in enumerate(in_front) if not f]
        for tier in self.tiers[1:]:
            if not rest:
                break
            got = await tier.find_sizes([fkeys[i] for i in rest], dialog)
            for i, size in zip(rest, got):
                sizes[i] = size
            rest = [i for i in rest if sizes[i] is None]
        plans = []
        count = 0
        for i, k in enumerate(fkeys):
            if in_front[i]:
                count += 1
                continue
            size = sizes[i]
            if size is None:
                break
            res = front.reserve(k, size, ObjectMeta(dialog=dialog, created_ns=time.time_ns()))
            if res is None:
                break
            views = res.views()
            plans.append((k, res, size, views[0] if len(views) == 1 else memoryview(bytearray(size))))
        if not plans:
            return count
        try:
            got, _needed, metas, _served = await self._read([GetItem(k, dialog, dest) for k, _res, _size, dest in plans], 1,
                                                   own=True, gets=False, stop=self.local)  # no client's get
        except BaseException:
            for _k, res, _size, _dest in plans:
                front.abort(res)
            raise
        for (k, res, size, dest), s, meta in zip(plans, got, metas):
            if s != size or meta is None:
                front.abort(res)
                continue
            views = res.views()
            if len(views) != 1:
                await self.pool.run(copy_into, views, dest)
            front.commit(res, meta)
            count += 1
        return count

    async def clean(self) -> int:
        """Drop everything from every tier; the most objects any tier held."""
        return max([await tier.clean() for tier in self.tiers])

    async def clean_namespace(self, ns: bytes) -> tuple[int, int]:
        """Delete every object of namespace ``ns`` (its encoded form) from every tier, the loop let go
        between batches.  -> (objects dropped from the RAM tier, objects deleted from the tiers below)."""
        counts = [await tier.clean_namespace(ns) for tier in self.tiers]
        return counts[0], sum(counts[1:])

    async def held_keys(self, chunk: int = 10_000) -> AsyncIterator[tuple[str, list[bytes]]]:
        """Everything held now whose key is known, as ``(tier, full keys)`` of at most ``chunk`` keys, tier
        by tier (``Tier.held_keys``: the RAM tier as ``"ram"``, each card as its serial).

        The loop is let go between chunks, so what changes meanwhile may be
        missed or listed twice: a reader applies ``changes`` noted after it
        started on top of what this lists.
        """
        for tier in self.tiers:
            async for found in tier.held_keys(chunk):
                yield found

    # ---- for the gateway: it reaches the tiers only through these ----------------------

    def card_states(self) -> list[ManagedCard]:
        """The cards of the set now, in service or not (head sync, the ready message)."""
        return self.cards.set.cards

    @property
    def card_set(self) -> CardSet:
        """The card set itself, for what changes it: the admin's card operations, a cluster's view
        (``CardSource``), head sync's list of cards."""
        return self.cards.set

    @property
    def fingerprint(self) -> str:
        """The key layout's fingerprint (placement over the cards in service): clients compare it."""
        return self.cards.set.fingerprint

    @property
    def storage_patterns(self) -> list[str]:
        """The ``storage_devices`` entries in force."""
        return self.cards.set.patterns

    async def apply_devices(self, patterns: list[str]) -> list[str]:
        """``storage_devices`` changed (SIGHUP): ``CardSet.apply_devices``; what could not be done."""
        return await self.cards.set.apply_devices(patterns)

    def size_in_ram(self, fkey: bytes) -> int | None:
        """The payload size of ``fkey`` in the RAM tier (None: not there, or past the ttl)."""
        return self.ram.pages.size_of(fkey)

    def status(self) -> dict:
        """The tiers' part of the gateway's status: ``ram`` (the RAM tier's row but its counters, which
        are ``counters.ram``), the card tier's (``CardTier.status``) and the peers' (``PeerSet.status``)."""
        return {"ram": self.ram.status(), **self.cards.status(), **self.peerset.status()}


def _by_dialog(dialogs: list[bytes]) -> dict[bytes, list[int]]:
    """Positions per dialog (a get's items name theirs; most name one)."""
    first = dialogs[0] if dialogs else b""
    if dialogs.count(first) == len(dialogs):
        return {first: list(range(len(dialogs)))} if dialogs else {}
    out: dict[bytes, list[int]] = {}
    for i, d in enumerate(dialogs):
        out.setdefault(d, []).append(i)
    return out
