"""A card's index across restarts: a snapshot kept on the card, loaded at start, then checked against the card.

Why.  Rebuilding the index by reading every object's header cost 18-19 s for
100,000 objects on a cold page cache (a 4 TB card of 2 MiB blocks holds 2
million: six minutes), and a lookup during that scan took 25-160 ms.  A
snapshot of the index is one sequential read: ``IndexKeeper.load`` reads it
before the card serves, builds the index from it off the loop, and the card
answers lookups from the first request on.

Trusting it.  A snapshot is a hint, never the truth: a read checks the
object's own header, always (a gone or corrupt object is a miss and drops
its row; a header of another size corrects it).  And right after the load,
``IndexKeeper.check`` lists the card's object names (no object is opened)
and compares: a name the index lacks is an object written after the
snapshot, or by another gateway on a shared card; its header is read and it
is indexed.  A row whose name is not on the card is an object deleted behind
the gateway's back; it is dropped.  Without a usable snapshot the same check
reads every header (the full scan of before).  A snapshot that cannot be
used is ignored with one log line: unreadable, truncated, failing its hash,
of another format version, or written for another card (serial) or another
``num_dbs``.

Writing it.  On a clean stop, at the end of the start-up check when it
changed anything, and every ``SAVE_EVERY_S`` while rows change.  The rows
are copied ``SAVE_ROWS`` at a time on the loop (a copy of a whole card's
index at once would hold the loop for tens of milliseconds per million
objects) and written by a pool thread between copies; rows that move
between two copies may be written twice or not at all, which the load
(duplicates) and the check (missing names) absorb.

The file (``Card.snapshot_writer``: a temp name renamed over the old one;
Redis: a temp key renamed), little-endian::

    head     magic "KVGINDEX", u32 format, u32 num_dbs, i64 written (ns), u16 serial length, serial
    rows     n x ROW (71 bytes: key digest, dialog digest, payload and stored bytes, created, group tick,
             position, namespace id, segment)
    tail     namespaces (u8 length + bytes each), then u64 n, u32 namespaces, u64 offset of the tail,
             magic "KVGIEND1"
    hash     XXH3-64 of everything before it

Runs on the loop, with the file I/O, the decoding and the building of the
index on the general pool (a slow card must not hold its own I/O threads).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import struct
import time
from dataclasses import dataclass
from typing import Callable, Final, Protocol

import numpy as np
import xxhash

from kvgate.cards import Card, CardUnavailable, SnapshotWriter
from kvgate.config import Config
from kvgate.tiers.catalog import CardCatalog
from kvgate.tiers.index import CHECKED, OVERSIZE, CardIndex
from kvgate.tiers.rows import digest_array
from kvgate.tiers.slices import LoopSlices
from kvgate.errors import KvgateError
from kvgate.tiers.io import IoPool

log = logging.getLogger("kvgate.long")

MAGIC: Final = b"KVGINDEX"
END: Final = b"KVGIEND1"
FORMAT: Final = 1
_HEAD = struct.Struct("<8sIIqH")
_TAIL = struct.Struct("<QIQ8s")
_HASH = struct.Struct("<Q")
ROW: Final = np.dtype([("lo", "<u8"), ("hi", "<u8"), ("dlo", "<u8"), ("dhi", "<u8"), ("payload", "<u8"),
                       ("stored", "<u8"), ("created", "<i8"), ("tick", "<i8"), ("pos", "<i4"), ("ns", "<u2"),
                       ("seg", "u1")])
assert ROW.itemsize == 71

# Rows copied per loop step while saving: 1.1 MB of records, about a millisecond here.  65,536
# rows took 13 ms a step (46 at worst): past the CPU caches, the column gathers slow down four
# times, and a 1M-object card's save after its start-up scan held lookups up to 22 ms.
SAVE_ROWS: Final = 16384
SAVE_EVERY_S: Final = 300.0
# Unindexed names whose headers one pool call reads, then indexed on the loop in slices (``LoopSlices``):
# a row costs 25-100 us (more when its dialog's blocks come out of order, as a scan finds them).
CHECK_HEADERS: Final = 128


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        # The process's own symbols (libc among them): find_library would run ldconfig at import.
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_malloc_trim = _libc_malloc_trim()


def give_back_memory() -> None:
    """Return the allocator's free pages to the system after a load or scan.

    Decoding a snapshot, building an index and scanning a card allocate
    temporaries of megabytes; glibc keeps what they freed (its mmap threshold
    rises with each large free), which counted 50 bytes per object in the
    gateway's RSS on a 100,000-object card.  ``malloc_trim(0)`` hands free
    pages back without changing how later allocations are served.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # an abandoned read's error is not "never retrieved"


