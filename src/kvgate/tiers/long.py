"""The long tier: every card, its index, its capacity and its health.

Threading contract: every method here runs on the gateway's event loop and
never blocks.  Card I/O goes through each card's own ``CardIo`` pool, with a
deadline (``io_timeout_ms``): a card that hangs ties up only its own threads,
and the request that touched it gets its answer (a miss, a failed write) in
time.

Index: what this gateway wrote, or found on the card at start, answers
lookups without touching the card.  A key missing from the index is probed on
the card, since other gateways sharing it, or objects not yet indexed after a
restart, may hold it.

Where a key is (``find``), one rule for every lookup, exists, get, prewarm
and delete: a key is wherever an active card's index holds it, whatever
dialog the request names (its placement card is asked first); a key no index
holds is probed on its placement card for the request's dialog (the dialog's
card, or the key's own card when the request names none).  With ``ttl``, an
object the index knows to be older is a miss, and is deleted.

Capacity: what a card may hold is what it holds plus what its medium has
free beyond the reserve of its kind (``card_reserve`` for a filesystem; a
Redis card keeps its own, see ``RedisCard.free_bytes``), or ``card_capacity``
when set.  What a card holds at start counts exactly as it does later, so a
restart evicts only from a card that really is over its capacity, and says
so.  A card that can hold nothing is warned about, and long puts to it fail.

Health: a check of each card's label every second;
``io_timeout_strikes`` I/Os in a row that fail or pass the deadline take a
card out of service; out of service, its lookups are misses and its writes
fail at once.  A card that answers again comes back at once, or after
``IO_ERROR_COOLDOWN_S`` when I/O errors took it out.  A card that refuses
writes as read-only (EROFS: a filesystem remounted read-only after errors, a
read-only export, a Redis replica) is not taken out: it goes on serving
reads, takes no writes, and is tried for writability every
``READ_ONLY_RECHECK_S``; taking it out would lose every conversation it
holds, and bringing it back would only fail its next write.

A card is known by the serial on its label: found again under another path that its
``storage_devices`` entry matches (a glob), it is taken back there; a
different card at its old path is never used in its place.

Claims: every card is claimed (``Card.claim``) before it is used, exclusively
or, with ``shared_storage``, shared.  At start a card another gateway holds
in a way that does not mix refuses the start (``CardInUse``, one line with
the fix); a card that appears later (pending, relocated) and is held so is
not used, and logged.

A configured card directory that does not exist is not created (unless
``create_card_dirs``, or it is the default ``./var/kvgate/card0``): it is
logged and pending, and taken as soon as it exists, labelled or not, as at
start; what it must not be is a directory the gateway made itself on the
filesystem under a missing mount.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable

from kvgate.cards import (
    BufferTooSmall,
    Card,
    CardInUse,
    CardUnavailable,
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    expand,
    is_redis,
    make_card,
)
from kvgate.config import Config
from kvgate.keys import NO_DIALOG, key_digest
from kvgate.memcopy import MemoryFault
from kvgate.placement import SlotMap, fingerprint, slot_of
from kvgate.tiers.eviction import LONG, EvictionPolicy, make_policy
from kvgate.tiers.holds import Holds
from kvgate.tiers.io import Abandon, CardIo, IoPool, KeyOrder, split
from kvgate.tiers.usage import NamespaceUsage

log = logging.getLogger("kvgate.long")

SCAN_BATCH = 10_000
CHECK_INTERVAL_S = 1.0
IO_ERROR_COOLDOWN_S = 10.0
READ_ONLY_RECHECK_S = 10.0
RESIZE_EVERY_CHECKS = 30  # re-read a card's free space about every 30 s
# After a deadline passed on a card, lookups send it no read hints for this
# many I/Os: its hint thread may be stuck with the rest.
SUSPECT_IOS = 1000
# Keys remembered as written by a newer kvgate, per card; past this the set
# starts over (an upgrade in progress should not hold memory without bound).
UNREADABLE_MAX = 65536


class LayoutMismatch(RuntimeError):
    """The configured key_layout_fingerprint differs from the cards found."""


class TooLarge(OSError):
    """A write refused before any I/O: the object is larger than the card's capacity (0 for a card that holds nothing)."""


@dataclass(slots=True)
class IndexEntry:
    stored_bytes: int
    payload_len: int
    created_ns: int
    expiring: bool = False  # past the ttl: a miss, its delete is under way


