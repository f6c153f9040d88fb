"""A Redis card's objects on the wire: one SET writes a value whole, one GET reads it, checked before it is delivered.

A value is exactly the on-card object format (``objectformat``): header then
payload.  The write path sends both as separate buffers of one argument
(``redispacker``), after an ``EXISTS label`` in the same pipeline (the
module doc of ``kvgate.cards.redis.card`` says why).  The read path checks the
header, lengths and hash of each reply and delivers the payload only
through the caller's guard; a value found corrupt is deleted, unless a good
one was written over it meanwhile.  Batches are pipelined, large reads in
pipelines of their own (``_READ_PIPELINE_BYTES`` says why).
"""

from __future__ import annotations

import errno
import time
from typing import Any, Callable, Iterator

import redis.exceptions as rexc

from kvgate.cards.base import CardUnavailable, WriteAbandoned, byte_view
from kvgate.cards.objectformat import (
    FIXED_SIZE,
    BufferTooSmall,
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    header_size,
    pack_header,
    parse_header,
)
from kvgate.keys import payload_hash, payload_hasher
from kvgate.cards.redis.conn import RedisConnections
from kvgate.cards.redis.keys import RedisKeys
from kvgate.cards.redis.packer import ZERO_COPY, ArgumentParts
from kvgate.memcopy import Abandon
from kvgate.memguard import hash_with

# A fetched value is hashed and handed to the destination in pieces of
# this size, each copied while it is still in the CPU cache (1 MiB of L2
# here); every kernel copy into a client region has a fixed cost on top.
# Measured here, the verify-and-deliver of 2 MiB objects into a session
# region, one thread: 2.0 GiB/s in 256 KiB pieces, 2.7 in 1 MiB.
DELIVER_PIECE = 1 << 20
# read_many_into pipelines GETs until their destinations add up to this; an
# object bigger than this gets a round trip of its own.  Measured here (Unix
# socket, 16 KiB - 4 MiB objects): one pipeline for a whole batch of large
# values is 1.5-3x slower, because redis-py returns all values at once, as
# fresh multi-MiB bytes objects, and glibc trims them back to the kernel when
# they are freed together, so every batch faults its memory in again
# (~0.5 GiB/s).  A round trip costs ~30 us, under 5% of a 1 MiB transfer.
_READ_PIPELINE_BYTES = 1 << 20

# Deletes a corrupt object only if it still starts with the bytes that were
# found bad: a good object written over it meanwhile is left alone.
_DISCARD_LUA = """
local cur = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[2]))
if cur == ARGV[1] then return redis.call('UNLINK', KEYS[1]) end
return 0
"""
_DISCARD_COMPARE = FIXED_SIZE  # header hash and creation time: a rewrite differs here


