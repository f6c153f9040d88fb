"""The gateway: listeners, sessions, and the operations clients ask for.

One asyncio event loop owns all state.  It only parses frames, checks
requests and does bookkeeping; bytes move in ``IoPool`` threads (see
``TieredStore``).  Each request of a connection runs as its own task, so a
client may pipeline, and a slow card read never holds up a lookup.

Nothing a client sends can stop the gateway: a broken frame closes that
connection, a wrong request gets an ``Error`` reply, and any unexpected
exception in a handler is logged and answered with ``INTERNAL``.
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
from kvgate.gateway.connection import Connection, accept_loop, tcp_listeners, unix_listener
from kvgate.gateway.shm import Region, RegionError, create_session_region, map_client_region, reap_dead_regions
from kvgate.keys import MAX_KEY_BYTES, BadKey, check_key, dialog_digest, encode_namespace, full_key
from kvgate.memcopy import MemoryFault
from kvgate.protocol import (
    INLINE,
    KIND_REPLY,
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
    Get,
    GetReply,
    Hello,
    HelloReply,
    Lookup,
    Prewarm,
    Put,
    PutReply,
    RegionReply,
    RegisterRegion,
    RequestError,
    Stats,
    StatsReply,
    decode_request,
    encode_frame,
    parse_preamble,
)
from kvgate.tiers.io import ByteBudget, IoPool, realtime_permitted
from kvgate.tiers.long import LayoutMismatch
from kvgate.tiers.store import GetItem, PutItem, TieredStore

log = logging.getLogger("kvgate.gateway")

MAX_KEYS_PER_REQUEST = 65536
MAX_INFLIGHT_PER_CONNECTION = 64
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


class Gateway:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.pool = IoPool(cfg.thread_pool_size, realtime=self._realtime_reads(cfg))
        self.store = TieredStore(cfg, self.pool)
        self.engine: EngineClaim | None = None
        self.sessions: dict[int, Session] = {}
        self.started_at = time.time()
        self.token: str | None = None
        self.budget: ByteBudget | None = None
        self.http: status_mod.HttpStatus | None = None
        self.tcp_port: int | None = None
        self._listeners: list[socket.socket] = []
        self._session_ids = itertools.count(1)
        self._connections = 0
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
        self.budget = ByteBudget(2 * cfg.max_frame_bytes)
        self._check_bind()
        await self._check_socket_free(cfg.socket_path)
        reaped = await self.pool.run(reap_dead_regions)
        if reaped:
            log.info("removed %d shared-memory regions left by gateways that died", reaped)
        try:
            await self.store.start()
        except (LayoutMismatch, CardInUse) as e:
            raise StartupError(str(e)) from None
        os.makedirs(os.path.dirname(os.path.abspath(cfg.socket_path)), exist_ok=True)
        try:
            unix = unix_listener(cfg.socket_path)
        except OSError as e:
            raise StartupError(f"config key 'socket': cannot listen on {cfg.socket_path}: {e.strerror}") from None
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
                self.http = status_mod.HttpStatus(self, asyncio.get_running_loop(), cfg.metrics_bind_address,
                                                  cfg.metrics_port)
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
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone
            sock.close()
            return
        await self._serve(Connection(sock), local=local, pid=pid, uid=uid)

    async def _serve(self, conn: Connection, local: bool, pid: int | None, uid: int | None) -> None:
        """Read requests until the client leaves; each one after hello runs as its own task.

        A body is received straight into a ``bytearray`` of its length, taken
        from the inline byte budget before a byte of it is read.
        """
        self._connections += 1
        session: Session | None = None
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(MAX_INFLIGHT_PER_CONNECTION)
        try:
            if self._connections > self.cfg.max_connections:
                await self._reply(conn, Error(code=ErrorCode.TOO_MANY_CONNECTIONS,
                                              message=f"the gateway serves at most {self.cfg.max_connections} connections"))
                return
            while True:
                try:
                    pre = await conn.readexactly(PREAMBLE_SIZE)
                except (asyncio.IncompleteReadError, OSError):
                    return
                try:
                    _kind, hlen, blen = parse_preamble(pre, self.cfg.max_frame_bytes)
                except FrameError as e:
                    await self._reply(conn, Error(code=e.code, message=str(e)))
                    return
                try:
                    header = await conn.readexactly(hlen)
                    body: bytes | bytearray = b""
                    if blen:
                        await self.budget.acquire(blen)
                        try:
                            body = bytearray(blen)
                            await conn.readinto(memoryview(body))
                        except BaseException:
                            await self.budget.release(blen)
                            raise
                except (asyncio.IncompleteReadError, OSError):
                    return
                try:
                    req = decode_request(header)
                except RequestError as e:
                    await self._release(blen)
                    await self._reply(conn, Error(id=e.request_id, code=e.code, message=str(e)))
                    continue
                if session is None:
                    if not isinstance(req, Hello):
                        await self._release(blen)
                        await self._reply(conn, Error(id=req.id, code=ErrorCode.NO_SESSION, message="send hello first"))
                        continue
                    session = await self._hello(req, conn, local, pid, uid)
                    await self._release(blen)
                    continue
                await slots.acquire()
                task = asyncio.get_running_loop().create_task(self._dispatch(session, req, body, blen, conn))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                task.add_done_callback(lambda _t: slots.release())
        except asyncio.CancelledError:
            for t in inflight:  # the gateway is stopping: so are this connection's requests
                t.cancel()
            raise
        except Exception:  # noqa: BLE001 - one connection must never take the gateway down
            log.exception("connection handler failed")
        finally:
            self._connections -= 1
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
            if session is not None:
                self._close_session(session)
            conn.close()

    async def _release(self, n: int) -> None:
        if n:
            await self.budget.release(n)

    async def _reply(self, conn: Connection, msg, body: bytes | bytearray | memoryview | None = None) -> None:
        """Send a reply frame; the body goes out from its buffer, uncopied."""
        await conn.send(encode_frame(msg, len(body) if body is not None else 0, KIND_REPLY), body)

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
            await self._release(blen)
        reply.id = req.id
        try:
            await self._reply(conn, reply, reply_body)
        finally:
            if reply_body is not None:
                await self._release(len(reply_body))

    # ---- sessions -------------------------------------------------------------------

    async def _hello(self, req: Hello, conn: Connection, local: bool, pid: int | None, uid: int | None) -> Session | None:
        async def refuse(code: str, message: str) -> None:
            await self._reply(conn, Error(id=req.id, code=code, message=message))

        if req.protocol != VERSION:
            await refuse(ErrorCode.BAD_VERSION, f"client speaks protocol {req.protocol}, gateway {VERSION}")
            return None
        if not local and self.token is not None:
            if req.token is None or not hmac.compare_digest(req.token.encode(), self.token.encode()):
                await refuse(ErrorCode.NOT_AUTHORIZED, "a valid token is required on this listener")
                return None
        sess = Session(next(self._session_ids), local, pid if local else None, uid, role=req.role)
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
        ))
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
        items = [PutItem(k, v, ObjectMeta(dialog, pos + i if pos >= 0 else -1, now)) for i, (k, v) in enumerate(zip(keys, views))]
        return PutReply(stored=await self.store.put(items, req.retention))

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
            await self.budget.acquire(cursor)
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
                await self.budget.release(cursor)
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

    async def snapshot_async(self) -> dict[str, Any]:
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        st = self.store
        c = st.counters
        ram = st.ram
        cards = []
        for cs in st.card_states():
            cards.append({
                "serial": cs.serial, "location": cs.where, "kind": cs.card.kind, "active": cs.active,
                "read_only": cs.read_only,
                "capacity_bytes": cs.capacity, "used_bytes": cs.used, "objects": len(cs.index),
                "hits": cs.hits, "misses": cs.misses, "errors": cs.errors, "timeouts": cs.timeouts,
                "bytes_read": cs.reads_bytes, "bytes_written": cs.writes_bytes, "evictions": cs.evictions,
                "read_hints": cs.read_hints,
                "scanned": cs.scanned, **cs.card.read_rates(),
            })
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
                "fingerprint": st.long.fingerprint, "placement": self.cfg.key_placement,
                "socket": self.cfg.socket_path, "port": self.tcp_port, "sessions": len(self.sessions),
                "connections": self._connections, "engine": engine, "shared_storage": self.cfg.shared_storage,
                "read_priority": "realtime" if self.pool.realtime else "normal",
            },
            "tiers": {"ram": ram_tier, "long": long_tier},
            "lookups": c.lookups,
            "corrupt_objects": c.corrupt,
            "expired_objects": c.expired,
            "io_timeouts": st.long.io_timeouts,
            "io_errors": st.long.io_errors,
            "oldest_io_age_s": max(self.pool.oldest_age(), st.long.oldest_io_age()),
            "cards": cards,
        }


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
