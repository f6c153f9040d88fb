"""The one interface every card kind implements.

Contract:
- Every method blocks and may take as long as the medium does.  The gateway
  calls them only from its I/O thread pool, never from the event loop; health
  and deadlines (``io_timeout_ms``) are enforced above this layer.
- Methods are safe to call from several threads at once.
- ``read_into`` reads into memory the card owns (a per-thread scratch, a
  reply buffer), verifies it there (header key, lengths, hash) and hands the
  payload to the caller's buffer only through ``guard.copy``; it never
  writes, reads or hashes the destination itself.  Why: the destination may
  be a client's guarded shared memory (shrunk under its mapping, a store
  there is a SIGBUS; ``guard.copy`` turns that into ``MemoryFault``), and the call runs
  in a pool thread that may outlive its deadline: the caller (the event
  loop, in ``CardIo.run``) abandons the guard before it answers the client,
  after which ``guard.copy`` raises ``ReadAbandoned`` and no byte lands in a
  buffer the client may have reused.  One exception: a destination that is
  no guarded client memory (``memcopy.in_client_memory`` False) may be read
  into straight from a cache and verified there, through
  ``guard.read_cached``, which is abandoned the same way; a mismatch there,
  in memory a client may have written meanwhile, is decided by a read
  through the card's own memory.  Likewise a network card receives a payload
  straight into memory the gateway owns (``guard.own``, never client
  memory) through ``guard.recv_nowait``, hashing it there, under the same
  lock.  A bad object is deleted and reported
  as ``ObjectCorrupt``: the caller must treat the destination bytes as
  garbage.  An object a newer kvgate wrote, in a format this build cannot
  read, is ``ObjectTooNew`` (a miss) and stays; ``scan`` skips it.
- ``write`` is atomic: a concurrent or later reader sees the whole new object
  or none (or the previous whole object).  A crash mid-write leaves nothing
  readable.  Its payload is memory the gateway owns, except on a kind with
  ``writes_client_memory``: that one may be given client memory, and then
  publishes it only if the guard was not abandoned by the time the last
  piece was written; guarded client memory it moves only through the kernel
  (a ``pwrite`` from it) and hashes what landed on the card, never the
  client's pages.
- A card that cannot be reached raises ``CardUnavailable`` (an ``OSError``).
- ``claim`` takes the card for this process's life, exclusively or shared
  with other ``shared_storage`` gateways; a card another gateway holds in a
  way that does not mix is ``CardInUse`` and must not be used.
- Objects are named by ``key_digest(full_key)``: ``names`` lists them
  without reading them, ``stored_objects`` reads the headers of named ones,
  ``delete_named`` removes one.  What a name alone says is a hint (another
  gateway may have replaced the object since); the header is checked on
  every read.
- A kind with ``lends_files`` can also open an object for a client to read
  itself (``open_cached_many``): the file, open read-only, and its checked
  header, only while the page cache holds the whole object.  Object files
  are never written in place once published (a new version is a new file
  renamed over the name), so the open file stays that object whatever
  happens to its name; the reader still verifies the payload's hash.
- A card keeps one snapshot of the gateway's index of it (bytes the gateway
  writes and reads back whole, ``kvgate.tiers.restart``), written so that a
  reader sees the previous snapshot or the new one whole, never a mix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar, Iterable, Iterator

from kvgate.cards.heads import HeadsChannel
from kvgate.cards.objectformat import Header, ObjectMeta, ObjectTooNew
from kvgate.keys import key_digest
from kvgate.memcopy import Abandon
from kvgate.errors import KvgateError

log = logging.getLogger("kvgate.cards")


class CardUnavailable(KvgateError, OSError):
    """The card cannot be used now (missing, unreadable, not a card, wrong serial)."""


class NotACardLocation(CardUnavailable):
    """Something a card cannot be is at the location (a regular file where a directory card was named): no wait
    makes it one, so it is said at once, not retried as a card that is not there yet."""


class CardInUse(CardUnavailable):
    """Another gateway holds the card, exclusively, or shared while this one wants it exclusively.

    ``str()`` is the whole one-line message: the card, who holds it (where
    known) and the fix.
    """

    def __init__(self, where: str, holder: str, held_shared: bool, want_shared: bool):
        self.where, self.holder, self.held_shared, self.want_shared = where, holder, held_shared, want_shared
        how = "shared (shared_storage: true)" if held_shared else "exclusively"
        mine = "shared" if want_shared else "exclusively (shared_storage is false)"
        msg = (f"card {where} is in use by another gateway ({holder}, holding it {how}) and this gateway would use "
               f"it {mine}: set shared_storage: true on every gateway of this card, or give this gateway another card")
        super().__init__(errno.EBUSY, msg, where)

    def __str__(self) -> str:
        return self.strerror


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: no boot id
        return ""


# Who this process is, as card locks, leases and temp names record it: a pid
# means something only on the same host (a container's own host name) in the
# same boot, and every process of an earlier boot is dead.
HOST = socket.gethostname()
BOOT_ID = _boot_id()
# Short, filename-safe form of both (8 + 8 hex digits), for temp names.
HOST_TAG = (hashlib.blake2b(HOST.encode(), digest_size=4).hexdigest() + "-"
            + hashlib.blake2b(BOOT_ID.encode(), digest_size=4).hexdigest())


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs here now (one of another user counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_doc(shared: bool) -> dict[str, Any]:
    """What a lock file or lease says about the gateway that holds it."""
    return {"host": HOST, "boot": BOOT_ID, "pid": os.getpid(), "mode": "shared" if shared else "exclusive"}


def describe_holder(doc: Any) -> str:
    """``pid N on host H`` from a holder document; "holder unknown" when it says nothing usable."""
    if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int):
        return "holder unknown"
    return f"pid {doc['pid']} on host {doc.get('host', '?')}"


def holder_dead(doc: Any) -> bool:
    """True only when the holder is known to be gone: this host, this boot, its pid not running, or an earlier boot."""
    if not isinstance(doc, dict) or doc.get("host") != HOST or not BOOT_ID:
        return False
    if doc.get("boot") != BOOT_ID:
        return True
    pid = doc.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid)


class WriteAbandoned(KvgateError, OSError):
    """The caller stopped waiting for this write (deadline); nothing was published."""


LABEL_FORMAT = 1
LABEL_MAX = 64 << 10  # a larger "label" is not ours: refuse it without reading more


def new_label(serial: str | None = None) -> bytes:
    """The label document of a card: its serial (new unless given), format, creation time."""
    doc = {"serial": serial or uuid.uuid4().hex, "format": LABEL_FORMAT,
           "created": datetime.now(timezone.utc).isoformat()}
    return (json.dumps(doc) + "\n").encode()


def parse_label(raw: bytes, where: str) -> str:
    """The serial in a label document; CardUnavailable naming ``where`` when it is not one."""
    if len(raw) > LABEL_MAX:
        raise CardUnavailable(errno.EINVAL, "card label is not a kvgate label (too large)", where)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CardUnavailable(errno.EINVAL, "card label is not valid JSON", where) from None
    if not isinstance(doc, dict):
        raise CardUnavailable(errno.EINVAL, "card label is not a JSON object", where)
    serial = doc.get("serial")
    if not isinstance(serial, str) or not serial:
        raise CardUnavailable(errno.EINVAL, "card label has no serial", where)
    if doc.get("format") != LABEL_FORMAT:
        raise CardUnavailable(
            errno.EINVAL, f"card label has format {doc.get('format')!r}; this gateway reads {LABEL_FORMAT}", where
        )
    return serial


def byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of ``buf`` (no copy).

    Slicing and ``len`` must count bytes: a memoryview of a float16 tensor
    would otherwise slice by elements and read the wrong spans.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object found by ``Card.scan``: enough to rebuild the index."""

    full_key: bytes
    payload_len: int
    stored_bytes: int  # header + payload, what it costs on the card
    meta: ObjectMeta


