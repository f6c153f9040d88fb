"""One card as this gateway runs it: the card, its I/O threads, its index, its eviction and its health.

``ManagedCard`` is the only writer of its fields: the card set (``CardSet``)
decides which card an object belongs on and asks it; the tiered store reads
and writes through it; the status asks it for its row (``snapshot``).

Threading contract: every method runs on the gateway's event loop and never
blocks.  Card I/O runs on the card's own ``CardIo`` pool with a deadline
(``io_timeout_ms``): a card that hangs ties up only its own threads, and the
request that touched it gets its answer (a miss, a failed write) in time.
The start-up work on the index (``kvgate.tiers.restart``: its snapshot's
load, the check against the card, the saves) runs on the general pool (a
slow scan must not hold the card's threads, and it has no deadline).

The index knows objects by their key digest (``CardIndex``), and so do the
card's own bookkeeping sets (``leaving``, ``unreadable``) and the order of
its writes and deletes (``order``): an eviction names its victims by digest,
and the card deletes them by name.

Capacity: what a card may hold is what it holds plus what its medium has
free beyond the reserve of its kind, or ``card_capacity`` when set
(``CardRoom``).  What a card holds at start counts exactly as it does later,
so a restart evicts only from a card that really is over its capacity, and
says so.  A card that can hold nothing is warned about, and long puts to it
fail.  A write takes its room before its first byte (``write``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Callable

import numpy as np

from kvgate.latency import Latencies
from kvgate.cards import Card, CardUnavailable, ObjectMeta
from kvgate.cards.base import CachedObjectFile, StoredObject
from kvgate.cards.objectformat import padded_object_size
from kvgate.config import Config
from kvgate.keys import key_digest, key_digests
from kvgate.tiers.events import TierChanges
from kvgate.tiers.health import CardHealth, Outcome
from kvgate.tiers.holds import Holds
from kvgate.tiers.index import EXPIRING, CardIndex, IndexEntry
from kvgate.tiers.channel import CardChannel
from kvgate.tiers.io import CardIo, IoPool, KeyOrder, Tasks
from kvgate.tiers.reads import CardRead, ReadOutcome, RecentlyPrepared
from kvgate.tiers.restart import IndexKeeper
from kvgate.tiers.room import CardRoom
from kvgate.tiers.rows import digest_array
from kvgate.tiers.sampled import SampledPolicy
from kvgate.tiers.usage import NamespaceUsage, namespace_of
from kvgate.errors import KvgateError

log = logging.getLogger("kvgate.long")

RESIZE_EVERY_CHECKS = 30  # re-read a card's free space about every 30 s
# Keys remembered as written by a newer kvgate, per card; past this the set
# starts over (an upgrade in progress should not hold memory without bound).
UNREADABLE_MAX = 65536


# Objects one I/O call of a namespace's clean deletes: the card's threads stay free for reads between calls.
CLEAN_BATCH = 1024


class TooLarge(KvgateError, OSError):
    """A write refused before any I/O: the object is larger than the card's capacity (0 for a card that holds nothing)."""


class NoRoom(KvgateError, OSError):
    """A write refused before any I/O: its batch holds more than the card can take beside the writes in flight
    and the held objects; the batch's last objects are the ones refused."""


class CardCounters:
    __slots__ = ("hits", "misses", "reads_bytes", "writes_bytes", "evictions", "read_hints", "refused")

    def __init__(self) -> None:
        self.hits = self.misses = self.reads_bytes = self.writes_bytes = self.evictions = self.read_hints = 0
        self.refused = 0  # objects a write refused without I/O (``TooLarge``, ``NoRoom``)


class TierHooks:
    """What a card reports to the tiers above it: shared objects and counters (``TieredStore`` owns them)."""

    def __init__(self, usage: NamespaceUsage, holds: Holds, on_corrupt: Callable[[int], None] | None = None,
                 on_expired: Callable[[int], None] = lambda n: None, io_seconds: Latencies | None = None,
                 changes: TierChanges | None = None) -> None:
        self.usage = usage
        self.changes = changes if changes is not None else TierChanges()  # what the cards store and drop
        self.holds = holds
        self.io_seconds = io_seconds if io_seconds is not None else Latencies()  # every card's I/O calls
        self.on_corrupt = on_corrupt  # the scan deleted n broken objects
        self.on_expired = on_expired  # n objects found past the ttl (deleted)


