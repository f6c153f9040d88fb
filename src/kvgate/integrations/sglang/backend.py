"""KvgateHiCacheStorage: SGLang's HiCache L3 storage backed by a kvgate gateway.

Who calls what, from which thread (SGLang 0.5.23, ``HiCacheController``):

- construction, ``register_mem_pool_host``, ``on_host_pools_registered``,
  ``clear``, ``get_stats``, ``close``: the scheduler thread (attach, flush,
  metrics, detach);
- ``batch_exists``: the prefetch thread (``_storage_hit_query``);
- ``batch_get_v1``: the prefetch I/O thread (``_page_get_zero_copy``);
- ``batch_set_v1``: the backup thread (``_page_backup``).

The three storage threads run at once, so each has its own gateway
connection (a ``Client`` serialises its calls) and, for the two that move
bytes, its own staging region.  None of these threads is restarted by SGLang
when it dies: no method here raises into SGLang, none returns None where
SGLang expects a result, and the gateway calls of one method together wait
no longer than ``kvgate.io_timeout`` (``kvgate.lookup_timeout`` for
``batch_exists``), plus ``kvgate.connect_timeout`` when it has to reconnect.
A gateway that is down or stuck means misses (False, 0) and one log line;
the next call after a back-off reconnects.

Copies.  SGLang's host pool is anonymous process memory (``torch.empty``),
which the gateway cannot map, and a page of the ``layer_first`` layout is
2 x layers separate fragments.  So a page moves as: pool fragments -> one
contiguous slot of a staging region (a /dev/shm file this backend creates,
registers with the gateway and unlinks at once) -> the gateway's RAM tier;
and back the same way.  Two copies each way, each by ``memmove`` (no Python
``bytes`` in between); the gather into the slot is the copy that any
object store needs for a fragmented page.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvgate.client import MARK_KEYS, Client, DialogMark, GatewayError
from kvgate.integrations.sglang.settings import NamespaceInputs, derive_namespace, page_keys, settings_from_extra
from kvgate.integrations.settings import dialog_mark as digest_mark

try:  # the metrics record SGLang's metrics collector expects from get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # pragma: no cover - another SGLang layout: report no metrics
    StorageMetrics = None  # type: ignore[assignment,misc]

# under "sglang." so that SGLang's logging configuration (handler, level, format) applies
logger = logging.getLogger("sglang.kvgate")

#: Most bytes a staging region holds; a larger batch is moved in several rounds.
STAGING_BYTES = 64 << 20
#: Pages per batch SGLang sends (STORAGE_BATCH_SIZE): no region needs more slots.
MAX_BATCH_PAGES = 128
_SLOT_ALIGN = 64  # cache-line aligned slots
_MARK_TTL_S = 30.0  # a cached dialog mark is asked again after this: the gateway keeps learning heads
_MARK_CACHE = 4096


class GatewayDown(ConnectionError):
    """No connection to the gateway right now (it failed recently; retried after a back-off)."""


class OutOfTime(Exception):
    """A method's time budget (``kvgate.io_timeout`` / ``lookup_timeout``) is spent before its next
    gateway call: it returns what it has (the connection is fine and stays)."""


class _Staging:
    """A /dev/shm file mapped here and by the gateway: page slots that the gateway reads and
    writes in place.  The file is unlinked as soon as the gateway has mapped it, so nothing is
    left behind when the process dies; both mappings live until closed."""

    def __init__(self, nbytes: int):
        path = f"/dev/shm/kvgate-sglang-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path: str | None = path
        self.view = memoryview(self.mm)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = nbytes

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None

    def close(self) -> None:
        self.unlink()
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):  # a view still exported: the mapping goes with the process
            pass


class _Link:
    """One lazily (re)connected gateway session for one SGLang thread.

    ``get`` never waits longer than the connect timeout and refuses at once
    during the back-off after a failure, so a dead gateway costs each call
    microseconds, not a timeout.
    """

    def __init__(self, owner: "KvgateHiCacheStorage", name: str, timeout: float, slots: int):
        self.owner = owner
        self.name = name
        self.timeout = timeout
        self.slots = slots  # 0: no bytes travel here (lookups)
        self.lock = threading.Lock()  # held for a whole operation: the staging slots are per call
        self.client: Client | None = None
        self.staging: _Staging | None = None
        self.registered = False
        self._next_try = 0.0
        self._backoff = 0.5
        self.closed = False
        self.deadline = 0.0

    def begin(self) -> Client:
        """The connected client, and the method's time budget starts (caller holds ``self.lock``).

        One SGLang call may take several gateway calls (a dialog mark, one per dialog run or
        staging round): together they get ``timeout``, not each."""
        client = self.get()
        self.deadline = time.monotonic() + self.timeout
        return client

    def budget(self) -> Client:
        """The client with its socket deadline set to what is left of the method's budget."""
        left = self.deadline - time.monotonic()
        if left <= 0 or self.client is None:
            raise OutOfTime(f"{self.name}: the {self.timeout} s budget is spent")
        self.client.set_timeout(left)
        return self.client

    def get(self) -> Client:
        """The connected client (caller holds ``self.lock``); GatewayDown when there is none."""
        if self.closed:
            raise GatewayDown("the backend is closed")
        if self.client is not None and not self.client.broken:
            return self.client
        self.drop()
        now = time.monotonic()
        if now < self._next_try:
            raise GatewayDown(f"next try in {self._next_try - now:.1f} s")
        try:
            self.client = self._open()
        except Exception as e:
            self._next_try = now + self._backoff
            self._backoff = min(self._backoff * 2, 10.0)
            self.owner._went_down(self.name, e)
            raise GatewayDown(str(e)) from e
        self._backoff = 0.5
        self.owner._came_up(self.name)
        return self.client

    def _open(self) -> Client:
        o = self.owner
        s = o.settings
        client = Client.connect(s.target, namespace=o.namespace, token=s.token, engine_id=o.engine_id,
                                want_shm=False, timeout=min(s.connect_timeout, self.timeout))
        client.set_timeout(self.timeout)  # every later call: a stuck gateway is an error, not a hang
        if not self.slots:
            return client
        if self.staging is None:
            self.staging = _Staging(self.slots * o.slot_bytes)
        self.registered = False
        if client.local:
            path = self.staging.path
            if path is None:  # unlinked after an earlier registration: a new gateway needs a new file
                self.staging.close()
                self.staging = _Staging(self.slots * o.slot_bytes)
                path = self.staging.path
            try:
                client.register_region(path, mapping=self.staging.view)
                self.registered = True
            except Exception as e:
                o._log_once("region", "kvgate: the gateway could not map the staging region %s (%s); pages "
                            "travel inline in the socket frames", path, e)
            self.staging.unlink()
        return client

    def drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def abort(self) -> None:
        """Unblock a call in progress on another thread (it fails), refuse new ones."""
        self.closed = True
        client = self.client
        if client is not None:
            client.abort()

    def close(self) -> None:
        self.closed = True
        with self.lock:
            self.drop()
            if self.staging is not None:
                self.staging.close()
                self.staging = None


class KvgateHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage (L3) in a kvgate gateway; see the module docstring for threads.

    Built by SGLang's ``StorageBackendFactory`` as ``Cls(storage_config, kwargs)``
    from ``--hicache-storage-backend dynamic`` with ``interface_v1: 1``; the
    ``kvgate.*`` keys of the extra config are parsed here, and a wrong one
    raises ``ConfigError`` (the attach fails, naming the key).  Nothing
    connects before ``register_mem_pool_host``: the namespace needs the host
    pool's page geometry.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.settings = settings_from_extra(storage_config.extra_config)
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self.namespace: str = self.settings.namespace or ""
        self.namespace_description = ""
        self.engine_id = ""
        self.page_size = 0
        self.page_bytes = 0
        self.slot_bytes = 0
        self.fragments = 0
        self.closed = False
        self._down_since: float | None = None
        self._logged: dict[str, float] = {}
        self._log_lock = threading.Lock()
        self._marks: OrderedDict[bytes, tuple[DialogMark, float]] = OrderedDict()
        self._marks_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self.counters: dict[str, int] = {
            "exists_calls": 0, "exists_pages": 0, "exists_hits": 0, "get_calls": 0, "get_pages": 0,
            "get_hits": 0, "set_calls": 0, "set_pages": 0, "set_stored": 0, "errors": 0, "mark_calls": 0,
            "no_prefix_batch_exists": 0, "no_prefix_batch_get_v1": 0, "no_prefix_batch_set_v1": 0}
        self._lookups: _Link | None = None
        self._loads: _Link | None = None
        self._stores: _Link | None = None
        self._warned_no_prefix = False
        logger.info("kvgate backend: gateway %s, affinity_chunks=%s, retention %s", self.settings.target,
                    self.settings.affinity_chunks or "auto (the gateway's mark)", self.settings.retention)

    # ---- registration (scheduler thread) ----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page geometry, fix the namespace, open the connections.

        Raises (the attach fails, SGLang says so) only when the pool cannot
        describe its pages for zero-copy I/O: then this backend cannot work.
        Connecting does not raise: a gateway that is not up yet is retried.
        """
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError(f"kvgate backend: the host pool describes a page as {len(ptrs)} pointers and "
                             f"{len(sizes)} sizes; cannot store its pages")
        self.page_size = page_size
        self.fragments = len(ptrs)
        self.page_bytes = int(sum(int(s) for s in sizes))
        self.slot_bytes = -(-self.page_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        inputs = NamespaceInputs.build(self.storage_config, page_size=page_size,
                                       layout=getattr(mem_pool_host, "layout", "unknown"),
                                       dtype=str(getattr(mem_pool_host, "dtype", "unknown")),
                                       page_bytes=self.page_bytes, fragments=self.fragments)
        derived, self.namespace_description = derive_namespace(inputs)
        self.namespace = self.settings.namespace or derived
        # A gateway serves one engine; all ranks of one SGLang server are that engine (their pages are
        # apart in the namespace).  SGLang starts every scheduler (rank) process from the server's
        # main process (or its data-parallel controller): their parent names the server.
        self.engine_id = f"sglang-{os.getppid()}"
        slots = max(1, min(MAX_BATCH_PAGES, STAGING_BYTES // self.slot_bytes))
        s = self.settings
        self._lookups = _Link(self, "lookups", s.lookup_timeout, 0)
        self._loads = _Link(self, "loads", s.io_timeout, slots)
        self._stores = _Link(self, "stores", s.io_timeout, slots)
        logger.info("kvgate backend: namespace %r%s; pages of %d tokens, %d bytes in %d fragments (%s); "
                    "staging %d pages a round", self.namespace,
                    "" if s.namespace else " (derived)", page_size, self.page_bytes, self.fragments,
                    inputs.layout, slots)
        if not s.namespace:
            logger.info("kvgate backend: namespace inputs %s", self.namespace_description)
        for link in (self._lookups, self._loads, self._stores):
            with link.lock:
                try:
                    link.get()
                except GatewayDown:
                    pass  # logged; retried by the first call that needs it

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Every pool of the host pool group (the KV pool too); hybrid models' extra pools are recorded
        and their transfers refused (see batch_*_v2)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) == "kv" and host_pool is self.mem_pool_host:
            return  # the anchor pool, registered again as the pool group's KV entry: served by v1
        self._log_once("v2", "kvgate backend: host pool %r registered, but hybrid (v2) transfers are not "
                       "supported yet: requests of this model are computed, not restored", str(host_pool_name))

    # ---- logging -------------------------------------------------------------------------------

    def _log_once(self, topic: str, msg: str, *args: Any, every_s: float = 60.0) -> None:
        now = time.monotonic()
        with self._log_lock:
            last = self._logged.get(topic)
            if last is not None and now - last < every_s:
                return
            self._logged[topic] = now
        logger.warning(msg, *args)

    def _went_down(self, what: str, e: BaseException) -> None:
        with self._log_lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:
            logger.warning("kvgate backend: gateway %s unreachable (%s: %s, on %s); serving without it "
                           "(misses, no stores) and reconnecting in the background of later calls",
                           self.settings.target, type(e).__name__, e, what)

    def _came_up(self, what: str) -> None:
        with self._log_lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.warning("kvgate backend: gateway %s reachable again after %.1f s (%s)", self.settings.target,
                           time.monotonic() - since, what)

    def _failed(self, link: _Link, what: str, e: BaseException) -> None:
        """A call failed: a refusal is logged (rate-limited), anything else drops the connection."""
        self.counters["errors"] += 1
        if isinstance(e, GatewayDown):
            return
        if isinstance(e, OutOfTime):
            self._log_once(f"slow-{what}", "kvgate backend: a %s ran out of time (%s); the rest is a miss", what, e)
            return
        if isinstance(e, GatewayError):
            self._log_once(f"refused-{what}", "kvgate backend: the gateway refused a %s: %s", what, e)
            if e.code in ("ENGINE_BUSY", "NOT_AUTHORIZED", "BAD_VERSION"):
                link.drop()
            return
        if isinstance(e, (OSError, EOFError, ConnectionError)):
            link.drop()
            self._went_down(link.name, e)
            return
        # Not the gateway's doing (a host pool that describes its pages unexpectedly, a bug): the
        # connection stays (a call cut short marks its client broken, and get() replaces it).
        self._log_once(f"unexpected-{what}-{type(e).__name__}", "kvgate backend: %s failed (%s: %s); treated "
                       "as a miss", what, type(e).__name__, e)

    # ---- dialog marks ------------------------------------------------------------------------

    def _dialog(self, link: _Link, bkeys: list[bytes], extra_info: Optional[HiCacheStorageExtraInfo],
                what: str) -> tuple[DialogMark, int]:
        """(DialogMark, position of keys[0]) of a call.

        SGLang passes every page hash before the call's keys in
        ``extra_info.prefix_keys`` when ``hicache_storage_pass_prefix_keys``
        is on; without it a call's place in its prompt is unknown, and pages
        go without a dialog.  With ``kvgate.affinity_chunks`` the mark is a
        digest of the prompt's first pages, as in the vLLM tier; otherwise the
        gateway's mark (``Client.dialog_mark``), cached per prompt head so that
        the calls of one request ask once.
        """
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None:
            self.counters[f"no_prefix_{what}"] += 1
            if not self._warned_no_prefix:
                self._warned_no_prefix = True
                logger.warning("kvgate backend: SGLang passed no prefix keys (%s), so pages go without dialog "
                               "marks (no dialog placement). Add \"hicache_storage_pass_prefix_keys\": true to "
                               "--hicache-storage-backend-extra-config", what)
            return DialogMark(None, 0), -1
        position = len(prefix)
        need = MARK_KEYS + 1 if self.settings.affinity_chunks is None else self.settings.affinity_chunks
        lead = page_keys(prefix[:need]) if position else []
        if len(lead) < need:
            lead += bkeys[: need - len(lead)]
        if self.settings.affinity_chunks is not None:
            return DialogMark(digest_mark(lead), 0), position
        return self._gateway_mark(link, lead), position

    def _gateway_mark(self, link: _Link, lead: list[bytes]) -> DialogMark:
        now = time.monotonic()
        with self._marks_lock:
            hit = self._marks.get(lead[0])
        if hit is not None:
            dm, t = hit
            # The same prompt head iff the keys at the head's cut points and past it are the same
            # (chained hashes: one key names its whole prefix).
            if (now - t < _MARK_TTL_S and dm.mark is not None and dm.shared < len(lead)
                    and lead[dm.shared] == dm.mark and all(lead[p] == m for p, m in dm.heads)):
                return dm
        self.counters["mark_calls"] += 1
        try:
            dm = link.budget().dialog_mark(lead)
        except GatewayError as e:
            if e.code != "UNKNOWN_OP":
                raise
            self._log_once("no-marks", "kvgate backend: the gateway has no dialog_mark (an older version): the "
                           "first page marks the dialog; upgrade the gateway")
            dm = DialogMark(digest_mark(lead[:1]), 0)
        if dm.mark is not None:
            with self._marks_lock:
                self._marks[lead[0]] = (dm, now)
                self._marks.move_to_end(lead[0])
                while len(self._marks) > _MARK_CACHE:
                    self._marks.popitem(last=False)
        return dm

    # ---- page fragments ----------------------------------------------------------------------

    def _fragments(self, host_indices: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != n * self.fragments:
            raise ValueError(f"host pool gave {len(ptrs)} fragments for {n} pages of {self.fragments}")
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    # ---- v1 interface (storage threads) --------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages stored (prefetch thread): one lookup per dialog run, usually one call.

        Never raises; 0 when the gateway is down, stuck past ``kvgate.lookup_timeout`` or refuses.
        """
        n = len(keys)
        link = self._lookups
        if not n or link is None or self.closed:
            return 0
        self.counters["exists_calls"] += 1
        self.counters["exists_pages"] += n
        try:
            bkeys = page_keys(keys)
            with link.lock:
                link.begin()
                dm, position = self._dialog(link, bkeys, extra_info, "batch_exists")
                found = 0
                for start, end, dialog in dm.spans(position, n):
                    c = link.budget().lookup(bkeys[start:end], dialog=dialog)
                    found += c
                    if c < end - start:
                        break
        except Exception as e:
            self._failed(link, "lookup", e)
            return 0
        self.counters["exists_hits"] += found
        return found

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Fill the host pool pages at ``host_indices`` (prefetch I/O thread); per page, whether it came.

        The gateway writes each hit into a staging slot; complete pages are
        then copied into their fragments in the pool.  A page of the wrong
        size (another layout under the same namespace) is a miss.  Never
        raises, never returns None; all False when the gateway is unusable.
        """
        n = len(keys)
        out = [False] * n
        link = self._loads
        if not n or link is None or self.closed:
            return out
        t0 = time.perf_counter()
        self.counters["get_calls"] += 1
        self.counters["get_pages"] += n
        try:
            bkeys = page_keys(keys)
            ptrs, sizes = self._fragments(host_indices, n)
            f = self.fragments
            with link.lock:
                link.begin()
                dm, position = self._dialog(link, bkeys, extra_info, "batch_get_v1")
                stage = link.staging
                assert stage is not None
                slot = self.slot_bytes
                for r0 in range(0, n, link.slots):
                    r1 = min(n, r0 + link.slots)
                    views = [stage.view[(i - r0) * slot:(i - r0) * slot + self.page_bytes] for i in range(r0, r1)]
                    got: list = []
                    for start, end, dialog in dm.spans(position + r0 if position >= 0 else -1, r1 - r0):
                        got += link.budget().get_many(bkeys[r0 + start:r0 + end], into=views[start:end],
                                                     dialog=dialog)
                    sizes_got = [None if g is None else g.nbytes for g in got]
                    got = []
                    for v in views:
                        v.release()
                    for j, size in enumerate(sizes_got):
                        if size is None:
                            continue
                        if size != self.page_bytes:
                            self._log_once("size", "kvgate backend: a stored page is %d bytes, this pool's %d: "
                                           "ignored (a namespace shared by engines with different layouts?)",
                                           size, self.page_bytes)
                            continue
                        i = r0 + j
                        src = stage.base + j * slot
                        for k in range(i * f, (i + 1) * f):
                            ctypes.memmove(ptrs[k], src, sizes[k])
                            src += sizes[k]
                        out[i] = True
        except Exception as e:
            self._failed(link, "load", e)
        hits = sum(out)
        self.counters["get_hits"] += hits
        self._record(self._prefetch_pgs, self._prefetch_bw, hits, t0)
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store the host pool pages at ``host_indices`` (backup thread); per page, whether it was stored.

        Each page's fragments are gathered into a staging slot that the
        gateway reads in place.  With ``kvgate.retention: none`` nothing is
        stored and every page reports True (SGLang would otherwise stop backing
        up the request).  Never raises, never returns None.
        """
        n = len(keys)
        link = self._stores
        if not n:
            return []
        if self.settings.retention == "none":
            return [True] * n
        out = [False] * n
        if link is None or self.closed:
            return out
        t0 = time.perf_counter()
        self.counters["set_calls"] += 1
        self.counters["set_pages"] += n
        try:
            bkeys = page_keys(keys)
            ptrs, sizes = self._fragments(host_indices, n)
            f = self.fragments
            with link.lock:
                link.begin()
                dm, position = self._dialog(link, bkeys, extra_info, "batch_set_v1")
                stage = link.staging
                assert stage is not None
                slot = self.slot_bytes
                for r0 in range(0, n, link.slots):
                    r1 = min(n, r0 + link.slots)
                    for i in range(r0, r1):
                        dst = stage.base + (i - r0) * slot
                        for k in range(i * f, (i + 1) * f):
                            ctypes.memmove(dst, ptrs[k], sizes[k])
                            dst += sizes[k]
                    views = [stage.view[(i - r0) * slot:(i - r0) * slot + self.page_bytes] for i in range(r0, r1)]
                    try:
                        for start, end, dialog in dm.spans(position + r0 if position >= 0 else -1, r1 - r0):
                            stored = link.budget().put_many(
                                bkeys[r0 + start:r0 + end], views[start:end], retention=self.settings.retention,
                                dialog=dialog, position=position + r0 + start if position >= 0 else -1)
                            out[r0 + start:r0 + end] = [bool(s) for s in stored]
                    finally:
                        for v in views:
                            v.release()
        except Exception as e:
            self._failed(link, "store", e)
        stored_n = sum(out)
        self.counters["set_stored"] += stored_n
        self._record(self._backup_pgs, self._backup_bw, stored_n, t0)
        return out

    def _record(self, pgs: list[int], bw: list[float], pages: int, t0: float) -> None:
        if not pages:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:
            if len(pgs) < 10000:  # bounded when SGLang never collects (metrics off)
                pgs.append(pages)
                bw.append(pages * self.page_bytes / dt / 1e9 if dt > 0 else 0.0)

    # ---- hybrid (v2) interface: not supported yet; refused without raising --------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[list] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._log_once("v2", "kvgate backend: hybrid (v2) storage is not supported yet: no hits")
        return PoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: list, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        return {str(t.name): [False] * len(t.keys or ()) for t in transfers}

    def batch_set_v2(self, transfers: list, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        return {str(t.name): [False] * len(t.keys or ()) for t in transfers}

    # ---- the legacy (non-zero-copy) interface: SGLang uses it only without interface_v1 --------

    def _needs_v1(self, *_: Any, **__: Any) -> Any:
        self._log_once("legacy", "kvgate backend: SGLang called the legacy page-copy interface: add "
                       "\"interface_v1\": 1 to --hicache-storage-backend-extra-config (nothing is stored "
                       "or read without it)")
        return None

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self._needs_v1()

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        self._needs_v1()
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._needs_v1()
        return False

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self._needs_v1()
        return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- control (scheduler thread) --------------------------------------------------------------

    def clear(self) -> None:
        """Delete everything stored (SGLang's cache flush).  A gateway on shared storage refuses
        (other engines use those pages): logged, nothing raised.  Bounded by ``kvgate.io_timeout``."""
        link = self._stores
        if link is None:
            return
        try:
            with link.lock:
                n = link.get().clean()
            logger.info("kvgate backend: clear deleted %d objects in the gateway", n)
        except GatewayError as e:
            logger.warning("kvgate backend: clear refused by the gateway (%s): nothing deleted", e)
        except Exception as e:
            self._failed(link, "clear", e)
            logger.warning("kvgate backend: clear failed (%s: %s): nothing deleted", type(e).__name__, e)

    def get_stats(self) -> Any:
        """Pages and bandwidth (GB/s) per transfer since the last call, as SGLang's ``StorageMetrics``."""
        if StorageMetrics is None:
            return None
        with self._metrics_lock:
            m = StorageMetrics(prefetch_pgs=self._prefetch_pgs, backup_pgs=self._backup_pgs,
                               prefetch_bandwidth=self._prefetch_bw, backup_bandwidth=self._backup_bw)
            self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw = [], [], [], []
        return m

    def close(self) -> None:
        """Detach (scheduler thread, after SGLang stopped its storage threads): close connections and
        staging regions.  Calls still in flight on other threads are aborted first."""
        self.closed = True
        links = [x for x in (self._lookups, self._loads, self._stores) if x is not None]
        for link in links:
            link.abort()
        for link in links:
            try:
                link.close()
            except Exception:
                pass
        logger.info("kvgate backend: closed; %s", self.counters)
