"""Sessions: what one client connection's session holds, how its hello opens it and how it ends.

A session holds its namespace, its role, its part of the listener's inline
byte budget, the shared-memory regions mapped for it, and (for an engine)
a share in the gateway's one engine claim; when it ends its holds lapse and
its regions are unmapped.

Everything here runs on the event loop: a connection's task (``Listeners``)
opens a session with ``Sessions.hello`` and closes it when the connection
ends; ``Gateway.stop`` closes the rest.  Nothing may block the loop: a
session region is created in the ``IoPool``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
from dataclasses import dataclass, field

from kvgate import __version__, crossmem
from kvgate.cards.base import CachedObjectFile
from kvgate.config import Config
from kvgate.gateway.connection import Body, Connection, body_length
from kvgate.gateway.shm import Region, RegionError, could_stop_gateway, create_session_region
from kvgate.keys import BadKey, encode_namespace
from kvgate.protocol import (
    KIND_REPLY,
    SESSION_REGION,
    VERSION,
    Error,
    ErrorCode,
    Hello,
    HelloReply,
    RequestError,
    encode_frame,
)
from kvgate.tiers.io import IoPool
from kvgate.tiers.store import RamLoan, TieredStore

log = logging.getLogger("kvgate.gateway")


async def reply(conn: Connection, msg, body: Body | None = None, deadline: float | None = None) -> None:
    """Send a reply frame; the body (a buffer, or a list of them) goes out from its buffers, uncopied."""
    await conn.send(encode_frame(msg, body_length(body), KIND_REPLY), body, deadline)


class InlineBudget:
    """Bounds the inline bytes (bodies, headers over the staging buffer, inline get replies) that the
    sessions of one listener hold at once: ``limit`` in all, ``share`` per connection, so one connection
    never holds all of it.  A taker that holds nothing may always take (one frame of any allowed size
    must get through); see ``InlineShare``.

    Used on the event loop by the connection tasks of one listener and their request tasks; a taker
    waits here, never the loop."""

    def __init__(self, limit: int, share: int):
        self.limit = limit
        self.share = share
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, taker: "InlineShare", n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: (self.used + n <= self.limit or self.used == 0)
                                      and (taker.held + n <= self.share or taker.held == 0))
            self.used += n
            taker.held += n

    async def release(self, taker: "InlineShare", n: int) -> None:
        async with self._cond:
            self.used -= n
            taker.held -= n
            self._cond.notify_all()


class InlineShare:
    """One session's part of its listener's ``InlineBudget``."""

    def __init__(self, budget: InlineBudget):
        self.budget = budget
        self.held = 0

    async def acquire(self, n: int) -> None:
        if n:
            await self.budget.acquire(self, n)

    async def release(self, n: int) -> None:
        if n:
            await self.budget.release(self, n)


@dataclass(frozen=True)
class LentBody:
    """Bytes a reply lends from several buffers, RAM-tier pages among them: sent as a reply body (TCP,
    inline), or read by the client out of our memory (a ``LENT`` get).  Once done with, ``loans`` go back
    to the store and ``nbytes`` to the session's inline share."""

    segments: list[memoryview]
    nbytes: int
    loans: list[RamLoan | None]
    buffers: list[memoryview] = field(default_factory=list)  # ours, filled by card reads: back with the loans
    files: list[CachedObjectFile] = field(default_factory=list)  # card objects lent open (LENT only)

    def give_back(self, store: TieredStore) -> None:
        """What it holds of the store's back to it (not the inline share, which the caller releases)."""
        store.return_ram(self.loans, self.buffers)
        store.return_files(self.files)


@dataclass
class Session:
    id: int
    local: bool
    pid: int | None
    uid: int | None
    inline: InlineShare  # this connection's part of its listener's inline byte budget
    role: str = ""
    namespace: bytes = b""
    engine_id: str = ""
    regions: dict[int, Region] = field(default_factory=dict)
    lends: bool = False  # may read lent objects out of our memory (HelloReply.lends)
    # Its regions are used in place (kvgate.gateway.shm): it could stop the gateway anyway.
    in_place: bool = False
    loans: dict[int, LentBody] = field(default_factory=dict)  # lent, not given back yet, by loan id
    files_lent: int = 0  # open files among its loans

    def region(self, rid: int) -> Region:
        """Region ``rid`` for a request about to use it; an in-place one's file checked first
        (``Region.check_size``: ``RegionError`` when its client shrank it)."""
        r = self.regions.get(rid)
        if r is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"no region {rid} in this session")
        r.check_size()
        return r


@dataclass
class EngineClaim:
    engine_id: str
    pid: int
    connections: int = 0


