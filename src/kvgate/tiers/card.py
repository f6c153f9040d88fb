"""One card as this gateway runs it: the card, its I/O threads, its index, its eviction and its health.

``ManagedCard`` is the only writer of its fields: the card set (``CardSet``)
decides which card an object belongs on and asks it; the tiered store reads
and writes through it; the status asks it for its row (``snapshot``).

Threading contract: every method runs on the gateway's event loop and never
blocks.  Card I/O runs on the card's own ``CardIo`` pool with a deadline
(``io_timeout_ms``): a card that hangs ties up only its own threads, and the
request that touched it gets its answer (a miss, a failed write) in time.
The start-up scan runs on the general pool (a slow scan must not hold the
card's threads, and it has no deadline).

Capacity: what a card may hold is what it holds plus what its medium has
free beyond the reserve of its kind (``Card.reserve_bytes``), or
``card_capacity`` when set.  What a card holds at start counts exactly as it
does later, so a restart evicts only from a card that really is over its
capacity, and says so.  A card that can hold nothing is warned about, and
long puts to it fail.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass
from enum import Enum
from itertools import islice
from typing import Callable

from kvgate.cards import (
    BufferTooSmall,
    Card,
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    ObjectTooNew,
)
from kvgate.config import Config
from kvgate.memcopy import MemoryFault
from kvgate.tiers.eviction import LONG, EvictionPolicy, make_policy
from kvgate.tiers.health import CardHealth, Outcome
from kvgate.tiers.holds import Holds
from kvgate.tiers.index import CardIndex, IndexEntry
from kvgate.tiers.io import Abandon, CardIo, IoPool, KeyOrder, Tasks, split_calls
from kvgate.tiers.usage import NamespaceUsage

log = logging.getLogger("kvgate.long")

SCAN_BATCH = 10_000
RESIZE_EVERY_CHECKS = 30  # re-read a card's free space about every 30 s
# Keys remembered as written by a newer kvgate, per card; past this the set
# starts over (an upgrade in progress should not hold memory without bound).
UNREADABLE_MAX = 65536


class TooLarge(OSError):
    """A write refused before any I/O: the object is larger than the card's capacity (0 for a card that holds nothing)."""


class ReadOutcome(Enum):
    """What one object's read from a card came to."""

    HIT = "hit"  # the payload is in the destination; ``header`` says what it was
    MISSING = "missing"  # not on the card
    TOO_SMALL = "too_small"  # the destination is smaller than the object; ``needed`` bytes are
    CORRUPT = "corrupt"  # a bad object, deleted: the destination holds garbage
    TOO_NEW = "too_new"  # written by a newer kvgate, left in place: a miss here
    FAILED = "failed"  # the card failed or passed its deadline; ``error`` says how


@dataclass(slots=True)
class CardRead:
    """One object's read (``ManagedCard.read``)."""

    outcome: ReadOutcome
    header: Header | None = None
    needed: int = 0
    error: BaseException | None = None

    @classmethod
    def of(cls, r: Header | BaseException) -> CardRead:
        """From what a card's ``read_many_into`` answers for one object."""
        if isinstance(r, Header):
            return cls(ReadOutcome.HIT, header=r)
        if isinstance(r, BufferTooSmall):
            return cls(ReadOutcome.TOO_SMALL, needed=r.needed, error=r)
        if isinstance(r, ObjectTooNew):  # before ObjectMissing, which it is a kind of
            return cls(ReadOutcome.TOO_NEW, error=r)
        if isinstance(r, ObjectMissing):
            return cls(ReadOutcome.MISSING, error=r)
        if isinstance(r, ObjectCorrupt):
            return cls(ReadOutcome.CORRUPT, error=r)
        return cls(ReadOutcome.FAILED, error=r)


class CardCounters:
    __slots__ = ("hits", "misses", "reads_bytes", "writes_bytes", "evictions", "read_hints")

    def __init__(self) -> None:
        self.hits = self.misses = self.reads_bytes = self.writes_bytes = self.evictions = self.read_hints = 0


class TierHooks:
    """What a card reports to the tiers above it: shared objects and counters (``TieredStore`` owns them)."""

    def __init__(self, usage: NamespaceUsage, holds: Holds, on_corrupt: Callable[[int], None] | None = None,
                 on_expired: Callable[[int], None] = lambda n: None) -> None:
        self.usage = usage
        self.holds = holds
        self.on_corrupt = on_corrupt  # the scan deleted n broken objects
        self.on_expired = on_expired  # n objects found past the ttl (deleted)


