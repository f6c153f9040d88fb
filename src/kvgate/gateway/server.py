"""The gateway: wires the store, sessions, operations, listeners and status together; start, stop, signals.

One asyncio event loop owns all state.  It only parses frames, checks
requests and does bookkeeping; bytes move in ``IoPool`` threads (see
``TieredStore``).  Each request of a connection runs as its own task, so a
client may pipeline, and a slow card read never holds up a lookup.

Nothing a client sends can stop the gateway: a broken frame closes that
connection (``listeners``), a wrong request gets an ``Error`` reply, and any
unexpected exception in a handler is logged and answered with ``INTERNAL``
(``operations``).

``run_gateway`` is called by ``kvgate serve`` (``kvgate.cli``) in the main
thread's event loop; ``Gateway`` runs there, and nothing it does may block
that loop: files, regions and card I/O go to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import time
from typing import Any, Callable, Protocol

from kvgate import __version__

from kvgate.gateway import lending
from kvgate.cards import CardInUse
from kvgate.config import FIELDS, Config, ConfigError, is_loopback, read_token
from kvgate.gateway import status as status_mod
from kvgate.keys import NamespaceBook
from kvgate.latency import Latencies
from kvgate.gateway.sdnotify import notify
from kvgate.gateway.connection import tcp_listeners, unix_listener
from kvgate.gateway.headsync import HeadSync
from kvgate.gateway.kvevents import KvEvents
from kvgate.gateway.peerserve import PeerServer
from kvgate.gateway.listeners import Listeners
from kvgate.gateway.operations import Operations
from kvgate.gateway.peers import loopback_uids_visible
from kvgate.gateway.sessions import Sessions
from kvgate.gateway.shm import reap_dead_regions
from kvgate.heads import SharedHeads
from kvgate.tiers.io import IoPool, Tasks, realtime_permitted
from kvgate.tiers.layout import LayoutMismatch
from kvgate.tiers.store import TieredStore
from kvgate.errors import KvgateError

log = logging.getLogger("kvgate.gateway")
GIL_SWITCH_S = 0.001  # sys.setswitchinterval of a serving gateway (see run_gateway)


class StartupError(KvgateError, RuntimeError):
    """The gateway cannot start as configured; the message says why."""


class CardSource(Protocol):
    """Where a gateway's cards come from besides ``storage_devices``: cluster mode's registry view (and the
    peers the registry names).

    Made by whoever starts the gateway (``kvgate serve``), given the
    gateway's store (its card set, ``set_peers``); ``start`` runs before the gateway listens (cards it
    knows serve from the first request), ``run`` is its task while the
    gateway serves, ``close`` comes after the task was cancelled.
    """

    async def start(self) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]:
        """Its part of the gateway's status (``snapshot["cluster"]``)."""


