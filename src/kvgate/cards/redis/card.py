"""A card that is a Redis-protocol server (Redis, Valkey, anything that speaks RESP).

Locations are redis-py URLs: ``redis://host:port``, ``redis://host:port/<db>``,
``redis://:password@host:port``, ``rediss://`` for TLS and
``unix:///path/to/redis.sock`` (``?db=N`` for another logical database).

Layout, in the logical database the URL selects::

    kvgate:card-label               label: JSON {"serial", "format", "created"}
    kvgate:index                    the gateway's index snapshot (kvgate.tiers.restart)
    kvgate:heads                    the shared-heads set, the card's ``heads`` channel (``redisheads``)
    kvgate:o:<N>:<digest hex>       one object per string value (header + payload)

``N`` spreads objects over ``num_dbs`` key prefixes (the same choice of db as
the directory card); the digest is ``key_digest`` of the full key, and the
header inside the value still carries the full key, so a reader checks it.
A value is exactly the on-card object format (``objectformat``): one ``SET``
stores it whole, which is what makes writes atomic; one ``GET`` reads it.

Every socket operation (connect, each send, each receive) is bounded by
``io_timeout_ms`` and nothing is retried, so a dead or hung server fails a
call within about the I/O deadline.  Every failure leaves as an ``OSError``:
``CardUnavailable`` when the server cannot be used (refused, timed out, auth,
read-only replica, loading), a plain ``OSError(ENOSPC)`` when the server is
out of memory and refuses one write, so the gateway's health logic treats a
Redis card exactly like a directory.

The label, and a server that restarts empty: ``redislabel``.  An empty
server gets its old serial back; one that holds kvgate objects but no label
is refused.

To keep "objects but no label" meaning exactly that, every write sends
``EXISTS label`` ahead of its ``SET`` in the same pipeline.  A pipeline runs
on one connection, so both commands reach the same server process: a write
that lands on a server restarted empty (before the next health check put the
label back) is seen at once, deleted again and reported as
``CardUnavailable``, instead of leaving an unlabelled object that would make
the card unrecoverable.

The server must not evict by itself (``maxmemory-policy noeviction``): the
gateway keeps the card within its capacity (``free_bytes``) and evicts what
it chooses; a server that evicts on its own drops objects the gateway has
acknowledged, and may drop the label.  ``open()`` warns about any other
policy.  A write the full server refuses (OOM) is ENOSPC: the gateway lowers
the card's capacity and evicts.

Claims: a gateway holds the card through a lease in the server, renewed
by every health check (``redislease``).

Copies: a write sends the header and the caller's payload buffer to the
socket as separate buffers of one RESP argument (a small command packer,
``redispacker``, replaces redis-py's, which with hiredis copies a payload
twice), so the only pass over the payload before the kernel is the hash.  A
read gets the value as one ``bytes`` from redis-py (hiredis) and copies the
payload out of it once, checksumming each piece just before copying it.
Batches are pipelined; see ``redisobjects._READ_PIPELINE_BYTES`` for why
large reads are not.  Both paths are ``RedisObjects`` (``redisobjects``).
"""

from __future__ import annotations

import errno
import logging
import uuid
from typing import Any, Iterator

import redis.exceptions as rexc

from kvgate.cards.base import Card, CardUnavailable, SnapshotWriter, StoredObject
from kvgate.cards.objectformat import FIXED_SIZE, Header, ObjectCorrupt, ObjectMeta, ObjectTooNew, peek_header
from kvgate.cards.redis.conn import RedisConnections
from kvgate.cards.redis.heads import RedisHeads
from kvgate.cards.redis.keys import SCAN_COUNT, RedisKeys, as_text, redact, split_tag
from kvgate.cards.redis.label import RedisLabel
from kvgate.cards.redis.lease import RedisLease
from kvgate.cards.redis.objects import RedisObjects
from kvgate.cards.redis.snapshot import RedisSnapshotWriter
from kvgate.keys import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES, key_digest
from kvgate.memcopy import Abandon

log = logging.getLogger("kvgate.cards.redis")

