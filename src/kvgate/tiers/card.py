"""One card as this gateway runs it: three parts, and the data path through them.

``ManagedCard`` puts together what one card is here: its catalog
(``CardCatalog``: index, room, eviction, ttl, the objects leaving it or
unreadable on it), its I/O channel (``CardChannel``: chunked calls with
deadlines and health strikes) and its life (``CardLife``: identity, health,
adopt, check, resize, stop, the index across restarts).  It owns none of their
fields; it runs each read, write, probe and delete through them, in the order
that keeps the card consistent: the catalog decides (room taken, victims
chosen), the key order's turn is held (``KeyOrder``), the channel does the
I/O, the catalog learns what it showed.

Who calls it: the card set (``CardSet``) decides which card an object
belongs on and asks it; the card tier (``CardTier``), the finder and the
mover read and write through it; the status asks it for its row
(``snapshot``).  Threading: every method runs on the gateway's event loop
and never blocks.  Card I/O runs on the card's own ``CardIo`` pool with a
deadline (``io_timeout_ms``): a card that hangs ties up only its own
threads, and the request that touched it gets its answer (a miss, a failed
write) in time.

The catalog knows objects by their key digest (``CardIndex``), and so does
the order of the card's writes and deletes: an eviction names its victims
by digest, and the card deletes them by name.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Callable

import numpy as np

from kvgate.latency import Latencies
from kvgate.cards import Card, ObjectMeta
from kvgate.cards.base import CachedObjectFile, StoredObject
from kvgate.config import Config
from kvgate.keys import key_digest, key_digests
from kvgate.tiers.catalog import CardCatalog
from kvgate.tiers.channel import CardChannel
from kvgate.tiers.events import TierChanges
from kvgate.tiers.holds import Holds
from kvgate.tiers.index import CardIndex
from kvgate.tiers.io import CardIo, IoPool, KeyOrder
from kvgate.tiers.life import CardLife
from kvgate.tiers.reads import CardRead, RecentlyPrepared
from kvgate.tiers.referee import Referee
from kvgate.tiers.room import CardRoom
from kvgate.tiers.rows import key_digest_array
from kvgate.tiers.usage import NamespaceUsage, namespace_of

# Objects one I/O call of a namespace's clean deletes: the card's threads stay free for reads between calls.
CLEAN_BATCH = 1024


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
    """One card: its catalog, channel and life, and the data path through them (module docstring).

    Created by ``CardSet`` for each configured location (``pattern`` is the
    ``storage_devices`` entry it came from); the card set takes it into
    service and out through its ``life``.
    """

    def __init__(self, pattern: str, location: str, card: Card, cfg: Config, pool: IoPool, hooks: TierHooks,
                 io: CardIo | None = None, referee: Referee | None = None) -> None:
        """``referee``: the one the card set's cards share (``CardSet.referee``; "adaptive" only)."""
        self.cfg = cfg
        self.io = io or CardIo(cfg.thread_pool_size, cfg.io_timeout_ms / 1000, "kvgate-card", realtime=pool.realtime,
                               latencies=hooks.io_seconds)
        room = CardRoom(lambda: self.life.card, cfg, lambda: self.life.describe())
        self.catalog = CardCatalog(cfg, hooks.usage, hooks.holds, room, self._spawn_delete, lambda: self.life.where,
                                   hooks.on_expired, hooks.changes, referee)
        self.life = CardLife(pattern, location, card, cfg, pool, self.io, self.catalog, hooks.on_corrupt)
        self.channel = CardChannel(lambda: self.life.card, self.io, self.life.note_result)  # bulk reads, writes, opens
        self.order = KeyOrder()  # writes and deletes of one key, in the order issued
        self.prepared = RecentlyPrepared()

    # ---- what it is, for its callers (the life and the catalog own these) ------------------

    @property
    def card(self) -> Card:
        return self.life.card

    @property
    def serial(self) -> str | None:
        return self.life.serial

    @property
    def location(self) -> str:
        return self.life.location

    @property
    def pattern(self) -> str:
        return self.life.pattern

    @property
    def name(self) -> str:
        return self.life.serial or self.life.location

    @property
    def where(self) -> str:
        """The location as logs and status show it (a Redis password masked)."""
        return self.life.where

    def describe(self) -> str:
        return self.life.describe()

    @property
    def active(self) -> bool:
        return self.life.active

    @property
    def read_only(self) -> bool:
        return self.life.read_only

    @property
    def index(self) -> CardIndex:
        return self.catalog.index

    @property
    def used(self) -> int:
        return self.catalog.used

    @property
    def capacity(self) -> int:
        return self.catalog.capacity

    # ---- deletes ----------------------------------------------------------------

    def _spawn_delete(self, digests: list[bytes]) -> asyncio.Task:
        """The catalog's deleter (``CardCatalog.let_go``): ``_delete_quietly`` as a task."""
        return self.life.tasks.spawn(self._delete_quietly(digests))

    async def _delete_quietly(self, digests: list[bytes]) -> None:
        """Delete objects (by key digest) the catalog has already let go of (evicted, expired, stale copies).

        A key with a write under way is left alone: the delete was meant for
        the object that write replaces, and would remove the new one.
        """
        replaced = [d for d in digests if self.order.writing(d)]
        digests = [d for d in digests if not self.order.writing(d)]
        self.catalog.left(replaced)
        if not digests:
            return
        try:
            async with self.order.turn(digests):
                await self.io.run(_delete_each, self.card, digests)
        except OSError:
            pass
        finally:
            self.catalog.left(digests)

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
            self.catalog.note_gone_digest(d)
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
            n = await self.life.pool.run(self.card.clean)
        except OSError as e:
            self.life.note_result(e)
            return 0
        await self.life.emptied()
        return n

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
        if not (self.card.prepares_reads and self.life.health.hints_ok):
            return
        if digests is None:
            digests = key_digest_array(fkeys)
        fresh = self.prepared.fresh(digests)
        todo = fkeys if fresh.all() else [fkeys[i] for i in np.flatnonzero(fresh).tolist()]
        if not todo or self.io.hint(self.card.prepare_reads, todo, urgent=urgent):
            self.prepared.note(digests[fresh])
            self.catalog.note_hinted(len(fkeys))

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
        (``CardCatalog.take_room``).
        """
        if self.read_only:  # known to refuse: fail at once, no I/O (the health check tries it again)
            return [OSError(errno.EROFS, "card is read-only", self.where) for _ in items]
        fit, out = self.catalog.refuse_too_large(items)
        taken, freeing = self.catalog.take_room(items, fit, out)
        try:
            if freeing is not None:
                await asyncio.wait({freeing})  # the room is there once the victims are gone (not cancelled with us)
            if fit:
                async with self.order.turn((key_digest(items[i][0]) for i in fit), write=True):
                    done = await self.channel.write([items[i] for i in fit])
                for i, r in zip(fit, done):
                    out[i] = r
        finally:
            self.catalog.give_back_room(taken)
        return out  # type: ignore[return-value]

    async def probe_prefix(self, fkeys: list[bytes], urgent: bool = False) -> int:
        """How many leading keys the card holds (the card itself is asked); a failed probe is 0."""
        unreadable = self.catalog.first_unreadable(fkeys)
        if unreadable is not None:
            fkeys = fkeys[:unreadable]  # the prefix ends there
        if not fkeys:
            return 0
        try:
            n = await self.io.run(_exists_prefix, self.card, fkeys, self.catalog.not_before(), urgent=urgent)
        except OSError as e:
            self.life.note_result(e)
            return 0
        self.catalog.note_present(fkeys[:n])
        return n

    async def probe_each(self, fkeys: list[bytes], urgent: bool = False) -> list[bool]:
        """Whether the card holds each key (the card itself is asked; a failed probe is all False)."""
        unreadable = self.catalog.unreadable
        ask = ([i for i, k in enumerate(fkeys) if key_digest(k) not in unreadable] if unreadable
               else list(range(len(fkeys))))
        out = [False] * len(fkeys)
        if not ask:
            return out
        try:
            res = await self.io.run(self.card.exists_many, [fkeys[i] for i in ask], self.catalog.not_before(),
                                    urgent=urgent)
        except OSError as e:
            self.life.note_result(e)
            return out
        for i, r in zip(ask, res):
            out[i] = r is True
        if self.index.keys:
            self.catalog.note_present([k for k, found in zip(fkeys, out) if found])
        return out

    # ---- status -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The card's row in the gateway's status."""
        c, life = self.catalog.counters, self.life
        health = life.health
        return {
            "serial": self.serial, "location": self.where, "kind": self.card.kind, "active": self.active,
            "read_only": self.read_only, "held_out": health.held_out,
            "capacity_bytes": self.capacity, "used_bytes": self.used, "objects": len(self.index),
            "hits": c.hits, "misses": c.misses, "errors": health.errors, "timeouts": health.timeouts,
            "bytes_read": c.reads_bytes, "bytes_written": c.writes_bytes, "evictions": c.evictions,
            "read_hints": c.read_hints, "refused": c.refused, "writing_bytes": self.catalog.room.writing,
            **{f"{order}_order_evictions": n for order, n in self.index.evictions_by_order().items()},
            "scanned": life.scanned, "index_bytes": self.index.nbytes(), "snapshot_rows_loaded": life.keeper.loaded,
            **self.card.read_rates(),
        }


def _exists_prefix(card: Card, keys: list[bytes], not_before_ns: int | None) -> int:
    """How many leading ``keys`` the card holds.  The first key alone first: the keys a probe asks about
    are those no index knows, most often a prompt nothing holds, and asking every key of it cost a check
    each (a lookup of 1,000 absent keys on a directory card took 13 ms, where the first one answers)."""
    if card.exists_many(keys[:1], not_before_ns)[0] is not True:
        return 0
    n = 1
    for r in card.exists_many(keys[1:], not_before_ns) if len(keys) > 1 else ():
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

