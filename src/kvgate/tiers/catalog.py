"""What one card holds, as this gateway knows it: its index, its room, its eviction and its ttl.

``CardCatalog`` is the card's bookkeeping, with no I/O of its own: the index
of its objects by key digest (``CardIndex``, whose eviction order is its
``policy``), the room it may fill (``CardRoom``), the objects it let go of
whose delete has not run yet (``leaving``), the objects a newer kvgate wrote
(``unreadable``), and its counters.  The index changes only here and in the
start-up check (``kvgate.tiers.restart``), which fills it through the index's
own methods; the stored/removed events of every change go out through the
index (``kvgate.tiers.events``).

Who calls it: its ``ManagedCard`` (before and after each read, write, probe
and delete), the card's life (``CardLife``: sizing, the index at start), the
card tier and the mover (what a read showed).  Threading: every method runs on
the gateway's event loop and never blocks.  What it evicts or finds past the
ttl it hands to ``delete`` (given by the card: the delete runs on the card's
I/O threads and calls ``left`` when done); until then those objects are
``leaving``, misses for any probe.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Callable

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.cards.objectformat import padded_object_size
from kvgate.config import Config
from kvgate.errors import KvgateError
from kvgate.keys import key_digest, key_digests
from kvgate.tiers.holds import Holds
from kvgate.tiers.index import EXPIRING, CardIndex, IndexEntry
from kvgate.tiers.reads import CardRead, ReadOutcome
from kvgate.tiers.referee import Referee
from kvgate.tiers.room import CardRoom
from kvgate.tiers.rows import key_digest_array
from kvgate.tiers.sampled import SampledPolicy
from kvgate.tiers.usage import NamespaceUsage

log = logging.getLogger("kvgate.long")

# Keys remembered as written by a newer kvgate, per card; past this the set
# starts over (an upgrade in progress should not hold memory without bound).
UNREADABLE_MAX = 65536


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


class CardCatalog:
    """One card's index, room, eviction, ttl and the objects leaving it or unreadable on it (module docstring).

    ``room``: the card's ``CardRoom`` (sized by its life); ``delete``: runs
    the delete of objects the catalog let go of, by digest, and returns its
    task; ``where``: the card as logs name it.
    """

    def __init__(self, cfg: Config, usage: NamespaceUsage, holds: Holds, room: CardRoom,
                 delete: Callable[[list[bytes]], asyncio.Task], where: Callable[[], str],
                 on_expired: Callable[[int], None], changes=None, referee: Referee | None = None) -> None:
        self.cfg = cfg
        self._referee = referee
        self._usage = usage
        self._holds = holds
        self._changes = changes
        self._delete = delete
        self._where = where
        self._on_expired = on_expired
        self.room = room
        self.tier: str | None = None  # the card's serial, once known: what its index's events name
        self.index = self.new_index()
        self.counters = CardCounters()
        self.deleting = 0  # eviction batches whose deletes have not finished yet
        # Digests of unindexed keys whose delete has not run yet: a probe must not find them
        # (a put answered False for an object its own batch evicted; it stays a miss).
        self.leaving: set[bytes] = set()
        # Digests of keys whose object on the card a newer kvgate wrote (ObjectTooNew): probes
        # call them misses instead of offering what every read of it would refuse.
        self.unreadable: set[bytes] = set()
        self._watching: set[bytes] | None = None  # what was let go of since ``watch_gone``

    # ---- the index as a whole ---------------------------------------------------

    @property
    def used(self) -> int:
        return self.index.used

    @property
    def capacity(self) -> int:
        """What the index may hold (``CardRoom``)."""
        return self.room.capacity

    @property
    def policy(self) -> SampledPolicy:
        """The eviction order of the card's rows (part of its index)."""
        return self.index.policy

    def new_index(self) -> CardIndex:
        """An empty index for this card: keeping keys, and noting its changes as this card's tier (its
        serial), when the gateway publishes events (``kv_events_endpoint``; ``kvgate.tiers.events``)."""
        return CardIndex(self._usage, self.cfg.eviction_policy, keys=self.cfg.kv_events_endpoint is not None,
                         changes=self._changes, tier=self.tier, referee=self._referee)

    def name_tier(self, serial: str) -> None:
        """The card's serial is known: its index's events name it from now on."""
        self.tier = self.index.tier = serial

    def take_index(self, index: CardIndex) -> None:
        """Serve from ``index`` from now on (an empty one at adopt, then the snapshot's when it loads)."""
        self.index = index

    def clear(self) -> None:
        """Forget every object (the card was emptied, or left): its namespaces' figures no longer count it."""
        self.index.clear()

    def count_found(self, stored_bytes: int) -> None:
        """Bytes of objects the start-up check found on the card (or, negative, found gone from it) that
        the free space read at start did not count: the capacity of a card sized by its medium follows."""
        self.room.capacity = max(0, self.room.capacity + stored_bytes)

    def watch_gone(self) -> set[bytes]:
        """A set that gets every digest let go of (evicted, deleted, expired) until ``unwatch_gone``: the
        start-up check must not index an object whose delete is under way."""
        self._watching = set()
        return self._watching

    def unwatch_gone(self) -> None:
        self._watching = None

    # ---- room and eviction ----------------------------------------------------------

    def evict_over_capacity(self) -> None:
        self._evict_to(self.capacity)

    def _evict_to(self, limit: int) -> asyncio.Task | None:
        """Evict until the index holds at most ``limit`` bytes (held objects stay); the victims' delete, if any."""
        victims = []
        held = None
        holds = self._holds
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
            self.counters.evictions += 1
            victims.append(victim)
        if not victims:
            return None
        if self._watching is not None:
            self._watching.update(victims)
        self.deleting += 1
        task = self.let_go(victims)
        task.add_done_callback(self._deleted)
        return task

    def _deleted(self, _t: asyncio.Task) -> None:
        self.deleting -= 1

    def refuse_too_large(self, items: list) -> tuple[list[int], list]:
        """Which of ``items`` (``(full key, payload, ...)``) may be written: their positions, and each
        refused one's ``TooLarge`` in an answer list (None for the rest).  An object whose payload alone is
        not smaller than the capacity could only be evicted again."""
        out: list = [None] * len(items)
        fit = []
        for i, it in enumerate(items):
            if len(it[1]) >= self.capacity:
                out[i] = TooLarge(errno.ENOSPC, f"object of {len(it[1])} bytes does not fit the card's capacity "
                                  f"of {self.capacity} bytes", self._where())
            else:
                fit.append(i)
        return fit, out

    def take_room(self, items: list, fit: list[int], out: list) -> tuple[int, asyncio.Task | None]:
        """Take room for the objects ``fit`` names before any of them is written (``CardRoom``).

        The batch is cut from its end to what the card can hold beside the
        writes in flight; older objects are evicted until the rest fits on
        the medium, and their delete is handed back for the writer to wait
        on; held objects stay, and where they leave no room the batch is
        cut further.  Objects cut get ``NoRoom`` in ``out``, and leave
        ``fit``.  Returns the bytes taken (the caller gives them back with
        ``give_back_room`` after the write; the writer indexes what it
        wrote before its next await, so the room moves from ``writing`` to
        the index with no gap) and the victims' delete.
        """
        room = self.room
        sizes = [padded_object_size(items[i][0], len(items[i][1])) for i in fit]
        keep = room.plan(sizes)
        for i in fit[keep:]:
            out[i] = NoRoom(errno.ENOSPC, "no room for this object: its batch is larger than the card's capacity "
                            f"of {room.capacity} bytes less {room.writing} bytes being written", self._where())
        del fit[keep:], sizes[keep:]
        total = sum(sizes)
        limit = room.evict_to(total)
        freeing = self._evict_to(limit) if self.index.used > limit else None
        while fit and self.index.used > room.evict_to(total):  # held objects stay
            total -= sizes.pop()
            out[fit.pop()] = NoRoom(errno.ENOSPC, f"no room for this object: {self.index.used} bytes of the card's "
                                    f"capacity of {room.capacity} are held (lookup-and-lock)", self._where())
        room.writing += total
        self.counters.refused += len(items) - len(fit)  # TooLarge before, NoRoom here
        return total, freeing

    def give_back_room(self, taken: int) -> None:
        """The write that took ``taken`` bytes (``take_room``) is over: what it wrote is indexed."""
        self.room.writing -= taken

    # ---- ttl --------------------------------------------------------------------------

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

    def not_before(self) -> int | None:
        """With a ttl, objects created before this are expired: what card probes are told."""
        return time.time_ns() - int(self.cfg.ttl * 1e9) if self.cfg.ttl is not None else None

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
        self._on_expired(1)

        def done(_t: asyncio.Task) -> None:
            row = self.index.row(digest)
            if row >= 0 and self.index.rows.flags.item(row) & EXPIRING:  # not written again meanwhile
                self.note_gone_digest(digest)

        self.let_go([digest]).add_done_callback(done)

    def expire_rows(self, rows: np.ndarray) -> None:
        """``_expire`` of rows ``past_ttl`` found (by a lookup of many keys)."""
        for digest, r in zip(self.index.rows.digests(rows), rows.tolist()):
            self._expire(digest, r)

    def expire_unindexed(self, digests: list[bytes]) -> None:
        """Objects found on the card past the ttl, never indexed (the start-up check): deleted, counted."""
        self._on_expired(len(digests))
        self.let_go(digests)

    # ---- what I/O showed ---------------------------------------------------------------

    def note_written(self, fkeys: list[bytes], stored: list[int], payload_lens: list[int], metas: list[ObjectMeta],
                     digests: np.ndarray | None = None) -> np.ndarray:
        """Index objects just written here; whether each stayed (one may be evicted by its own batch).  A key
        named twice is indexed as its last write.  ``digests``: the keys' (``key_digest_array``), if known."""
        if digests is None:
            digests = key_digest_array(fkeys)
        if self.unreadable:
            self.unreadable.difference_update(key_digests(fkeys))
        now = time.time_ns()
        if len(set(fkeys)) == len(fkeys):
            self.index.put_many(fkeys, digests, stored, payload_lens, metas, now)
        else:  # (a batch that names a key twice: each write in turn, the last one stays)
            for k, s, p, m in zip(fkeys, stored, payload_lens, metas):
                self.index.put(k, s, p, m, m.created_ns or now, tail=m.tail)
        self.counters.writes_bytes += sum(stored)
        self.evict_over_capacity()
        return self.index.find(digests) >= 0

    def note_hit(self, fkey: bytes, nbytes: int) -> None:
        self.counters.hits += 1
        self.counters.reads_bytes += nbytes
        r = self.index.row(key_digest(fkey))
        if r >= 0:
            self.index.touch(r)
            if self.index.keys:  # a row loaded from the snapshot learns its key here
                self.index.learn_key(r, fkey)

    def note_hinted(self, n: int) -> None:
        """``n`` objects a lookup found were hinted to the card (``ManagedCard.hint_reads``)."""
        self.counters.read_hints += n

    def note_present(self, fkeys: list[bytes]) -> None:
        """A probe found these keys on the card: rows loaded from the snapshot learn their keys."""
        if self.index.keys and fkeys:
            self.index.learn_keys(fkeys)

    def note_unreadable(self, fkey: bytes) -> None:
        """The card holds the object in a format only a newer kvgate reads: a miss here, left in place."""
        self.note_gone(fkey)
        if len(self.unreadable) >= UNREADABLE_MAX:
            self.unreadable.clear()
        self.unreadable.add(key_digest(fkey))

    def first_unreadable(self, fkeys: list[bytes]) -> int | None:
        """The position of the first of ``fkeys`` known unreadable here, None when none is."""
        if not self.unreadable:
            return None
        return next((j for j, k in enumerate(fkeys) if key_digest(k) in self.unreadable), None)

    def note_gone(self, fkey: bytes) -> None:
        """The object is not (or no longer validly) on the card."""
        self.note_gone_digest(key_digest(fkey))

    def note_gone_digest(self, digest: bytes) -> None:
        self.index.pop(digest)
        if self._watching is not None:
            self._watching.add(digest)

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
                log.warning("corrupt object on card %s removed: %s", self._where(), r.error)
                self.note_gone(fkey)
            case ReadOutcome.TOO_NEW:
                self.note_unreadable(fkey)
            case ReadOutcome.MISSING:
                self.note_gone(fkey)

    # ---- deletes -------------------------------------------------------------------------

    def let_go(self, digests: list[bytes]) -> asyncio.Task:
        """Have the card delete objects the index no longer holds: misses from now on (``leaving``), not
        from when the delete first runs; the card calls ``left`` once it ran."""
        self.leaving.update(digests)
        return self._delete(digests)

    def left(self, digests: list[bytes]) -> None:
        """The delete of ``digests`` ran (or was not needed: a write replaced them)."""
        self.leaving.difference_update(digests)


def expired(created_ns: int, ttl: float) -> bool:
    return created_ns + ttl * 1e9 < time.time_ns()