class RedisObjects:
    """The object values of one card: written whole, read back checked, deleted when found corrupt.

    ``object_key`` names the Redis key of a full key's object (the card's
    placement); ``ttl_ns``, when set, is how long after its creation an
    object expires in the server.
    """

    def __init__(self, conns: RedisConnections, keys: RedisKeys, object_key: Callable[[bytes], bytes],
                 ttl_ns: int | None) -> None:
        self.conns = conns
        self.keys = keys
        self.object_key = object_key
        self.ttl_ns = ttl_ns
        self._discard_script = conns.r.register_script(_DISCARD_LUA)
        self._scripts_ok = True

    # ------------------------------------------------------------------ reads

    def read_into(self, full_key: bytes, dest: memoryview, guard: Abandon | None = None) -> Header:
        view = byte_view(dest)
        rkey = self.object_key(full_key)
        with self.conns.io():
            try:
                value = self.conns.r.get(rkey)
            except rexc.ResponseError as exc:  # WRONGTYPE and friends: judged like a pipelined reply
                value = exc
        return self._finish_read(rkey, full_key, value, view, guard or Abandon())

    def read_many_into(self, items: list[tuple[bytes, memoryview]],
                       guard: Abandon | None = None) -> list[Header | BaseException]:
        """Pipelined GETs (up to ``_READ_PIPELINE_BYTES`` of destinations per round trip).

        Replies land in redis-py's buffers, which are ours; payloads reach the
        destinations only through ``guard`` (the contract in ``base``).

        Results are per object; a connection failure fails the objects of
        that pipeline and every later one at once (no waiting out each).
        """
        guard = guard or Abandon()
        out: list[Header | BaseException | None] = [None] * len(items)
        views = [byte_view(dest) for _, dest in items]
        rkeys = [self.object_key(k) for k, _ in items]
        down: OSError | None = None
        for chunk in self._read_chunks(views):
            if down is not None:  # the card failed on an earlier pipeline: do not wait out each one
                for i in chunk:
                    out[i] = self.conns.same_error(down)
                continue
            try:
                pipe = self.conns.r.pipeline(transaction=False)
                for i in chunk:
                    pipe.get(rkeys[i])
                values = pipe.execute(raise_on_error=False)
            except (rexc.RedisError, OSError) as exc:
                err = self.conns.map_error(exc)
                if isinstance(err, CardUnavailable):
                    down = err
                for i in chunk:
                    out[i] = self.conns.same_error(err)
                continue
            for i, value in zip(chunk, values):
                try:
                    out[i] = self._finish_read(rkeys[i], items[i][0], value, views[i], guard)
                except (LookupError, ValueError, OSError) as exc:
                    out[i] = exc
            del values
        return out  # type: ignore[return-value]

    @staticmethod
    def _read_chunks(views: list[memoryview]) -> Iterator[list[int]]:
        chunk: list[int] = []
        size = 0
        for i, v in enumerate(views):
            if chunk and size + len(v) > _READ_PIPELINE_BYTES:
                yield chunk
                chunk, size = [], 0
            chunk.append(i)
            size += len(v)
        if chunk:
            yield chunk

    def _finish_read(self, rkey: bytes, full_key: bytes, value: Any, view: memoryview, guard: Abandon) -> Header:
        """Check one GET reply and deliver its payload into ``view`` through ``guard``."""
        if value is None:
            raise ObjectMissing(f"no object {rkey.decode()}")
        if isinstance(value, rexc.ResponseError):
            if "WRONGTYPE" in str(value):
                self.discard(rkey, None)
                exc = ObjectCorrupt("the key holds a value of another type")
                exc.add_note(f"deleted corrupt object {rkey.decode()} on {self.conns.display_location}")
                raise exc
            raise self.conns.map_error(value)
        try:
            return self._verify_into(full_key, value, view, guard)
        except ObjectCorrupt as exc:
            exc.add_note(f"deleted corrupt object {rkey.decode()} on {self.conns.display_location}")
            self.discard(rkey, value)
            raise

    @staticmethod
    def _verify_into(full_key: bytes, value: bytes, view: memoryview, guard: Abandon) -> Header:
        """Header, lengths and hash of ``value``, then its payload into ``view`` through ``guard``.

        The payload is checked and delivered piece by piece: each piece is
        copied right after its hash, while it is still in the CPU cache.  A
        hash that fails leaves the destination partly written, which the
        contract allows (the caller treats it as garbage).
        """
        header = parse_header(value, expect_key=full_key)
        hlen, plen = header.header_len, header.payload_len
        if hlen != header_size(full_key) or header.payload_offset != hlen:  # Redis objects are never padded
            raise ObjectCorrupt("bad header length")
        if len(value) != hlen + plen:
            raise ObjectCorrupt(f"object is {len(value)} bytes, its header says {hlen + plen}")
        if plen > len(view):
            raise BufferTooSmall(plen)
        if plen == 0:
            if header.payload_hash != payload_hash(b""):
                raise ObjectCorrupt("payload checksum mismatch")
            return header
        src = memoryview(value)[hlen:]
        hasher = payload_hasher()
        for off in range(0, plen, DELIVER_PIECE):
            end = min(off + DELIVER_PIECE, plen)
            hasher.update(src[off:end])
            guard.copy(view[off:end], src[off:end])
        if hasher.intdigest() != header.payload_hash:
            raise ObjectCorrupt("payload checksum mismatch")
        return header

    # ----------------------------------------------------------------- writes

    def write_many(self, items: list[tuple[bytes, memoryview, ObjectMeta]],
                   guard: Abandon | None = None) -> list[int | BaseException]:
        """One pipeline: ``EXISTS label`` then a ``SET`` per object.

        The label test rides in the same pipeline (same connection, same
        server process), so a write that reached a server restarted empty is
        known at once; it is deleted and fails with CardUnavailable.
        """
        if not items:
            return []
        rkeys: list[bytes] = []
        sizes: list[int] = []
        pipe = self.conns.r.pipeline(transaction=False)
        pipe.exists(self.keys.label)
        for full_key, payload, meta in items:
            rkey = self.object_key(full_key)
            value, size = self._value(full_key, byte_view(payload), meta)
            if self.ttl_ns is None:
                pipe.set(rkey, value)
            else:  # created_ns is when the client put it: what is left of its life, at least 1 ms
                pipe.set(rkey, value, px=max(1, (meta.created_ns + self.ttl_ns - time.time_ns()) // 1_000_000))
            rkeys.append(rkey)
            sizes.append(size)
        if guard is not None and guard.abandoned:
            return [WriteAbandoned(self.conns.display_location) for _ in items]
        try:
            replies = pipe.execute(raise_on_error=False)
        except (rexc.RedisError, OSError) as exc:
            err = self.conns.map_error(exc)
            return [self.conns.same_error(err) for _ in items]
        label, results = replies[0], replies[1:]
        if isinstance(label, BaseException) or not label:
            written = [k for k, r in zip(rkeys, results) if not isinstance(r, BaseException)]
            if written:
                try:
                    self.conns.r.unlink(*written)
                except (rexc.RedisError, OSError):
                    pass
            why = (self.conns.map_error(label) if isinstance(label, BaseException) else
                   CardUnavailable(errno.ENOENT, "card label is missing (server restarted empty?); write undone",
                                   self.conns.display_location))
            return [self.conns.same_error(why) for _ in items]
        out: list[int | BaseException] = []
        for r, size in zip(results, sizes):
            out.append(self.conns.map_error(r) if isinstance(r, BaseException) else size)
        return out

    @staticmethod
    def _value(full_key: bytes, view: memoryview, meta: ObjectMeta) -> tuple[Any, int]:
        plen = len(view)
        header = pack_header(full_key, plen, hash_with(view, payload_hasher), meta)  # (in-place: guarded)
        if ZERO_COPY:
            return ArgumentParts(header, view), len(header) + plen
        return header + view, len(header) + plen  # old redis-py: one copy of the payload

    # ---------------------------------------------------------------- deletes

    def discard(self, rkey: bytes, seen: bytes | None) -> None:
        """Delete a corrupt object, but not a good one written over it since.

        ``seen`` is the start of the value found bad; None deletes whatever
        is there (a value of the wrong type).  Best effort: a failure here
        leaves the object for the next read or scan to find again.
        """
        try:
            if seen is not None and self._scripts_ok:
                prefix = seen[:_DISCARD_COMPARE]
                try:
                    self._discard_script(keys=[rkey], args=[prefix, len(prefix) - 1 if prefix else -1])
                    return
                except rexc.ResponseError as exc:
                    if "WRONGTYPE" in str(exc):
                        pass  # replaced by a foreign value: fall through and delete it
                    else:  # scripting disabled or forbidden: plain deletes from now on
                        self._scripts_ok = False
            self.conns.r.unlink(rkey)
        except (rexc.RedisError, OSError):
            pass