# The longest honest header: fixed part + length byte + namespace + key.
# Scan reads this much of each value, so one GETRANGE covers every header.
_SCAN_READ = FIXED_SIZE + 1 + MAX_NAMESPACE_BYTES + MAX_KEY_BYTES
_SCAN_PIPELINE = 256  # keys per GETRANGE/STRLEN pipeline in scan()
_UNLINK_BATCH = 500  # keys per UNLINK in clean()
# No free-memory limit (maxmemory 0): the server grows until the machine is full.
UNLIMITED_FREE_BYTES = 1 << 60
# What an object costs in used_memory per byte of it: jemalloc rounds each
# allocation up to a size class (4 per doubling).  Measured (redis 7,
# jemalloc 5.3): 1 MiB + header takes 1.25 MiB, a payload of exactly 1 MiB
# 1.27 MiB, 256 KiB + header 1.25x, 64 KiB 1.18x.
MEMORY_PER_OBJECT_BYTE = 1.3
# Share of maxmemory left to the server itself: client and replication
# buffers, fragmentation, the keys' own overhead.
SERVER_RESERVE = 0.05

_HEX = frozenset(b"0123456789abcdef")


class RedisCard(Card):
    """A Redis server (or one logical database of it) as a card.

    Thread-safe: every call checks a connection out of a bounded pool, so
    the gateway's I/O threads use the card at once.
    """

    kind = "redis"

    def __init__(self, location: str, num_dbs: int = 1, io_timeout_ms: int = 2000, max_connections: int = 64,
                 ttl_s: float | None = None):
        """``ttl_s``: objects expire in the server that long after their creation (the gateway's ``ttl``), so
        ``exists`` of an object the gateway has not indexed agrees with the ttl too."""
        super().__init__(location, num_dbs)
        if io_timeout_ms < 1:
            raise ValueError(f"io_timeout_ms must be at least 1, got {io_timeout_ms}")
        self.io_timeout_ms = io_timeout_ms
        self.ttl_ns = int(ttl_s * 1e9) if ttl_s is not None else None
        self.display_location = redact(location)
        url, tag = split_tag(location)
        self._k = RedisKeys(tag)
        self._conns = RedisConnections(url, self.display_location, io_timeout_ms, max_connections)
        self._r = self._conns.r  # the client every part of the card shares
        self._prefixes = [self._k.objects + b"%d:" % i for i in range(num_dbs)]
        self.maxmemory_policy: str | None = None
        self._objects = RedisObjects(self._conns, self._k, self.object_key, self.ttl_ns)
        self._label = RedisLabel(self._conns, self._k, io_timeout_ms)
        self._lease = RedisLease(self._conns, self._k.lease)
        self.heads = RedisHeads(self._conns, self._k.heads)

    # ----------------------------------------------------------------- label

    def open(self) -> str:
        with self._conns.io():
            raw = self._label.read()
            if raw is not None:
                serial = self._label.parse(raw)
            elif self.serial is not None:
                serial = self._label.restore(self.serial)
            else:
                serial = self._label.create(uuid.uuid4().hex)
            self._read_policy()
        self.serial = serial
        return serial

    def check(self) -> str:
        """The serial on the label; renews the lease of a claimed card (``CardInUse`` once it is lost)."""
        with self._conns.io():
            raw = self._label.read()
            if raw is not None:
                serial = self._label.parse(raw)
            elif self.serial is None:
                raise CardUnavailable(errno.ENOENT, "card label is missing (not a kvgate card, or never opened)",
                                      self.display_location)
            else:
                serial = self._label.restore(self.serial)
        if self.claimed is not None:
            self._lease.renew(self.claimed, claiming=False)
        return serial

    def claim(self, shared: bool) -> None:
        self._lease.renew(shared, claiming=self.claimed is None)
        self.claimed = shared

    def check_writable(self) -> None:
        with self._conns.io():  # a replica answers READONLY: CardUnavailable(EROFS)
            self._r.set(self._k.probe, b"1", px=1000)
            self._r.delete(self._k.probe)

    def _read_policy(self) -> None:
        try:
            conf = self._r.config_get("maxmemory-policy")
        except rexc.ResponseError:  # CONFIG renamed or forbidden (managed services): nothing to check
            self.maxmemory_policy = None
            return
        policy = as_text({as_text(k): v for k, v in dict(conf).items()}.get("maxmemory-policy"))
        self.maxmemory_policy = policy
        if policy is not None and policy != "noeviction":
            log.warning("redis card %s: maxmemory-policy is %s: the server may drop objects the gateway has "
                        "acknowledged, and the card label; set maxmemory-policy noeviction (the gateway keeps the "
                        "card within its capacity itself)", self.display_location, policy)

    # --------------------------------------------------------------- helpers

    def object_key(self, full_key: bytes) -> bytes:
        """The Redis key of the object for ``full_key`` (whether or not it exists)."""
        return self.named_key(key_digest(full_key))

    def named_key(self, digest: bytes) -> bytes:
        """The Redis key of the object named ``digest``."""
        db, name = self.named_place(digest)
        return self._prefixes[db] + name.encode()

    # ------------------------------------------------------------------- I/O

    def read_into(self, full_key: bytes, dest: memoryview, guard: Abandon | None = None) -> Header:
        return self._objects.read_into(full_key, dest, guard)

    def read_many_into(self, items: list[tuple[bytes, memoryview]],
                       guard: Abandon | None = None) -> list[Header | BaseException]:
        return self._objects.read_many_into(items, guard)

    def write(self, full_key: bytes, payload: memoryview, meta: ObjectMeta,
              guard: Abandon | None = None) -> int:
        return self._write_one(full_key, payload, meta, guard)

    def write_many(self, items: list[tuple[bytes, memoryview, ObjectMeta]],
                   guard: Abandon | None = None) -> list[int | BaseException]:
        return self._objects.write_many(items, guard)

    def exists(self, full_key: bytes, not_before_ns: int | None = None) -> bool:
        """``not_before_ns`` needs no check here: with a ttl the server expires objects itself (``ttl_s``)."""
        with self._conns.io():
            return bool(self._r.exists(self.object_key(full_key)))

    def exists_many(self, full_keys: list[bytes], not_before_ns: int | None = None) -> list[bool | BaseException]:
        if not full_keys:
            return []
        try:
            pipe = self._r.pipeline(transaction=False)
            for k in full_keys:
                pipe.exists(self.object_key(k))
            replies = pipe.execute(raise_on_error=False)
        except (rexc.RedisError, OSError) as exc:
            err = self._conns.map_error(exc)
            return [self._conns.same_error(err) for _ in full_keys]
        return [self._conns.map_error(r) if isinstance(r, BaseException) else bool(r) for r in replies]

    def delete(self, full_key: bytes) -> bool:
        return self.delete_named(key_digest(full_key))

    def delete_named(self, digest: bytes) -> bool:
        with self._conns.io():
            return bool(self._r.unlink(self.named_key(digest)))

    # --------------------------------------------------------- whole-card ops

    def _object_names(self) -> Iterator[list[bytes]]:
        """Every ``kvgate:o:*`` key name, in batches (SCAN may repeat a name)."""
        cursor = 0
        while True:
            with self._conns.io():
                cursor, keys = self._r.scan(cursor, match=self._k.objects_match, count=SCAN_COUNT)
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def _parse_name(self, name: bytes) -> tuple[int, bytes] | None:
        """(db, digest hex) of an object key name, or None for a name that is not ours."""
        rest = name[len(self._k.objects):]
        db, sep, hexd = rest.partition(b":")
        if not sep or not db.isdigit() or len(hexd) != 32 or not set(hexd) <= _HEX:
            return None
        return int(db), hexd

    def names(self) -> Iterator[list[bytes]]:
        """One batch per SCAN page.  Objects stored under another ``num_dbs`` are renamed (RENAMENX) to where
        reads look; a key under our prefix whose name is not ours is left alone."""
        relocated: set[bytes] = set()
        for names in self._object_names():
            batch = []
            for name in names:
                parsed = self._parse_name(name)
                if parsed is None or name in relocated:
                    continue
                digest = bytes.fromhex(parsed[1].decode())
                home = self.named_key(digest)
                if home != name:
                    with self._conns.io():
                        moved = self._r.renamenx(name, home)
                        if not moved:  # the right place holds the key already: that copy wins
                            self._r.unlink(name)
                            continue
                    relocated.add(home)
                batch.append(digest)
            if batch:
                yield batch

    def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        """Header-only checks, pipelined; payload hashes are left to reads."""
        out: list[StoredObject | None] = []
        for start in range(0, len(digests), _SCAN_PIPELINE):
            names = [self.named_key(d) for d in digests[start:start + _SCAN_PIPELINE]]
            with self._conns.io():
                pipe = self._r.pipeline(transaction=False)
                for n in names:
                    pipe.getrange(n, 0, _SCAN_READ - 1)
                    pipe.strlen(n)
                replies = pipe.execute(raise_on_error=False)
            for j, name in enumerate(names):
                out.append(self._scan_one(name, replies[2 * j], replies[2 * j + 1]))
        return out

    def _scan_one(self, name: bytes, buf: Any, size: Any) -> StoredObject | None:
        if isinstance(buf, BaseException) or isinstance(size, BaseException):
            err = buf if isinstance(buf, BaseException) else size
            if "WRONGTYPE" in str(err):
                self._objects.discard(name, None)
                return None
            raise self._conns.map_error(err)
        if size == 0:  # deleted since it was listed (or an empty value, garbage either way)
            self._objects.discard(name, b"")
            return None

        def read_head(n: int) -> bytes:
            nonlocal buf  # discard compares what the header was read from
            with self._conns.io():
                buf = self._r.getrange(name, 0, n - 1)
            return buf

        try:
            header = peek_header(buf, size, read_head)
            if self.object_key(header.full_key) != name:
                raise ObjectCorrupt("object key name does not match the key inside")
        except ObjectTooNew as exc:
            self._skip_newer(name.decode(errors="replace"), exc)
            return None
        except ObjectCorrupt:
            self._objects.discard(name, bytes(buf))
            self.scan_corrupt += 1
            return None
        return StoredObject(header.full_key, header.payload_len, size, header.meta)

    def snapshot_writer(self) -> SnapshotWriter:
        return RedisSnapshotWriter(self._conns, self._k)

    def read_snapshot(self) -> bytes | None:
        with self._conns.io():
            return self._r.get(self._k.snapshot)

    def drop_snapshot(self) -> None:
        with self._conns.io():
            self._r.unlink(self._k.snapshot)

    def clean(self) -> int:
        """UNLINK every ``kvgate:o:*`` key; the label and foreign keys stay (never FLUSHDB)."""
        deleted = 0
        pending: list[bytes] = []
        for names in self._object_names():
            pending.extend(names)
            while len(pending) >= _UNLINK_BATCH:
                with self._conns.io():
                    deleted += self._r.unlink(*pending[:_UNLINK_BATCH])
                del pending[:_UNLINK_BATCH]
        if pending:
            with self._conns.io():
                deleted += self._r.unlink(*pending)
        return deleted

    def free_bytes(self) -> int:
        """Object bytes (header + payload, as ``write`` counts them) that still fit under maxmemory.

        What is free beyond the server's own reserve (``SERVER_RESERVE`` of
        maxmemory), divided by what an object byte costs in used_memory
        (``MEMORY_PER_OBJECT_BYTE``); the gateway adds what the card holds
        and applies no ``card_reserve``.  A server without maxmemory reports
        ``UNLIMITED_FREE_BYTES``.
        """
        with self._conns.io():
            info = self._r.info("memory")
        maxmemory = int(info.get("maxmemory", 0))
        if maxmemory <= 0:
            return UNLIMITED_FREE_BYTES
        free = maxmemory * (1 - SERVER_RESERVE) - int(info.get("used_memory", 0))
        return max(0, int(free / MEMORY_PER_OBJECT_BYTE))

    def reserve_bytes(self, card_reserve: int) -> int:
        """None beyond ``free_bytes``, which keeps the server's own (``SERVER_RESERVE``); ``card_reserve`` is
        for filesystems."""
        return 0

    def why_empty(self, free: int, used: int, card_reserve: int) -> str:
        return (f"the server's maxmemory leaves {free} bytes for objects after its own reserve and what it "
                "holds; raise maxmemory (or delete what else the server holds)")

    def close(self) -> None:
        """Give up the claim and close every connection; the pool reconnects if the card is used again."""
        if self.claimed is not None:
            self.claimed = None
            self._lease.give_up()
        self._conns.disconnect()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display_location!r}, serial={self.serial!r})"
