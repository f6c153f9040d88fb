"""The operations clients ask for, one handler per request type, and the answer to each request.

``Operations.dispatch`` runs as a task of its own for each request a
connection's task (``Listeners``) read after the hello, so a client may
pipeline and a slow card read never holds up a lookup.  It runs on the event
loop and only checks requests and does bookkeeping: bytes move in ``IoPool``
threads (see ``TieredStore``), and no handler may block the loop.

A wrong request gets an ``Error`` reply, and any unexpected exception in a
handler is logged and answered with ``INTERNAL``: nothing a client asks can
stop the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.cards.base import CachedObjectFile
from kvgate.config import Config
from kvgate.gateway.connection import Connection
from kvgate.latency import Latencies
from kvgate.gateway.sessions import LentBody, Session, reply
from kvgate.gateway.shm import RegionError, map_client_region
from kvgate.heads import SharedHeads
from kvgate.keys import MARK_KEYS, BadKey, check_key, dialog_digest, encode_namespace, full_key, full_keys
from kvgate.memcopy import MemoryFault
from kvgate.protocol import (
    Cards,
    CardsReply,
    Clean,
    CountReply,
    Delete,
    Error,
    ErrorCode,
    Exists,
    ExistsReply,
    Get,
    GetReply,
    GiveBack,
    Hello,
    Hold,
    INLINE,
    LENT,
    Lookup,
    Mark,
    MarkReply,
    MISS,
    NOT_DONE,
    Prewarm,
    Put,
    PutReply,
    RegionReply,
    RegisterRegion,
    Release,
    RequestError,
    SESSION_REGION,
    Stats,
    StatsReply,
    TOO_SMALL,
)
from kvgate.tiers.cardset import CardChangeError
from kvgate.tiers.io import IoPool
from kvgate.tiers.store import GetItem, PutItem, RamLoan, TieredStore
from kvgate.types import Retention

log = logging.getLogger("kvgate.gateway")

MAX_KEYS_PER_REQUEST = 65536
# Lent gets a session may hold, not given back: each holds a little of our memory however small its
# bytes (a get of empty objects), so a client that never gives back would otherwise grow it without end.
MAX_LOANS = 256
# Card objects one session may hold lent as open files; past that they are read into buffers of ours.
FILES_PER_SESSION = 1024
# Client regions one session may register (each engine integration registers one, its CPU tier or L1).
MAX_CLIENT_REGIONS = 16
_EMPTY = memoryview(bytearray(0))

# A handler answers (session, request, body) with its reply and the reply's body (None: no body).
Handler = Callable[[Session, Any, bytes], Awaitable[tuple[Any, Any]]]


@dataclass(frozen=True)
class _Lent:
    sizes: list[int]  # per object lent, in order: its size, MISS or NOT_DONE
    body: LentBody
    files: dict[int, CachedObjectFile] = field(default_factory=dict)  # by key index: the objects lent open


class _LendRoom:
    """What one reply sent or lent from our memory may still take: ``limit`` bytes in all, and RAM-tier
    objects only while the tier may still lend them (``TieredStore.lendable_bytes``).  Past that share
    an object would be copied out of the tier into a buffer of ours: the client asks again for it
    instead.  Objects read from cards go into reply buffers whatever the share.  The first object
    always goes (the client's request carried it in one frame, so one frame carries it back)."""

    def __init__(self, store: TieredStore, limit: int) -> None:
        self.store = store
        self.left = limit
        self.ram_left = max(store.lendable_bytes(), 1 << 20)

    def take(self, key: bytes, size: int, first: bool) -> bool:
        in_ram = self.store.size_in_ram(key) == size
        if not first and (size > self.left or (in_ram and size > self.ram_left)):
            return False
        self.left -= size
        if in_ram:
            self.ram_left -= size
        return True


@dataclass(frozen=True)
class Operation:
    handler: Handler
    engine_only: bool  # only an engine session may ask for it


class Operations:
    """What each request type does: one table, keyed by the request's message type.

    Called on the event loop: ``dispatch`` from the task a connection starts for each request,
    ``prewarm_by_name`` from the HTTP status threads through the loop.  Handlers await the store and the
    pool, never block the loop.
    """

    def __init__(self, cfg: Config, store: TieredStore, pool: IoPool, heads: SharedHeads,
                 snapshot: Callable[[], dict[str, Any]], latency: Latencies | None = None):
        self.cfg = cfg
        self.latency = latency if latency is not None else Latencies()
        self.store = store
        self.pool = pool
        self.heads = heads
        self.snapshot = snapshot
        self._loans = 0  # the last loan id given (ids are per gateway, looked up per session)
        keyed = self._keyed
        self.table: dict[type, Operation] = {
            Stats: Operation(self._stats, engine_only=False),
            Clean: Operation(self._clean, engine_only=False),
            Cards: Operation(self._cards, engine_only=False),
            Hello: Operation(self._hello_again, engine_only=False),
            RegisterRegion: Operation(self._register, engine_only=True),
            Mark: Operation(self._mark, engine_only=True),
            Put: Operation(keyed(self._put), engine_only=True),
            Get: Operation(keyed(self._get), engine_only=True),
            Lookup: Operation(keyed(self._lookup), engine_only=True),
            Exists: Operation(keyed(self._exists), engine_only=True),
            Delete: Operation(keyed(self._delete), engine_only=True),
            Prewarm: Operation(keyed(self._prewarm), engine_only=True),
            Hold: Operation(keyed(self._hold), engine_only=True),
            Release: Operation(keyed(self._release), engine_only=True),
            GiveBack: Operation(self._give_back, engine_only=True),
        }

        # The wire name of each request type ("lookup", "get"): the label of its latency histogram.
        self.names: dict[type, str] = {t: str(t.__struct_config__.tag) for t in self.table}

    async def dispatch(self, session: Session, req, body: bytes | bytearray, blen: int, conn: Connection) -> None:
        """Answer one request; its body's ``blen`` inline bytes go back to the session's share."""
        reply_body = None
        started = time.perf_counter()
        try:
            answer, reply_body = await self.handle(session, req, body)
        except RequestError as e:
            answer = Error(id=req.id, code=e.code, message=str(e))
        except (BadKey, RegionError) as e:
            answer = Error(id=req.id, code=ErrorCode.BAD_REQUEST, message=str(e))
        except MemoryFault as e:  # the client shrank a region it shares with us: its request fails, nothing else
            region = session.regions.get(getattr(req, "region", INLINE)) if session is not None else None
            where = f"region {req.region} ({region.path})" if region is not None else "a shared region"
            answer = Error(id=req.id, code=ErrorCode.BAD_REQUEST,
                           message=f"{where} is shorter than when it was mapped ({e.strerror}): keep region files "
                                   "at their size while the gateway has them")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", type(req).__name__)
            answer = Error(id=req.id, code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
        finally:
            await session.inline.release(blen)
        answer.id = req.id
        try:
            if isinstance(reply_body, LentBody):
                await reply(conn, answer, reply_body.segments)
            else:
                await reply(conn, answer, reply_body)
        finally:
            if isinstance(reply_body, LentBody):
                reply_body.give_back(self.store)
                await session.inline.release(reply_body.nbytes)
            elif reply_body is not None:
                await session.inline.release(len(reply_body))
            self.latency.observe(self.names.get(type(req), "other"), time.perf_counter() - started)

    async def handle(self, sess: Session, req, body: bytes) -> tuple[Any, Any]:
        op = self.table.get(type(req))
        if (op is None or op.engine_only) and sess.role != "engine":
            raise RequestError(ErrorCode.BAD_REQUEST, f"{type(req).__name__.lower()} needs an engine session")
        if op is None:
            raise RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {type(req).__name__}")
        return await op.handler(sess, req, body)

    def _keyed(self, handler: Callable[..., Awaitable[tuple[Any, Any]]]) -> Handler:
        """The handler of an op on keys, given them full (namespaced, checked) and the dialog's digest."""
        async def on_keys(sess: Session, req, body: bytes) -> tuple[Any, Any]:
            keys = self._full_keys(sess, req.keys)
            return await handler(sess, req, keys, dialog_digest(req.dialog), body)
        return on_keys

    def _full_keys(self, sess: Session, keys: list[bytes]) -> list[bytes]:
        """``full_key(namespace, key)`` of every key of a decoded request.

        Done in bulk (``kvgate.keys.full_keys``) rather than two Python calls
        per key: an engine looks up 1,000s of keys on every scheduling step,
        and per-key calls were a third of a lookup's time.  The decoder has
        checked each key already (``kvgate.keys.Key``: bytes of a length in
        bounds); the count is checked here, for its own error code.
        """
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise RequestError(ErrorCode.TOO_LARGE, f"{len(keys)} keys in one request (limit {MAX_KEYS_PER_REQUEST})")
        return full_keys(sess.namespace, keys)

    # ---- any session ----------------------------------------------------------------

    async def _stats(self, sess: Session, req: Stats, body: bytes) -> tuple[StatsReply, None]:
        return StatsReply(stats=self.snapshot()), None

    async def _clean(self, sess: Session, req: Clean, body: bytes) -> tuple[CountReply, None]:
        """An engine session cleans its own namespace; every namespace (or one named) is an admin session's
        on the Unix socket, as card changes are.  The log names who asked and what went."""
        asker = (f"session {sess.id} ({sess.role}, {sess.who}, {'Unix socket' if sess.local else 'TCP'}"
                 + (f", namespace {sess.namespace.decode(errors='replace')!r})" if sess.role == "engine" else ")"))
        if sess.role == "engine":
            if req.namespace is not None and req.namespace.encode() != sess.namespace:
                log.warning("clean refused: %s asked to clean namespace %r", asker, req.namespace)
                raise RequestError(ErrorCode.NOT_AUTHORIZED, "an engine session cleans only its own namespace; "
                                   "another namespace's clean needs an admin session on the gateway's Unix socket")
            ns: bytes | None = sess.namespace
        elif not sess.local:
            log.warning("clean refused: %s is not on the Unix socket", asker)
            raise RequestError(ErrorCode.NOT_AUTHORIZED, "clean needs an admin session on the gateway's Unix socket "
                               "(kvgate clean --socket PATH), or an engine session for its own namespace")
        else:
            ns = encode_namespace(req.namespace) if req.namespace is not None else None
        what = "every namespace" if ns is None else f"namespace {ns.decode(errors='replace')!r}"
        if self.cfg.shared_storage:
            log.warning("clean refused: %s asked to clean %s, but shared_storage is true, other gateways use these "
                        "cards; nothing was deleted", asker, what)
            raise RequestError(ErrorCode.CLEAN_REFUSED,
                               "shared_storage is true: this gateway never deletes all data; nothing was deleted")
        if ns is None:
            n = await self.store.clean()
            log.info("clean: %s cleaned %s: deleted %d objects", asker, what, n)
        else:
            in_ram, on_cards = await self.store.clean_namespace(ns)
            n = max(in_ram, on_cards)
            log.info("clean: %s cleaned %s: deleted %d objects from cards, dropped %d from RAM", asker, what,
                        on_cards, in_ram)
        return CountReply(count=n), None

    async def _cards(self, sess: Session, req: Cards, body: bytes) -> tuple[CardsReply, None]:
        """List or change the card set: an admin session on the Unix socket only (a change points the
        gateway at a path or server of the asker's choosing)."""
        if req.action != "list" and not (sess.local and sess.role == "admin"):
            raise RequestError(ErrorCode.NOT_AUTHORIZED,
                               "card changes need an admin session on the gateway's Unix socket")
        if req.action != "list" and self.cfg.cluster_mode:
            # The view would undo the change at its next epoch, and the other gateways would not follow it.
            raise RequestError(ErrorCode.CARDS_REFUSED,
                               f"this gateway is in cluster mode: its cards follow the cluster's view; change them "
                               f"with `kvgate cluster {'register' if req.action == 'add' else req.action}` "
                               f"(etcd {', '.join(self.cfg.cluster_etcd_endpoints)})")
        cards = self.store.card_set
        message = ""
        try:
            if req.action == "add":
                mc = await cards.add(req.target)
                message = f"card {mc.where} ({mc.serial}) added"
            elif req.action == "drain":
                mc = cards.drain(req.target, now=req.now, force=req.force)
                message = (f"card {mc.where} ({mc.serial}) " +
                           ("removed without copying" if req.now else f"draining: {len(mc.index)} objects to copy"))
            elif req.action == "undrain":
                mc = cards.undrain(req.target)
                message = f"card {mc.where} ({mc.serial}) takes writes again"
            elif req.action == "remove":
                await cards.remove(req.target, force=req.force)
                message = f"card {req.target} removed"
        except CardChangeError as e:
            raise RequestError(ErrorCode.CARDS_REFUSED, str(e)) from None
        if message and req.action == "add":
            message += "; until a restart: add it to storage_devices to keep it"
        return CardsReply(generation=cards.generation, fingerprint=cards.fingerprint, cards=cards.status(pending=True),
                          message=message), None

    async def _hello_again(self, sess: Session, req: Hello, body: bytes) -> tuple[Any, Any]:
        raise RequestError(ErrorCode.BAD_REQUEST, "this connection already has a session")

    # ---- engine sessions ----------------------------------------------------------------

    async def _register(self, sess: Session, req: RegisterRegion, body: bytes) -> tuple[RegionReply, None]:
        if not sess.local:
            raise RequestError(ErrorCode.BAD_REQUEST, "regions can only be registered over the Unix socket")
        if "\x00" in req.path:
            raise RequestError(ErrorCode.BAD_REQUEST, "region path contains a NUL byte")
        if len(sess.regions) - (SESSION_REGION in sess.regions) >= MAX_CLIENT_REGIONS:
            # each region holds a mapping and (in place) a descriptor: without a cap one connection
            # could spend the gateway's descriptors and mappings, and every other session with them
            raise RequestError(ErrorCode.BAD_REQUEST, f"a session registers at most {MAX_CLIENT_REGIONS} "
                               f"regions (not {req.path}): open another session for more")
        region = await self.pool.run(map_client_region, req.path, sess.uid, not sess.in_place, sess.id, sess.pid)
        rid = max(sess.regions, default=0) + 1
        sess.regions[rid] = region
        return RegionReply(region=rid, size=region.size), None

    async def _mark(self, sess: Session, req: Mark, body: bytes) -> tuple[MarkReply, None]:
        # only the first MARK_KEYS count: the rest are neither keyed nor hashed
        shared, starts = self.heads.shared_prefix(self._full_keys(sess, req.keys[:MARK_KEYS]))
        return MarkReply(mark=req.keys[shared] if shared < len(req.keys) else None, shared=shared,
                         heads=starts), None

    async def _lookup(self, sess: Session, req: Lookup, keys: list[bytes], dialog: bytes,
                      body: bytes) -> tuple[CountReply, None]:
        self.store.note_source(req.source)
        return CountReply(count=await self.store.lookup(keys, dialog, sess.local, req.source)), None

    async def _exists(self, sess: Session, req: Exists, keys: list[bytes], dialog: bytes,
                      body: bytes) -> tuple[ExistsReply, None]:
        self.store.note_source(req.source)
        return ExistsReply(present=await self.store.exists(keys, dialog, sess.local, source=req.source)), None

    async def _delete(self, sess: Session, req: Delete, keys: list[bytes], dialog: bytes,
                      body: bytes) -> tuple[CountReply, None]:
        return CountReply(count=await self.store.delete(keys, dialog)), None

    async def _prewarm(self, sess: Session, req: Prewarm, keys: list[bytes], dialog: bytes,
                       body: bytes) -> tuple[CountReply, None]:
        return CountReply(count=await self.store.prewarm(keys, dialog)), None

    async def _hold(self, sess: Session, req: Hold, keys: list[bytes], dialog: bytes,
                    body: bytes) -> tuple[ExistsReply, None]:
        return ExistsReply(present=await self.store.hold(sess.id, keys, dialog, sess.local)), None

    async def _release(self, sess: Session, req: Release, keys: list[bytes], dialog: bytes,
                       body: bytes) -> tuple[CountReply, None]:
        return CountReply(count=self.store.holds.release(sess.id, keys)), None

    async def _put(self, sess: Session, req: Put, keys: list[bytes], dialog: bytes,
                   body: bytes) -> tuple[PutReply, None]:
        n = len(keys)
        if len(req.sizes) != n:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{n} keys but {len(req.sizes)} sizes")
        if any(s < 0 for s in req.sizes):
            raise RequestError(ErrorCode.BAD_REQUEST, "negative size")
        if 0 in req.sizes:
            # Every object an engine stores is a KV chunk or page, never empty; a 0-byte one is a buffer cut
            # short (a vLLM chunk id past its CPU tier's end was stored so), and would answer later lookups
            # as a hit whose load then fails.  The gateway knows no namespace's object size (neither the
            # hello nor the put carries one, and one namespace may hold several: SGLang's hybrid pools,
            # LMCache's last partial chunk), so the rule is the one every namespace shares: none is empty.
            i = req.sizes.index(0)
            raise RequestError(ErrorCode.BAD_REQUEST, f"sizes[{i}] is 0: the gateway stores no empty objects "
                               "(nothing of this put was stored)")
        if req.position + n > (1 << 63):  # object headers hold positions as int64
            raise RequestError(ErrorCode.BAD_REQUEST, f"position {req.position} out of range for {n} keys")
        if req.region == INLINE:
            if sum(req.sizes) != len(body):
                raise RequestError(ErrorCode.BAD_REQUEST, f"sizes add up to {sum(req.sizes)} but the body has {len(body)} bytes")
            mv = memoryview(body)
            views, off = [], 0
            for s in req.sizes:
                views.append(mv[off : off + s])
                off += s
        else:
            region = sess.region(req.region)
            if req.offsets is None or len(req.offsets) != n:
                raise RequestError(ErrorCode.BAD_REQUEST, "a put from a region needs one offset per key")
            views = [region.slice(o, s) for o, s in zip(req.offsets, req.sizes)]
        now = time.time_ns()
        pos = req.position
        last = len(keys) - 1
        in_region = req.region != INLINE
        items = [PutItem(k, v, ObjectMeta(dialog, pos + i if pos >= 0 else -1, now, i == last), in_region)
                 for i, (k, v) in enumerate(zip(keys, views))]
        return PutReply(stored=await self.store.put(items, Retention.parse(req.retention))), None

    async def _get(self, sess: Session, req: Get, keys: list[bytes], dialog: bytes, body: bytes):
        n = len(keys)
        self.store.note_source(req.source)
        paths = self.store.counters.get_paths
        paths["lent" if req.region == LENT else "inline" if req.region == INLINE else
              "session_region" if req.region == SESSION_REGION else "registered_region"] += 1
        if req.offsets is not None:
            if req.region == INLINE:
                raise RequestError(ErrorCode.BAD_REQUEST, "offsets need a region; inline gets are packed by the gateway")
            region = sess.region(req.region)
            if req.capacities is None or len(req.capacities) != n or len(req.offsets) != n:
                raise RequestError(ErrorCode.BAD_REQUEST, "a get into a region needs one offset and one capacity per key")
            dests = [region.slice(o, c) for o, c in zip(req.offsets, req.capacities)]
            sizes, needed = await self.store.get([GetItem(k, dialog, d) for k, d in zip(keys, dests)], sess.local,
                                                 source=req.source)
            return GetReply(sizes=sizes, needed=needed if TOO_SMALL in sizes else None), None
        if req.region == LENT:
            return await self._get_lent(sess, req, keys, dialog)
        return await self._get_packed(sess, req, keys, dialog)

    async def _sizes(self, sess: Session, keys: list[bytes], dialog: bytes, source: str | None) -> list[int]:
        """Each key's payload size, or MISS: known to the tiers, else asked of the cards (a read into an
        empty buffer tells it) and of the peers ``source`` chooses."""
        hints = self.store.size_hints(keys, dialog)
        unknown = [i for i, h in enumerate(hints) if h is None]
        if unknown:
            probe, needed = await self.store.get([GetItem(keys[i], dialog, _EMPTY) for i in unknown], sess.local,
                                                 source=source)
            for i, s, need in zip(unknown, probe, needed):
                hints[i] = need if s == TOO_SMALL else (s if s >= 0 else MISS)
        return hints  # type: ignore[return-value]

    async def _get_packed(self, sess: Session, req: Get, keys: list[bytes], dialog: bytes):
        """Place results one after another: from offset 0 of a region, or in the reply body.

        In the reply body (``INLINE``), what the RAM tier holds is sent from
        its own pages (``TieredStore.lend_ram``, a ``LentBody``); only the
        objects read from cards are copied, into a buffer of ours.
        """
        hints = await self._sizes(sess, keys, dialog, req.source)
        inline = req.region == INLINE
        room = _LendRoom(self.store, self.cfg.max_frame_bytes - (1 << 20)) if inline else None
        region_size = 0 if inline else sess.region(req.region).size
        offsets = [0] * len(keys)
        sizes = [MISS] * len(keys)
        wanted, cursor = [], 0
        for i, h in enumerate(hints):
            if h == MISS:
                continue
            # inline: the first object always goes, even past the limit (it came in one frame, so one
            # frame carries it back); otherwise an object near max_frame_bytes could never be read
            full = not room.take(keys[i], h, not wanted) if room is not None else cursor + h > region_size
            if full:
                for j in range(i, len(keys)):
                    if hints[j] != MISS:
                        sizes[j] = NOT_DONE
                break
            offsets[i] = cursor
            wanted.append(i)
            cursor += h
        if not inline:
            view = sess.region(req.region).view
            got, _needed = await self.store.get([GetItem(keys[i], dialog, view[offsets[i] : offsets[i] + hints[i]])
                                                 for i in wanted], sess.local, source=req.source)
            for i, s in zip(wanted, got):
                sizes[i] = NOT_DONE if s == TOO_SMALL else s  # changed size under us: ask again
            return GetReply(sizes=sizes, offsets=offsets), None
        lent = await self._lend(sess, keys, dialog, wanted, hints, cursor, source=req.source)
        for i, s in zip(wanted, lent.sizes):
            sizes[i] = s
        return GetReply(sizes=sizes, offsets=offsets), lent.body

    async def _lend(self, sess: Session, keys: list[bytes], dialog: bytes, wanted: list[int], hints: list,
                    nbytes: int, files: int = 0, source: str | None = None) -> "_Lent":
        """The objects ``wanted`` (``hints``: their sizes, ``nbytes`` in all) as a ``LentBody`` in key order:
        the RAM tier's own pages where it holds them, up to ``files`` card objects as their open files
        (``TieredStore.lend_files``), a buffer of ours filled by the cards for the rest.  Holds ``nbytes``
        of the session's inline share until the body is given back."""
        await sess.inline.acquire(nbytes)
        loans: list[RamLoan | None] = []
        opened: list = []
        try:
            loans = self.store.lend_ram([keys[i] for i in wanted], [hints[i] for i in wanted])
            from_cards = [i for i, loan in zip(wanted, loans) if loan is None]
            if files and from_cards:
                asked = from_cards[:files]
                opened = await self.store.lend_files([keys[i] for i in asked], dialog, [hints[i] for i in asked],
                                                     sess.local)
                as_file = {i: f for i, f in zip(asked, opened) if f is not None}
                opened = list(as_file.values())
                from_cards = [i for i in from_cards if i not in as_file]
            else:
                as_file = {}
            buffers = self.store.reply_buffers.take([hints[i] for i in from_cards])
            dest = dict(zip(from_cards, buffers))
            got, _needed = await self.store.get([GetItem(keys[i], dialog, dest[i]) for i in from_cards], sess.local,
                                                own=True, source=source)
        except BaseException:
            # Not given back (a cancelled get's copies may still be landing in them): dropped.
            self.store.return_ram(loans)
            self.store.return_files(opened)
            await sess.inline.release(nbytes)
            raise
        read = dict(zip(from_cards, got))
        sizes: list[int] = []
        segments: list[memoryview] = []
        for i, loan in zip(wanted, loans):
            if i in as_file:
                sizes.append(as_file[i].header.payload_len)
            elif loan is None:
                s = read[i]
                sizes.append(NOT_DONE if s == TOO_SMALL else s)  # changed size under us: ask again
                segments.append(dest[i])
            else:
                sizes.append(loan.size)
                segments += loan.views
        return _Lent(sizes, LentBody(segments, nbytes, loans, buffers, opened), as_file)

    async def _get_lent(self, sess: Session, req: Get, keys: list[bytes], dialog: bytes):
        """A get the client reads out of our memory (``LENT``): one copy, made by the client
        (``kvgate.client.crossmem``).  Each hit is lent whole; the reply says where its bytes are: pages of ours,
        or (``Get.files``) a card object's file, open, which the client reads itself."""
        if not sess.lends:
            raise RequestError(ErrorCode.BAD_REQUEST, "this session may not read the gateway's memory (a TCP "
                               "session, another user's, or cross_memory_gets is off): get into its region")
        n = len(keys)
        if req.capacities is None or len(req.capacities) != n:
            raise RequestError(ErrorCode.BAD_REQUEST, "a lent get needs one capacity per key")
        if len(sess.loans) >= MAX_LOANS:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{len(sess.loans)} loans not given back: give them back "
                               "(GiveBack) before the next lent get")
        sizes = [MISS] * n
        needed = [0] * n
        hints = await self._sizes(sess, keys, dialog, req.source)
        wanted, total = [], 0
        room = _LendRoom(self.store, self.cfg.max_frame_bytes)
        for i, h in enumerate(hints):
            if h == MISS:
                continue
            if h > req.capacities[i]:
                sizes[i], needed[i] = TOO_SMALL, h
                continue
            if not room.take(keys[i], h, not wanted):
                sizes[i] = NOT_DONE
                continue
            wanted.append(i)
            total += h
        files = max(0, FILES_PER_SESSION - sess.files_lent) if req.files else 0
        lent = await self._lend(sess, keys, dialog, wanted, hints, total, files, req.source)
        segments: list[int] = []
        lent_files: list[int] = []
        views = iter(lent.body.segments)
        for i, s, loan in zip(wanted, lent.sizes, lent.body.loans):
            sizes[i] = s
            f = lent.files.get(i)
            if f is not None:
                lent_files += (i, f.fd, f.header.payload_offset, f.header.payload_hash)
                continue
            parts = len(loan.views) if loan is not None else 1
            for _ in range(parts):
                v = next(views)
                if s >= 0:
                    addr = np.frombuffer(v, np.uint8).ctypes.data if v.nbytes else 0
                    segments += (addr, min(v.nbytes, s))
                    s -= min(v.nbytes, s)
        loan_id = 0
        if wanted:  # a get that found nothing holds nothing: no loan to give back
            self._loans += 1
            loan_id = self._loans
            sess.loans[loan_id] = lent.body
            sess.files_lent += len(lent.body.files)
        return GetReply(sizes=sizes, needed=needed if TOO_SMALL in sizes else None, segments=segments,
                        files=lent_files or None, loan=loan_id), None

    async def _give_back(self, sess: Session, req: GiveBack, body: bytes) -> tuple[CountReply, None]:
        lent = sess.loans.pop(req.loan, None)
        if lent is None:
            return CountReply(count=0), None
        lent.give_back(self.store)
        sess.files_lent -= len(lent.files)
        await sess.inline.release(lent.nbytes)
        return CountReply(count=1), None

    # ---- over HTTP ------------------------------------------------------------------------

    async def prewarm_by_name(self, namespace: str, keys: list[bytes], dialog: bytes | None) -> int:
        """Prewarm for the HTTP endpoint (keys are the client's, not yet namespaced)."""
        ns = encode_namespace(namespace)
        return await self.store.prewarm([full_key(ns, check_key(k)) for k in keys], dialog_digest(dialog))