class ManagedCard:
    """One card: its I/O, index, eviction policy, capacity, health and counters.

    Created by ``CardSet`` for each configured location (``pattern`` is the
    ``storage_devices`` entry it came from); ``serial`` is set once the
    card's label is read.  ``adopt`` starts serving it (loads its index
    snapshot, sizes it, checks the index against the card in the
    background); ``stop`` saves the snapshot and closes; ``close`` ends its
    tasks and its I/O threads.
    """

    def __init__(self, pattern: str, location: str, card: Card, cfg: Config, pool: IoPool, hooks: TierHooks,
                 io: CardIo | None = None) -> None:
        self.pattern = pattern
        self.location = location
        self.card = card
        self.cfg = cfg
        self.pool = pool  # the general pool: scans
        self.hooks = hooks
        self.io = io or CardIo(cfg.thread_pool_size, cfg.io_timeout_ms / 1000, "kvgate-card", realtime=pool.realtime,
                               latencies=hooks.io_seconds)
        self.channel = CardChannel(lambda: self.card, self.io, self.note_result)  # bulk reads, writes, opens
        self.serial: str | None = None
        self.room = CardRoom(lambda: self.card, cfg, self.describe)
        self.index = self.new_index()
        self.keeper = IndexKeeper(self)
        self.health = CardHealth(cfg.io_timeout_strikes, self.describe)
        self.counters = CardCounters()
        self.order = KeyOrder()  # writes and deletes of one key, in the order issued
        self.prepared = RecentlyPrepared()
        self.scanned = False
        self.deleting = 0  # eviction batches whose deletes have not finished yet
        # Digests of unindexed keys whose delete has not run yet: a probe must not find them
        # (a put answered False for an object its own batch evicted; it stays a miss).
        self.leaving: set[bytes] = set()
        # Digests of keys whose object on the card a newer kvgate wrote (ObjectTooNew): probes
        # call them misses instead of offering what every read of it would refuse.
        self.unreadable: set[bytes] = set()
        self.refused_serial: str | None = None  # the other card last seen at our path
        self._shrinking = False  # a re-read of the free space after a full medium is under way
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

    def hold_out(self, why: str) -> None:
        """Out of service until ``release``, whatever its checks say (cluster mode: no agent reports it alive)."""
        self.health.hold_out(why)

    def release(self) -> None:
        self.health.release()

    @property
    def used(self) -> int:
        return self.index.used

    @property
    def capacity(self) -> int:
        """What the card's index may hold (``CardRoom``)."""
        return self.room.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self.room.capacity = value

    def count_found(self, stored_bytes: int) -> None:
        """Bytes of objects the start-up check found on the card (or, negative, found gone from it) that
        the free space read at start did not count: the capacity of a card sized by its medium follows."""
        self.room.capacity = max(0, self.room.capacity + stored_bytes)

    @property
    def policy(self) -> SampledPolicy:
        """The eviction order of the card's rows (part of its index)."""
        return self.index.policy

    # ---- life -----------------------------------------------------------------

    async def adopt(self) -> None:
        """Take the card's index snapshot (if usable), size the card, and check the index against the card
        in the background."""
        self.index = self.new_index()
        fresh = await self.keeper.load()
        if fresh is not None:
            self.index = fresh
        if self.cfg.card_capacity is not None:
            self.room.set(self.cfg.card_capacity, "card_capacity is 0; set it to what the card may hold")
        else:
            try:
                free = await self.io.run(self.card.free_bytes)
            except OSError as e:
                log.warning("card %s: cannot read free space (%s); capacity 0 until it can", self.where, e)
                free = 0
            self.room.size_at_start(free, self.used)
        self.tasks.spawn(self._check_at_start())
        self.tasks.spawn(self.keeper.save_now_and_then())

    async def _check_at_start(self) -> None:
        """The index checked against the card (``IndexKeeper.check``): the card reads as scanned once it
        went through, and its snapshot is written when the check changed the index."""
        if not await self.keeper.check():
            return
        self.scanned = True
        if self.keeper.changed_since_saved():
            await self.keeper.save("after the start-up check")

    async def stop(self) -> None:
        """Save the index snapshot (when it changed and the card is in service), then ``close``."""
        await self.tasks.cancel()
        if self.active and self.serial and self.keeper.changed_since_saved():
            try:
                await self.keeper.save("at stop")
            except CardUnavailable:
                pass
        await self.close()

    async def close(self) -> None:
        """End the card's tasks, its threads (not waiting for a hung one) and its claim."""
        await self.tasks.cancel()
        self.io.shutdown(wait=False)
        try:
            self.card.close()
        except OSError:
            pass

    def new_index(self) -> CardIndex:
        """An empty index for this card: keeping keys, and noting its changes as this card's tier (its
        serial), when the gateway publishes events (``kv_events_endpoint``; ``kvgate.tiers.events``)."""
        return CardIndex(self.hooks.usage, self.cfg.eviction_policy, keys=self.cfg.kv_events_endpoint is not None,
                         changes=self.hooks.changes, tier=self.serial)

    def serve(self, card: Card, location: str, serial: str) -> None:
        """The card was opened and claimed at ``location``: it is in service from now on."""
        self.card, self.location, self.serial = card, location, serial
        self.index.tier = serial
        self.health.active = True

    def reopen(self, card: Card, location: str) -> None:
        """The card was found again at ``location`` (already opened and claimed there)."""
        old = self.location
        self.card, self.location, self.refused_serial = card, location, None
        log.warning("card %s (%s) reopened as %s", old, self.serial, location)
        if self.health.held_out is None:
            self.health.bring_back()

    # ---- capacity -------------------------------------------------------------

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
        self.room.size(free, self.used)
        self.evict_over_capacity()

    def evict_over_capacity(self) -> None:
        self._evict_to(self.capacity)

    def _evict_to(self, limit: int) -> asyncio.Task | None:
        """Evict until the index holds at most ``limit`` bytes (held objects stay); the victims' delete, if any."""
        victims = []
        held = None
        holds = self.hooks.holds
        index = self.index
        if holds:
            holds.expire()
            if holds:
                held = lambda r: holds.holds_digest(index.digest(r))  # noqa: E731
        while index.used > limit:
            r = index.policy.choose_victim(held)
            if r < 0:
                break
            victim = index.digest(r)
            index.pop_row(r)
            self.keeper.digest_gone(victim)
            self.counters.evictions += 1
            victims.append(victim)
        if not victims:
            return None
        self.deleting += 1
        task = self.spawn_delete(victims)
        task.add_done_callback(self._deleted)
        return task

    def _take_room(self, items: list, fit: list[int], out: list) -> tuple[int, asyncio.Task | None]:
        """Take room for the objects ``fit`` names before any of them is written (``CardRoom``).

        The batch is cut from its end to what the card can hold beside the
        writes in flight; older objects are evicted until the rest fits on
        the medium, and their delete is handed back for the writer to wait
        on; held objects stay, and where they leave no room the batch is
        cut further.  Objects cut get ``NoRoom`` in ``out``, and leave
        ``fit``.  Returns the bytes taken (the caller gives them back after
        the write; the writer indexes what it wrote before its next await,
        so the room moves from ``writing`` to the index with no gap) and
        the victims' delete.
        """
        room = self.room
        sizes = [padded_object_size(items[i][0], len(items[i][1])) for i in fit]
        keep = room.plan(sizes)
        for i in fit[keep:]:
            out[i] = NoRoom(errno.ENOSPC, "no room for this object: its batch is larger than the card's capacity "
                            f"of {room.capacity} bytes less {room.writing} bytes being written", self.where)
        del fit[keep:], sizes[keep:]
        total = sum(sizes)
        limit = room.evict_to(total)
        freeing = self._evict_to(limit) if self.index.used > limit else None
        while fit and self.index.used > room.evict_to(total):  # held objects stay
            total -= sizes.pop()
            out[fit.pop()] = NoRoom(errno.ENOSPC, f"no room for this object: {self.index.used} bytes of the card's "
                                    f"capacity of {room.capacity} are held (lookup-and-lock)", self.where)
        room.writing += total
        self.counters.refused += len(items) - len(fit)  # TooLarge before, NoRoom here
        return total, freeing

    def _deleted(self, _t: asyncio.Task) -> None:
        self.deleting -= 1

    # ---- the index ------------------------------------------------------------

    def entry(self, fkey: bytes) -> IndexEntry | None:
        """The live index entry of ``fkey``: None when unindexed, or known past the ttl (then deleted)."""
        digest = key_digest(fkey)
        r = self.index.row(digest)
        if r < 0:
            return None
        if self.cfg.ttl is not None and self.past_ttl(np.array([r]))[0]:
            self._expire(digest, r)
            return None
        return self.index.entry(r)

    def past_ttl(self, rows: np.ndarray) -> np.ndarray:
        """Which rows are past the ttl (or already known to be); all False without one."""
        if self.cfg.ttl is None:
            return np.zeros(len(rows), bool)
        index = self.index
        return (((index.rows.flags[rows] & EXPIRING) != 0)
                | (index.rows.created[rows] < time.time_ns() - int(self.cfg.ttl * 1e9)))

    def _expire(self, digest: bytes, r: int) -> None:
        """Delete an object past the ttl; its row stays (a miss, never probed) until the delete is done."""
        flags = self.index.rows.flags
        if flags.item(r) & EXPIRING:
            return
        flags[r] |= EXPIRING
        self.hooks.on_expired(1)

        def done(_t: asyncio.Task) -> None:
            row = self.index.row(digest)
            if row >= 0 and self.index.rows.flags.item(row) & EXPIRING:  # not written again meanwhile
                self.note_gone_digest(digest)

        self.spawn_delete([digest]).add_done_callback(done)

    def expire_rows(self, rows: np.ndarray) -> None:
        """``_expire`` of rows ``past_ttl`` found (by a lookup of many keys)."""
        for digest, r in zip(self.index.rows.digests(rows), rows.tolist()):
            self._expire(digest, r)

    def note_written(self, fkey: bytes, stored: int, payload_len: int, meta: ObjectMeta) -> bool:
        """Index an object just written here; False when it did not stay (evicted by its own write)."""
        digest = key_digest(fkey)
        self.unreadable.discard(digest)
        self.index.put(fkey, stored, payload_len, meta, meta.created_ns or time.time_ns(), tail=meta.tail)
        self.counters.writes_bytes += stored
        self.evict_over_capacity()
        return self.index.has(digest)

    def note_hit(self, fkey: bytes, nbytes: int) -> None:
        self.counters.hits += 1
        self.counters.reads_bytes += nbytes
        r = self.index.row(key_digest(fkey))
        if r >= 0:
            self.index.touch(r)
            if self.index.keys:  # a row loaded from the snapshot learns its key here
                self.index.learn_key(r, fkey)

    def note_unreadable(self, fkey: bytes) -> None:
        """The card holds the object in a format only a newer kvgate reads: a miss here, left in place."""
        self.note_gone(fkey)
        if len(self.unreadable) >= UNREADABLE_MAX:
            self.unreadable.clear()
        self.unreadable.add(key_digest(fkey))

    def note_gone(self, fkey: bytes) -> None:
        """The object is not (or no longer validly) on the card."""
        self.note_gone_digest(key_digest(fkey))

    def note_gone_digest(self, digest: bytes) -> None:
        self.index.pop(digest)
        self.keeper.digest_gone(digest)

    def note_failed_read(self, fkey: bytes, r: CardRead) -> None:
        """A read of ``fkey`` came to ``r``, not the object: a miss; forget what it showed to be wrong."""
        self.counters.misses += 1
        match r.outcome:
            case ReadOutcome.TOO_SMALL:
                row = self.index.row(key_digest(fkey))
                if row >= 0 and self.index.sizes(row)[1] != r.needed:
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

    def spawn_delete(self, digests: list[bytes]) -> asyncio.Task:
        """``delete_quietly`` as a task; its objects are misses from now on, not from when the task first runs."""
        self.leaving.update(digests)
        return self.tasks.spawn(self._delete_quietly(digests))

    async def _delete_quietly(self, digests: list[bytes]) -> None:
        """Delete objects (by key digest) the index has already let go of (evicted, expired, stale copies).

        A key with a write under way is left alone: the delete was meant for
        the object that write replaces, and would remove the new one.
        """
        replaced = [d for d in digests if self.order.writing(d)]
        digests = [d for d in digests if not self.order.writing(d)]
        self.leaving.difference_update(replaced)
        if not digests:
            return
        try:
            async with self.order.turn(digests):
                await self.io.run(_delete_each, self.card, digests)
        except OSError:
            pass
        finally:
            self.leaving.difference_update(digests)

    async def delete(self, fkeys: list[bytes]) -> int:
        """Delete keys now (a client's delete); returns how many objects were there."""
        return await self.delete_digests(key_digests(fkeys))

    async def clean_namespace(self, ns: bytes) -> int:
        """Delete every object of namespace ``ns`` the index knows (the ``clean`` op of one namespace), in
        batches of ``CLEAN_BATCH`` in the card's I/O threads; returns how many were deleted.  Objects no
        index knows yet (a start's scan still under way) stay."""
        digests, shared = self.index.namespace_digests(ns)
        n = 0
        for i in range(0, len(digests), CLEAN_BATCH):
            batch = digests[i : i + CLEAN_BATCH]
            if shared:  # the row's namespace id is shared by several: only what the header says is ns's
                found = await self.stored_objects(batch)
                batch = [d for d, f in zip(batch, found) if f is not None and namespace_of(f.full_key) == ns]
            n += await self.delete_digests(batch)
        return n

    async def delete_digests(self, digests: list[bytes]) -> int:
        """Delete objects by key digest now; returns how many were there."""
        for d in digests:
            self.note_gone_digest(d)
        try:
            async with self.order.turn(digests):
                return await self.io.run(_delete_each, self.card, digests)
        except OSError:
            return 0

    async def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        """The headers of objects named by digest (what the mover needs to read them: their full keys)."""
        return await self.io.run(self.card.stored_objects, digests)

    async def clean(self) -> int:
        """Delete every object of ours on the card (``start_clean``, the ``clean`` op)."""
        try:
            n = await self.pool.run(self.card.clean)
        except OSError as e:
            self.note_result(e)
            return 0
        self.index.clear()
        try:
            await self.pool.run(self.card.drop_snapshot)
        except OSError:
            pass  # the next start's check drops what it lists, all of it gone
        self.keeper.forget_saved()  # whatever the card had, the next stop writes what is there now
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
        # writers, a smaller filesystem).  What it has free is read again
        # rather than guessed from what we hold: a batch that fails before
        # any of it is indexed would make such a guess 0.
        if not self._shrinking:
            self._shrinking = True
            self.tasks.spawn(self._shrink_to_medium())

    async def _shrink_to_medium(self) -> None:
        """After a write found the medium full: capacity at most what the card holds plus what is free now
        (``CardRoom.shrink_to_medium``); what no longer fits is evicted.  A card sized by its medium grows
        back at its next ``resize``; a configured ``card_capacity`` stays lowered."""
        try:
            free = await self.io.run(self.card.free_bytes)
        except OSError:
            return
        finally:
            self._shrinking = False
        if self.room.shrink_to_medium(free, self.used):
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

    async def answers(self) -> bool:
        """Whether the card reads back its own label now: one I/O, bounded like any other.

        Not fed to its health: the caller decides what a failure means (cluster mode holds the card out,
        and the card is back at its first passed check once released, with no I/O-error cooldown).
        """
        try:
            return await self.io.run(self.card.check) == self.serial
        except OSError:
            return False

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

    def hint_reads(self, fkeys: list[bytes], urgent: bool = False, digests: np.ndarray | None = None) -> None:
        """Tell the card which of its objects a lookup just found (``Card.prepare_reads``).

        An engine loads what its lookup found a moment later; whatever part
        of those reads can run before the load arrives is then off its path.
        Best effort, on the card's hint thread; a card under suspicion is
        left alone.  An object prepared in the last ``RecentlyPrepared``
        period is not prepared again (an engine looks the same prefix up
        on every step until it loads it); it still counts as hinted.
        ``digests``: the keys' ``digest_array``, when the caller has it.
        """
        if not (self.card.prepares_reads and self.health.hints_ok):
            return
        if digests is None:
            digests = digest_array(key_digests(fkeys))
        fresh = self.prepared.fresh(digests)
        todo = fkeys if fresh.all() else [fkeys[i] for i in np.flatnonzero(fresh).tolist()]
        if not todo or self.io.hint(self.card.prepare_reads, todo, urgent=urgent):
            self.prepared.note(digests[fresh])
            self.counters.read_hints += len(fkeys)

    async def read(self, items: list[tuple[bytes, memoryview]], urgent: bool = False,
                   own: bool = False) -> list[CardRead]:
        """Read ``(full key, dest)`` pairs (``CardChannel.read``: chunks with deadlines, each one strike or
        success); raises ``MemoryFault`` when a ``dest`` is a client's memory that is gone."""
        return await self.channel.read(items, urgent, own)

    async def open_cached(self, fkeys: list[bytes], urgent: bool = False) -> list[CachedObjectFile | None]:
        """Each object's file, open for a client to read itself, where the card lends it and the page cache
        holds it whole (``CardChannel.open_cached``); None for the rest, which are read the usual way (and
        counted then).  The caller closes every file."""
        return await self.channel.open_cached(fkeys, urgent)

    async def write(self, items: list[tuple[bytes, memoryview, ObjectMeta]]) -> list[int | BaseException]:
        """Write ``(full key, payload, meta)`` items: bytes stored, or the error, per item.

        An object whose payload alone is not smaller than the card's
        capacity is refused without I/O (``TooLarge``): the card could only
        evict it again.  So are the last objects of a batch larger than the
        card can take beside the writes in flight (``NoRoom``); for the rest,
        room is made on the medium before the first byte is written
        (``_take_room``).
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
        taken, freeing = self._take_room(items, fit, out)
        try:
            if freeing is not None:
                await asyncio.wait({freeing})  # the room is there once the victims are gone (not cancelled with us)
            if fit:
                async with self.order.turn((key_digest(items[i][0]) for i in fit), write=True):
                    done = await self.channel.write([items[i] for i in fit])
                for i, r in zip(fit, done):
                    out[i] = r
        finally:
            self.room.writing -= taken
        return out  # type: ignore[return-value]

    def _not_before(self) -> int | None:
        """With a ttl, objects created before this are expired: what card probes are told."""
        return time.time_ns() - int(self.cfg.ttl * 1e9) if self.cfg.ttl is not None else None

    async def probe_prefix(self, fkeys: list[bytes], urgent: bool = False) -> int:
        """How many leading keys the card holds (the card itself is asked); a failed probe is 0."""
        unreadable = (next((j for j, k in enumerate(fkeys) if key_digest(k) in self.unreadable), None)
                      if self.unreadable else None)
        if unreadable is not None:
            fkeys = fkeys[:unreadable]  # the prefix ends there
        if not fkeys:
            return 0
        try:
            n = await self.io.run(_exists_prefix, self.card, fkeys, self._not_before(), urgent=urgent)
        except OSError as e:
            self.note_result(e)
            return 0
        if self.index.keys and n:
            self.index.learn_keys(fkeys[:n])
        return n

    async def probe_each(self, fkeys: list[bytes], urgent: bool = False) -> list[bool]:
        """Whether the card holds each key (the card itself is asked; a failed probe is all False)."""
        ask = ([i for i, k in enumerate(fkeys) if key_digest(k) not in self.unreadable] if self.unreadable
               else list(range(len(fkeys))))
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
        if self.index.keys:
            self.index.learn_keys([k for k, found in zip(fkeys, out) if found])
        return out

    # ---- status -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The card's row in the gateway's status."""
        c = self.counters
        return {
            "serial": self.serial, "location": self.where, "kind": self.card.kind, "active": self.active,
            "read_only": self.read_only, "held_out": self.health.held_out,
            "capacity_bytes": self.capacity, "used_bytes": self.used, "objects": len(self.index),
            "hits": c.hits, "misses": c.misses, "errors": self.health.errors, "timeouts": self.health.timeouts,
            "bytes_read": c.reads_bytes, "bytes_written": c.writes_bytes, "evictions": c.evictions,
            "read_hints": c.read_hints, "refused": c.refused, "writing_bytes": self.room.writing,
            "scanned": self.scanned, "index_bytes": self.index.nbytes(), "snapshot_rows_loaded": self.keeper.loaded, **self.card.read_rates(),
        }


def _exists_prefix(card: Card, keys: list[bytes], not_before_ns: int | None) -> int:
    res = card.exists_many(keys, not_before_ns)
    n = 0
    for r in res:
        if r is not True:
            break
        n += 1
    return n


def _delete_each(card: Card, digests: list[bytes]) -> int:
    n = 0
    for d in digests:
        try:
            n += card.delete_named(d)
        except OSError:
            pass  # unindexed already; a later scan re-indexes or drops it
    return n


def expired(created_ns: int, ttl: float) -> bool:
    return created_ns + ttl * 1e9 < time.time_ns()
