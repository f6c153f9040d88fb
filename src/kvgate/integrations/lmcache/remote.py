"""``KvgateRemoteConnector``: LMCache's (0.5.6) in-process remote storage plugin, backed by a kvgate gateway.

LMCache config (the engine's, e.g. ``LMCACHE_CONFIG_FILE``)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5          # LMCache needs its CPU backend: objects are allocated there
    remote_storage_plugins: ["kvgate"]
    extra_config:
      remote_storage_plugin.kvgate.module_path: kvgate.integrations.lmcache
      remote_storage_plugin.kvgate.class_name: KvgateRemoteConnector
      remote_storage_plugin.kvgate.kvgate.socket: /tmp/kvgate-5557.sock

LMCache's ``RemoteBackend`` runs every call of this connector on its own
asyncio loop (``run_coroutine_threadsafe``), so all gateway I/O happens there,
on ``AsyncClient`` sessions: one per kind of call (lookups, loads, stores) and
namespace (a worker has one), so a lookup never queues behind a large store.  Sessions open
on first use.  A gateway that is down, stuck or restarting never raises into
LMCache: ``exists`` answers False, ``get`` None, a store is logged as failed;
each call is bounded by its timeout; the connector logs one line when the
gateway becomes unavailable and one when it is back, and reconnects with a
back-off (0.5 s doubling to 10 s) during which calls fail at once.

Keys: ``settings.engine_key_namespace`` / ``engine_key_bytes``.  Objects are
stored as their bytes, nothing else: ``get`` allocates a full chunk from
LMCache's ``LocalCPUBackend`` (the engine's shapes and dtypes) and the gateway
fills it; a shorter object (the last, partial chunk of a prompt) is reshaped
by LMCache's own ``reshape_partial_chunk``.  So only ``remote_serde: naive``
and non-layerwise configs are accepted.

Copies (Unix socket): a store copies the chunk from LMCache's CPU buffer into
the session's shared-memory region, and the gateway from there into its RAM
tier; a load is the same two copies back, the last one straight into the
MemoryObj LMCache gets (no bytes object in between).  Over TCP the bytes
travel in the frames, received straight into the MemoryObj.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, List, Optional

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvgate.client.async_client import AsyncClient
from kvgate.client.core import GatewayError, ObjectTooLarge
from kvgate.integrations.lmcache.settings import (
    ConfigError,
    connector_plugin_name,
    engine_key_bytes,
    engine_key_namespace,
    parse_connector_config,
    plugin_logger,
)
from kvgate.integrations.reconnect import Backoff
from kvgate.errors import KvgateError

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = plugin_logger()

# the gateway's refusals that mean this session cannot go on as it is: open a new one next time
_SESSION_REFUSALS = ("ENGINE_BUSY", "NOT_AUTHORIZED", "UNSALTED_REFUSED", "BAD_VERSION")
_LOOKUP, _LOAD, _STORE = "lookup", "load", "store"


class _Unavailable(KvgateError, Exception):
    """The gateway is down (or the connector closed): the call fails at once, already logged."""


class KvgateRemoteConnector(RemoteConnector):
    """An LMCache remote connector storing chunks in a kvgate gateway (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: "LocalCPUBackend",
                 config: "LMCacheEngineConfig | None" = None):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        config = config if config is not None else local_cpu_backend.config
        extra = config.extra_config or {}
        self.plugin_name = connector_plugin_name(config.remote_storage_plugins, extra, type(self).__name__)
        self.settings = parse_connector_config(extra, self.plugin_name)
        if config.use_layerwise:
            raise ConfigError("kvgate remote connector: use_layerwise is not supported (objects are stored as "
                              "their bytes and restored with the engine's chunk shapes)")
        if (config.remote_serde or "naive") != "naive":
            raise ConfigError(f"kvgate remote connector: remote_serde {config.remote_serde!r} is not supported "
                              f"(only 'naive': objects are stored as their bytes)")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        # no engine id, as the L2 adapter: every worker and every LMCache instance may share one gateway
        self.engine_id = ""
        self._base_ns = self.settings.namespace
        self._clients: dict[tuple[str, str], AsyncClient] = {}
        self._connect_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._closed = False
        self._down = False
        self._down_since = 0.0
        self._backoff = Backoff()  # one for all its sessions: a gateway that is down is down for all
        self._refusals_logged: set[str] = set()
        self.counters = {"lookups": 0, "lookup_hits": 0, "loads": 0, "loaded": 0, "stores": 0, "stored": 0,
                         "store_failed": 0, "bytes_loaded": 0, "bytes_stored": 0, "outages": 0}
        s = self.settings
        logger.info("kvgate remote connector (plugin %r): gateway %s, namespace %s|w<world>r<worker>|<dtype>, "
                    "retention %s, chunk %d bytes", self.plugin_name, s.target,
                    self._base_ns or "lmcache|<model>", s.retention, self.full_chunk_size_bytes)

    # ---- sessions and outages -----------------------------------------------------------

    async def _client(self, ns: str, kind: str) -> AsyncClient:
        key = (ns, kind)
        c = self._clients.get(key)
        if c is not None and not c.broken:
            return c
        lock = self._connect_locks.setdefault(key, asyncio.Lock())
        async with lock:
            c = self._clients.get(key)
            if c is not None and not c.broken:
                return c
            if c is not None:
                await self._drop(key)
            if self._closed:
                raise _Unavailable("the connector is closed")
            now = time.monotonic()
            if self._backoff.left(now) > 0:
                raise _Unavailable("backing off")
            s = self.settings
            try:
                c = await AsyncClient.connect(s.target, ns, token=s.token, engine_id=self.engine_id,
                                              timeout=s.connect_timeout, want_shm=kind != _LOOKUP)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._backoff.failed(time.monotonic())
                self._failed(f"cannot connect ({type(e).__name__}: {e})")
                raise _Unavailable(str(e)) from e
            c.set_timeout(s.lookup_timeout if kind == _LOOKUP else s.io_timeout)
            self._clients[key] = c
            self._backoff.succeeded()
            self._back()
            return c

    async def _drop(self, key: tuple[str, str]) -> None:
        c = self._clients.pop(key, None)
        if c is not None:
            try:
                await c.close()
            except Exception:
                pass

    def _failed(self, why: str) -> None:
        if not self._down:  # one line per outage
            self._down = True
            self._down_since = time.monotonic()
            self.counters["outages"] += 1
            logger.warning("kvgate: gateway %s unavailable: %s; LMCache goes on without it (misses, failed "
                           "stores) and the connector reconnects", self.settings.target, why)

    def _back(self) -> None:
        if self._down:
            self._down = False
            logger.info("kvgate: gateway %s reachable again after %.1f s", self.settings.target,
                        time.monotonic() - self._down_since)

    async def _call(self, ns: str, kind: str, what: str, fn: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
        """``await fn(client)`` on this namespace's session of ``kind``; None when the gateway failed (logged)."""
        try:
            c = await self._client(ns, kind)
        except _Unavailable:
            return None
        try:
            return await fn(c)
        except asyncio.CancelledError:  # LMCache gave up waiting: a call cut short leaves its client broken
            raise
        except GatewayError as e:
            if e.code not in self._refusals_logged:
                self._refusals_logged.add(e.code)
                logger.warning("kvgate: the gateway refused a %s: %s (further %s refusals are logged at debug "
                               "level)", what, e, e.code)
            else:
                logger.debug("kvgate: the gateway refused a %s: %s", what, e)
            if e.code in _SESSION_REFUSALS:
                await self._drop((ns, kind))
            return None
        except TimeoutError as e:
            if c.broken:  # it had sent: the gateway is stuck or gone
                await self._drop((ns, kind))
                if not self._closed:
                    self._failed(f"a {what} timed out")
            else:  # it waited for the session behind other calls: the gateway may be fine
                logger.debug("kvgate: a %s timed out waiting for its session: %s", what, e)
            return None
        except (ObjectTooLarge, ValueError, TypeError) as e:  # refused before anything was sent
            logger.warning("kvgate: a %s was refused: %s", what, e)
            return None
        except Exception as e:  # ConnectionError, OSError, a broken frame: reconnect next time
            await self._drop((ns, kind))
            if not self._closed:
                self._failed(f"a {what} failed ({type(e).__name__}: {e})")
            return None

    def _groups(self, keys: List["CacheEngineKey"]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(engine_key_namespace(k, self._base_ns), []).append(i)
        return groups

    def _sync(self, coro: Awaitable[Any], timeout: float, default: Any) -> Any:
        """Run ``coro`` on LMCache's loop from another thread (the sync entry points); ``default`` on failure."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # waiting here would block the loop the call needs
            logger.warning("kvgate: a synchronous call on LMCache's event loop thread; answering %r", default)
            coro.close()  # type: ignore[attr-defined]
            return default
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout + self.settings.connect_timeout + 1.0)
        except Exception as e:
            fut.cancel()
            logger.debug("kvgate: a synchronous call failed: %s", e)
            return default

    # ---- lookups ------------------------------------------------------------------------

    async def _exists_many(self, keys: List["CacheEngineKey"]) -> list[bool]:
        self.counters["lookups"] += 1
        out = [False] * len(keys)
        for ns, idx in self._groups(keys).items():
            kb = [engine_key_bytes(keys[i]) for i in idx]
            res = await self._call(ns, _LOOKUP, "lookup", lambda c: c.exists_many(kb))
            for i, present in zip(idx, res or ()):
                out[i] = bool(present)
        self.counters["lookup_hits"] += sum(out)
        return out

    async def exists(self, key: "CacheEngineKey") -> bool:
        return (await self._exists_many([key]))[0]

    def exists_sync(self, key: "CacheEngineKey") -> bool:
        return self._sync(self.exists(key), self.settings.lookup_timeout, False)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List["CacheEngineKey"]) -> int:
        """How many leading keys the gateway holds (one call per namespace), from LMCache's lookup thread."""
        return self._sync(self.batched_async_contains("", keys), self.settings.lookup_timeout, 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List["CacheEngineKey"], pin: bool = False) -> int:
        """Leading keys held (``pin`` is ignored: kvgate has no pin, a key found may be evicted before its get)."""
        if not keys:
            return 0
        found = await self._exists_many(list(keys))
        return found.index(False) if False in found else len(found)

    # ---- loads --------------------------------------------------------------------------

    async def _get_many(self, keys: List["CacheEngineKey"]) -> list[Optional["MemoryObj"]]:
        """One get per namespace straight into MemoryObjs from LMCache's CPU backend; None for a miss."""
        self.counters["loads"] += 1
        out: list[Optional["MemoryObj"]] = [None] * len(keys)
        for ns, idx in self._groups(keys).items():
            objs = self._allocate(len(idx))
            if objs is None:
                continue
            kb = [engine_key_bytes(keys[i]) for i in idx]
            got = None
            try:
                got = await self._call(ns, _LOAD, "load", lambda c: self._get_fitting(c, kb, objs))
            finally:  # on cancellation too: the gateway no longer writes into them
                for j, obj in enumerate(objs):
                    g = got[j] if got is not None else None
                    kept = self._fill(obj, g) if g is not None else None
                    if kept is None:
                        obj.ref_count_down()
                    else:
                        out[idx[j]] = kept
        n = sum(o is not None for o in out)
        self.counters["loaded"] += n
        return out

    def _allocate(self, n: int) -> Optional[list["MemoryObj"]]:
        """``n`` full-chunk MemoryObjs (None, logged, when LMCache's CPU buffer has no room now)."""
        b = self.local_cpu_backend
        try:
            if n == 1:
                o = b.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt, busy_loop=False)
                objs = None if o is None else [o]
            else:  # never busy-wait: this runs on LMCache's event loop
                objs = b.batched_allocate(self.meta_shapes, self.meta_dtypes, n, self.meta_fmt, busy_loop=False)
        except Exception as e:
            logger.warning("kvgate: LMCache's CPU backend could not allocate %d chunk(s): %s", n, e)
            return None
        if objs is None:
            logger.debug("kvgate: no room in LMCache's CPU backend for %d chunk(s): reported as misses", n)
        return objs

    @staticmethod
    async def _get_fitting(client: AsyncClient, kb: list[bytes], objs: list["MemoryObj"]) -> list:
        """get_many into the objects' bytes; an object larger than a full chunk is a miss for that key alone."""
        out: list = [None] * len(kb)
        todo = list(range(len(kb)))
        while todo:
            try:
                got = await client.get_many([kb[j] for j in todo], into=[objs[j].byte_array for j in todo])
            except ObjectTooLarge as e:  # refused before anything was sent: drop that key, ask again
                todo.pop(e.index)
                continue
            for j, g in zip(todo, got):
                out[j] = g
            break
        return out

    def _fill(self, obj: "MemoryObj", got: Any) -> Optional["MemoryObj"]:
        """The MemoryObj holding ``len(got)`` bytes (a partial chunk reshaped), or None for a size LMCache
        cannot hold."""
        n = len(got)
        try:
            obj = self.reshape_partial_chunk(obj, n)
        except ValueError as e:
            logger.warning("kvgate: an object of %d bytes does not fit this engine's chunks: %s", n, e)
            return None
        self.counters["bytes_loaded"] += n
        return obj

    async def get(self, key: "CacheEngineKey") -> Optional["MemoryObj"]:
        return (await self._get_many([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List["CacheEngineKey"]) -> List[Optional["MemoryObj"]]:
        return await self._get_many(list(keys))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List["CacheEngineKey"]) -> List["MemoryObj"]:
        """The leading objects found (LMCache's contract): the ones after the first miss are released."""
        got = await self._get_many(list(keys))
        out: list["MemoryObj"] = []
        for obj in got:
            if obj is None:
                break
            out.append(obj)
        for obj in got[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        return out

    # ---- stores -------------------------------------------------------------------------

    async def _put_many(self, keys: List["CacheEngineKey"], objs: List["MemoryObj"]) -> int:
        """One put per namespace from the objects' bytes; how many were stored.  LMCache releases the
        objects when this returns (its InstrumentedRemoteConnector), so they are not released here."""
        self.counters["stores"] += 1
        stored = 0
        retention = self.settings.retention
        for ns, idx in self._groups(keys).items():
            kb = [engine_key_bytes(keys[i]) for i in idx]
            bufs = [objs[i].byte_array for i in idx]
            res = await self._call(ns, _STORE, "store", lambda c: c.put_many(kb, bufs, retention=retention))
            for b, ok in zip(bufs, res or ()):
                if ok:
                    stored += 1
                    self.counters["bytes_stored"] += len(b)
        self.counters["stored"] += stored
        if stored < len(keys):
            self.counters["store_failed"] += len(keys) - stored
        return stored

    async def put(self, key: "CacheEngineKey", memory_obj: "MemoryObj") -> None:
        await self._put_many([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List["CacheEngineKey"], memory_objs: List["MemoryObj"]) -> None:
        await self._put_many(list(keys), list(memory_objs))

    # ---- the rest -----------------------------------------------------------------------

    def remove_sync(self, key: "CacheEngineKey") -> bool:
        return self._sync(self._remove(key), self.settings.io_timeout, False)

    async def _remove(self, key: "CacheEngineKey") -> bool:
        ns = engine_key_namespace(key, self._base_ns)
        kb = engine_key_bytes(key)
        n = await self._call(ns, _STORE, "delete", lambda c: c.delete_many([kb]))
        return bool(n)

    async def list(self) -> List[str]:
        """Empty: the gateway has no listing of keys."""
        return []

    async def close(self) -> None:
        self._closed = True
        for key in list(self._clients):
            c = self._clients.get(key)
            if c is not None:
                c.abort()  # wake a call stuck on a frozen gateway
        for key in list(self._clients):
            await self._drop(key)

    def report_status(self) -> dict:
        return {"type": type(self).__name__, "gateway": self.settings.target, "is_healthy": not self._down,
                "gateway_down_for_s": round(time.monotonic() - self._down_since, 1) if self._down else 0.0,
                "sessions": len(self._clients), **self.counters}

    def __repr__(self) -> str:
        return f"<KvgateRemoteConnector {self.settings.target}>"


__all__ = ["KvgateRemoteConnector"]
