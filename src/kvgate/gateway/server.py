"""The gateway: listeners, sessions, and the operations clients ask for.

One asyncio event loop owns all state.  It only parses frames, checks
requests and does bookkeeping; bytes move in ``IoPool`` threads (see
``TieredStore``).  Each request of a connection runs as its own task, so a
client may pipeline, and a slow card read never holds up a lookup.

Nothing a client sends can stop the gateway: a broken frame closes that
connection, a wrong request gets an ``Error`` reply, and any unexpected
exception in a handler is logged and answered with ``INTERNAL``.

Nor can a peer hold what others need.  Until its hello is accepted a
connection holds only its staging buffer: frames without a body, headers
that fit the staging buffer, ``hello_timeout`` to be accepted, and at most
``PENDING_PER_PEER`` such connections per peer (a TCP source address, a
local process).  Each listener (the Unix socket; all TCP listeners) has its
own ``max_connections`` and its own inline byte budget, so TCP peers never
lock out a local engine.  Once announced, a header and body must arrive
within ``frame_timeout`` (plus their size at ``FRAME_MIN_RATE``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from kvgate import __version__
from kvgate.cards import CardInUse, ObjectMeta
from kvgate.config import Config
from kvgate.gateway import status as status_mod
from kvgate.gateway.headsync import HeadSync
from kvgate.gateway.connection import STAGE_BYTES, Connection, accept_loop, tcp_listeners, unix_listener
from kvgate.gateway.shm import Region, RegionError, create_session_region, map_client_region, reap_dead_regions
from kvgate.heads import SharedHeads
from kvgate.keys import MARK_KEYS, MAX_KEY_BYTES, BadKey, check_key, dialog_digest, encode_namespace, full_key
from kvgate.memcopy import MemoryFault
from kvgate.protocol import (
    INLINE,
    KIND_REPLY,
    MAX_HEADER_BYTES,
    MISS,
    NOT_DONE,
    PREAMBLE_SIZE,
    SESSION_REGION,
    TOO_SMALL,
    VERSION,
    Clean,
    CountReply,
    Delete,
    Error,
    ErrorCode,
    Exists,
    ExistsReply,
    FrameError,
    FrameTooLarge,
    Get,
    GetReply,
    Hello,
    HelloReply,
    Hold,
    Lookup,
    Mark,
    MarkReply,
    Prewarm,
    Put,
    PutReply,
    RegionReply,
    RegisterRegion,
    Release,
    RequestError,
    Stats,
    StatsReply,
    decode_request,
    encode_frame,
    parse_preamble,
)
from kvgate.tiers.io import IoPool, realtime_permitted
from kvgate.tiers.cardset import LayoutMismatch
from kvgate.types import Retention
from kvgate.tiers.store import GetItem, PutItem, TieredStore

log = logging.getLogger("kvgate.gateway")

MAX_KEYS_PER_REQUEST = 65536
MAX_INFLIGHT_PER_CONNECTION = 64
# Connections one peer may have waiting for their hello on a listener: a client pool connecting at once
# gets in, one host or process holding idle connections does not fill the listener.
PENDING_PER_PEER = 16
# A refused connection is answered to its hello (with the hello's id, so a client reads a clear refusal);
# a peer that sends nothing gets the refusal after this long.  At most MAX_REFUSING are waited on at once,
# the rest are answered at once.
REFUSAL_WAIT_S = 1.0
MAX_REFUSING = 64
FRAME_MIN_RATE = 4 << 20  # bytes/s an announced header and body must at least arrive at, beyond frame_timeout
_EMPTY = memoryview(bytearray(0))
_PEERCRED = struct.Struct("3i")


class StartupError(RuntimeError):
    """The gateway cannot start as configured; the message says why."""


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

    def region(self, rid: int) -> Region:
        r = self.regions.get(rid)
        if r is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"no region {rid} in this session")
        return r


@dataclass
class EngineClaim:
    engine_id: str
    pid: int
    connections: int = 0


class InlineBudget:
    """Bounds the inline bytes (bodies, headers over the staging buffer, inline get replies) that the
    sessions of one listener hold at once: ``limit`` in all, ``share`` per connection, so one connection
    never holds all of it.  A taker that holds nothing may always take (one frame of any allowed size
    must get through); see ``InlineShare``."""

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


@dataclass
class ListenerLimits:
    """Connections of one listener (the Unix socket, or all TCP listeners): open ones, and per peer those
    still waiting for their hello."""

    name: str
    limit: int
    budget: InlineBudget
    open: int = 0
    pending: dict[Any, int] = field(default_factory=dict)

    def refusal(self, peer: Any) -> str | None:
        """Why a new connection from ``peer`` is refused, or None."""
        if self.open >= self.limit:
            return f"the {self.name} serves at most {self.limit} connections (max_connections); try again later"
        if self.pending.get(peer, 0) >= PENDING_PER_PEER:
            return (f"{peer} already has {PENDING_PER_PEER} connections to the {self.name} waiting for their "
                    "hello; say hello on those first")
        return None

    def admit(self, peer: Any) -> None:
        self.open += 1
        self.pending[peer] = self.pending.get(peer, 0) + 1

    def done_waiting(self, peer: Any) -> None:
        """A connection of the peer had its hello accepted, or left without: it no longer waits."""
        n = self.pending[peer] - 1
        if n:
            self.pending[peer] = n
        else:
            del self.pending[peer]

    def leave(self) -> None:
        self.open -= 1


class Gateway:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.pool = IoPool(cfg.thread_pool_size, realtime=self._realtime_reads(cfg))
        self.store = TieredStore(cfg, self.pool)
        self.heads = SharedHeads()
        self.head_sync = HeadSync(self.heads, self.store.long)
        self.engine: EngineClaim | None = None
        self.sessions: dict[int, Session] = {}
        self.started_at = time.time()
        self.token: str | None = None
        self.limits: dict[bool, ListenerLimits] = {}  # by local: the Unix socket (True), the TCP listeners
        self.http: status_mod.HttpStatus | None = None
        self.tcp_port: int | None = None
        self._listeners: list[socket.socket] = []
        self._session_ids = itertools.count(1)
        self._refusing = 0
        self.refused_connections = 0
        self._tasks: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self._socket_owned = False  # only a gateway that bound the socket may remove it

    @staticmethod
    def _realtime_reads(cfg: Config) -> bool:
        if cfg.read_priority != "realtime":
            return False
        if realtime_permitted():
            return True
        log.info("read_priority is realtime but this process may not use SCHED_RR (it needs CAP_SYS_NICE "
                 "or an RLIMIT_RTPRIO of 1): reads run at normal priority")
        return False

    # ---- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        # a listener's sessions hold at most two frames' worth of inline bytes, one connection one frame's worth
        for local, name in ((True, "Unix socket"), (False, "TCP listener")):
            budget = InlineBudget(2 * cfg.max_frame_bytes, cfg.max_frame_bytes)
            self.limits[local] = ListenerLimits(name, cfg.max_connections, budget)
        self._check_bind()
        await self._check_socket_free(cfg.socket_path)
        reaped = await self.pool.run(reap_dead_regions)
        if reaped:
            log.info("removed %d shared-memory regions left by gateways that died", reaped)
        try:
            await self.store.start()
        except (LayoutMismatch, CardInUse) as e:
            raise StartupError(str(e)) from None
        await self.head_sync.sync_once()  # marks as before a restart, from the first request on
        if len(self.heads):
            log.info("shared heads: %d blocks known from the cards", len(self.heads))
        self._spawn(self.head_sync.run())
        os.makedirs(os.path.dirname(os.path.abspath(cfg.socket_path)), exist_ok=True)
        try:
            unix = unix_listener(cfg.socket_path)
        except OSError as e:
            raise StartupError(f"config key 'socket': cannot listen on {cfg.socket_path}: {e.strerror or e}") from None
        self._socket_owned = True
        os.chmod(cfg.socket_path, 0o660)
        self._listen(unix, local=True)
        where = [f"socket {cfg.socket_path}"]
        if cfg.port:
            try:
                tcp = await tcp_listeners(cfg.bind_address, cfg.port)
            except OSError as e:
                raise StartupError(f"config key 'port': cannot listen on {cfg.bind_address}:{cfg.port}: {e.strerror}") from None
            self.tcp_port = tcp[0].getsockname()[1]
            for sock in tcp:
                self._listen(sock, local=False)
            where.append(f"tcp {cfg.bind_address}:{self.tcp_port}")
        if cfg.metrics_port:
            try:
                self.http = status_mod.HttpStatus(
                    self.snapshot, self.prewarm, asyncio.get_running_loop(), cfg.metrics_bind_address,
                    cfg.metrics_port, token=None if _is_loopback(cfg.metrics_bind_address) else self.token)
            except OSError as e:
                raise StartupError(
                    f"config key 'metrics_port': cannot serve /metrics on {cfg.metrics_bind_address}:{cfg.metrics_port}: "
                    f"{e.strerror}") from None
            self.http.start()
            where.append(f"metrics http://{cfg.metrics_bind_address}:{self.http.port}/metrics")
        if cfg.status_file:
            self._spawn(self._status_file_loop())
        ram_mib = cfg.max_bytes / (1 << 20)
        cards = ", ".join(f"{cs.where} ({cs.serial or 'unavailable'})" for cs in self.store.card_states())
        log.info("kvgate %s ready: %s; RAM tier %.0f MiB; reads at %s priority; cards: %s", __version__,
                 "; ".join(where), ram_mib, "real-time" if self.pool.realtime else "normal", cards)

    def _check_bind(self) -> None:
        cfg = self.cfg
        if cfg.auth_token_file:
            try:
                with open(cfg.auth_token_file, encoding="utf-8") as f:
                    self.token = f.read().strip()
            except OSError as e:
                raise StartupError(
                    f"config key 'auth_token_file': cannot read {cfg.auth_token_file}: {e.strerror}") from None
            if not self.token:
                raise StartupError(f"config key 'auth_token_file': {cfg.auth_token_file} is empty")
        if cfg.port and not _is_loopback(cfg.bind_address) and not self.token:
            raise StartupError(
                f"config key 'bind_address': {cfg.bind_address} is not loopback; set auth_token_file so "
                "clients on other hosts must present a token"
            )
        if cfg.metrics_port and not _is_loopback(cfg.metrics_bind_address) and not self.token:
            raise StartupError(
                f"config key 'metrics_bind_address': {cfg.metrics_bind_address} is not loopback; set auth_token_file "
                "so HTTP clients on other hosts must present it (Authorization: Bearer <token>; /healthz needs none)"
            )

    async def _check_socket_free(self, path: str) -> None:
        if not os.path.exists(path):
            return
        try:
            _r, w = await asyncio.wait_for(asyncio.open_unix_connection(path), 1.0)
        except (OSError, asyncio.TimeoutError):
            os.unlink(path)  # left behind by a gateway that died
            return
        w.close()
        raise StartupError(f"another gateway is already listening on {path}")

    async def serve_until_stopped(self) -> None:
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    async def stop(self) -> None:
        # the accept loops and every connection are tasks too: each connection cancels its requests, closes
        # its session and its socket
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._listeners:
            s.close()
        if self.http:
            await asyncio.get_running_loop().run_in_executor(None, self.http.stop)
        await self.store.stop()
        for sess in list(self.sessions.values()):
            self._close_session(sess)
        if self._socket_owned:  # a gateway refused at start must not remove a running one's socket
            try:
                os.unlink(self.cfg.socket_path)
            except FileNotFoundError:
                pass
        self.pool.shutdown()
        log.info("kvgate stopped")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _status_file_loop(self) -> None:
        path = self.cfg.status_file
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        while True:
            text = status_mod.render(self.snapshot())
            try:
                await self.pool.run(status_mod.write_status_file, path, text)
            except OSError as e:
                log.warning("cannot write status file %s: %s", path, e)
            await asyncio.sleep(1.0)

    # ---- connections ------------------------------------------------------------------

    def _listen(self, sock: socket.socket, local: bool) -> None:
        self._listeners.append(sock)

        def on_connection(conn: socket.socket) -> None:
            self._spawn(self._on_connection(conn, local))

        self._spawn(accept_loop(sock, on_connection))

    async def _on_connection(self, sock: socket.socket, local: bool) -> None:
        try:
            pid = uid = None
            if local:
                pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                peer: Any = f"process {pid}"
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = sock.getpeername()[0]
        except OSError:  # the peer is already gone
            sock.close()
            return
        limits = self.limits[local]
        conn = Connection(sock)
        why = limits.refusal(peer)
        if why is not None:
            await self._refuse_connection(conn, why)
            return
        limits.admit(peer)
        try:
            await self._serve(conn, limits, peer, local=local, pid=pid, uid=uid)
        finally:
            limits.leave()

    async def _refuse_connection(self, conn: Connection, why: str) -> None:
        """Answer TOO_MANY_CONNECTIONS to the connection's first request (its hello), with its id, and close."""
        self.refused_connections += 1
        rid = 0
        try:
            if self._refusing < MAX_REFUSING:
                self._refusing += 1
                try:
                    deadline = asyncio.get_running_loop().time() + REFUSAL_WAIT_S
                    pre = await conn.readexactly(PREAMBLE_SIZE, deadline)
                    _kind, hlen, blen = parse_preamble(pre, STAGE_BYTES)
                    rid = _request_id(await conn.readexactly(hlen, deadline))
                except (FrameError, asyncio.IncompleteReadError, OSError):
                    pass  # TimeoutError included: refused with id 0
                finally:
                    self._refusing -= 1
            deadline = asyncio.get_running_loop().time() + REFUSAL_WAIT_S
            await self._reply(conn, Error(id=rid, code=ErrorCode.TOO_MANY_CONNECTIONS, message=why), deadline=deadline)
        finally:
            conn.close()

    async def _serve(self, conn: Connection, limits: ListenerLimits, peer: Any, local: bool, pid: int | None,
                     uid: int | None) -> None:
        """Read requests until the client leaves; each one after hello runs as its own task.

        Before the hello is accepted the connection may send only frames without a body whose header fits
        the staging buffer, and must be accepted within ``hello_timeout``; a peer that does not read what
        it is answered is closed then too.  After it, a body (and a header over the staging buffer) is taken
        from the listener's inline byte budget, within the session's share, before a byte of it is read,
        and is received straight into a ``bytearray`` of its length.
        """
        loop = asyncio.get_running_loop()
        session: Session | None = None
        share = InlineShare(limits.budget)
        hello_deadline: float | None = loop.time() + self.cfg.hello_timeout
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(MAX_INFLIGHT_PER_CONNECTION)
        try:
            while True:
                if conn.send_failed:
                    return
                try:
                    pre = await conn.readexactly(PREAMBLE_SIZE, hello_deadline)
                except TimeoutError:
                    await self._reply(conn, Error(code=ErrorCode.NO_SESSION,
                                                  message=f"no hello within {self.cfg.hello_timeout:g} s "
                                                          "(hello_timeout); closing"), deadline=loop.time() + 1.0)
                    return
                except (asyncio.IncompleteReadError, OSError):
                    return
                try:
                    _kind, hlen, blen = parse_preamble(pre, self.cfg.max_frame_bytes)
                except FrameTooLarge as e:
                    if session is None or e.header_len > min(MAX_HEADER_BYTES, self.cfg.max_frame_bytes):
                        await self._reply(conn, Error(code=e.code, message=str(e)), deadline=hello_deadline)
                        return
                    if not await self._skip_frame(conn, share, e):
                        return
                    continue
                except FrameError as e:
                    await self._reply(conn, Error(code=e.code, message=str(e)), deadline=hello_deadline)
                    return
                if session is None and hlen > STAGE_BYTES:
                    await self._reply(conn, Error(code=ErrorCode.TOO_LARGE, message=(
                        f"a {hlen}-byte header before hello (limit {STAGE_BYTES} until a hello is accepted)")),
                                      deadline=hello_deadline)
                    return
                if session is None and blen:  # answered with its id (the header is in the staging buffer), closed
                    rid = _request_id(await conn.readexactly(hlen, hello_deadline))
                    await self._reply(conn, Error(id=rid, code=ErrorCode.NO_SESSION, message=(
                        f"a frame with a {blen}-byte body before hello: send hello first")), deadline=hello_deadline)
                    return
                # a header over the staging buffer is allocated for its length: it counts as inline bytes too
                big_header = hlen if hlen > STAGE_BYTES else 0
                await share.acquire(big_header + blen)
                deadline = hello_deadline or loop.time() + self.cfg.frame_timeout + (hlen + blen) / FRAME_MIN_RATE
                try:
                    header = await conn.readexactly(hlen, deadline)
                    body: bytes | bytearray = b""
                    if blen:
                        body = bytearray(blen)
                        await conn.readinto(memoryview(body), deadline)
                except TimeoutError:
                    await share.release(big_header + blen)
                    await self._reply(conn, Error(code=ErrorCode.BAD_FRAME,
                                                  message=self._late_frame(hlen, blen, session is None)),
                                      deadline=loop.time() + 1.0)
                    return
                except BaseException:
                    await share.release(big_header + blen)
                    raise
                try:
                    req = decode_request(header)
                except RequestError as e:
                    req = e
                del header  # not held past its budget
                await share.release(big_header)
                if isinstance(req, RequestError):
                    await share.release(blen)
                    await self._reply(conn, Error(id=req.request_id, code=req.code, message=str(req)),
                                      deadline=hello_deadline)
                    continue
                if session is None:
                    if not isinstance(req, Hello):
                        await self._reply(conn, Error(id=req.id, code=ErrorCode.NO_SESSION, message="send hello first"),
                                          deadline=hello_deadline)
                        continue
                    session = await self._hello(req, conn, local, pid, uid, share, hello_deadline)
                    if session is not None:
                        limits.done_waiting(peer)
                        hello_deadline = None
                    continue
                await slots.acquire()
                task = loop.create_task(self._dispatch(session, req, body, blen, conn))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                task.add_done_callback(lambda _t: slots.release())
        except (asyncio.IncompleteReadError, OSError):
            return  # the peer left mid-frame
        except asyncio.CancelledError:
            for t in inflight:  # the gateway is stopping: so are this connection's requests
                t.cancel()
            raise
        except Exception:  # noqa: BLE001 - one connection must never take the gateway down
            log.exception("connection handler failed")
        finally:
            if session is None:
                limits.done_waiting(peer)  # no longer waiting either way
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
            if session is not None:
                self._close_session(session)
            conn.close()

    def _late_frame(self, hlen: int, blen: int, pending: bool) -> str:
        if pending:
            return f"no hello within {self.cfg.hello_timeout:g} s (hello_timeout); closing"
        return (f"a frame of {hlen} + {blen} bytes did not arrive within frame_timeout ({self.cfg.frame_timeout:g} s) "
                f"plus 1 s per {FRAME_MIN_RATE >> 20} MiB; closing")

    async def _skip_frame(self, conn: Connection, share: "InlineShare", e: FrameTooLarge) -> bool:
        """A session's frame over max_frame_bytes: answer TOO_LARGE with its id and drop its body, unallocated.

        -> whether the connection is still in step (False: it is to be closed).
        """
        loop = asyncio.get_running_loop()
        hlen, blen = e.header_len, e.body_len
        big_header = hlen if hlen > STAGE_BYTES else 0
        await share.acquire(big_header)
        deadline = loop.time() + self.cfg.frame_timeout + (hlen + blen) / FRAME_MIN_RATE
        try:
            rid = _request_id(await conn.readexactly(hlen, deadline))
        except TimeoutError:
            await self._reply(conn, Error(code=ErrorCode.BAD_FRAME, message=self._late_frame(hlen, blen, False)),
                              deadline=loop.time() + 1.0)
            return False
        finally:
            await share.release(big_header)
        await self._reply(conn, Error(id=rid, code=ErrorCode.TOO_LARGE, message=str(e)))
        try:
            await conn.discard(blen, deadline)
        except TimeoutError:
            await self._reply(conn, Error(code=ErrorCode.BAD_FRAME, message=self._late_frame(hlen, blen, False)),
                              deadline=loop.time() + 1.0)
            return False
        return True

    async def _reply(self, conn: Connection, msg, body: bytes | bytearray | memoryview | None = None,
                     deadline: float | None = None) -> None:
        """Send a reply frame; the body goes out from its buffer, uncopied."""
        await conn.send(encode_frame(msg, len(body) if body is not None else 0, KIND_REPLY), body, deadline)

    async def _dispatch(self, session: Session, req, body: bytes | bytearray, blen: int, conn: Connection) -> None:
        reply_body = None
        try:
            reply, reply_body = await self._handle(session, req, body)
        except RequestError as e:
            reply = Error(id=req.id, code=e.code, message=str(e))
        except (BadKey, RegionError) as e:
            reply = Error(id=req.id, code=ErrorCode.BAD_REQUEST, message=str(e))
        except MemoryFault as e:  # the client shrank a region it shares with us: its request fails, nothing else
            region = session.regions.get(getattr(req, "region", INLINE)) if session is not None else None
            where = f"region {req.region} ({region.path})" if region is not None else "a shared region"
            reply = Error(id=req.id, code=ErrorCode.BAD_REQUEST,
                          message=f"{where} is shorter than when it was mapped ({e.strerror}): keep region files "
                                  "at their size while the gateway has them")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", type(req).__name__)
            reply = Error(id=req.id, code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
        finally:
            await session.inline.release(blen)
        reply.id = req.id
        try:
            await self._reply(conn, reply, reply_body)
        finally:
            if reply_body is not None:
                await session.inline.release(len(reply_body))

    # ---- sessions -------------------------------------------------------------------

    async def _hello(self, req: Hello, conn: Connection, local: bool, pid: int | None, uid: int | None,
                     inline: InlineShare, deadline: float | None) -> Session | None:
        """The session of an accepted hello (replied to by ``deadline``), or None (refused, and answered why)."""
        async def refuse(code: str, message: str) -> None:
            await self._reply(conn, Error(id=req.id, code=code, message=message), deadline=deadline)

        if req.protocol != VERSION:
            await refuse(ErrorCode.BAD_VERSION, f"client speaks protocol {req.protocol}, gateway {VERSION}")
            return None
        if not local and self.token is not None:
            if req.token is None or not hmac.compare_digest(req.token.encode(), self.token.encode()):
                await refuse(ErrorCode.NOT_AUTHORIZED, "a valid token is required on this listener")
                return None
        sess = Session(next(self._session_ids), local, pid if local else None, uid, inline, role=req.role)
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
        shm_path, shm_size = None, 0
        if local and req.want_shm and req.role == "engine":
            try:
                region = await self.pool.run(create_session_region, str(sess.id),
                                             self.cfg.shared_memory_size)
            except RegionError as e:
                self._release_engine(sess)
                await refuse(ErrorCode.INTERNAL, str(e))
                return None
            sess.regions[SESSION_REGION] = region
            shm_path, shm_size = region.path, region.size
        self.sessions[sess.id] = sess
        await self._reply(conn, HelloReply(
            id=req.id, session=sess.id, gateway_version=__version__, shm_path=shm_path, shm_size=shm_size,
            max_frame_bytes=self.cfg.max_frame_bytes, fingerprint=self.store.long.fingerprint,
            placement=self.cfg.key_placement,
        ), deadline=deadline)
        return sess

    def _release_engine(self, sess: Session) -> None:
        if sess.engine_id and self.engine is not None and self.engine.engine_id == sess.engine_id:
            self.engine.connections -= 1
            if self.engine.connections <= 0:
                log.info("engine %r disconnected", self.engine.engine_id)
                self.engine = None
        sess.engine_id = ""

    def _close_session(self, sess: Session) -> None:
        self.sessions.pop(sess.id, None)
        self.store.holds.release_all(sess.id)
        self._release_engine(sess)
        for region in sess.regions.values():
            region.close()
        sess.regions.clear()

    # ---- operations -------------------------------------------------------------------

    async def _handle(self, sess: Session, req, body: bytes) -> tuple[Any, Any]:
        if isinstance(req, Stats):
            return StatsReply(stats=self.snapshot()), None
        if isinstance(req, Clean):
            return await self._clean(), None
        if isinstance(req, Hello):
            raise RequestError(ErrorCode.BAD_REQUEST, "this connection already has a session")
        if sess.role != "engine":
            raise RequestError(ErrorCode.BAD_REQUEST, f"{type(req).__name__.lower()} needs an engine session")
        if isinstance(req, RegisterRegion):
            return await self._register(sess, req), None
        if isinstance(req, Mark):  # only the first MARK_KEYS count: the rest are neither keyed nor hashed
            shared, starts = self.heads.shared_prefix(self._full_keys(sess, req.keys[:MARK_KEYS]))
            return MarkReply(mark=req.keys[shared] if shared < len(req.keys) else None, shared=shared,
                             heads=starts), None
        keys = self._full_keys(sess, req.keys)
        dialog = dialog_digest(req.dialog)
        if isinstance(req, Put):
            return await self._put(sess, req, keys, dialog, body), None
        if isinstance(req, Get):
            return await self._get(sess, req, keys, dialog)
        if isinstance(req, Lookup):
            return CountReply(count=await self.store.lookup(keys, dialog, sess.local)), None
        if isinstance(req, Exists):
            return ExistsReply(present=await self.store.exists(keys, dialog, sess.local)), None
        if isinstance(req, Delete):
            return CountReply(count=await self.store.delete(keys, dialog)), None
        if isinstance(req, Prewarm):
            return CountReply(count=await self.store.prewarm(keys, dialog)), None
        if isinstance(req, Hold):
            return ExistsReply(present=await self.store.hold(sess.id, keys, dialog, sess.local)), None
        if isinstance(req, Release):
            return CountReply(count=self.store.holds.release(sess.id, keys)), None
        raise RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {type(req).__name__}")

    def _full_keys(self, sess: Session, keys: list[bytes]) -> list[bytes]:
        """``full_key(namespace, key)`` of every key, checked.

        Done in bulk (one C-level pass over the lengths, one concatenation per
        key) rather than two Python calls per key: an engine looks up 1,000s
        of keys on every scheduling step, and per-key calls were a third of a
        lookup's time.  The decoder already guarantees ``bytes``; only the
        lengths need checking, and ``check_key`` names the bad one.
        """
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise RequestError(ErrorCode.TOO_LARGE, f"{len(keys)} keys in one request (limit {MAX_KEYS_PER_REQUEST})")
        if keys and (min(map(len, keys)) == 0 or max(map(len, keys)) > MAX_KEY_BYTES):
            for k in keys:
                check_key(k)
        prefix = full_key(sess.namespace, b"")
        return [prefix + k for k in keys]

    async def _register(self, sess: Session, req: RegisterRegion) -> RegionReply:
        if not sess.local:
            raise RequestError(ErrorCode.BAD_REQUEST, "regions can only be registered over the Unix socket")
        if "\x00" in req.path:
            raise RequestError(ErrorCode.BAD_REQUEST, "region path contains a NUL byte")
        region = await self.pool.run(map_client_region, req.path, sess.uid)
        rid = max(sess.regions, default=0) + 1
        sess.regions[rid] = region
        return RegionReply(region=rid, size=region.size)

    async def _put(self, sess: Session, req: Put, keys: list[bytes], dialog: bytes, body: bytes) -> PutReply:
        n = len(keys)
        if len(req.sizes) != n:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{n} keys but {len(req.sizes)} sizes")
        if any(s < 0 for s in req.sizes):
            raise RequestError(ErrorCode.BAD_REQUEST, "negative size")
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
        items = [PutItem(k, v, ObjectMeta(dialog, pos + i if pos >= 0 else -1, now, i == last))
                 for i, (k, v) in enumerate(zip(keys, views))]
        return PutReply(stored=await self.store.put(items, Retention.parse(req.retention)))

    async def _get(self, sess: Session, req: Get, keys: list[bytes], dialog: bytes):
        n = len(keys)
        if req.offsets is not None:
            if req.region == INLINE:
                raise RequestError(ErrorCode.BAD_REQUEST, "offsets need a region; inline gets are packed by the gateway")
            region = sess.region(req.region)
            if req.capacities is None or len(req.capacities) != n or len(req.offsets) != n:
                raise RequestError(ErrorCode.BAD_REQUEST, "a get into a region needs one offset and one capacity per key")
            dests = [region.slice(o, c) for o, c in zip(req.offsets, req.capacities)]
            sizes, needed = await self.store.get([GetItem(k, dialog, d) for k, d in zip(keys, dests)], sess.local)
            return GetReply(sizes=sizes, needed=needed if TOO_SMALL in sizes else None), None
        return await self._get_packed(sess, req, keys, dialog)

    async def _get_packed(self, sess: Session, req: Get, keys: list[bytes], dialog: bytes):
        """Place results one after another: from offset 0 of a region, or in the reply body."""
        hints = [self.store.size_hint(k, dialog) for k in keys]
        unknown = [i for i, h in enumerate(hints) if h is None]
        if unknown:  # ask the cards for the sizes: a read into an empty buffer tells it
            probe, needed = await self.store.get([GetItem(keys[i], dialog, _EMPTY) for i in unknown], sess.local)
            for i, s, need in zip(unknown, probe, needed):
                hints[i] = need if s == TOO_SMALL else (s if s >= 0 else MISS)
        if req.region == INLINE:
            limit = self.cfg.max_frame_bytes - (1 << 20)
        else:
            limit = sess.region(req.region).size
        offsets = [0] * len(keys)
        sizes = [MISS] * len(keys)
        wanted, cursor = [], 0
        for i, h in enumerate(hints):
            if h == MISS:
                continue
            # inline: the first object always goes, even past the limit (it came in one frame, so one
            # frame carries it back); otherwise an object near max_frame_bytes could never be read
            if cursor + h > limit and (wanted or req.region != INLINE):
                for j in range(i, len(keys)):
                    if hints[j] != MISS:
                        sizes[j] = NOT_DONE
                break
            offsets[i] = cursor
            wanted.append(i)
            cursor += h
        if req.region == INLINE:
            await sess.inline.acquire(cursor)
            buf = memoryview(bytearray(cursor))
            body = buf
        else:
            buf = sess.region(req.region).view
            body = None
        try:
            got, _needed = await self.store.get([GetItem(keys[i], dialog, buf[offsets[i] : offsets[i] + hints[i]])
                                                 for i in wanted], sess.local)
        except BaseException:
            if body is not None:
                await sess.inline.release(cursor)
            raise
        for i, s in zip(wanted, got):
            sizes[i] = NOT_DONE if s == TOO_SMALL else s  # changed size under us: ask again
        return GetReply(sizes=sizes, offsets=offsets), body

    async def _clean(self) -> CountReply:
        if self.cfg.shared_storage:
            log.warning("clean refused: shared_storage is true, other gateways use these cards; nothing was deleted")
            raise RequestError(ErrorCode.CLEAN_REFUSED,
                               "shared_storage is true: this gateway never deletes all data; nothing was deleted")
        n = await self.store.clean()
        log.info("clean: deleted %d objects", n)
        return CountReply(count=n)

    async def prewarm(self, namespace: str, keys: list[bytes], dialog: bytes | None) -> int:
        """Prewarm for the HTTP endpoint (keys are the client's, not yet namespaced)."""
        ns = encode_namespace(namespace)
        return await self.store.prewarm([full_key(ns, check_key(k)) for k in keys], dialog_digest(dialog))

    # ---- status ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        st = self.store
        c = st.counters
        ram = st.ram
        cards = [mc.snapshot() for mc in st.card_states()]
        long_tier = {
            "sets": c.long.sets, "gets": c.long.gets, "hits": c.long.hits, "misses": c.long.misses,
            "bytes_read": c.long.bytes_read, "bytes_written": c.long.bytes_written,
            "evictions": sum(x["evictions"] for x in cards),
            "used_bytes": sum(x["used_bytes"] for x in cards if x["active"]),
            "capacity_bytes": sum(x["capacity_bytes"] for x in cards if x["active"]),
            "objects": sum(x["objects"] for x in cards if x["active"]),
        }
        ram_tier = {
            "sets": c.ram.sets, "gets": c.ram.gets, "hits": c.ram.hits, "misses": c.ram.misses,
            "bytes_read": c.ram.bytes_read, "bytes_written": c.ram.bytes_written, "evictions": ram.evictions,
            "used_bytes": ram.used_bytes, "capacity_bytes": ram.capacity, "objects": ram.entries,
        }
        engine = None
        if self.engine is not None:
            engine = {"engine_id": self.engine.engine_id, "pid": self.engine.pid, "connections": self.engine.connections}
        return {
            "gateway": {
                "version": __version__, "pid": os.getpid(), "uptime_s": round(time.time() - self.started_at, 3),
                "fingerprint": st.long.fingerprint, "placement": self.cfg.key_placement, "storage_slots": st.long.slots,
                "socket": self.cfg.socket_path, "port": self.tcp_port, "sessions": len(self.sessions),
                "connections": sum(lim.open for lim in self.limits.values()),
                "refused_connections": self.refused_connections, "engine": engine, "shared_storage": self.cfg.shared_storage,
                "read_priority": "realtime" if self.pool.realtime else "normal",
            },
            "tiers": {"ram": ram_tier, "long": long_tier},
            "namespaces": st.usage.snapshot(),
            "holds": {"objects": len(st.holds), "refused": st.holds.refused},
            "lookups": c.lookups,
            "corrupt_objects": c.corrupt,
            "expired_objects": c.expired,
            "io_timeouts": st.long.io_timeouts,
            "io_errors": st.long.io_errors,
            "oldest_io_age_s": max(self.pool.oldest_age(), st.long.oldest_io_age()),
            "cards": cards,
            "shared_heads": {"blocks": len(self.heads), "learned": self.heads.learned,
                             "sync_rounds": self.head_sync.rounds, "sync_errors": self.head_sync.errors},
        }


def _request_id(header: bytes | bytearray) -> int:
    """The id of the request in ``header``, wrong or not (0 where it has none that can be read)."""
    try:
        return decode_request(header).id
    except RequestError as e:
        return e.request_id


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def run_gateway(cfg: Config, ready: asyncio.Event | None = None) -> None:
    """Start, serve until SIGINT/SIGTERM, stop cleanly."""
    import signal

    gw = Gateway(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gw.request_stop)
    try:
        await gw.start()
    except BaseException:
        await gw.stop()
        raise
    if ready is not None:
        ready.set()
    try:
        await gw.serve_until_stopped()
    finally:
        await gw.stop()