class Gateway:
    """One gateway: its store, sessions, operations, listeners and status, and their life cycle.

    ``run_gateway`` makes it on the event loop, calls ``start``, waits in ``serve_until_stopped`` and calls
    ``stop``; the signal handlers call ``request_stop``.  Everything runs on that loop and must not block
    it: the store's I/O, region files and the status file go to the ``IoPool``.
    """

    def __init__(self, cfg: Config, card_source: Callable[[TieredStore], CardSource] | None = None):
        self.cfg = cfg
        self.pool = IoPool(cfg.thread_pool_size, realtime=self._realtime_reads(cfg))
        self.namespaces = NamespaceBook()  # what each engine namespace stands for (hellos): shown to peers
        self.store = TieredStore(cfg, self.pool, self.namespaces)
        self.card_source = card_source(self.store) if card_source is not None else None
        self.heads = SharedHeads()
        self.head_sync = HeadSync(self.heads, self.store.card_set)
        self.sessions = Sessions(cfg, self.store, self.pool, self.namespaces)
        self.kv_events: KvEvents | None = None  # kv_events_endpoint: the tiers' changes as vLLM KV events
        self.peer_server: PeerServer | None = None  # peer_listen: what the tiers hold, read by peer gateways
        self.latency = Latencies()
        self.operations = Operations(cfg, self.store, self.pool, self.heads, self.snapshot, self.latency)
        self.listeners = Listeners(cfg, self.sessions, self.operations, self._spawn)
        self.started_at = time.time()
        self.http: status_mod.HttpStatus | None = None
        self.tcp_port: int | None = None
        self._tasks = Tasks()
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
        self._check_bind()
        await self._check_socket_free(cfg.socket_path)
        reaped = await self.pool.run(reap_dead_regions)
        if reaped:
            log.info("removed %d shared-memory regions left by gateways that died", reaped)
        if cfg.cross_memory_gets and lending.supported:
            arena = ("the RAM tier is shared read-only with them (shared_ram_arena)" if self.store.shared_ram()
                     else "the RAM tier is private memory")
            log.info("cross-memory gets (local clients of this user read lent objects): %s; %s",
                     lending.allow_readers(), arena)
        try:
            await self.store.start()
        except (LayoutMismatch, CardInUse) as e:
            raise StartupError(str(e)) from None
        if self.card_source is not None:
            await self.card_source.start()
            self._spawn(self.card_source.run())
        await self.head_sync.sync_once()  # marks as before a restart, from the first request on
        if len(self.heads):
            log.info("shared heads: %d blocks known from the cards", len(self.heads))
        self._spawn(self.head_sync.run())
        if cfg.kv_events_endpoint:  # before the listeners: every change a client makes is published
            kv_events = KvEvents(cfg, self.store, self.sessions.key_forms)
            try:
                await kv_events.start()
            except ConfigError as e:
                raise StartupError(f"config key {e}") from None
            self.kv_events = kv_events
        if cfg.peer_listen:
            try:
                peer_server = PeerServer(cfg, self.store, self.namespaces)
                await peer_server.start()
            except ConfigError as e:
                raise StartupError(f"config key {e}") from None
            except OSError as e:
                raise StartupError(f"config key 'peer_listen': cannot listen on {cfg.peer_listen}: "
                                   f"{e.strerror or e}") from None
            self.peer_server = peer_server
        socket_dir = os.path.dirname(os.path.abspath(cfg.socket_path))
        if cfg.socket is None:  # the default's directory (XDG_RUNTIME_DIR, or /tmp) is the gateway's to make
            os.makedirs(socket_dir, exist_ok=True)
        elif not os.path.isdir(socket_dir):  # a path someone wrote: a typo must not become a new directory tree
            raise StartupError(f"config key 'socket': the directory of {cfg.socket_path} ({socket_dir}) does not "
                               "exist: create it, or choose a socket path in a directory that does")
        try:
            unix = unix_listener(cfg.socket_path)
        except OSError as e:
            raise StartupError(f"config key 'socket': cannot listen on {cfg.socket_path}: {e.strerror or e}") from None
        self._socket_owned = True
        os.chmod(cfg.socket_path, 0o660)
        self.listeners.listen(unix, local=True)
        where = [f"socket {cfg.socket_path}"]
        # Without a token, only the gateway's user and root get in over loopback TCP: the kernel must tell
        # a peer's uid (kvgate.gateway.peers), checked once here.
        hosts = [h for h, on in ((cfg.bind_address, cfg.port), (cfg.metrics_bind_address, cfg.metrics_port)) if on]
        blind = await self.pool.run(loopback_uids_visible, hosts) if hosts else None
        self.sessions.loopback_uids = blind is None
        if cfg.port and blind is not None and self.sessions.token is None:
            log.warning("the TCP listener on %s:%s stays closed: this gateway cannot tell the uid of a loopback peer "
                        "(%s), so it could not keep other users out without a token; set auth_token_file to open "
                        "it (clients then present that token), or connect over the Unix socket %s",
                        cfg.bind_address, cfg.port, blind, cfg.socket_path)
        elif cfg.port:
            try:
                tcp = await tcp_listeners(cfg.bind_address, cfg.port)
            except OSError as e:
                raise StartupError(f"config key 'port': cannot listen on {cfg.bind_address}:{cfg.port}: {e.strerror}") from None
            self.tcp_port = tcp[0].getsockname()[1]
            for sock in tcp:
                self.listeners.listen(sock, local=False)
            where.append(f"tcp {cfg.bind_address}:{self.tcp_port}")
        if cfg.metrics_port:
            try:
                self.http = status_mod.HttpStatus(
                    self.snapshot, self.operations.prewarm_by_name, asyncio.get_running_loop(),
                    cfg.metrics_bind_address, cfg.metrics_port, token=self.sessions.token,
                    local_uids=self.sessions.loopback_uids)
            except OSError as e:
                raise StartupError(
                    f"config key 'metrics_port': cannot serve /metrics on {cfg.metrics_bind_address}:{cfg.metrics_port}: "
                    f"{e.strerror}") from None
            self.http.start()
            where.append(f"metrics http://{cfg.metrics_bind_address}:{self.http.port}/metrics")
        if self.peer_server is not None:
            scheme = "kvgates" if self.peer_server.tls is not None else "kvgate"
            where.append(f"peers {scheme}://{self.peer_server.host}:{self.peer_server.port}/peer")
        if cfg.peers:
            where.append(f"pulls from {', '.join(cfg.peers)}")
        if cfg.status_file:
            self._spawn(self._status_file_loop())
        ram_mib = cfg.max_bytes / (1 << 20)
        cards = ", ".join(f"{cs.where} ({cs.serial or 'unavailable'})" for cs in self.store.card_states())
        log.info("kvgate %s ready: %s; RAM tier %.0f MiB; reads at %s priority; cards: %s", __version__,
                 "; ".join(where), ram_mib, "real-time" if self.pool.realtime else "normal", cards)

    def _check_bind(self) -> None:
        cfg = self.cfg
        token = None
        if cfg.auth_token_file:
            try:
                token = read_token(cfg.auth_token_file, "config key 'auth_token_file'")
            except ConfigError as e:
                raise StartupError(str(e)) from None
        self.sessions.token = token
        if cfg.port and not is_loopback(cfg.bind_address) and not token:
            raise StartupError(
                f"config key 'bind_address': {cfg.bind_address} is not loopback; set auth_token_file so "
                "clients on other hosts must present a token"
            )
        if cfg.metrics_port and not is_loopback(cfg.metrics_bind_address) and not token:
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
        if not self._stopped.is_set():
            notify("STOPPING=1")
        self._stopped.set()

    def request_reload(self, load: Callable[[], Config]) -> None:
        """SIGHUP: read the config again (``load``) and apply its ``storage_devices`` to the running card set."""
        self._spawn(self._reload(load))

    async def _reload(self, load: Callable[[], Config]) -> None:
        notify("RELOADING=1", "STATUS=reloading the config")
        try:
            await self._reload_devices(load)
        finally:
            notify("READY=1", "STATUS=serving")

    async def _reload_devices(self, load: Callable[[], Config]) -> None:
        try:
            cfg = await self.pool.run(load)  # reads the file: off the loop
        except (ConfigError, OSError) as e:
            log.error("SIGHUP: config not reloaded, the gateway goes on as it was: %s", e)
            return
        later = [f.name for f in FIELDS
                 if f.name != "storage_devices" and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if later:
            log.warning("SIGHUP: %s changed in the config; only storage_devices applies while serving, the rest at "
                        "the next start", ", ".join(later))
        if list(cfg.storage_devices) == self.store.storage_patterns:
            log.info("SIGHUP: storage_devices unchanged")
            return
        log.warning("SIGHUP: storage_devices now %s", ", ".join(cfg.storage_devices))
        for problem in await self.store.apply_devices(list(cfg.storage_devices)):
            log.error("SIGHUP: %s", problem)

    async def stop(self) -> None:
        # the accept loops and every connection are tasks too: each connection cancels its requests, closes
        # its session and its socket
        await self._tasks.cancel()
        if self.card_source is not None:
            await self.card_source.close()
        self.listeners.close()
        if self.http:
            await asyncio.get_running_loop().run_in_executor(None, self.http.stop)
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None
        if self.peer_server is not None:
            await self.peer_server.close()
            self.peer_server = None
        await self.store.stop()
        self.sessions.close_all()
        self.sessions.peers.close()
        if self._socket_owned:  # a gateway refused at start must not remove a running one's socket
            try:
                os.unlink(self.cfg.socket_path)
            except FileNotFoundError:
                pass
        self.pool.shutdown()
        log.info("kvgate stopped")

    def _spawn(self, coro) -> asyncio.Task:
        return self._tasks.spawn(coro)

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

    def snapshot(self) -> dict[str, Any]:
        snap = status_mod.snapshot(self.cfg, self.store, self.pool, self.heads, self.head_sync, self.sessions,
                                   self.listeners, self.started_at, self.tcp_port,
                                   cluster=self.card_source.status() if self.card_source is not None else None,
                                   latency=self.latency)
        if self.kv_events is not None:
            snap["kv_events"] = self.kv_events.status()
        if self.peer_server is not None:
            snap["peer_listen"] = self.peer_server.status()
        return snap



def raise_open_files_limit() -> int:
    """Take the hard limit on open files as the soft one, and say what it is.

    systemd and many shells start services at a soft limit of 1,024 (kept
    low for ``select``, which nothing here uses); a quarter of what the
    process may open goes to files lent to clients (``TieredStore.lend_files``).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.info("open files stay limited to %d (%s)", soft, e)
    return soft


async def run_gateway(cfg: Config, ready: asyncio.Event | None = None,
                      reload: Callable[[], Config] | None = None,
                      card_source: Callable[[TieredStore], CardSource] | None = None) -> None:
    """Start, serve until SIGINT/SIGTERM, stop cleanly; on SIGHUP, ``reload`` the config (its cards)."""
    import signal

    # A pool thread running Python code (a card's scan or listing, a snapshot's rows) keeps the GIL until
    # the interpreter takes it away, 5 ms by default, while the loop waits to answer a lookup.  Measured
    # with one such thread busy: loop work of 0.1 ms took 5.5 ms at p50 (13.7 p99); at 1 ms, 1.4 (5.3).
    sys.setswitchinterval(GIL_SWITCH_S)
    raise_open_files_limit()
    gw = Gateway(cfg, card_source)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gw.request_stop)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, gw.request_reload, reload)
    try:
        await gw.start()
    except BaseException:
        await gw.stop()
        raise
    if ready is not None:
        ready.set()
    notify("READY=1", f"STATUS=serving; {len(gw.store.card_states())} cards")
    try:
        await gw.serve_until_stopped()
    finally:
        await gw.stop()