class ManagedCard:
    """One card: its I/O, index, eviction policy, capacity, health and counters.

    Created by ``CardSet`` for each configured location (``pattern`` is the
    ``storage_devices`` entry it came from); ``serial`` is set once the
    card's label is read.  ``adopt`` starts serving it (sizes it, indexes
    what it holds in the background); ``close`` ends its tasks and its I/O
    threads.
    """

    def __init__(self, pattern: str, location: str, card: Card, cfg: Config, pool: IoPool, hooks: TierHooks,
                 io: CardIo | None = None) -> None:
        self.pattern = pattern
        self.location = location
        self.card = card
        self.cfg = cfg
        self.pool = pool  # the general pool: scans
        self.hooks = hooks
        self.io = io or CardIo(cfg.thread_pool_size, cfg.io_timeout_ms / 1000, "kvgate-card", realtime=pool.realtime)
        self.serial: str | None = None
        self.capacity = 0
        self.index = CardIndex(hooks.usage)
        self.policy: EvictionPolicy = make_policy(cfg.eviction_policy)
        self.health = CardHealth(cfg.io_timeout_strikes, self.describe)
        self.counters = CardCounters()
        self.order = KeyOrder()  # writes and deletes of one key, in the order issued
        self.scanned = False
        self.deleting = 0  # eviction batches whose deletes have not finished yet
        # Unindexed keys whose delete has not run yet: a probe must not find them
        # (a put answered False for an object its own batch evicted; it stays a miss).
        self.leaving: set[bytes] = set()
        # Keys whose object on the card a newer kvgate wrote (ObjectTooNew): probes
        # call them misses instead of offering what every read of it would refuse.
        self.unreadable: set[bytes] = set()
        self.refused_serial: str | None = None  # the other card last seen at our path
        self._warned_empty = False  # said that it can hold nothing (said again only after it could hold some)
        self.tasks = Tasks()

    # ---- naming -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.serial or self.location

    @property
    def where(self) -> str:
        """The location as logs and status show it (a Redis password masked)."""
        return self.card.display_location

    def describe(self) -> str:
        return f"card {self.where} ({self.serial})"

    @property
    def active(self) -> bool:
        return self.health.active

    @property
    def read_only(self) -> bool:
        return self.health.read_only

    @property
    def used(self) -> int:
        return self.index.used

    # ---- life -----------------------------------------------------------------

    async def adopt(self) -> None:
        """Size the card, now in the slot map, and index what it holds in the background."""
        self.policy = make_policy(self.cfg.eviction_policy)
        if self.cfg.card_capacity is not None:
            self._set_capacity(self.cfg.card_capacity, "card_capacity is 0; set it to what the card may hold")
        else:
            # Free space only, for now: the scan adds what the card already
            # holds as it indexes it, and sizes the card again at its end.
            try:
                free = await self.io.run(self.card.free_bytes)
            except OSError as e:
                log.warning("card %s: cannot read free space (%s); capacity 0 until it can", self.where, e)
                free = 0
            self.capacity = max(0, free - self.card.reserve_bytes(self.cfg.card_reserve))
        self.tasks.spawn(self._scan())

    async def close(self) -> None:
        """End the card's tasks, its threads (not waiting for a hung one) and its claim."""
        await self.tasks.cancel()
        self.io.shutdown(wait=False)
        try:
            self.card.close()
        except OSError:
            pass

    def serve(self, card: Card, location: str, serial: str) -> None:
        """The card was opened and claimed at ``location``: it is in service from now on."""
        self.card, self.location, self.serial = card, location, serial
        self.health.active = True

    def reopen(self, card: Card, location: str) -> None:
        """The card was found again at ``location`` (already opened and claimed there)."""
        old = self.location
        self.card, self.location, self.refused_serial = card, location, None
        log.warning("card %s (%s) reopened as %s", old, self.serial, location)
        self.health.bring_back()

    # ---- capacity -------------------------------------------------------------

    def _set_capacity(self, capacity: int, why_empty: str) -> None:
        """Set what the card may hold; say loudly when that becomes nothing (``why_empty``: cause and fix)."""
        self.capacity = max(0, capacity)
        if self.capacity == 0 and not self._warned_empty:
            self._warned_empty = True
            log.warning("card %s (%s) can hold nothing: %s; long puts to it fail until it can", self.where,
                        self.serial, why_empty)
        elif self.capacity > 0 and self._warned_empty:
            self._warned_empty = False
            log.warning("card %s (%s) can hold objects again: capacity %d bytes", self.where, self.serial,
                        self.capacity)

    async def resize(self) -> None:
        """Follow the medium's free space (others write to shared filesystems too).

        Capacity is what we hold plus what is free beyond the reserve: it
        shrinks when others fill the filesystem and grows back when they
        delete, so a card lowered by a full disk recovers without a restart.
        """
        try:
            free = await self.io.run(self.card.free_bytes)
        except OSError:
            return
        self._set_capacity(self.used + free - self.card.reserve_bytes(self.cfg.card_reserve),
                           self.card.why_empty(free, self.used, self.cfg.card_reserve))
        self.evict_over_capacity()

    def evict_over_capacity(self) -> None:
        victims = []
        held = None
        holds = self.hooks.holds
        if holds:
            holds.expire()
            held = holds.__contains__ if holds else None
        while self.index.used > self.capacity:
            victim = self.policy.choose_victim(held)
            if victim is None:
                break
            self.note_gone(victim)
            self.counters.evictions += 1
            victims.append(victim)
        if victims:
            self.deleting += 1
            self.spawn_delete(victims).add_done_callback(self._deleted)

    def _deleted(self, _t: asyncio.Task) -> None:
        self.deleting -= 1

    # ---- the index ------------------------------------------------------------

    async def _scan(self) -> None:
        """Rebuild the index of what the card already holds, in batches off the loop."""
        corrupt0 = self.card.scan_corrupt
        by_free_space = self.cfg.card_capacity is None
        ttl = self.cfg.ttl
        n_expired = 0
        index = self.index
        try:
            it = await self.pool.run(self.card.scan)
            while True:
                batch = await self.pool.run(lambda: list(islice(it, SCAN_BATCH)))
                if not batch:
                    break
                too_old = []
                for obj in batch:
                    if obj.full_key in index:
                        continue  # written since start: newer than what the scan saw
                    if ttl is not None and expired(obj.meta.created_ns, ttl):
                        too_old.append(obj.full_key)
                        continue
                    index.put(obj.full_key, IndexEntry(obj.stored_bytes, obj.payload_len, obj.meta.created_ns,
                                                         obj.meta.dialog))
                    if by_free_space:  # the free space measured before the scan did not count these bytes
                        self.capacity += obj.stored_bytes
                    self.policy.add(obj.full_key, obj.stored_bytes, obj.meta.dialog, obj.meta.position, LONG)
                if too_old:
                    n_expired += len(too_old)
                    self.hooks.on_expired(len(too_old))
                    self.spawn_delete(too_old)
            evictions, used = self.counters.evictions, self.used
            if by_free_space:
                await self.resize()
            else:
                self.evict_over_capacity()
            self.scanned = True
            log.info("card %s (%s): %d objects, %d bytes indexed, capacity %d bytes%s", self.where, self.serial,
                     len(index), self.used, self.capacity,
                     f"; {n_expired} objects past the ttl deleted" if n_expired else "")
            if self.counters.evictions > evictions:
                log.warning("card %s (%s) held more than its capacity of %d bytes at start: %d objects (%d bytes) "
                            "evicted", self.where, self.serial, self.capacity, self.counters.evictions - evictions,
                            used - self.used)
        except OSError as e:
            log.warning("card %s: index scan stopped: %s", self.where, e)
        # Counted also when the scan stopped: what it deleted is gone either way.
        corrupt = self.card.scan_corrupt - corrupt0
        if corrupt:
            log.warning("card %s (%s): the index scan deleted %d corrupt objects (bad header, truncated or "
                        "misnamed)", self.where, self.serial, corrupt)
            if self.hooks.on_corrupt is not None:
                self.hooks.on_corrupt(corrupt)

    def entry(self, fkey: bytes) -> IndexEntry | None:
        """The live index entry of ``fkey``: None when unindexed, or known past the ttl (then deleted)."""
        entry = self.index.get(fkey)
        return entry if entry is not None and self.live(fkey, entry) else None

    def live(self, fkey: bytes, entry: IndexEntry) -> bool:
        """False when ``entry`` (of ``fkey``, in this index) is past the ttl: a miss, and its delete starts."""
        if self.cfg.ttl is None or not (entry.expiring or expired(entry.created_ns, self.cfg.ttl)):
            return True
        self._expire(fkey, entry)
        return False

    def _expire(self, fkey: bytes, entry: IndexEntry) -> None:
        """Delete an object past the ttl; its entry stays (a miss, never probed) until the delete is done."""
        if entry.expiring:
            return
        entry.expiring = True
        self.hooks.on_expired(1)

        def done(_t: asyncio.Task) -> None:
            if self.index.get(fkey) is entry:
                self.note_gone(fkey)

        self.spawn_delete([fkey]).add_done_callback(done)

    def note_written(self, fkey: bytes, stored: int, payload_len: int, meta: ObjectMeta) -> bool:
        """Index an object just written here; False when it did not stay (evicted by its own write)."""
        self.unreadable.discard(fkey)
        entry = IndexEntry(stored, payload_len, meta.created_ns or time.time_ns(), meta.dialog)
        self.index.put(fkey, entry)
        self.counters.writes_bytes += stored
        self.policy.add(fkey, stored, meta.dialog, meta.position, LONG, tail=meta.tail)
        self.evict_over_capacity()
        return self.index.get(fkey) is entry

    def note_hit(self, fkey: bytes, nbytes: int) -> None:
        self.counters.hits += 1
        self.counters.reads_bytes += nbytes
        if fkey in self.index:
            self.policy.touch(fkey)

    def note_unreadable(self, fkey: bytes) -> None:
        """The card holds the object in a format only a newer kvgate reads: a miss here, left in place."""
        self.note_gone(fkey)
        if len(self.unreadable) >= UNREADABLE_MAX:
            self.unreadable.clear()
        self.unreadable.add(fkey)

    def note_gone(self, fkey: bytes) -> None:
        """The object is not (or no longer validly) on the card."""
        if self.index.pop(fkey) is not None:
            self.policy.remove(fkey)

    def note_failed_read(self, fkey: bytes, r: CardRead) -> None:
        """A read of ``fkey`` came to ``r``, not the object: a miss; forget what it showed to be wrong."""
        self.counters.misses += 1
        match r.outcome:
            case ReadOutcome.TOO_SMALL:
                entry = self.index.get(fkey)
                if entry is not None and entry.payload_len != r.needed:
                    # Another gateway replaced it (shared cards): forget the stale
                    # size, or every size hint of a packed get repeats it.
                    self.note_gone(fkey)
            case ReadOutcome.CORRUPT:
                log.warning("corrupt object on card %s removed: %s", self.where, r.error)
                self.note_gone(fkey)
            case ReadOutcome.TOO_NEW:
                self.note_unreadable(fkey)
            case ReadOutcome.MISSING:
                self.note_gone(fkey)

    # ---- deletes ----------------------------------------------------------------

    def spawn_delete(self, fkeys: list[bytes]) -> asyncio.Task:
        """``delete_quietly`` as a task; its keys are misses from now on, not from when the task first runs."""
        self.leaving.update(fkeys)
        return self.tasks.spawn(self._delete_quietly(fkeys))

    async def _delete_quietly(self, fkeys: list[bytes]) -> None:
        """Delete objects the index has already let go of (evicted, expired, stale copies).

        A key with a write under way is left alone: the delete was meant for
        the object that write replaces, and would remove the new one.
        """
        replaced = [k for k in fkeys if self.order.writing(k)]
        fkeys = [k for k in fkeys if not self.order.writing(k)]
        self.leaving.difference_update(replaced)
        if not fkeys:
            return
        try:
            async with self.order.turn(fkeys):
                await self.io.run(_delete_each, self.card, fkeys)
        except OSError:
            pass
        finally:
            self.leaving.difference_update(fkeys)

    async def delete(self, fkeys: list[bytes]) -> int:
        """Delete keys now (a client's delete); returns how many objects were there."""
        for k in fkeys:
            self.note_gone(k)
        try:
            async with self.order.turn(fkeys):
                return await self.io.run(_delete_each, self.card, fkeys)
        except OSError:
            return 0

    async def clean(self) -> int:
        """Delete every object of ours on the card (``start_clean``, the ``clean`` op)."""
        try:
            n = await self.pool.run(self.card.clean)
        except OSError as e:
            self.note_result(e)
            return 0
        self.index.clear()
        self.policy = make_policy(self.cfg.eviction_policy)
        return n

    # ---- health -----------------------------------------------------------------

    def note_result(self, err: BaseException | None) -> None:
        """Feed one I/O outcome to the card's health (``CardHealth.note``)."""
        if self.health.note(err) is not Outcome.FULL or self.deleting:
            # (FULL while deleting: room is being made already, evicted objects
            # not deleted yet; this write raced that and tells nothing new.
            # Shrinking again for each such write would compound, 0.9 ** n of a batch.)
            return
        # Full, not broken: the medium holds less than we thought (other
        # writers, a smaller filesystem).  Shrink to what fits and evict.
        log.warning("card %s (%s) is full; capacity lowered to %d bytes", self.where, self.serial,
                    min(self.capacity, int(self.used * 0.9)))
        self._set_capacity(min(self.capacity, int(self.used * 0.9)),
                           "its medium refused a write as full while it held nothing of ours; make room there")
        self.evict_over_capacity()

    async def check(self) -> bool:
        """One health check of the card's label; False when the card is not (or no longer) at its location."""
        try:
            serial = await self.io.run(self.card.check)
        except OSError as e:
            # A check is one I/O like any other: a slow one is a strike; a
            # card that is gone (CardUnavailable) goes out at once.
            if self.active:
                self.note_result(e)
            return self.active or isinstance(e, TimeoutError)
        if serial != self.serial:
            if self.refused_serial != serial:
                log.warning("card %s: the card at %s now has serial %s, not %s: not used", self.serial, self.where,
                            serial, self.serial)
                self.refused_serial = serial
            if self.active:
                self.health.take_out(f"label now says serial {serial}", by_error=True)
            return False
        self.refused_serial = None
        self.health.checked()
        if self.health.recheck_due():
            await self._recheck_writable()
        if self.active and self.cfg.card_capacity is None and self.health.checks % RESIZE_EVERY_CHECKS == 0:
            await self.resize()
        self.health.come_back_if_due()
        return True

    async def _recheck_writable(self) -> None:
        try:
            await self.io.run(self.card.check_writable)
        except OSError as e:
            if e.errno != errno.EROFS:
                log.warning("card %s (%s): write probe failed: %s", self.where, self.serial, e)
            self.health.still_read_only()
            return
        self.health.writable_again()

    # ---- bulk I/O -----------------------------------------------------------------

    def hint_reads(self, fkeys: list[bytes], urgent: bool = False) -> None:
        """Tell the card which of its objects a lookup just found (``Card.prepare_reads``).

        An engine loads what its lookup found a moment later; whatever part
        of those reads can run before the load arrives is then off its path.
        Best effort, on the card's hint thread; a card under suspicion is
        left alone.
        """
        if not (self.card.prepares_reads and self.health.hints_ok):
            return
        if self.io.hint(self.card.prepare_reads, fkeys, urgent=urgent):
            self.counters.read_hints += len(fkeys)

    async def read(self, items: list[tuple[bytes, memoryview]], urgent: bool = False) -> list[CardRead]:
        """Read ``(full key, dest)`` pairs, in parallel chunks, each with a deadline.

        ``urgent``: an engine waits on it (``IoPool.run``).  Once this returns
        or raises, no byte of the read lands in any ``dest`` (each chunk's
        guard is abandoned first), however long the card takes.  Raises
        ``MemoryFault`` when a ``dest`` is memory that is gone (a client's
        region shrunk under its mapping): the client's doing, not the card's.
        """
        chunks = split_calls(items, self.io.threads, [len(dest) for _k, dest in items])
        out = await self._chunked([self._read_chunk(chunk, urgent) for chunk in chunks])
        fault = next((r for r in out if isinstance(r, MemoryFault)), None)
        if fault is not None:
            raise fault
        return [CardRead.of(r) for r in out]

    async def _chunked(self, chunk_calls: list) -> list:
        """Run the chunk calls at once and feed the outcomes to the card's health.

        A chunk is one I/O to the card: however many objects it carried, it
        is one success or one strike (the first error it met), so a slow
        chunk of 16 objects is not 16 strikes.
        """
        out = []
        for res in await asyncio.gather(*chunk_calls):
            if isinstance(res, BaseException):
                self.note_result(res)
                out += [res] * res.n_items  # type: ignore[attr-defined]
                continue
            failed = next((r for r in res if isinstance(r, OSError) and not isinstance(r, MemoryFault)), None)
            self.note_result(failed)
            out += res
        return out

    async def _read_chunk(self, chunk: list, urgent: bool) -> list | BaseException:
        # The card reads into its own memory and delivers through the guard,
        # which CardIo.run abandons before it gives up on the call: a read
        # that ends after its deadline writes nothing into the destinations.
        guard = Abandon()
        try:
            return await self.io.run(self.card.read_many_into, chunk, guard, abandon=guard, urgent=urgent)
        except OSError as e:
            return _whole_chunk(e, len(chunk))

    async def write(self, items: list[tuple[bytes, memoryview, ObjectMeta]]) -> list[int | BaseException]:
        """Write ``(full key, payload, meta)`` items: bytes stored, or the error, per item.

        An object whose payload alone is not smaller than the card's
        capacity is refused without I/O (``TooLarge``): the card could only
        evict it again.
        """
        if self.read_only:  # known to refuse: fail at once, no I/O (the health check tries it again)
            return [OSError(errno.EROFS, "card is read-only", self.where) for _ in items]
        out: list[int | BaseException | None] = [None] * len(items)
        fit = []
        for i, it in enumerate(items):
            if len(it[1]) >= self.capacity:
                out[i] = TooLarge(errno.ENOSPC, f"object of {len(it[1])} bytes does not fit the card's capacity "
                                  f"of {self.capacity} bytes", self.where)
            else:
                fit.append(i)
        if fit:
            async with self.order.turn((items[i][0] for i in fit), write=True):
                chunks = split_calls([items[i] for i in fit], self.io.threads, [len(items[i][1]) for i in fit])
                done = await self._chunked([self._write_chunk(chunk) for chunk in chunks])
            for i, r in zip(fit, done):
                out[i] = r
        return out  # type: ignore[return-value]

    async def _write_chunk(self, chunk: list) -> list | BaseException:
        abandon = Abandon()
        try:
            return await self.io.run(self.card.write_many, chunk, lambda: not abandon.abandoned, abandon=abandon)
        except OSError as e:
            return _whole_chunk(e, len(chunk))

    def _not_before(self) -> int | None:
        """With a ttl, objects created before this are expired: what card probes are told."""
        return time.time_ns() - int(self.cfg.ttl * 1e9) if self.cfg.ttl is not None else None

    async def probe_prefix(self, fkeys: list[bytes], urgent: bool = False) -> int:
        """How many leading keys the card holds (the card itself is asked); a failed probe is 0."""
        unreadable = next((j for j, k in enumerate(fkeys) if k in self.unreadable), None)
        if unreadable is not None:
            fkeys = fkeys[:unreadable]  # the prefix ends there
        if not fkeys:
            return 0
        try:
            return await self.io.run(_exists_prefix, self.card, fkeys, self._not_before(), urgent=urgent)
        except OSError as e:
            self.note_result(e)
            return 0

    async def probe_each(self, fkeys: list[bytes], urgent: bool = False) -> list[bool]:
        """Whether the card holds each key (the card itself is asked; a failed probe is all False)."""
        ask = [i for i, k in enumerate(fkeys) if k not in self.unreadable]
        out = [False] * len(fkeys)
        if not ask:
            return out
        try:
            res = await self.io.run(self.card.exists_many, [fkeys[i] for i in ask], self._not_before(),
                                    urgent=urgent)
        except OSError as e:
            self.note_result(e)
            return out
        for i, r in zip(ask, res):
            out[i] = r is True
        return out

    # ---- status -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The card's row in the gateway's status."""
        c = self.counters
        return {
            "serial": self.serial, "location": self.where, "kind": self.card.kind, "active": self.active,
            "read_only": self.read_only,
            "capacity_bytes": self.capacity, "used_bytes": self.used, "objects": len(self.index),
            "hits": c.hits, "misses": c.misses, "errors": self.health.errors, "timeouts": self.health.timeouts,
            "bytes_read": c.reads_bytes, "bytes_written": c.writes_bytes, "evictions": c.evictions,
            "read_hints": c.read_hints,
            "scanned": self.scanned, **self.card.read_rates(),
        }


def _whole_chunk(err: OSError, n_items: int) -> OSError:
    err.n_items = n_items  # type: ignore[attr-defined]
    return err


def _exists_prefix(card: Card, keys: list[bytes], not_before_ns: int | None) -> int:
    res = card.exists_many(keys, not_before_ns)
    n = 0
    for r in res:
        if r is not True:
            break
        n += 1
    return n


def _delete_each(card: Card, fkeys: list[bytes]) -> int:
    n = 0
    for k in fkeys:
        try:
            n += card.delete(k)
        except OSError:
            pass  # unindexed already; a later scan re-indexes or drops it
    return n


def expired(created_ns: int, ttl: float) -> bool:
    return created_ns + ttl * 1e9 < time.time_ns()