class SnapshotUnusable(KvgateError, ValueError):
    """Why a snapshot is ignored (the message is the log line's reason)."""


@dataclass
class Snapshot:
    rows: np.ndarray  # ROW records
    namespaces: list[bytes]
    written_ns: int


def encode_head(serial: str, num_dbs: int) -> bytes:
    s = serial.encode()
    return _HEAD.pack(MAGIC, FORMAT, num_dbs, time.time_ns(), len(s)) + s


def encode_rows(index: CardIndex, start: int, stop: int, out: np.ndarray | None = None) -> memoryview:
    """Rows ``start..stop`` of ``index`` as ROW records (on the loop: a consistent copy of each row), in
    ``out`` (ROW records, at least ``stop - start``) when given: a saver reuses one buffer for every step."""
    rows = index.rows
    sel = np.arange(start, stop)
    rec = out[: len(sel)] if out is not None else np.empty(len(sel), ROW)
    rec["lo"], rec["hi"] = rows.lo[sel], rows.hi[sel]
    dialogs = index.policy.dialog_digests(sel)
    rec["dlo"], rec["dhi"] = dialogs[:, 0], dialogs[:, 1]
    payload = rows.payload[sel].astype(np.uint64)
    rec["payload"], rec["stored"] = payload, payload + rows.head[sel]
    for i in np.flatnonzero(payload == OVERSIZE).tolist():
        rec["stored"][i], rec["payload"][i] = index.sizes(int(sel[i]))
    rec["created"] = rows.created[sel]
    rec["tick"] = index.policy.group_ticks(sel)
    rec["pos"] = rows.pos[sel]
    rec["ns"] = rows.ns[sel]
    rec["seg"] = rows.seg[sel]
    return memoryview(rec.view(np.uint8))


def encode_tail(namespaces: list[bytes], n_rows: int, tail_offset: int) -> bytes:
    table = b"".join(bytes([len(ns)]) + ns for ns in namespaces)
    return table + _TAIL.pack(n_rows, len(namespaces), tail_offset, END)


def decode(raw: bytes, serial: str, num_dbs: int) -> Snapshot:
    """Check a snapshot whole and split it; ``SnapshotUnusable`` says why it cannot be used."""
    if len(raw) < _HEAD.size + _TAIL.size + _HASH.size:
        raise SnapshotUnusable(f"truncated ({len(raw)} bytes)")
    magic, fmt, dbs, written, slen = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise SnapshotUnusable("not an index snapshot (bad magic)")
    (want,) = _HASH.unpack_from(raw, len(raw) - _HASH.size)
    if xxhash.xxh3_64_intdigest(memoryview(raw)[: len(raw) - _HASH.size]) != want:
        raise SnapshotUnusable("its hash does not match (torn or corrupt)")
    if fmt != FORMAT:
        raise SnapshotUnusable(f"format {fmt}; this build reads {FORMAT}")
    head_end = _HEAD.size + slen
    found = bytes(raw[_HEAD.size:head_end]).decode(errors="replace")
    if found != serial:
        raise SnapshotUnusable(f"written for card {found}, not this card ({serial})")
    if dbs != num_dbs:
        raise SnapshotUnusable(f"written with num_dbs {dbs}, now {num_dbs}")
    n, n_ns, tail_at, end = _TAIL.unpack_from(raw, len(raw) - _HASH.size - _TAIL.size)
    if end != END or tail_at != head_end + n * ROW.itemsize or tail_at > len(raw):
        raise SnapshotUnusable("its layout does not add up")
    namespaces, at = [], tail_at
    for _ in range(n_ns):
        k = raw[at]
        namespaces.append(bytes(raw[at + 1 : at + 1 + k]))
        at += 1 + k
    if at != len(raw) - _HASH.size - _TAIL.size:
        raise SnapshotUnusable("its namespace table does not add up")
    rows = np.frombuffer(raw, ROW, count=n, offset=head_end)
    if n and int(rows["ns"].max()) >= max(1, n_ns):
        raise SnapshotUnusable("a row names a namespace the snapshot lacks")
    return Snapshot(rows, namespaces, written)