@dataclass
class CardState:
    """One card as the gateway sees it."""

    pattern: str  # the storage_devices entry it came from
    location: str
    card: Card
    io: CardIo
    serial: str | None = None
    active: bool = False
    capacity: int = 0
    used: int = 0
    index: dict[bytes, IndexEntry] = field(default_factory=dict)
    policy: EvictionPolicy | None = None
    order: KeyOrder = field(default_factory=KeyOrder)  # writes and deletes of one key, in the order issued
    strikes: int = 0
    inactive_since: float = 0.0
    taken_out_by_error: bool = False
    suspect: int = 0
    scanned: bool = False
    read_only: bool = False  # refused a write with EROFS: serves reads, takes no writes
    read_only_since: float = 0.0
    refused_serial: str | None = None  # the other card last seen at our path
    deleting: int = 0  # eviction batches whose deletes have not finished yet
    # Unindexed keys whose delete has not run yet: a probe must not find them
    # (a put answered False for an object its own batch evicted; it stays a miss).
    leaving: set[bytes] = field(default_factory=set)
    checks: int = 0  # health checks passed
    warned_empty: bool = False  # said that it can hold nothing (said again only after it could hold some)
    # counters
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    reads_bytes: int = 0
    writes_bytes: int = 0
    evictions: int = 0
    read_hints: int = 0  # objects passed to prepare_reads after lookups found them
    # Keys whose object on the card a newer kvgate wrote (ObjectTooNew): probes
    # call them misses instead of offering what every read of it would refuse.
    unreadable: set[bytes] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.serial or self.location

    @property
    def where(self) -> str:
        """The location as logs and status show it (a Redis password masked)."""
        return self.card.display_location


def default_slots(cfg: Config, cards_found: int) -> int:
    """``storage_slots``: a fixed count, never the number of cards.

    Tied to the card count, adding a card would move every key (a new slot
    count re-maps them all), and with a few slots rendezvous hashing leaves
    some cards with none: 4 slots over 4 cards land one per card only 9 % of
    the time.  ``cards_found`` stays for the caller's log.
    """
    return cfg.storage_slots


