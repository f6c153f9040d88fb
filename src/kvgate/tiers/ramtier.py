"""The RAM tier: the store's front tier (``kvgate.tiers.contract``) over ``RamPages``.

Objects live in preallocated pages (``kvgate.tiers.ram``); this module adds
what makes those pages a tier: reads and writes batched into ``IoPool``
chunks, the tier's counters, and lending pages to replies.  Bookkeeping on
the event loop; byte copies in pool threads, on entries pinned for the copy
(``RamPages``'s threading contract).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.config import Config
from kvgate.keys import full_key
from kvgate.tiers.contract import ABSENT, CPU, PRESENT, GetItem, Known, PutItem
from kvgate.tiers.counters import TierCounters
from kvgate.tiers.events import RAM_TIER, TierChanges
from kvgate.tiers.referee import EXPERTS
from kvgate.tiers.io import IoPool
from kvgate.tiers.ram import Entry, RamPages, Reservation, copy_into, copy_out
from kvgate.tiers.usage import NamespaceUsage
from kvgate.types import Retention, SizeCode

CLEAN_RAM_BATCH = 4096  # entries a namespace's clean drops between two turns of the loop
LEND_SHARE = 0.25  # of the tier, at most, pinned by lent replies at once (``RamTier.lend``)


@dataclass(slots=True)
class RamLoan:
    """A RAM-tier object lent to a reply (``RamTier.lend``): its pages stay put, unchanged, until it is
    given back; ``views`` hold its ``size`` bytes, in order."""

    size: int
    views: list[memoryview]
    entry: Entry  # pinned: for ``RamTier.give_back`` only


class RamTier:
    """The store's RAM tier (``kvgate.tiers.contract.Tier``); keeps ``short`` and ``long`` puts."""

    name = RAM_TIER
    medium = CPU
    keeps = frozenset({Retention.SHORT, Retention.LONG})
    probes = False
    promote = False

    def __init__(self, cfg: Config, pool: IoPool, counters: TierCounters, usage: NamespaceUsage,
                 changes: TierChanges, on_expired) -> None:
        """Raises ``RamTooLarge`` when ``cfg.max_bytes`` cannot be had."""
        self.pool = pool
        self.counters = counters
        self.pages = RamPages(cfg.max_bytes, cfg.ram_page_size, cfg.eviction_policy, ttl=cfg.ttl,
                              on_expired=on_expired, usage=usage, changes=changes,
                              shared=cfg.shared_ram_arena and cfg.cross_memory_gets)

    # ---- presence -----------------------------------------------------------------

    def known(self, fkeys: list[bytes], dialog: bytes = b"") -> Known:
        if not self.pages.entries:
            return Known(np.full(len(fkeys), ABSENT, np.int8))
        present = self.pages.contains_many(fkeys)
        return Known(np.where(present, np.int8(PRESENT), np.int8(ABSENT)))

    async def find(self, fkeys: list[bytes], dialog: bytes = b"", urgent: bool = False) -> list[bool]:
        return self.pages.contains_many(fkeys).tolist()

    async def probe_prefix(self, fkeys, dialog, known, start, end, urgent=False) -> int:
        return 0  # it knows every key it holds

    def prepare(self, fkeys, known, present, urgent=False) -> None:
        pass

    def sizes(self, fkeys: list[bytes], dialog: bytes = b"") -> list[int | None]:
        size_of = self.pages.size_of
        return [size_of(k) for k in fkeys]

    async def find_sizes(self, fkeys: list[bytes], dialog: bytes = b"") -> list[int | None]:
        return self.sizes(fkeys, dialog)

    # ---- reads and writes -------------------------------------------------------------

    async def read_into(self, items: list[GetItem], urgent: bool = False, own: bool = False, gets: bool = True,
                        ) -> tuple[list[int], list[int], list[ObjectMeta | None]]:
        c = self.counters if gets else TierCounters()
        n = len(items)
        sizes: list[int] = [SizeCode.MISS] * n
        needed = [0] * n
        metas: list[ObjectMeta | None] = [None] * n
        plans: list[tuple[int, GetItem, Entry]] = []
        for i, it in enumerate(items):
            entry = self.pages.pin(it.fkey)
            c.gets += 1
            if entry is None:
                c.misses += 1
            elif entry.size > len(it.dest):
                self.pages.unpin(entry)
                sizes[i], needed[i] = SizeCode.TOO_SMALL, entry.size
            else:
                plans.append((i, it, entry))
        if not plans:
            return sizes, needed, metas

        def copy_work(chunk: list) -> None:
            for _i, it, entry in chunk:
                copy_out(entry.views(), it.dest[: entry.size])

        try:
            await self.pool.map_chunks(copy_work, plans, min_chunk=2, urgent=urgent)
        finally:
            for _i, _it, entry in plans:
                self.pages.unpin(entry)
        for i, _it, entry in plans:
            sizes[i], metas[i] = entry.size, entry.meta
            c.hits += 1
            self.counters.bytes_read += entry.size
        return sizes, needed, metas

    async def write(self, items: list[PutItem], retention: Retention,
                    sources: dict[int, memoryview] | None = None) -> list[bool]:
        stored, pinned = await self.write_pinned(items, retention, pin=False)
        return stored

    async def write_pinned(self, items: list[PutItem], retention: Retention, pin: bool = True,
                           ) -> tuple[list[bool], list[Entry | None]]:
        """``write``, and (``pin``) each copy made pinned, for the tiers below to write from: hand them
        to ``unpin`` once done.  ``(stored, pinned)``, one of each per item; items the tier had no room
        for are not stored, and have no pinned copy."""
        reservations = [self.pages.reserve(it.fkey, len(it.src), it.meta, retention) for it in items]
        copies = [(it, res) for it, res in zip(items, reservations) if res is not None]

        def copy_work(chunk: list) -> None:
            for it, res in chunk:
                copy_into(res.views(), it.src)

        try:
            await self.pool.map_chunks(copy_work, copies, min_chunk=2)
        except BaseException:
            for _it, res in copies:
                self.pages.abort(res)
            raise
        pinned: list[Entry | None] = []
        c = self.counters
        for it, res in zip(items, reservations):
            if res is None:
                pinned.append(None)
                continue
            self.pages.commit(res)
            c.sets += 1
            c.bytes_written += len(it.src)
            pinned.append(self.pages.pin(it.fkey) if pin else None)
        return [res is not None for res in reservations], pinned

    def unpin(self, entries: list[Entry | None]) -> None:
        for entry in entries:
            if entry is not None:
                self.pages.unpin(entry)

    # ---- what the store fills from the tiers below (prewarm) ----------------------------

    def reserve(self, fkey: bytes, size: int, meta: ObjectMeta) -> Reservation | None:
        """Room for an object read from a tier below; ``commit`` or ``abort`` it."""
        return self.pages.reserve(fkey, size, meta, Retention.LONG)

    def commit(self, reservation: Reservation, meta: ObjectMeta) -> None:
        reservation.meta = meta  # the stored object's: its creation time counts for the ttl here too
        self.pages.commit(reservation)

    def abort(self, reservation: Reservation) -> None:
        self.pages.abort(reservation)

    # ---- lending --------------------------------------------------------------------

    def lend(self, fkeys: list[bytes], sizes: list[int]) -> list[RamLoan | None]:
        """The objects of ``fkeys``, pinned so that a reply can be sent straight from their pages; None for
        each key it lacks, or holds at another size than ``sizes`` says, or past ``LEND_SHARE``.

        A reply of many MiB built by copying out of the tier costs a fresh
        buffer's page faults and the copy: 1.4 GiB/s here, against 3.6 for
        the loopback socket that carries it.  Replies held by slow or stalled
        clients must not pin the tier: past a share of it, an object is
        copied out instead (its pin then lasts the copy), so puts always
        find pages.  Counted as hits now; every loan goes back through
        ``give_back``, on the loop, once its reply has gone (or failed).
        """
        out: list[RamLoan | None] = []
        for k, size in zip(fkeys, sizes, strict=True):
            room = size <= self.lendable_bytes()
            entry = self.pages.pin(k) if room and self.pages.size_of(k) == size else None
            if entry is None:  # (or its ttl ran out between the two)
                out.append(None)
                continue
            c = self.counters
            c.gets += 1
            c.hits += 1
            c.bytes_read += entry.size
            out.append(RamLoan(entry.size, entry.views(), entry))
        return out

    def lendable_bytes(self) -> int:
        """How many more bytes ``lend`` would lend now."""
        return max(0, int(self.pages.capacity * LEND_SHARE) - self.pages.pinned_bytes)

    def shared(self) -> tuple[int, int, int] | None:
        """Its arena for a reader of this process's user to map read-only (``RamPages.shared``)."""
        return self.pages.shared()

    def give_back(self, loans: list[RamLoan | None]) -> None:
        for loan in loans:
            if loan is not None:
                self.pages.unpin(loan.entry)

    # ---- dropping -------------------------------------------------------------------

    async def delete(self, fkeys: list[bytes], dialog: bytes = b"") -> int:
        delete = self.pages.delete
        return sum(delete(k) for k in fkeys)

    async def clean(self) -> int:
        n = self.pages.entries
        self.pages.clear()
        return n

    async def clean_namespace(self, ns: bytes) -> int:
        """In batches of ``CLEAN_RAM_BATCH``, the loop let go between them."""
        prefix = full_key(ns, b"")  # the length byte keeps "ab" from matching a namespace "abc"
        mine = [k for k in self.pages.keys() if k.startswith(prefix)]
        n = 0
        for i in range(0, len(mine), CLEAN_RAM_BATCH):
            n += sum(self.pages.delete(k) for k in mine[i : i + CLEAN_RAM_BATCH])
            await asyncio.sleep(0)
        return n

    async def held_keys(self, chunk: int = 10_000) -> AsyncIterator[tuple[str, list[bytes]]]:
        """Its keys are copied once (11 ms for a million entries, which at the default 256 KiB pages is a
        256 GB tier), then listed ``chunk`` at a time."""
        keys = self.pages.keys()
        for i in range(0, len(keys), chunk):
            yield RAM_TIER, keys[i : i + chunk]
            await asyncio.sleep(0)

    def status(self) -> dict:
        """Its row of the status (its counters are ``counters.ram``)."""
        p = self.pages
        orders = p.evictions_by_order()
        return {"evictions": p.evictions, "used_bytes": p.used_bytes, "capacity_bytes": p.capacity,
                "objects": p.entries, "pinned_bytes": p.pinned_bytes,
                **{f"{order}_order_evictions": orders.get(order, 0) for order in EXPERTS}}
