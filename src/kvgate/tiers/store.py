"""The tiered store: RAM tier in front of the long tier, as the gateway uses them.

Threading contract: every coroutine here runs on the event loop.  Bookkeeping
(RAM allocation, card indexes, counters) happens on the loop, so it needs no
locks; byte copies and card I/O run in ``IoPool`` threads, on RAM entries
pinned for the duration.  Bulk operations are split into at most
``thread_pool_size`` chunks, one pool call each: a batch of 32 objects costs
a handful of thread hand-offs, not 32.

Writes are write-through: a put of retention ``long`` is acknowledged once
the object is in the RAM tier *and* on its card, so what was acknowledged
survives a gateway restart.  ``short`` stays in RAM only; ``none`` is not
stored at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvgate.cards import BufferTooSmall, CardUnavailable, ObjectCorrupt, ObjectMeta, ObjectMissing
from kvgate.config import Config
from kvgate.protocol import MISS, TOO_SMALL
from kvgate.tiers.eviction import LONG, SHORT
from kvgate.tiers.io import IoPool
from kvgate.tiers.long import CardState, LongTier, _expired
from kvgate.tiers.ram import RamTier, copy_into, copy_out

log = logging.getLogger("kvgate.store")

RETENTION_CLASS = {"short": SHORT, "long": LONG}


@dataclass
class TierCounters:
    sets: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class StoreCounters:
    ram: TierCounters = field(default_factory=TierCounters)
    long: TierCounters = field(default_factory=TierCounters)
    lookups: int = 0
    corrupt: int = 0
    expired: int = 0


@dataclass(slots=True)
class PutItem:
    fkey: bytes
    src: memoryview
    meta: ObjectMeta


@dataclass(slots=True)
class GetItem:
    fkey: bytes
    dialog: bytes
    dest: memoryview


class TieredStore:
    def __init__(self, cfg: Config, pool: IoPool):
        self.cfg = cfg
        self.pool = pool
        self.ram = RamTier(cfg.max_bytes, cfg.ram_page_size, cfg.eviction_policy)
        self.long = LongTier(cfg, pool)
        self.counters = StoreCounters()

    async def start(self) -> None:
        await self.long.start()

    async def stop(self) -> None:
        await self.long.stop()

    # ---- put ------------------------------------------------------------------

    async def put(self, items: list[PutItem], retention: str) -> list[bool]:
        if retention == "none" or not items:
            return [False] * len(items)
        klass = RETENTION_CLASS[retention]
        plans = []
        for it in items:
            res = self.ram.reserve(it.fkey, len(it.src), it.meta, klass)
            cs = self.long.card_for(it.fkey, it.meta.dialog) if klass == LONG else None
            plans.append((it, res, cs))

        def work(chunk: list) -> list:
            out = []
            for it, res, cs in chunk:
                ram_ok = False
                if res is not None:
                    copy_into(res.views(), it.src)
                    ram_ok = True
                card_result: int | BaseException | None = None
                if cs is not None:
                    try:
                        card_result = cs.card.write(it.fkey, it.src, it.meta)
                    except OSError as e:
                        card_result = e
                out.append((ram_ok, card_result))
            return out

        results = [r for chunk in await self.pool.map_chunks(work, plans) for r in chunk]
        stored = []
        c = self.counters
        for (it, res, cs), (ram_ok, card_result) in zip(plans, results):
            n = len(it.src)
            if res is not None:
                self.ram.commit(res)
                c.ram.sets += 1
                c.ram.bytes_written += n
            card_ok = isinstance(card_result, int)
            if cs is not None:
                if card_ok:
                    self.long.note_ok(cs)
                    self.long.note_written(cs, it.fkey, card_result, n, it.meta)
                    c.long.sets += 1
                    c.long.bytes_written += n
                else:
                    log.debug("write to card %s failed: %s", cs.location, card_result)
                    self.long.note_error(cs, card_result)
            stored.append(card_ok or (ram_ok and cs is None))
        return stored

    # ---- get ------------------------------------------------------------------

    async def get(self, items: list[GetItem]) -> tuple[list[int], list[int]]:
        """Fill each item's dest; returns (sizes, needed) with MISS / TOO_SMALL in sizes."""
        c = self.counters
        sizes = [MISS] * len(items)
        needed = [0] * len(items)
        plans = []
        for i, it in enumerate(items):
            entry = self.ram.pin(it.fkey)
            if entry is not None and self.cfg.ttl is not None and _expired(entry.meta.created_ns, self.cfg.ttl):
                self.ram.unpin(entry)
                self.ram.delete(it.fkey)
                c.expired += 1
                entry = None
            if entry is not None:
                if entry.size > len(it.dest):
                    self.ram.unpin(entry)
                    sizes[i], needed[i] = TOO_SMALL, entry.size
                    continue
                plans.append((i, it, entry, None))
                continue
            c.ram.gets += 1
            c.ram.misses += 1
            cs = self.long.card_for(it.fkey, it.dialog)
            if cs is None:
                continue
            plans.append((i, it, None, cs))

        ttl = self.cfg.ttl

        def work(chunk: list) -> list:
            out = []
            for _i, it, entry, cs in chunk:
                if entry is not None:
                    copy_out(entry.views(), it.dest[: entry.size])
                    out.append(entry.size)
                    continue
                try:
                    hdr = cs.card.read_into(it.fkey, it.dest)
                except (ObjectMissing, ObjectCorrupt, BufferTooSmall, OSError) as e:
                    out.append(e)
                    continue
                if ttl is not None and _expired(hdr.meta.created_ns, ttl):
                    try:
                        cs.card.delete(it.fkey)
                    except OSError:
                        pass
                    out.append(_Expired())
                    continue
                out.append(hdr.payload_len)
            return out

        results = [r for chunk in await self.pool.map_chunks(work, plans) for r in chunk]
        for (i, it, entry, cs), r in zip(plans, results):
            if entry is not None:
                self.ram.unpin(entry)
                sizes[i] = r
                c.ram.gets += 1
                c.ram.hits += 1
                c.ram.bytes_read += r
                continue
            c.long.gets += 1
            if isinstance(r, int):
                sizes[i] = r
                c.long.hits += 1
                c.long.bytes_read += r
                self.long.note_ok(cs)
                self.long.note_hit(cs, it.fkey, r)
                continue
            c.long.misses += 1
            cs.misses += 1
            if isinstance(r, BufferTooSmall):
                sizes[i], needed[i] = TOO_SMALL, r.needed
            elif isinstance(r, ObjectCorrupt):
                c.corrupt += 1
                log.warning("corrupt object on card %s removed: %s", cs.location, r)
                self.long.note_gone(cs, it.fkey)
            elif isinstance(r, (ObjectMissing, _Expired)):
                c.expired += isinstance(r, _Expired)
                self.long.note_gone(cs, it.fkey)
            elif isinstance(r, (CardUnavailable, OSError)):
                self.long.note_error(cs, r)
        return sizes, needed

    # ---- lookups ----------------------------------------------------------------

    def size_hint(self, fkey: bytes, dialog: bytes) -> int | None:
        """Payload size if this gateway knows it without touching a card."""
        size = self.ram.size_of(fkey)
        if size is not None:
            return size
        cs = self.long.card_for(fkey, dialog)
        entry = self.long.indexed(cs, fkey) if cs is not None else None
        return entry.payload_len if entry is not None else None

    def _known(self, fkey: bytes, dialog: bytes) -> bool:
        if self.ram.contains(fkey):
            return True
        cs = self.long.card_for(fkey, dialog)
        return cs is not None and self.long.indexed(cs, fkey) is not None

    def _known_prefix(self, fkeys: list[bytes], dialog: bytes) -> int:
        """How many leading keys this gateway knows without touching a card.

        ``_known`` in one loop with the bound methods hoisted: a lookup runs
        this for 1,000s of keys on every engine step, and the per-key method
        calls were most of its cost.  An empty RAM tier is not asked at all.
        """
        in_ram = self.ram.contains if self.ram.entries else None
        card_for = self.long.card_for
        indexed = self.long.indexed
        n = 0
        for k in fkeys:
            if in_ram is None or not in_ram(k):
                cs = card_for(k, dialog)
                if cs is None or indexed(cs, k) is None:
                    break
            n += 1
        return n

    async def lookup(self, fkeys: list[bytes], dialog: bytes) -> int:
        """How many leading keys exist in any tier."""
        self.counters.lookups += 1
        n = self._known_prefix(fkeys, dialog)
        if n < len(fkeys):
            n += await self.long.probe_prefix(fkeys[n:], dialog)
        return n

    async def exists(self, fkeys: list[bytes], dialog: bytes) -> list[bool]:
        present = [self._known(k, dialog) for k in fkeys]
        unknown = [i for i, p in enumerate(present) if not p]
        if unknown:
            found = await self.long.probe_each([fkeys[i] for i in unknown], dialog)
            for i, f in zip(unknown, found):
                present[i] = f
        return present

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        n_ram = sum(self.ram.delete(k) for k in fkeys)
        n_long = await self.long.delete((k, dialog) for k in fkeys)
        return max(n_ram, n_long)

    async def prewarm(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Pull the leading run of keys present on cards into the RAM tier; returns how many are in RAM."""
        plans = []
        in_ram = 0
        for k in fkeys:
            if self.ram.contains(k):
                in_ram += 1
                continue
            cs = self.long.card_for(k, dialog)
            entry = self.long.indexed(cs, k) if cs is not None else None
            if entry is not None:
                size, created_ns = entry.payload_len, entry.created_ns
            elif cs is not None and not cs.scanned:
                # the start-up scan has not indexed it yet: ask the card (as get and lookup do)
                size, created_ns = await self._unindexed_size(cs, k), time.time_ns()
                if size is None:
                    break
            else:
                break
            res = self.ram.reserve(k, size, ObjectMeta(dialog=dialog, created_ns=created_ns), LONG)
            if res is None:
                break
            plans.append((k, cs, res, size))

        def work(chunk: list) -> list:
            out = []
            scratch = bytearray()
            for k, cs, res, size in chunk:
                views = res.views()
                try:
                    if len(views) == 1:
                        cs.card.read_into(k, views[0])
                    else:
                        if len(scratch) < size:
                            scratch = bytearray(size)
                        cs.card.read_into(k, memoryview(scratch)[:size])
                        copy_into(views, memoryview(scratch)[:size])
                    out.append(None)
                except (ObjectMissing, ObjectCorrupt, BufferTooSmall, OSError) as e:
                    out.append(e)
            return out

        results = [r for chunk in await self.pool.map_chunks(work, plans) for r in chunk]
        for (k, cs, res, size), err in zip(plans, results):
            if err is None:
                self.ram.commit(res)
                self.long.note_hit(cs, k, size)
                self.counters.long.bytes_read += size
                in_ram += 1
            else:
                self.ram.abort(res)
                if isinstance(err, ObjectCorrupt):
                    self.counters.corrupt += 1
                    self.long.note_gone(cs, k)
                elif isinstance(err, ObjectMissing):
                    self.long.note_gone(cs, k)
                elif isinstance(err, OSError):
                    self.long.note_error(cs, err)
        return in_ram

    async def _unindexed_size(self, cs: CardState, fkey: bytes) -> int | None:
        """Payload size of an object on the card, read from its header (None: not there)."""

        def probe() -> int | None:
            try:
                return cs.card.read_into(fkey, memoryview(bytearray(0))).payload_len
            except BufferTooSmall as e:
                return e.needed
            except (ObjectMissing, ObjectCorrupt, OSError):
                return None

        return await self.pool.run(probe)

    async def clean(self) -> int:
        n = self.ram.entries
        self.ram.clear()
        return max(n, await self.long.clean())

    def card_states(self) -> list[CardState]:
        return self.long.cards


class _Expired(Exception):
    pass

