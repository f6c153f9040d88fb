"""The long tier: every card, its index, its capacity and its health.

Threading contract: every method here runs on the gateway's event loop and
never blocks; card I/O goes through ``IoPool``.  The in-memory index of each
card (what this gateway wrote or found at start) answers lookups without
touching the card; a key missing from the index is probed on the card, since
other gateways sharing the card, or objects not yet indexed after a restart,
may hold it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable

from kvgate.cards import Card, CardUnavailable, DirectoryCard, ObjectMeta
from kvgate.config import Config
from kvgate.keys import key_digest
from kvgate.placement import SlotMap, fingerprint, slot_of
from kvgate.tiers.eviction import LONG, EvictionPolicy, make_policy
from kvgate.tiers.io import IoPool

log = logging.getLogger("kvgate.long")

SCAN_BATCH = 10_000
CHECK_INTERVAL_S = 1.0
IO_ERROR_COOLDOWN_S = 10.0


class LayoutMismatch(RuntimeError):
    """The configured key_layout_fingerprint differs from the cards found."""


@dataclass(slots=True)
class IndexEntry:
    stored_bytes: int
    payload_len: int
    created_ns: int


@dataclass
class CardState:
    """One configured card as the gateway sees it."""

    location: str
    card: Card
    serial: str | None = None
    active: bool = False
    capacity: int = 0
    used: int = 0
    index: dict[bytes, IndexEntry] = field(default_factory=dict)
    policy: EvictionPolicy | None = None
    strikes: int = 0
    inactive_since: float = 0.0
    taken_out_by_error: bool = False
    scanned: bool = False
    # counters
    hits: int = 0
    misses: int = 0
    errors: int = 0
    reads_bytes: int = 0
    writes_bytes: int = 0
    evictions: int = 0

    @property
    def name(self) -> str:
        return self.serial or self.location


def make_card(location: str, cfg: Config) -> Card:
    return DirectoryCard(location, num_dbs=cfg.num_dbs, sync_writes=cfg.sync_writes)


class LongTier:
    def __init__(self, cfg: Config, pool: IoPool):
        self.cfg = cfg
        self.pool = pool
        self.cards = [CardState(loc, make_card(loc, cfg)) for loc in cfg.storage_devices]
        self.slot_map = SlotMap([], cfg.slots)
        self.fingerprint = ""
        self._by_serial: dict[str, CardState] = {}
        self._tasks: set[asyncio.Task] = set()
        self.io_errors = 0
        self.io_timeouts = 0

    # ---- start and stop ---------------------------------------------------

    async def start(self) -> None:
        for cs in self.cards:
            try:
                cs.serial = await self.pool.run(cs.card.open)
                cs.active = True
            except OSError as e:
                log.warning("card %s is not available at startup: %s", cs.location, e)
        serials = [cs.serial for cs in self.cards if cs.serial]
        try:
            self.slot_map = SlotMap(serials, self.cfg.slots)
        except ValueError as e:
            raise LayoutMismatch(str(e)) from None
        self._by_serial = {cs.serial: cs for cs in self.cards if cs.serial}
        self.fingerprint = fingerprint(self.slot_map, self.cfg.num_dbs, self.cfg.key_placement)
        log.info("Key layout fingerprint %s", self.fingerprint)
        expected = self.cfg.key_layout_fingerprint
        if expected and expected != self.fingerprint:
            raise LayoutMismatch(
                f"key layout fingerprint is {self.fingerprint} but key_layout_fingerprint is {expected}: "
                "these cards, slots, num_dbs or placement differ from the other gateways'; refusing to start"
            )
        if self.cfg.start_clean:
            deleted = await self.clean()
            log.info("start_clean: deleted %d objects", deleted)
        for cs in self.cards:
            cs.policy = make_policy(self.cfg.eviction_policy)
            if cs.active:
                await self._size_card(cs)
                self._spawn(self._scan(cs))
        self._spawn(self._health_loop())

    async def _size_card(self, cs: CardState) -> None:
        if self.cfg.card_capacity is not None:
            cs.capacity = self.cfg.card_capacity
        else:
            free = await self.pool.run(cs.card.free_bytes)
            cs.capacity = max(0, free - self.cfg.card_reserve)
            if cs.capacity == 0:
                log.warning("card %s has less free space than card_reserve; it will hold nothing", cs.location)

    async def _scan(self, cs: CardState) -> None:
        """Rebuild the index of what the card already holds, in batches off the loop."""
        try:
            it = await self.pool.run(cs.card.scan)
            while True:
                batch = await self.pool.run(lambda: list(islice(it, SCAN_BATCH)))
                if not batch:
                    break
                for obj in batch:
                    if obj.full_key in cs.index:
                        continue  # written since start: newer than what the scan saw
                    cs.index[obj.full_key] = IndexEntry(obj.stored_bytes, obj.payload_len, obj.meta.created_ns)
                    cs.used += obj.stored_bytes
                    cs.policy.add(obj.full_key, obj.stored_bytes, obj.meta.dialog, obj.meta.position, LONG)
            cs.scanned = True
            log.info("card %s (%s): %d objects, %d bytes indexed", cs.location, cs.serial, len(cs.index), cs.used)
            self._evict_over_capacity(cs)
        except OSError as e:
            log.warning("card %s: index scan stopped: %s", cs.location, e)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cs in self.cards:
            cs.card.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- placement --------------------------------------------------------

    def card_for(self, fkey: bytes, dialog: bytes) -> CardState | None:
        """The card an object belongs on, or None when no card serves its slot now."""
        serial = self.slot_map.serial_of_slot(slot_of(key_digest(fkey), dialog, self.cfg.key_placement, self.slot_map.slots))
        if serial is None:
            return None
        cs = self._by_serial[serial]
        return cs if cs.active else None

    # ---- index ------------------------------------------------------------

    def indexed(self, cs: CardState, fkey: bytes) -> IndexEntry | None:
        entry = cs.index.get(fkey)
        if entry is not None and self.cfg.ttl is not None and _expired(entry.created_ns, self.cfg.ttl):
            return None
        return entry

    def note_written(self, cs: CardState, fkey: bytes, stored: int, payload_len: int, meta: ObjectMeta) -> None:
        old = cs.index.pop(fkey, None)
        if old is not None:
            cs.used -= old.stored_bytes
        cs.index[fkey] = IndexEntry(stored, payload_len, meta.created_ns or time.time_ns())
        cs.used += stored
        cs.writes_bytes += stored
        cs.policy.add(fkey, stored, meta.dialog, meta.position, LONG)
        self._evict_over_capacity(cs)

    def note_hit(self, cs: CardState, fkey: bytes, nbytes: int) -> None:
        cs.hits += 1
        cs.reads_bytes += nbytes
        if fkey in cs.index:
            cs.policy.touch(fkey)

    def note_gone(self, cs: CardState, fkey: bytes) -> None:
        """The object is not (or no longer validly) on the card."""
        entry = cs.index.pop(fkey, None)
        if entry is not None:
            cs.used -= entry.stored_bytes
            cs.policy.remove(fkey)

    def _evict_over_capacity(self, cs: CardState) -> None:
        victims = []
        while cs.used > cs.capacity:
            victim = cs.policy.choose_victim()
            if victim is None:
                break
            self.note_gone(cs, victim)
            cs.evictions += 1
            victims.append(victim)
        if victims:
            self._spawn(self._delete_quietly(cs, victims))

    async def _delete_quietly(self, cs: CardState, fkeys: list[bytes]) -> None:
        def work() -> None:
            for k in fkeys:
                try:
                    cs.card.delete(k)
                except OSError:
                    pass  # the object is unindexed already; a scan will find and re-index or drop it

        await self.pool.run(work)

    # ---- health -------------------------------------------------------------

    def note_error(self, cs: CardState, err: BaseException) -> None:
        """An I/O on the card failed: strikes, then out of service."""
        cs.errors += 1
        self.io_errors += 1
        cs.strikes += 1
        if cs.active and (isinstance(err, CardUnavailable) or cs.strikes >= self.cfg.io_timeout_strikes):
            self._take_out(cs, f"{type(err).__name__}: {err}", by_error=True)

    def note_ok(self, cs: CardState) -> None:
        cs.strikes = 0

    def _take_out(self, cs: CardState, why: str, by_error: bool) -> None:
        cs.active = False
        cs.inactive_since = time.monotonic()
        cs.taken_out_by_error = by_error
        log.warning("card %s (%s) moved from active to inactive: %s", cs.location, cs.serial, why)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await asyncio.gather(*(self._check(cs) for cs in self.cards if cs.serial))

    async def _check(self, cs: CardState) -> None:
        try:
            serial = await asyncio.wait_for(self.pool.run(cs.card.check), self.cfg.io_timeout_ms / 1000)
        except (OSError, asyncio.TimeoutError) as e:
            if cs.active:
                self._take_out(cs, f"health check failed: {e or type(e).__name__}", by_error=True)
            return
        if serial != cs.serial:
            if cs.active:
                self._take_out(cs, f"label now says serial {serial}, expected {cs.serial}", by_error=True)
            return
        if not cs.active:
            if cs.taken_out_by_error and time.monotonic() - cs.inactive_since < IO_ERROR_COOLDOWN_S:
                return
            cs.active = True
            cs.strikes = 0
            log.warning("card %s (%s) moved from inactive to active", cs.location, cs.serial)

    # ---- bulk operations -----------------------------------------------------

    async def probe_prefix(self, fkeys: list[bytes], dialog: bytes) -> int:
        """How many leading keys exist on their cards (asks the cards themselves)."""
        targets = [self.card_for(k, dialog) for k in fkeys]

        def work() -> int:
            n = 0
            for k, cs in zip(fkeys, targets):
                if cs is None or not cs.card.exists(k):
                    break
                n += 1
            return n

        try:
            return await self.pool.run(work)
        except OSError:
            return 0

    async def probe_each(self, fkeys: list[bytes], dialog: bytes) -> list[bool]:
        targets = [self.card_for(k, dialog) for k in fkeys]

        def work() -> list[bool]:
            out = []
            for k, cs in zip(fkeys, targets):
                try:
                    out.append(cs is not None and cs.card.exists(k))
                except OSError:
                    out.append(False)
            return out

        return await self.pool.run(work)

    async def delete(self, fkeys: Iterable[tuple[bytes, bytes]]) -> int:
        """Delete (full key, dialog) pairs from their cards; returns how many were there."""
        targets = [(k, self.card_for(k, d)) for k, d in fkeys]
        for k, cs in targets:
            if cs is not None:
                self.note_gone(cs, k)

        def work() -> int:
            n = 0
            for k, cs in targets:
                if cs is None:
                    continue
                try:
                    n += cs.card.delete(k)
                except OSError:
                    pass
            return n

        return await self.pool.run(work)

    async def clean(self) -> int:
        total = 0
        for cs in self.cards:
            if not cs.active:
                continue
            try:
                total += await self.pool.run(cs.card.clean)
            except OSError as e:
                self.note_error(cs, e)
                continue
            cs.index.clear()
            cs.used = 0
            if cs.policy is not None:
                cs.policy = make_policy(self.cfg.eviction_policy)
        return total

    @property
    def active_cards(self) -> int:
        return sum(1 for cs in self.cards if cs.active)


def _expired(created_ns: int, ttl: float) -> bool:
    return created_ns + ttl * 1e9 < time.time_ns()