class NotCached(KvgateError, Exception):
    """The object is not wholly in the page cache (``Card.open_cached_many``): read it the usual way."""


@dataclass(frozen=True, slots=True)
class CachedObjectFile:
    """An object's file, open read-only, found wholly in the page cache (``Card.open_cached_many``).

    The payload is ``header.payload_len`` bytes at ``header.payload_offset``
    of ``fd``, hashing to ``header.payload_hash`` (``kvgate.keys.payload_hash``).
    Whoever holds it closes ``fd`` (``close_files``).
    """

    fd: int
    header: Header


def close_files(files: Iterable[CachedObjectFile | BaseException | None]) -> None:
    """Close each ``CachedObjectFile`` among ``files`` (the rest are skipped)."""
    for f in files:
        if isinstance(f, CachedObjectFile):
            os.close(f.fd)


class SnapshotWriter(ABC):
    """Bytes of a new index snapshot, in pieces; ``commit`` publishes them whole, ``abort`` leaves the old one."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``; nothing of it is kept once this returns (the saver reuses its buffer)."""

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Card(ABC):
    """One medium of the long tier, whatever its kind (the contract is the module's).

    The long tier calls every method that touches the medium from a card's
    I/O threads, never from the event loop; ``object_place``, ``named_place``,
    ``reserve_bytes`` and ``why_empty`` do no I/O and run anywhere.
    """

    kind: ClassVar[str]
    # Whether prepare_reads does anything: lookups hand keys only to kinds that use them.
    prepares_reads: ClassVar[bool] = False
    # Whether write may be given client memory (see the module contract): the store then skips
    # the staging copy it makes for every other kind.
    writes_client_memory: ClassVar[bool] = False
    # Whether open_cached_many opens objects for a client to read (the contract): the rest are read here.
    lends_files: ClassVar[bool] = False

    def __init__(self, location: str, num_dbs: int = 1):
        if num_dbs < 1:
            raise ValueError(f"num_dbs must be at least 1, got {num_dbs}")
        self.location = location
        self.display_location = location  # as logs and status show it (kinds with secrets in it redact)
        self.num_dbs = num_dbs
        self._newer_seen = False  # scan has met (and said so) an object of a newer format
        self.serial: str | None = None
        # Objects scan found broken (bad header, truncated, misnamed) and deleted:
        # the long tier adds them to the corrupt-objects counter after each scan.
        self.scan_corrupt = 0
        self.claimed: bool | None = None  # None: not claimed; else whether shared
        # The card's shared-heads list, a side channel beside this interface (kvgate.cards.heads);
        # a kind that keeps one sets it, None: this card keeps none and the head sync passes it by.
        self.heads: HeadsChannel | None = None

    def object_place(self, full_key: bytes) -> tuple[int, str]:
        """Where the object of ``full_key`` goes: which of the ``num_dbs`` shards, and its name there.

        The name is the hex digest of the full key (fixed-size, safe whatever
        the key holds); the shard comes from the same digest, the same way
        for every kind, so one key layout fingerprint covers them all.
        """
        return self.named_place(key_digest(full_key))

    def named_place(self, digest: bytes) -> tuple[int, str]:
        """``object_place`` of the object whose key digest is ``digest``."""
        return int.from_bytes(digest[:4], "little") % self.num_dbs, digest.hex()

    @abstractmethod
    def open(self) -> str:
        """Make the card usable; create its label on first use.  Returns the serial."""

    @abstractmethod
    def check(self) -> str:
        """Cheap health probe (read the label).  Returns the serial found now."""

    @abstractmethod
    def claim(self, shared: bool) -> None:
        """Take the card for as long as this process uses it (until ``close``).

        ``shared``: with other gateways that claim it shared too
        (``shared_storage``); otherwise for this gateway alone.  Raises
        ``CardInUse`` when another gateway holds it in a way that does not mix
        with ``shared``.  A holder that died releases it at once where the
        medium allows (directory locks, a lease whose pid on this host is
        dead), else when its lease runs out.  Call after ``open``; calling
        again renews the claim.
        """

    @abstractmethod
    def check_writable(self) -> None:
        """Write and remove a small probe; raises ``CardUnavailable`` (EROFS) while the card takes no writes."""

    @abstractmethod
    def read_into(self, full_key: bytes, dest: memoryview, guard: Abandon | None = None) -> Header:
        """Read and verify the payload, and deliver it into ``dest[:payload_len]`` through ``guard.copy``.

        ``guard``: the caller's (see the module contract); None delivers
        through a guard nobody abandons, for callers with no deadline.
        Raises ObjectMissing, ObjectCorrupt, BufferTooSmall (nothing usable
        was written to dest) or CardUnavailable; ``ReadAbandoned`` once the
        guard is abandoned, ``MemoryFault`` when dest's memory is gone.
        """

    @abstractmethod
    def write(self, full_key: bytes, payload: memoryview, meta: ObjectMeta, guard: Abandon | None = None) -> int:
        """Store atomically; returns the bytes the object takes on the card.

        ``guard.abandoned`` is polled before the object is published: once
        it is set the caller has given up (its deadline passed and the
        payload buffer may already hold other data), so the write must raise
        ``WriteAbandoned`` and publish nothing.  None: nobody gives up.
        """

    @abstractmethod
    def exists(self, full_key: bytes, not_before_ns: int | None = None) -> bool:
        """Whether the object is on the card; with ``not_before_ns``, one written before then counts as absent.

        Only the gateway's index knows an object's creation time exactly; this
        answers for objects it has not indexed (another gateway's, or before
        the start-up scan), so that a ``ttl`` makes them misses too.
        """

    @abstractmethod
    def delete(self, full_key: bytes) -> bool:
        """Remove the object; False when it was not there."""

    @abstractmethod
    def delete_named(self, digest: bytes) -> bool:
        """Remove the object named ``digest`` (whatever key it holds); False when it was not there."""

    @abstractmethod
    def names(self) -> Iterator[list[bytes]]:
        """The names (key digests) of every object on the card, in batches, without reading one.

        Leftover temp files are removed on the way, and an object stored
        where another ``num_dbs`` put it is moved to where reads look (when
        that place holds the key already, that copy wins).  A name may come
        twice where the medium's listing repeats itself (Redis SCAN).
        """

    @abstractmethod
    def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        """The headers of named objects (no payload read): None where it is gone, of a newer format, or
        broken (then deleted and counted in ``scan_corrupt``)."""

    def scan(self) -> Iterator[StoredObject]:
        """Every whole object on the card: ``names``, then their headers."""
        for batch in self.names():
            for found in self.stored_objects(batch):
                if found is not None:
                    yield found

    @abstractmethod
    def snapshot_writer(self) -> SnapshotWriter:
        """A writer of a new index snapshot (see the module contract)."""

    @abstractmethod
    def read_snapshot(self) -> bytes | None:
        """The last index snapshot committed, or None when there is none."""

    @abstractmethod
    def drop_snapshot(self) -> None:
        """Remove the index snapshot (after ``clean``: it describes objects that are gone)."""

    @abstractmethod
    def clean(self) -> int:
        """Delete every object (the label stays).  Returns how many were deleted."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Free space of the medium now."""

    # Capacity: the long tier sizes a card as what it holds plus free_bytes()
    # less reserve_bytes().  Both below run on the event loop: no I/O.

    @abstractmethod
    def reserve_bytes(self, card_reserve: int) -> int:
        """What the gateway leaves of ``free_bytes`` to the medium; ``card_reserve`` is the configured one."""

    @abstractmethod
    def why_empty(self, free: int, used: int, card_reserve: int) -> str:
        """Cause and fix, for the warning that the card can hold nothing.

        ``free``: what ``free_bytes`` said; ``used``: bytes of the objects
        the card holds; ``card_reserve``: the configured reserve.
        """

    def _skip_newer(self, where: str, exc: ObjectTooNew) -> None:
        """Scan met an object in a newer format: it stays for the gateways that read it; said once per card."""
        if not self._newer_seen:
            self._newer_seen = True
            log.warning("card %s holds objects written by a newer kvgate (%s, e.g. %s): left in place, "
                        "read as misses here", self.display_location, exc, where)

    def prepare_reads(self, full_keys: list[bytes]) -> None:
        """A hint: these objects are likely to be read soon (a lookup just found them).

        Kinds whose reads start with work that does not need the destination
        buffer do that work now, so the read that follows is shorter.  The
        default does nothing (``prepares_reads`` False: no hints are sent).  Runs on a card thread of its own, never on a
        read's path; it must not raise and must not change what the card
        holds.
        """

    def read_rates(self) -> dict[str, float]:
        """Rates (bytes/s) of the ways this card reads, for status; 0 where not timed yet.

        Directory cards time copying cached files out of the page cache and
        reading around it; other kinds have one way and report zeros.
        """
        return {"cached_copy_bytes_per_second": 0.0, "direct_read_bytes_per_second": 0.0}

    # Batched forms.  The store calls these with every object of one request
    # that lives on this card; kinds with a round trip per call (Redis)
    # override them with pipelines.  Errors are returned per object, never
    # raised, so one bad object does not fail its neighbours.

    def read_many_into(self, items: list[tuple[bytes, memoryview]],
                       guard: Abandon | None = None) -> list[Header | BaseException]:
        """``read_into`` of each item, all delivering through one ``guard``."""
        guard = guard or Abandon()
        out: list[Header | BaseException] = []
        for full_key, dest in items:
            try:
                out.append(self.read_into(full_key, dest, guard))
            except (LookupError, ValueError, OSError) as e:
                out.append(e)
        return out

    def open_cached_many(self, full_keys: list[bytes], guard: Abandon) -> list[CachedObjectFile | BaseException]:
        """Each object's file, open, with its checked header, where the page cache holds it whole; else
        per object ``NotCached``, ``ObjectMissing``, ``ObjectCorrupt`` (not deleted: the usual read that
        follows decides) or the card's error.  Reads only from the cache, through ``guard.read_cached``.
        Only kinds with ``lends_files``; the caller closes every file (``close_files``), also those of a
        call it stopped waiting for."""
        return [NotCached() for _ in full_keys]

    def write_many(self, items: list[tuple[bytes, memoryview, ObjectMeta]],
                   guard: Abandon | None = None) -> list[int | BaseException]:
        out: list[int | BaseException] = []
        for full_key, payload, meta in items:
            try:
                out.append(self.write(full_key, payload, meta, guard))
            except OSError as e:
                out.append(e)
        return out

    def _write_one(self, full_key: bytes, payload: memoryview, meta: ObjectMeta, guard: Abandon | None) -> int:
        """``write`` of a kind whose ``write_many`` is its write path (one round trip for the batch)."""
        result = self.write_many([(full_key, payload, meta)], guard)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def exists_many(self, full_keys: list[bytes], not_before_ns: int | None = None) -> list[bool | BaseException]:
        out: list[bool | BaseException] = []
        for k in full_keys:
            try:
                out.append(self.exists(k, not_before_ns))
            except OSError as e:
                out.append(e)
        return out

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources and the claim; the card may be opened again."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, serial={self.serial!r})"