def build_index(snap: Snapshot, index: CardIndex) -> None:
    """Fill an empty ``index`` from a snapshot (on a pool thread: nothing else uses ``index`` yet).

    Rows come in unchecked (``CHECKED`` clear); the namespaces' figures are
    counted when the loop takes the index over (``count_usage``).
    """
    rec = snap.rows
    if not len(rec):
        return
    # A row moved while the snapshot was written may be in it twice: keep one.
    _, first = np.unique(rec["lo"], return_index=True)
    rec = rec[np.sort(first)]
    rows = index.rows
    sel = rows.add_many(rec["lo"], rec["hi"])
    payload, stored = rec["payload"], rec["stored"]
    head = stored - payload
    big = (payload >= OVERSIZE) | (stored < payload) | (head > 0xFFFF)
    rows.payload[sel] = np.where(big, OVERSIZE, payload).astype(np.uint32)
    rows.head[sel] = np.where(big, 0, head).astype(np.uint16)
    for i in np.flatnonzero(big).tolist():
        index.note_oversize(rows.digest(int(sel[i])), int(stored[i]), int(payload[i]))
    rows.created[sel] = rec["created"]
    rows.ns[sel] = rec["ns"]
    rows.flags[sel] = 0
    if index.keys:
        rows.klen[sel] = 0  # a snapshot holds digests, not keys: known once a put, probe or read names them
    index.set_namespaces(snap.namespaces)
    index.used = int(stored.sum())
    dialogs = np.empty((len(rec), 2), np.uint64)
    dialogs[:, 0], dialogs[:, 1] = rec["dlo"], rec["dhi"]
    index.policy.restore(sel, dialogs, rec["pos"], rec["seg"], rec["tick"])


def count_usage(index: CardIndex) -> None:
    """Add a freshly built index's rows to the namespaces' figures (on the loop)."""
    n = index.rows.n
    if not n:
        return
    ns = index.rows.ns[:n]
    stored = index.stored_of(np.arange(n))
    counts = np.bincount(ns, minlength=len(index.namespaces))
    sums = np.bincount(ns, weights=stored, minlength=len(index.namespaces))
    for i in np.flatnonzero(counts).tolist():
        index.usage.card_namespace(index.namespaces[i], int(sums[i]), int(counts[i]))


class KeptCard(Protocol):
    """What an ``IndexKeeper`` reads of its card's life (``kvgate.tiers.life.CardLife``) and asks of it.  The
    keeper writes none of its fields: it fills the index the catalog gives it (``CardCatalog.new_index``),
    hands a loaded one back (``load``), and tells the catalog what its check found (``count_found``,
    ``expire_unindexed``, ``note_gone_digest``, ``evict_over_capacity``)."""

    card: Card
    cfg: Config
    pool: IoPool
    serial: str | None
    scanned: bool
    on_corrupt: Callable[[int], None] | None

    @property
    def where(self) -> str: ...

    @property
    def active(self) -> bool: ...

    async def resize(self) -> None: ...