class Sessions:
    """The open sessions, and the one engine they may belong to.

    Called on the event loop: ``hello`` from a connection's task when its hello arrives, ``close`` when
    that connection ends, ``close_all`` from ``Gateway.stop``.  ``hello`` waits on the pool (a session
    region) and on the peer (its reply by the hello deadline), never blocks the loop.
    """

    def __init__(self, cfg: Config, store: TieredStore, pool: IoPool):
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.token: str | None = None  # what a TCP peer's hello must present (auth_token_file, read at start)
        self.engine: EngineClaim | None = None
        self.by_id: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._releasing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.by_id)

    async def hello(self, req: Hello, conn: Connection, local: bool, pid: int | None, uid: int | None,
                    inline: InlineShare, deadline: float | None) -> Session | None:
        """The session of an accepted hello (replied to by ``deadline``), or None (refused, and answered why)."""
        async def refuse(code: str, message: str) -> None:
            await reply(conn, Error(id=req.id, code=code, message=message), deadline=deadline)

        if req.protocol != VERSION:
            await refuse(ErrorCode.BAD_VERSION, f"client speaks protocol {req.protocol}, gateway {VERSION}")
            return None
        if not local and self.token is not None:
            if req.token is None or not hmac.compare_digest(req.token.encode(), self.token.encode()):
                await refuse(ErrorCode.NOT_AUTHORIZED, "a valid token is required on this listener")
                return None
        sess = Session(next(self._ids), local, pid if local else None, uid, inline, role=req.role)
        if req.role == "engine":
            try:
                sess.namespace = encode_namespace(req.namespace)
            except BadKey as e:
                await refuse(ErrorCode.BAD_REQUEST, str(e))
                return None
            if self.cfg.refuse_unsalted and not req.salted:
                await refuse(ErrorCode.UNSALTED_REFUSED, "this gateway refuses sessions without a tenant salt")
                return None
            engine_id = req.engine_id or f"pid:{pid or req.pid}"
            if self.engine is not None and self.engine.engine_id != engine_id:
                await refuse(ErrorCode.ENGINE_BUSY,
                             f"this gateway serves engine {self.engine.engine_id!r} (pid {self.engine.pid}); "
                             "one engine per gateway: start another gateway for this engine")
                return None
            if self.engine is None:
                self.engine = EngineClaim(engine_id, pid or req.pid)
                log.info("engine %r (pid %s) connected, namespace %r", engine_id, pid or req.pid, req.namespace)
            self.engine.connections += 1
            sess.engine_id = engine_id
        sess.in_place = local and self.cfg.in_place_regions and could_stop_gateway(pid, uid)
        shm_path, shm_size = None, 0
        if local and req.want_shm and req.role == "engine":
            try:
                region = await self.pool.run(create_session_region, str(sess.id),
                                             self.cfg.shared_memory_size, not sess.in_place, sess.id, pid)
            except RegionError as e:
                self._release_engine(sess)
                await refuse(ErrorCode.INTERNAL, str(e))
                return None
            sess.regions[SESSION_REGION] = region
            shm_path, shm_size = region.path, region.size
        # Only our own user: what a process of it can read of ours it could read anyway (kvgate.crossmem).
        sess.lends = local and self.cfg.cross_memory_gets and crossmem.supported and uid == os.geteuid()
        self.by_id[sess.id] = sess
        await reply(conn, HelloReply(
            id=req.id, session=sess.id, gateway_version=__version__, shm_path=shm_path, shm_size=shm_size,
            max_frame_bytes=self.cfg.max_frame_bytes, fingerprint=self.store.long.fingerprint,
            placement=self.cfg.key_placement, pid=os.getpid(), lends=sess.lends,
        ), deadline=deadline)
        return sess

    def _release_engine(self, sess: Session) -> None:
        if sess.engine_id and self.engine is not None and self.engine.engine_id == sess.engine_id:
            self.engine.connections -= 1
            if self.engine.connections <= 0:
                log.info("engine %r disconnected", self.engine.engine_id)
                self.engine = None
        sess.engine_id = ""

    def close(self, sess: Session) -> None:
        for lent in sess.loans.values():
            lent.give_back(self.store)
            # its share goes with the connection, but the listener's budget must be told
            task = asyncio.get_running_loop().create_task(sess.inline.release(lent.nbytes))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        sess.loans.clear()
        self.by_id.pop(sess.id, None)
        self.store.holds.release_all(sess.id)
        self._release_engine(sess)
        for region in sess.regions.values():
            region.close()
        sess.regions.clear()

    def close_all(self) -> None:
        for sess in list(self.by_id.values()):
            self.close(sess)
