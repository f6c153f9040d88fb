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
import time
from dataclasses import dataclass, field

from kvgate import __version__

from kvgate.gateway import lending
from kvgate.cards.base import CachedObjectFile
from kvgate.config import Config
from kvgate.gateway.connection import Body, Connection, body_length
from kvgate.gateway.kvevents import KeyForms
from kvgate.gateway.peers import PeerLookups, is_loopback_peer, trusted_uid
from kvgate.gateway.shm import Region, RegionError, could_stop_gateway, create_session_region
from kvgate.keys import BadKey, NamespaceBook, encode_namespace, parse_namespace_inputs
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
REFUSAL_LOG_S = 10.0  # refused hellos are logged at most once per this long


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
    who: str = ""  # the peer, as the log names it: "pid 12 uid 0" or "127.0.0.1:40000 uid 0", and how it got in
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

    def __init__(self, cfg: Config, store: TieredStore, pool: IoPool, namespaces: NamespaceBook | None = None):
        self.cfg = cfg
        self.store = store
        # what each namespace stands for, as its engine's hello said (Hello.namespace_inputs): shown to peers
        self.namespaces = namespaces if namespaces is not None else NamespaceBook()
        self.pool = pool
        self.token: str | None = None  # the token of auth_token_file (read at start): lets any peer in
        # Whether the kernel tells the uid of a loopback TCP peer here (``peers.loopback_uids_visible``, at start)
        self.loopback_uids = False
        self.peers = PeerLookups()
        self._refusal_logged = -REFUSAL_LOG_S
        self._refusals_unlogged = 0
        self.engine: EngineClaim | None = None
        self.by_id: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._releasing: set[asyncio.Task] = set()
        self.key_forms = KeyForms()  # each namespace's Hello.block_keys / block_size, for the KV events

    def __len__(self) -> int:
        return len(self.by_id)

    async def hello(self, req: Hello, conn: Connection, local: bool, pid: int | None, uid: int | None,
                    inline: InlineShare, deadline: float | None, tcp: tuple | None = None) -> Session | None:
        """The session of an accepted hello (replied to by ``deadline``), or None (refused, and answered why).

        ``tcp``: for a TCP connection, (address family, our address, the peer's address).
        """
        async def refuse(code: str, message: str) -> None:
            await reply(conn, Error(id=req.id, code=code, message=message), deadline=deadline)

        if req.protocol != VERSION:
            await refuse(ErrorCode.BAD_VERSION, f"client speaks protocol {req.protocol}, gateway {VERSION}")
            return None
        who, why_not = await self.admit(req, local, pid, uid, tcp)
        if why_not is not None:
            self._log_refusal(who, local, req, why_not)
            await refuse(ErrorCode.NOT_AUTHORIZED, why_not)
            return None
        sess = Session(next(self._ids), local, pid if local else None, uid, inline, role=req.role, who=who)
        if req.role == "engine":
            try:
                sess.namespace = encode_namespace(req.namespace)
            except BadKey as e:
                await refuse(ErrorCode.BAD_REQUEST, str(e))
                return None
            try:
                if req.block_keys or req.block_size:
                    self.key_forms.declare(sess.namespace, req.block_keys, req.block_size)
                if req.namespace_inputs:
                    self.namespaces.declare(req.namespace, parse_namespace_inputs(req.namespace_inputs))
            except ValueError as e:
                await refuse(ErrorCode.BAD_REQUEST, f"hello: {e}")
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
        beside = local and could_stop_gateway(pid, uid)  # our user or root, in our PID namespace
        sess.in_place = beside and self.cfg.in_place_regions
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
        # Only our own user: what a process of it can read of ours it could read anyway (kvgate.gateway.lending);
        # and only in our PID namespace, where the pid the hello names is ours (elsewhere it names another
        # process, or none, and a read of that one's memory would hand the client its bytes).
        sess.lends = beside and self.cfg.cross_memory_gets and lending.supported and uid == os.geteuid()
        shared = self.store.shared_ram() if sess.lends else None
        arena = list(shared) if shared is not None else None
        self.by_id[sess.id] = sess
        await reply(conn, HelloReply(
            id=req.id, session=sess.id, gateway_version=__version__, shm_path=shm_path, shm_size=shm_size,
            max_frame_bytes=self.cfg.max_frame_bytes, fingerprint=self.store.fingerprint,
            placement=self.cfg.key_placement, pid=os.getpid(), lends=sess.lends, arena=arena,
        ), deadline=deadline)
        return sess

    async def admit(self, req: Hello, local: bool, pid: int | None, uid: int | None,
                    tcp: tuple | None) -> tuple[str, str | None]:
        """Who the peer is (for the log), and why its hello is refused (None: let in).

        A hello that presents a token must present the gateway's (a wrong one is refused, whoever sends
        it).  Without one, the gateway's own user and root are let in where the kernel tells the peer's
        uid: on the Unix socket (``SO_PEERCRED``; the socket's mode alone would let its group in) and over
        loopback TCP (``/proc/net/tcp``, looked up in the ``PeerLookups`` thread).  Everyone else needs
        the token.
        """
        if local:
            who = f"pid {pid} uid {uid}"
        else:
            theirs = tcp[2] if tcp is not None else ("?", 0)
            who = f"{theirs[0]}:{theirs[1]}"
        if req.token is not None and self.token is not None:
            if hmac.compare_digest(req.token.encode(), self.token.encode()):
                return f"{who} with the token", None
            return who, "the token presented is not this gateway's (auth_token_file): check the client's token"
        me = os.geteuid()
        if not local and tcp is not None and self.loopback_uids and is_loopback_peer(tcp[2][0]):
            uid = await self.peers.uid(*tcp)
            who += f" uid {uid}" if uid is not None else " (uid unknown)"
        elif not local:
            uid = None
        if trusted_uid(uid):
            return who, None
        if self.token is None:
            fix = ("set auth_token_file on the gateway and give this client its token (Client.connect(token=...), "
                   "kvgate.token_file, the CLI's --token-file)")
        else:
            fix = ("give this client the token of the gateway's auth_token_file (Client.connect(token=...), "
                   "kvgate.token_file, the CLI's --token-file)")
        if uid is not None:
            whose = f"uid {uid}"
        elif self.loopback_uids and tcp is not None and is_loopback_peer(tcp[2][0]):
            whose = "a loopback TCP peer whose socket the kernel does not show"
        else:
            whose = "a TCP peer whose uid the kernel does not tell"
        return who, (f"{whose} is neither the gateway's user (uid {me}) nor root, the only users let in without "
                     f"a token: {fix}, or run it as uid {me}")

    def _log_refusal(self, who: str, local: bool, req: Hello, why: str) -> None:
        """A refused hello is a warning, at most one per ``REFUSAL_LOG_S`` (a peer that retries in a loop
        does not fill the log); the next one says how many were not logged."""
        now = time.monotonic()
        if now - self._refusal_logged < REFUSAL_LOG_S:
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more refused since the last line)" if self._refusals_unlogged else ""
        self._refusal_logged, self._refusals_unlogged = now, 0
        log.warning("hello refused: %s (%s, role %s, namespace %r): %s%s", who, "Unix socket" if local else "TCP",
                    req.role, req.namespace, why, more)

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