class IndexKeeper:
    """Keeps one card's index across restarts (the module docstring): load, check, save.

    Owned by its card's life (``KeptCard``: what it uses of it), filling and
    reading the card's ``catalog``; every method runs on the loop, its I/O
    and heavy numpy work on the general pool.  While a check runs, the
    catalog collects the digests it lets go of (``watch_gone``), so the
    check does not index an object whose delete is under way.
    """

    def __init__(self, mc: KeptCard, catalog: CardCatalog) -> None:
        self.mc = mc
        self.catalog = catalog
        self.loaded = 0  # rows the last load took from a snapshot
        self.gone: set[bytes] = set()  # what the catalog let go of while a check runs (``watch_gone``)
        self.saved_changes = 0  # the index's change count at the last save (or load)
        self.saves = 0

    # ---- load ---------------------------------------------------------------------

    async def load(self) -> CardIndex | None:
        """The card's snapshot as an index, to take as its index, when it has a usable one (None when not);
        logs what it did."""
        mc = self.mc
        t0 = time.monotonic()
        try:
            raw = await mc.pool.run(mc.card.read_snapshot)
        except (OSError, NotImplementedError) as e:
            log.warning("card %s (%s): index snapshot not read (%s); scanning the card", mc.where, mc.serial, e)
            return None
        if raw is None:
            log.info("card %s (%s): no index snapshot; scanning the card", mc.where, mc.serial)
            return None
        fresh = self.catalog.new_index()

        def build() -> Snapshot:
            snap = decode(raw, mc.serial or "", mc.cfg.num_dbs)
            build_index(snap, fresh)
            return snap

        try:
            snap = await mc.pool.run(build)
        except SnapshotUnusable as e:
            log.warning("card %s (%s): index snapshot ignored: %s; scanning the card", mc.where, mc.serial, e)
            return
        finally:
            del raw
        written_ns = snap.written_ns
        del snap, build  # the snapshot's bytes: gone before the memory is given back
        await mc.pool.run(give_back_memory)
        if self.catalog.index:  # written to before the load ended (never at start): keep what it knows, check finds the rest
            log.warning("card %s (%s): index snapshot not used: the card took writes while it loaded",
                        mc.where, mc.serial)
            return None
        count_usage(fresh)
        self.loaded = len(fresh)
        self.saved_changes = fresh.changes
        age = (time.time_ns() - written_ns) / 1e9
        log.info("card %s (%s): index snapshot of %d objects (%d bytes, written %.0f s ago) loaded in %.2f s; "
                 "checking it against the card", mc.where, mc.serial, len(fresh), fresh.used, age,
                 time.monotonic() - t0)
        return fresh

    # ---- check ----------------------------------------------------------------------

    async def check(self) -> bool:
        """Compare the index with the card's names: index what it lacks, drop what the card lacks; whether it
        went through (then the card's index is what the card holds: the card reads as scanned)."""
        mc = self.mc
        corrupt0 = mc.card.scan_corrupt
        by_free_space = mc.cfg.card_capacity is None
        self.gone = self.catalog.watch_gone()
        found = dropped = expired = 0
        t0 = time.monotonic()
        slices = LoopSlices()
        reading: asyncio.Future | None = None  # the headers of the next names to index, read meanwhile
        try:
            names = await mc.pool.run(mc.card.names)
            while True:
                batch = await mc.pool.run(next, names, None)
                if batch is None:
                    break
                if self.loaded:
                    index = self.catalog.index
                    rows = index.find(digest_array(batch))
                    index.rows.flags[rows[rows >= 0]] |= CHECKED
                    new = [batch[i] for i in np.flatnonzero(rows < 0).tolist()]
                else:  # no snapshot: every name is new but for the few written since the start (_index_new)
                    new = batch
                for start in range(0, len(new), CHECK_HEADERS):
                    # A pool thread reads the next headers while the loop indexes the last ones.
                    digests = new[start:start + CHECK_HEADERS]
                    last, reading = reading, asyncio.ensure_future(self._read_headers(digests))
                    if last is not None:
                        f, e = await self._index_new(*await last, by_free_space, slices)
                        found += f
                        expired += e
            if reading is not None:
                last, reading = reading, None
                f, e = await self._index_new(*await last, by_free_space, slices)
                found += f
                expired += e
            dropped = await self._drop_unchecked(by_free_space)
            expired += self._drop_expired()
            catalog = self.catalog
            evictions, used = catalog.counters.evictions, catalog.used
            if by_free_space:
                await mc.resize()
            else:
                catalog.evict_over_capacity()
            # Counted and logged before the card reads as scanned, so whoever waits for that sees both.
            self._report_corrupt(corrupt0)
            log.info("card %s (%s): %d objects, %d bytes indexed, capacity %d bytes; %s, in %.1f s%s", mc.where,
                     mc.serial, len(catalog.index), catalog.used, catalog.capacity,
                     f"{self.loaded} from its snapshot, {found} found on the card, {dropped} gone from it"
                     if self.loaded else "no snapshot: every header read", time.monotonic() - t0,
                     f"; {expired} objects past the ttl deleted" if expired else "")
            if catalog.counters.evictions > evictions:
                log.warning("card %s (%s) held more than its capacity of %d bytes at start: %d objects (%d bytes) "
                            "evicted", mc.where, mc.serial, catalog.capacity, catalog.counters.evictions - evictions,
                            used - catalog.used)
            await mc.pool.run(give_back_memory)
            return True
        except OSError as e:
            log.warning("card %s: index scan stopped: %s", mc.where, e)
            self._report_corrupt(corrupt0)  # what it deleted before it stopped is gone all the same
            return False
        finally:
            self.catalog.unwatch_gone()
            self.gone = set()
            if reading is not None:  # stopped (an error, or the card left): the read ahead is not wanted
                reading.cancel()
                reading.add_done_callback(_retrieve)

    def changed_since_saved(self) -> bool:
        """Whether the card's index changed since the last snapshot written or loaded."""
        return self.catalog.index.changes != self.saved_changes

    def forget_saved(self) -> None:
        """The card was emptied (its snapshot dropped): the next save writes whatever it holds then."""
        self.saved_changes = -1

    def _report_corrupt(self, before: int) -> None:
        mc = self.mc
        corrupt = mc.card.scan_corrupt - before
        if corrupt:
            log.warning("card %s (%s): the index scan deleted %d corrupt objects (bad header, truncated or "
                        "misnamed)", mc.where, mc.serial, corrupt)
            if mc.on_corrupt is not None:
                mc.on_corrupt(corrupt)

    async def _read_headers(self, digests: list[bytes]) -> tuple[list[bytes], list]:
        return digests, await self.mc.pool.run(self.mc.card.stored_objects, digests)

    async def _index_new(self, digests: list[bytes], objs: list, by_free_space: bool,
                         slices: LoopSlices) -> tuple[int, int]:
        """Index the objects whose headers were read for names the index lacked; (indexed, expired)."""
        catalog = self.catalog
        ttl = self.mc.cfg.ttl
        too_old, n = [], 0
        slices.restart()
        for digest, obj in zip(digests, objs):
            await slices.give_way()
            if obj is None or digest in self.gone or digest in catalog.leaving or catalog.index.has(digest):
                continue  # gone, being deleted, or written since it was listed (newer than the header read)
            if ttl is not None and obj.meta.created_ns + ttl * 1e9 < time.time_ns():
                too_old.append(digest)
                continue
            catalog.index.put(obj.full_key, obj.stored_bytes, obj.payload_len, obj.meta, obj.meta.created_ns)
            n += 1
            if by_free_space:  # the free space measured before the scan did not count these bytes
                catalog.count_found(obj.stored_bytes)
        if too_old:
            catalog.expire_unindexed(too_old)
        return n, len(too_old)

    async def _drop_unchecked(self, by_free_space: bool) -> int:
        """Rows the check did not see on the card: their objects are gone."""
        index = self.catalog.index
        n = index.rows.n
        gone = index.rows.digests(np.flatnonzero((index.rows.flags[:n] & CHECKED) == 0))
        dropped = 0
        slices = LoopSlices()
        for digest in gone:
            await slices.give_way()
            r = index.row(digest)
            if r < 0 or index.rows.flags.item(r) & CHECKED:
                continue  # dropped, or written again, meanwhile
            stored, _ = index.sizes(r)
            index.pop_row(r)
            dropped += 1
            if by_free_space:
                self.catalog.count_found(-stored)
        return dropped

    def _drop_expired(self) -> int:
        """With a ttl, rows the snapshot brought that are past it: deleted now, not at their first lookup."""
        catalog, ttl = self.catalog, self.mc.cfg.ttl
        if ttl is None or not catalog.index:
            return 0
        n = catalog.index.rows.n
        old = np.flatnonzero(catalog.index.rows.created[:n] < time.time_ns() - int(ttl * 1e9))
        if not old.size:
            return 0
        digests = catalog.index.rows.digests(old)
        for d in digests:
            catalog.note_gone_digest(d)
        catalog.expire_unindexed(digests)
        return len(digests)

    # ---- save -------------------------------------------------------------------------

    async def save(self, why: str) -> bool:
        """Write the index to the card as its snapshot; False (logged) when the card would not take it."""
        mc = self.mc
        index = self.catalog.index
        changes = index.changes
        t0 = time.monotonic()
        writer: SnapshotWriter | None = None
        try:
            writer = await mc.pool.run(mc.card.snapshot_writer)
            hasher = xxhash.xxh3_64()
            head = encode_head(mc.serial or "", mc.cfg.num_dbs)
            written = len(head)
            hasher.update(head)
            await mc.pool.run(writer.write, head)
            start = n_rows = 0
            # One buffer for every step (writers keep nothing of what they are given): fresh
            # megabytes per step left tens of MB for the allocator to hand back after the save,
            # and that malloc_trim held the allocator's lock, and the loop, for 19 ms at 1M rows.
            records = np.empty(SAVE_ROWS, ROW)  # untouched pages cost nothing: a small index uses a few
            while start < index.rows.n:
                if index is not self.catalog.index:
                    raise OSError("the index was replaced (cleaned) while it was written")
                chunk = encode_rows(index, start, min(start + SAVE_ROWS, index.rows.n), records)
                hasher.update(chunk)
                await mc.pool.run(writer.write, chunk)
                n_rows += len(chunk) // ROW.itemsize
                written += len(chunk)
                start += SAVE_ROWS
            tail = encode_tail(list(index.namespaces), n_rows, written)
            hasher.update(tail)
            await mc.pool.run(writer.write, tail + _HASH.pack(hasher.intdigest()))
            await mc.pool.run(writer.commit)
        except (OSError, NotImplementedError) as e:
            if writer is not None:
                await mc.pool.run(writer.abort)
            log.warning("card %s (%s): index snapshot not written (%s)", mc.where, mc.serial, e)
            return False
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        self.saved_changes = changes
        self.saves += 1
        log.info("card %s (%s): index snapshot of %d objects written %s in %.2f s", mc.where, mc.serial, n_rows,
                 why, time.monotonic() - t0)
        return True

    async def save_now_and_then(self) -> None:
        """Every ``SAVE_EVERY_S``, a snapshot if the index changed since the last one (a crash then loses
        less: the check at the next start finds what the snapshot missed)."""
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            mc = self.mc
            if mc.scanned and mc.active and self.changed_since_saved():
                try:
                    await self.save("periodically")
                except CardUnavailable:
                    pass