class LongTier:
    """``on_corrupt(n)``: the start-up scan of a card deleted ``n`` broken objects (to count them);
    ``on_expired(n)``: it found ``n`` objects past the ttl (deleted too)."""

    def __init__(self, cfg: Config, pool: IoPool, on_corrupt: Callable[[int], None] | None = None,
                 on_expired: Callable[[int], None] = lambda n: None, usage: NamespaceUsage | None = None):
        self.cfg = cfg
        self.usage = usage if usage is not None else NamespaceUsage()
        self.holds = Holds()
        self.on_corrupt = on_corrupt
        self.pool = pool  # for work that is not one card's (globbing)
        self.cards: list[CardState] = []
        self.pending: list[CardState] = []  # entries with no readable card yet
        self.slot_map = SlotMap([], 1)
        self.slots = 0  # fixed at start: storage_slots
        self.fingerprint = ""
        self._by_serial: dict[str, CardState] = {}
        self._tasks: set[asyncio.Task] = set()
        self.io_errors = 0
        self.io_timeouts = 0
        self._refusals: dict[str, str] = {}  # location -> the last reason it was not taken, said once
        self.on_expired = on_expired

    def _new_state(self, pattern: str, location: str) -> CardState:
        return CardState(pattern, location, make_card(location, self.cfg),
                         CardIo(self.cfg.thread_pool_size, self.cfg.io_timeout_ms / 1000, "kvgate-card",
                                realtime=self.pool.realtime))

    # ---- start and stop ---------------------------------------------------

    async def start(self) -> None:
        for pattern in self.cfg.storage_devices:
            locations = await self.pool.run(expand, pattern)
            if not locations:
                log.warning("card %s is not available at startup: nothing matches", pattern)
                self.pending.append(self._new_state(pattern, pattern))
            for loc in locations:
                cs = self._new_state(pattern, loc)
                try:
                    cs.serial = await cs.io.run(cs.card.open)
                except OSError as e:
                    log.warning("card %s is not available at startup: %s", cs.where, e)
                    self.pending.append(cs)
                    continue
                if cs.serial in self._by_serial:
                    log.warning("card %s carries serial %s, already in use at %s: ignored", loc, cs.serial,
                                self._by_serial[cs.serial].location)
                    continue
                try:
                    await cs.io.run(cs.card.claim, self.cfg.shared_storage)
                except CardInUse:
                    cs.io.shutdown(wait=False)
                    await self.stop()  # release the cards claimed so far
                    raise
                except OSError as e:
                    log.warning("card %s is not available at startup: %s", cs.where, e)
                    cs.card.close()
                    self.pending.append(cs)
                    continue
                cs.active = True
                self.cards.append(cs)
                self._by_serial[cs.serial] = cs
        self._remap()
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
            await self._adopt(cs)
        self._spawn(self._health_loop())

    def _remap(self) -> None:
        if not self.slots:
            self.slots = default_slots(self.cfg, len(self._by_serial))
        try:
            self.slot_map = SlotMap(list(self._by_serial), self.slots)
        except ValueError as e:
            raise LayoutMismatch(str(e)) from None
        self.fingerprint = fingerprint(self.slot_map, self.cfg.num_dbs, self.cfg.key_placement)
        log.info("Key layout fingerprint %s", self.fingerprint)
        n = len(self.slot_map.serials)
        if n > 1:
            shares = ", ".join(f"{self._by_serial[s].location}: {len(self.slot_map.slots_of(s))}"
                               for s in self.slot_map.serials)
            log.info("slots per card: %s", shares)
            if self.slot_map.slots < 16 * n:
                log.warning("storage_slots is %d for %d cards: shares are uneven (a card may get none); "
                            "16 slots per card or more spread the load", self.slot_map.slots, n)

    async def _adopt(self, cs: CardState) -> None:
        """Size a card that is now in the map, and index what it holds in the background."""
        cs.policy = make_policy(self.cfg.eviction_policy)
        if self.cfg.card_capacity is not None:
            self._set_capacity(cs, self.cfg.card_capacity, "card_capacity is 0; set it to what the card may hold")
        else:
            # Free space only, for now: the scan adds what the card already
            # holds as it indexes it, and sizes the card again at its end.
            try:
                free = await cs.io.run(cs.card.free_bytes)
            except OSError as e:
                log.warning("card %s: cannot read free space (%s); capacity 0 until it can", cs.where, e)
                free = 0
            cs.capacity = max(0, free - self._reserve(cs))
        self._spawn(self._scan(cs))

    def _reserve(self, cs: CardState) -> int:
        """Free space the gateway leaves on the card's medium (a Redis card's free_bytes keeps its own)."""
        return cs.card.reserve_bytes(self.cfg.card_reserve)

    def _set_capacity(self, cs: CardState, capacity: int, why_empty: str) -> None:
        """Set what the card may hold; say loudly when that becomes nothing (``why_empty``: cause and fix)."""
        cs.capacity = max(0, capacity)
        if cs.capacity == 0 and not cs.warned_empty:
            cs.warned_empty = True
            log.warning("card %s (%s) can hold nothing: %s; long puts to it fail until it can", cs.where, cs.serial,
                        why_empty)
        elif cs.capacity > 0 and cs.warned_empty:
            cs.warned_empty = False
            log.warning("card %s (%s) can hold objects again: capacity %d bytes", cs.where, cs.serial, cs.capacity)

    def _why_empty(self, cs: CardState, free: int) -> str:
        return cs.card.why_empty(free, cs.used, self.cfg.card_reserve)

    async def _scan(self, cs: CardState) -> None:
        """Rebuild the index of what the card already holds, in batches off the loop.

        Scans run in the general pool: a slow scan must not hold the card's
        threads, and it has no deadline.
        """
        corrupt0 = cs.card.scan_corrupt
        by_free_space = self.cfg.card_capacity is None
        ttl = self.cfg.ttl
        n_expired = 0
        try:
            it = await self.pool.run(cs.card.scan)
            while True:
                batch = await self.pool.run(lambda: list(islice(it, SCAN_BATCH)))
                if not batch:
                    break
                too_old = []
                for obj in batch:
                    if obj.full_key in cs.index:
                        continue  # written since start: newer than what the scan saw
                    if ttl is not None and expired(obj.meta.created_ns, ttl):
                        too_old.append(obj.full_key)
                        continue
                    cs.index[obj.full_key] = IndexEntry(obj.stored_bytes, obj.payload_len, obj.meta.created_ns)
                    cs.used += obj.stored_bytes
                    self.usage.card(obj.full_key, obj.stored_bytes, 1)
                    if by_free_space:  # the free space measured before the scan did not count these bytes
                        cs.capacity += obj.stored_bytes
                    cs.policy.add(obj.full_key, obj.stored_bytes, obj.meta.dialog, obj.meta.position, LONG)
                if too_old:
                    n_expired += len(too_old)
                    self.on_expired(len(too_old))
                    self._spawn_delete(cs, too_old)
            evictions, used = cs.evictions, cs.used
            if by_free_space:
                await self._resize(cs)
            else:
                self._evict_over_capacity(cs)
            cs.scanned = True
            log.info("card %s (%s): %d objects, %d bytes indexed, capacity %d bytes%s", cs.where, cs.serial,
                     len(cs.index), cs.used, cs.capacity,
                     f"; {n_expired} objects past the ttl deleted" if n_expired else "")
            if cs.evictions > evictions:
                log.warning("card %s (%s) held more than its capacity of %d bytes at start: %d objects (%d bytes) "
                            "evicted", cs.where, cs.serial, cs.capacity, cs.evictions - evictions, used - cs.used)
        except OSError as e:
            log.warning("card %s: index scan stopped: %s", cs.where, e)
        # Counted also when the scan stopped: what it deleted is gone either way.
        corrupt = cs.card.scan_corrupt - corrupt0
        if corrupt:
            log.warning("card %s (%s): the index scan deleted %d corrupt objects (bad header, truncated or "
                        "misnamed)", cs.where, cs.serial, corrupt)
            if self.on_corrupt is not None:
                self.on_corrupt(corrupt)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cs in self.cards + self.pending:
            cs.io.shutdown(wait=False)
            try:
                cs.card.close()
            except OSError:
                pass

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- placement --------------------------------------------------------

    def card_for(self, fkey: bytes, dialog: bytes) -> CardState | None:
        """The card an object belongs on, or None when no card serves its slot now.

        An inactive card keeps its slots: its dialogs are misses until it is
        back, and are never written elsewhere where they would shadow it.
        """
        serial = self.slot_map.serial_of_slot(slot_of(key_digest(fkey), dialog, self.cfg.key_placement, self.slot_map.slots))
        if serial is None:
            return None
        cs = self._by_serial[serial]
        return cs if cs.active else None

    def cards_for(self, fkeys: list[bytes], dialog: bytes) -> list[CardState | None]:
        """``card_for`` of many keys of one request, computed once where placement allows.

        With dialog placement and a dialog mark, or a single slot, every key
        of the request lands on the same card: one hash instead of 1,000s.
        """
        if self.slot_map.slots == 1 or (self.cfg.key_placement == "dialog" and dialog != NO_DIALOG):
            return [self.card_for(fkeys[0], dialog) if fkeys else None] * len(fkeys)
        return [self.card_for(k, dialog) for k in fkeys]

    def group(self, items: list, key_of, dialog_of) -> dict[int, tuple[CardState, list[int]]]:
        """Indexes of ``items`` per active card (by id of the card state)."""
        groups: dict[int, tuple[CardState, list[int]]] = {}
        for i, it in enumerate(items):
            cs = self.card_for(key_of(it), dialog_of(it))
            if cs is not None:
                groups.setdefault(id(cs), (cs, []))[1].append(i)
        return groups

    # ---- index ------------------------------------------------------------

    def find(self, fkey: bytes, home: CardState | None) -> tuple[CardState | None, IndexEntry | None]:
        """Where ``fkey`` is by the module's rule; ``home``: its placement card for the request (``card_for``).

        ``(card, entry)``: an active card's index holds it (``home``'s
        first); ``(home, None)``: no index holds it, ask ``home``; ``(None,
        None)``: a miss without asking (no card serves it, or the index knows
        it is past the ttl).  Hot path: a lookup calls this for 1,000s of keys.
        """
        entry = home.index.get(fkey) if home is not None else None
        if entry is None:
            for cs in self.cards:
                if cs is not home and cs.active:
                    entry = cs.index.get(fkey)
                    if entry is not None:
                        home = cs
                        break
            else:
                if home is not None and fkey in home.leaving:
                    return None, None
                return home, None
        if self.cfg.ttl is not None and (entry.expiring or expired(entry.created_ns, self.cfg.ttl)):
            self._expire(home, fkey, entry)
            return None, None
        return home, entry

    def _expire(self, cs: CardState, fkey: bytes, entry: IndexEntry) -> None:
        """Delete an object past the ttl; its entry stays (a miss, never probed) until the delete is done."""
        if entry.expiring:
            return
        entry.expiring = True
        self.on_expired(1)

        def done(_t: asyncio.Task) -> None:
            if cs.index.get(fkey) is entry:
                self.note_gone(cs, fkey)

        self._spawn_delete(cs, [fkey]).add_done_callback(done)

    def note_written(self, cs: CardState, fkey: bytes, stored: int, payload_len: int, meta: ObjectMeta) -> bool:
        """Index an object just written to ``cs``; False when it did not stay there (evicted by its own write).

        A copy on any other card is deleted: the key is now on ``cs``, and a
        stale copy elsewhere must not answer for it (``find``).
        """
        cs.unreadable.discard(fkey)
        old = cs.index.pop(fkey, None)
        if old is not None:
            cs.used -= old.stored_bytes
            self.usage.card(fkey, -old.stored_bytes, -1)
        entry = IndexEntry(stored, payload_len, meta.created_ns or time.time_ns())
        cs.index[fkey] = entry
        cs.used += stored
        self.usage.card(fkey, stored, 1)
        cs.writes_bytes += stored
        cs.policy.add(fkey, stored, meta.dialog, meta.position, LONG, tail=meta.tail)
        for other in self.cards:
            if other is not cs and fkey in other.index:
                self.note_gone(other, fkey)
                self._spawn_delete(other, [fkey])
        self._evict_over_capacity(cs)
        return cs.index.get(fkey) is entry

    def note_hit(self, cs: CardState, fkey: bytes, nbytes: int) -> None:
        cs.hits += 1
        cs.reads_bytes += nbytes
        if fkey in cs.index:
            cs.policy.touch(fkey)

    def note_unreadable(self, cs: CardState, fkey: bytes) -> None:
        """The card holds the object in a format only a newer kvgate reads: a miss here, left in place."""
        self.note_gone(cs, fkey)
        if len(cs.unreadable) >= UNREADABLE_MAX:
            cs.unreadable.clear()
        cs.unreadable.add(fkey)

    def note_gone(self, cs: CardState, fkey: bytes) -> None:
        """The object is not (or no longer validly) on the card."""
        entry = cs.index.pop(fkey, None)
        if entry is not None:
            cs.used -= entry.stored_bytes
            self.usage.card(fkey, -entry.stored_bytes, -1)
            cs.policy.remove(fkey)

    def _evict_over_capacity(self, cs: CardState) -> None:
        victims = []
        held = None
        if self.holds:
            self.holds.expire()
            held = self.holds.__contains__ if self.holds else None
        while cs.used > cs.capacity:
            victim = cs.policy.choose_victim(held)
            if victim is None:
                break
            self.note_gone(cs, victim)
            cs.evictions += 1
            victims.append(victim)
        if victims:
            cs.deleting += 1
            self._spawn_delete(cs, victims).add_done_callback(lambda _t: self._deleted(cs))

    @staticmethod
    def _deleted(cs: CardState) -> None:
        cs.deleting -= 1

    def _spawn_delete(self, cs: CardState, fkeys: list[bytes]) -> asyncio.Task:
        """``_delete_quietly`` as a task; its keys are misses from now on, not from when the task first runs."""
        cs.leaving.update(fkeys)
        return self._spawn(self._delete_quietly(cs, fkeys))

    async def _delete_quietly(self, cs: CardState, fkeys: list[bytes]) -> None:
        """Delete objects the index has already let go of (evicted, expired, stale copies).

        A key with a write under way is left alone: the delete was meant for
        the object that write replaces, and would remove the new one.
        """
        replaced = [k for k in fkeys if cs.order.writing(k)]
        fkeys = [k for k in fkeys if not cs.order.writing(k)]
        cs.leaving.difference_update(replaced)
        if not fkeys:
            return

        def work() -> None:
            for k in fkeys:
                try:
                    cs.card.delete(k)
                except OSError:
                    pass  # unindexed already; a later scan re-indexes or drops it

        try:
            async with cs.order.turn(fkeys):
                await cs.io.run(work)
        except OSError:
            pass
        finally:
            cs.leaving.difference_update(fkeys)

    # ---- health -------------------------------------------------------------

    def note_result(self, cs: CardState, err: BaseException | None) -> None:
        """Feed one I/O outcome to the card's health.

        Object-level answers (missing, corrupt, too small) are the card
        working; only OSErrors and deadlines count as strikes.
        """
        if err is None or isinstance(err, (ObjectMissing, ObjectCorrupt, BufferTooSmall)):
            cs.strikes = 0
            if cs.suspect:
                cs.suspect -= 1
            return
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            # Full, not broken: the medium holds less than we thought (other
            # writers, a smaller filesystem).  Shrink to what fits and evict.
            cs.errors += 1
            if cs.deleting:
                # Room is being made already (evicted objects not deleted yet):
                # this write raced that and tells nothing new.  Shrinking again
                # for each such write would compound (0.9 ** n of a batch).
                return
            log.warning("card %s (%s) is full; capacity lowered to %d bytes", cs.where, cs.serial,
                        min(cs.capacity, int(cs.used * 0.9)))
            self._set_capacity(cs, min(cs.capacity, int(cs.used * 0.9)),
                               "its medium refused a write as full while it held nothing of ours; make room there")
            self._evict_over_capacity(cs)
            return
        if isinstance(err, OSError) and err.errno == errno.EROFS:
            cs.errors += 1
            self.io_errors += 1
            cs.strikes = 0  # it answered: the card works, for reads
            if not cs.read_only:
                cs.read_only, cs.read_only_since = True, time.monotonic()
                log.warning("card %s (%s) is read-only: it goes on serving reads and takes no writes; "
                            "writes are tried again every %.0f s", cs.where, cs.serial, READ_ONLY_RECHECK_S)
            return
        if isinstance(err, TimeoutError):  # our deadline, or the medium's own (a Redis socket timeout)
            cs.timeouts += 1
            self.io_timeouts += 1
            cs.suspect = SUSPECT_IOS
        else:
            cs.errors += 1
            self.io_errors += 1
        cs.strikes += 1
        if cs.active and (isinstance(err, CardUnavailable) or cs.strikes >= self.cfg.io_timeout_strikes):
            self._take_out(cs, f"{type(err).__name__}: {err}", by_error=not isinstance(err, TimeoutError))

    def _take_out(self, cs: CardState, why: str, by_error: bool) -> None:
        cs.active = False
        cs.inactive_since = time.monotonic()
        cs.taken_out_by_error = by_error
        log.warning("card %s (%s) moved from active to inactive: %s", cs.where, cs.serial, why)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                await asyncio.gather(*(self._check(cs) for cs in self.cards), self._retry_pending())
            except Exception:  # noqa: BLE001 - health checks must go on
                log.exception("card health check failed")

    async def _check(self, cs: CardState) -> None:
        try:
            serial = await cs.io.run(cs.card.check)
        except OSError as e:
            # A check is one I/O like any other: a slow one is a strike; a
            # card that is gone (CardUnavailable) goes out at once.
            if cs.active:
                self.note_result(cs, e)
            if not cs.active and not isinstance(e, TimeoutError):
                await self._relocate(cs)
            return
        if serial != cs.serial:
            if cs.refused_serial != serial:
                log.warning("card %s: the card at %s now has serial %s, not %s: not used", cs.serial, cs.where,
                            serial, cs.serial)
                cs.refused_serial = serial
            if cs.active:
                self._take_out(cs, f"label now says serial {serial}", by_error=True)
            await self._relocate(cs)
            return
        cs.refused_serial = None
        cs.checks += 1
        if cs.read_only and time.monotonic() - cs.read_only_since >= READ_ONLY_RECHECK_S:
            await self._recheck_writable(cs)
        if cs.active and self.cfg.card_capacity is None and cs.checks % RESIZE_EVERY_CHECKS == 0:
            await self._resize(cs)
        if not cs.active:
            if cs.taken_out_by_error and time.monotonic() - cs.inactive_since < IO_ERROR_COOLDOWN_S:
                return
            cs.active = True
            cs.strikes = 0
            log.warning("card %s (%s) moved from inactive to active", cs.where, cs.serial)

    async def _recheck_writable(self, cs: CardState) -> None:
        try:
            await cs.io.run(cs.card.check_writable)
        except OSError as e:
            if e.errno != errno.EROFS:
                log.warning("card %s (%s): write probe failed: %s", cs.where, cs.serial, e)
            cs.read_only_since = time.monotonic()
            return
        cs.read_only = False
        log.warning("card %s (%s) takes writes again", cs.where, cs.serial)

    async def _resize(self, cs: CardState) -> None:
        """Follow the medium's free space (others write to shared filesystems too).

        Capacity is what we hold plus what is free beyond the reserve: it
        shrinks when others fill the filesystem and grows back when they
        delete, so a card lowered by a full disk recovers without a restart.
        """
        try:
            free = await cs.io.run(cs.card.free_bytes)
        except OSError:
            return
        self._set_capacity(cs, cs.used + free - self._reserve(cs), self._why_empty(cs, free))
        self._evict_over_capacity(cs)

    async def _relocate(self, cs: CardState) -> None:
        """Look for the card's serial under the other locations its entry matches."""
        if is_redis(cs.pattern):
            return
        candidates = await self.pool.run(expand, cs.pattern)
        in_use = {c.location for c in self.cards if c is not cs}
        for loc in candidates:
            if loc == cs.location or loc in in_use:
                continue
            probe = make_card(loc, self.cfg)
            try:
                serial = await cs.io.run(probe.check)
            except OSError:
                continue
            if serial != cs.serial:
                continue
            try:
                await cs.io.run(probe.open)
            except OSError:
                continue
            # The old claim goes first: the card moved is the same lock file, which our own old lock would hold.
            cs.card.close()
            if not await self._claim_later(cs, probe, loc):
                try:
                    await cs.io.run(cs.card.claim, self.cfg.shared_storage)
                except OSError:
                    pass  # best effort: the old path failed its check, which is why we looked elsewhere
                continue
            old = cs.location
            cs.card, cs.location = probe, loc
            cs.active, cs.strikes, cs.refused_serial = True, 0, None
            log.warning("card %s (%s) reopened as %s", old, cs.serial, loc)
            log.warning("card %s (%s) moved from inactive to active", cs.where, cs.serial)
            return

    async def _claim_later(self, cs: CardState, probe: Card, loc: str) -> bool:
        """Claim a card found after start; one another gateway holds is not used, and logged once."""
        try:
            await cs.io.run(probe.claim, self.cfg.shared_storage)
        except OSError as e:
            probe.close()
            if self._refusals.get(loc) != str(e):
                self._refusals[loc] = str(e)
                log.warning("card %s is not used: %s", probe.display_location, e)
            return False
        self._refusals.pop(loc, None)
        return True

    async def _retry_pending(self) -> None:
        """Entries with no card at start: take the card as soon as one is there.

        A directory is taken labelled or not, as at start: what was missing
        then (a directory not created, a filesystem not mounted) is there now
        because someone made it so.  A directory this gateway would have had
        to create itself is never taken (``DirectoryCard.create_missing``).
        """
        for cs in list(self.pending):
            for loc in await self.pool.run(expand, cs.pattern):
                if any(c.location == loc for c in self.cards):
                    continue
                probe = make_card(loc, self.cfg)
                try:
                    serial = await cs.io.run(probe.open)
                except OSError:
                    continue
                if serial in self._by_serial or not await self._claim_later(cs, probe, loc):
                    continue
                self.pending.remove(cs)
                cs.card, cs.location, cs.serial, cs.active = probe, loc, serial, True
                self.cards.append(cs)
                self._by_serial[serial] = cs
                log.warning("card %s (%s) is available now; moved from inactive to active", loc, serial)
                self._remap()
                await self._adopt(cs)
                break

    # ---- bulk I/O ---------------------------------------------------------------

    def hint_reads(self, on_cards: dict[int, tuple[CardState, list[bytes]]], urgent: bool = False) -> None:
        """Tell cards which of their objects a lookup just found (``Card.prepare_reads``).

        An engine loads what its lookup found a moment later; whatever part
        of those reads can run before the load arrives is then off its path.
        Best effort, on each card's hint thread; a card under suspicion is
        left alone.
        """
        for cs, fkeys in on_cards.values():
            if not (cs.card.prepares_reads and cs.active and not cs.suspect):
                continue
            if cs.io.hint(cs.card.prepare_reads, fkeys, urgent=urgent):
                cs.read_hints += len(fkeys)

    async def read(self, cs: CardState, items: list[tuple[bytes, memoryview]],
                   urgent: bool = False) -> list[Header | BaseException]:
        """Read ``(full key, dest)`` pairs from one card, in parallel chunks, each with a deadline.

        ``urgent``: an engine waits on it (``IoPool.run``).  Once this returns
        or raises, no byte of the read lands in any ``dest`` (each chunk's
        guard is abandoned first), however long the card takes.  Raises
        ``MemoryFault`` when a ``dest`` is memory that is gone (a client's
        region shrunk under its mapping): the client's doing, not the card's.
        """
        out = await self._chunked(cs, [self._read_chunk(cs, chunk, urgent) for chunk in split(items, cs.io.threads)])
        fault = next((r for r in out if isinstance(r, MemoryFault)), None)
        if fault is not None:
            raise fault
        return out

    async def _chunked(self, cs: CardState, chunk_calls: list) -> list:
        """Run one card's chunk calls at once and feed the outcomes to its health.

        A chunk is one I/O to the card: however many objects it carried, it
        is one success or one strike (the first error it met), so a slow
        chunk of 16 objects is not 16 strikes.
        """
        out = []
        for res in await asyncio.gather(*chunk_calls):
            if isinstance(res, BaseException):
                self.note_result(cs, res)
                out += [res] * res.n_items  # type: ignore[attr-defined]
                continue
            failed = next((r for r in res if isinstance(r, OSError) and not isinstance(r, MemoryFault)), None)
            self.note_result(cs, failed)
            out += res
        return out

    async def _read_chunk(self, cs: CardState, chunk: list, urgent: bool) -> list | BaseException:
        # The card reads into its own memory and delivers through the guard,
        # which CardIo.run abandons before it gives up on the call: a read
        # that ends after its deadline writes nothing into the destinations.
        guard = Abandon()
        try:
            return await cs.io.run(cs.card.read_many_into, chunk, guard, abandon=guard, urgent=urgent)
        except OSError as e:
            return _whole_chunk(e, len(chunk))

    async def write(self, cs: CardState, items: list[tuple[bytes, memoryview, ObjectMeta]]) -> list[int | BaseException]:
        """Write ``(full key, payload, meta)`` items to one card: bytes stored, or the error, per item.

        An object whose payload alone is not smaller than the card's
        capacity is refused without I/O (``TooLarge``): the card could only
        evict it again.
        """
        if cs.read_only:  # known to refuse: fail at once, no I/O (the health check tries it again)
            return [OSError(errno.EROFS, "card is read-only", cs.where) for _ in items]
        out: list[int | BaseException | None] = [None] * len(items)
        fit = []
        for i, it in enumerate(items):
            if len(it[1]) >= cs.capacity:
                out[i] = TooLarge(errno.ENOSPC, f"object of {len(it[1])} bytes does not fit the card's capacity "
                                  f"of {cs.capacity} bytes", cs.where)
            else:
                fit.append(i)
        if fit:
            async with cs.order.turn((items[i][0] for i in fit), write=True):
                done = await self._chunked(cs, [self._write_chunk(cs, chunk)
                                                for chunk in split([items[i] for i in fit], cs.io.threads)])
            for i, r in zip(fit, done):
                out[i] = r
        return out  # type: ignore[return-value]

    async def _write_chunk(self, cs: CardState, chunk: list) -> list | BaseException:
        abandon = Abandon()
        try:
            return await cs.io.run(cs.card.write_many, chunk, lambda: not abandon.abandoned, abandon=abandon)
        except OSError as e:
            return _whole_chunk(e, len(chunk))

    def _not_before(self) -> int | None:
        """With a ttl, objects created before this are expired: what card probes are told."""
        return time.time_ns() - int(self.cfg.ttl * 1e9) if self.cfg.ttl is not None else None

    async def probe_prefix(self, fkeys: list[bytes], homes: list[CardState | None], urgent: bool = False) -> int:
        """How many leading keys exist on their ``homes`` (the cards themselves are asked)."""
        n = 0
        while n < len(fkeys):
            cs = homes[n]
            if cs is None:
                break
            run = [fkeys[n]]
            while n + len(run) < len(fkeys) and homes[n + len(run)] is cs:
                run.append(fkeys[n + len(run)])
            unreadable = next((j for j, k in enumerate(run) if k in cs.unreadable), None)
            if unreadable is not None:
                run = run[:unreadable]  # the prefix ends there
            found = 0
            if run:
                try:
                    found = await cs.io.run(_exists_prefix, cs.card, run, self._not_before(), urgent=urgent)
                except OSError as e:
                    self.note_result(cs, e)
                    break
            n += found
            if found < len(run) or unreadable is not None:
                break
        return n

    async def probe_each(self, fkeys: list[bytes], homes: list[CardState | None], urgent: bool = False) -> list[bool]:
        """Whether each key exists on its home card (the cards themselves are asked; no home: False)."""
        out = [False] * len(fkeys)
        groups: dict[int, tuple[CardState, list[int]]] = {}
        for i, cs in enumerate(homes):
            if cs is not None:
                groups.setdefault(id(cs), (cs, []))[1].append(i)

        async def one(cs: CardState, idx: list[int]) -> None:
            idx = [i for i in idx if fkeys[i] not in cs.unreadable]
            if not idx:
                return
            try:
                res = await cs.io.run(cs.card.exists_many, [fkeys[i] for i in idx], self._not_before(),
                                      urgent=urgent)
            except OSError as e:
                self.note_result(cs, e)
                return
            for i, r in zip(idx, res):
                out[i] = r is True

        await asyncio.gather(*(one(cs, idx) for cs, idx in groups.values()))
        return out

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Delete keys from every card ``find`` could answer from; returns how many objects were there."""
        per_card: dict[int, tuple[CardState, list[bytes]]] = {}
        for k, home in zip(fkeys, self.cards_for(fkeys, dialog)):
            targets = [cs for cs in self.cards if cs.active and k in cs.index]
            if home is not None and home not in targets:
                targets.append(home)
            for cs in targets:
                self.note_gone(cs, k)
                per_card.setdefault(id(cs), (cs, []))[1].append(k)

        async def one(cs: CardState, keys: list[bytes]) -> int:
            def work() -> int:
                n = 0
                for k in keys:
                    try:
                        n += cs.card.delete(k)
                    except OSError:
                        pass
                return n

            try:
                async with cs.order.turn(keys):
                    return await cs.io.run(work)
            except OSError:
                return 0

        return sum(await asyncio.gather(*(one(cs, keys) for cs, keys in per_card.values())))

    async def clean(self) -> int:
        total = 0
        for cs in self.cards:
            if not cs.active:
                continue
            try:
                total += await self.pool.run(cs.card.clean)
            except OSError as e:
                self.note_result(cs, e)
                continue
            for fkey, entry in cs.index.items():
                self.usage.card(fkey, -entry.stored_bytes, -1)
            cs.index.clear()
            cs.used = 0
            cs.policy = make_policy(self.cfg.eviction_policy)
        return total

    @property
    def active_cards(self) -> int:
        return sum(1 for cs in self.cards if cs.active)

    def oldest_io_age(self) -> float:
        return max((cs.io.oldest_age() for cs in self.cards + self.pending), default=0.0)


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


def expired(created_ns: int, ttl: float) -> bool:
    return created_ns + ttl * 1e9 < time.time_ns()
