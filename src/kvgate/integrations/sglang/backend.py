"""KvgateHiCacheStorage: SGLang's HiCache L3 storage backed by a kvgate gateway.

Who calls what, from which thread (SGLang 0.5.23, ``HiCacheController``):

- construction, ``register_mem_pool_host``, ``register_mem_host_pool_v2``,
  ``on_host_pools_registered``, ``clear``, ``get_stats``, ``close``: the
  scheduler thread (attach, flush, metrics, detach);
- ``batch_exists``, and ``batch_exists_v2`` for hybrid models: the prefetch
  thread (``_storage_hit_query``);
- ``batch_get_v1``, and ``batch_get_v2`` for a hybrid model's extra pools:
  the prefetch I/O thread (``_page_get_zero_copy``, ``_page_transfer_sidecar``);
- ``batch_set_v1``, and ``batch_set_v2`` for the extra pools: the backup
  thread (``_page_backup``).

The three storage threads run at once, so each has its own gateway
connection (a ``Client`` serialises its calls) and, for stores, its own
staging region.  None of these threads is restarted by SGLang
when it dies: no method here raises into SGLang, none returns None where
SGLang expects a result, and the gateway calls of one method together wait
no longer than ``kvgate.io_timeout`` (``kvgate.lookup_timeout`` for
``batch_exists``), plus ``kvgate.connect_timeout`` when it has to reconnect.
A gateway that is down or stuck means misses (False, 0) and one log line;
the next call after a back-off reconnects.

The parts it delegates to, one job each: ``link`` (a thread's gateway connection, its
reconnects and time budget), ``failures`` (what a failure costs: a log line, maybe the
connection), ``pools`` (a host pool's page geometry and keys, the rules a hybrid call's
pools agree by), ``marks`` (a call's dialog mark), ``staging`` (the copies: a store's pool
fragments -> a registered /dev/shm slot -> the gateway's RAM tier, two copies; a load's
straight into the fragments, one where the gateway lends its memory), ``stats`` (the
figures ``get_stats`` hands SGLang).
"""

from __future__ import annotations

import os
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransferResult,
)

from kvgate.client import GatewayError
from kvgate.integrations.sglang.failures import FailureLog, logger
from kvgate.integrations.sglang.link import GatewayDown, GatewayLink
from kvgate.integrations.sglang.marks import DialogMarks
from kvgate.integrations.sglang.pools import (
    RegisteredPool,
    all_or_none,
    as_pool_name,
    describe_pool,
    restorable_prefixes,
)
from kvgate.integrations.sglang.settings import NamespaceInputs, derive_namespace, page_keys, settings_from_extra
from kvgate.integrations.sglang.staging import MAX_BATCH_PAGES, STAGING_BYTES, load_pages, store_pages
from kvgate.integrations.sglang.stats import TransferStats


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
        self._stats = TransferStats()
        self.counters: dict[str, int] = {
            "exists_calls": 0, "exists_pages": 0, "exists_hits": 0, "get_calls": 0, "get_pages": 0,
            "get_hits": 0, "set_calls": 0, "set_pages": 0, "set_stored": 0, "errors": 0, "mark_calls": 0,
            "no_prefix_batch_exists": 0, "no_prefix_batch_get_v1": 0, "no_prefix_batch_set_v1": 0,
            "exists_v2_calls": 0, "exists_v2_pages": 0, "exists_v2_hits": 0, "get_v2_calls": 0,
            "get_v2_pages": 0, "get_v2_hits": 0, "set_v2_calls": 0, "set_v2_pages": 0, "set_v2_stored": 0,
            "no_prefix_batch_exists_v2": 0, "no_prefix_batch_get_v2": 0, "no_prefix_batch_set_v2": 0}
        self._log = FailureLog(self.settings.target, self.counters)
        self._marks = DialogMarks(self.settings.affinity_chunks, self.counters, self._log)
        self._kv: RegisteredPool | None = None  # the anchor (KV) pool, moved by v1
        # every pool registered through v2, by name (replaced, never mutated)
        self._pools: dict[str, RegisteredPool] = {}
        self._lookups: GatewayLink | None = None
        self._loads: GatewayLink | None = None
        self._stores: GatewayLink | None = None
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
        try:
            kv = describe_pool(as_pool_name(PoolName.KV), mem_pool_host, None)
        except Exception as e:
            raise ValueError(f"kvgate backend: cannot store the host pool's pages: {e}") from e
        page_size = kv.page_size
        self._kv = kv
        self.page_size = page_size
        self.fragments = kv.fragments
        self.page_bytes = kv.page_bytes
        self.slot_bytes = kv.slot_bytes
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
        self._close_links()  # a second registration (a new pool) replaces the first one's connections
        self._lookups = self._new_link("lookups", s.lookup_timeout, 0)
        self._loads = self._new_link("loads", s.io_timeout, 0)  # pages land in the pool's own fragments
        self._stores = self._new_link("stores", s.io_timeout, slots)
        for link in (self._loads, self._stores):  # extra pools registered before the anchor (not SGLang's order)
            link.min_bytes = max([p.slot_bytes for p in self._pools.values() if not p.error] + [0])
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

    def _close_links(self) -> None:
        links = [x for x in (self._lookups, self._loads, self._stores) if x is not None]
        self._lookups = self._loads = self._stores = None
        for link in links:
            link.abort()
        for link in links:
            try:
                link.close()
            except Exception:
                pass

    def _new_link(self, name: str, timeout: float, slots: int) -> GatewayLink:
        """A storage thread's connection, in the namespace and with the page slots just fixed."""
        return GatewayLink(name, timeout, slots, settings=self.settings, namespace=self.namespace,
                           engine_id=self.engine_id, slot_bytes=self.slot_bytes, log=self._log,
                           namespace_inputs=self.namespace_description)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """One pool of SGLang's host pool group (scheduler thread): at attach, every entry (the KV
        anchor again, then a hybrid model's Mamba, SWA, indexer... pools); later, a sidecar SGLang
        adds at run time.

        Learns the pool's page geometry from ``get_page_buffer_meta``, as for the anchor.  Never
        raises (that would fail the attach, or SGLang's scheduler for a later sidecar): a pool
        whose pages cannot be described is logged and its transfers are misses, so the requests
        that need it are computed, never restored without it.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = as_pool_name(host_pool_name)
        if name == as_pool_name(PoolName.KV) and host_pool is self.mem_pool_host and self._kv is not None:
            pool = self._kv  # the anchor again, as the group's KV entry: its pages are the v1 objects
        else:
            # Mamba state is split over TP ranks even where the KV is the same on all of them (an MLA
            # namespace has no TP part): its objects carry the rank.
            cfg = self.storage_config
            extra = ({"tp": f"{getattr(cfg, 'tp_rank', 0)}/{getattr(cfg, 'tp_size', 1)}"}
                     if name == as_pool_name(PoolName.MAMBA) else {})
            try:
                pool = describe_pool(name, host_pool, extra)
            except Exception as e:
                pool = RegisteredPool(name, host_pool, error=f"{type(e).__name__}: {e}")
                logger.warning("kvgate backend: host pool %r cannot be stored (%s): requests that need it are "
                               "computed, not restored", name, pool.error)
        self._pools = {**self._pools, name: pool}
        if pool.error:
            return
        logger.info("kvgate backend: host pool %r: pages of %d indices, %d bytes in %d fragments%s", name,
                    pool.page_size, pool.page_bytes, pool.fragments,
                    " (the KV pool: v1 objects)" if pool.tag is None else "")
        for link in (self._loads, self._stores):
            if link is not None:
                link.fit(pool.slot_bytes)

    def on_host_pools_registered(self) -> None:
        """The attach's pools are all registered (scheduler thread): one line naming them."""
        usable = sorted(n for n, p in self._pools.items() if not p.error)
        refused = sorted(n for n, p in self._pools.items() if p.error)
        if self._pools:
            logger.info("kvgate backend: host pools %s stored%s", usable,
                        f"; {refused} cannot be (their requests are computed)" if refused else "")

    def pool_key(self, pool_name: Any, page_hash: str) -> bytes:
        """The kvgate key (in ``self.namespace``) of one pool's part of the page ``page_hash``;
        for the KV pool, the page's v1 key."""
        name = as_pool_name(pool_name)
        pool = self._kv if name == as_pool_name(PoolName.KV) else self._pools.get(name)
        if pool is None:
            raise KeyError(f"no host pool {name!r} registered")
        return pool.key(page_keys([page_hash])[0])

    def _extra_pool(self, name: Any) -> RegisteredPool:
        n = as_pool_name(name)
        pool = self._kv if n == as_pool_name(PoolName.KV) else self._pools.get(n)
        if pool is None:
            raise ValueError(f"host pool {n!r} was never registered")
        if pool.error:
            raise ValueError(f"host pool {n!r} cannot be stored: {pool.error}")
        return pool

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
                dm, position = self._marks.of_call(link, bkeys, extra_info, "batch_exists")
                found = 0
                for start, end, dialog in dm.spans(position, n):
                    c = link.budget().lookup(bkeys[start:end], dialog=dialog)
                    found += c
                    if c < end - start:
                        break
        except Exception as e:
            self._log.failed(link, "lookup", e)
            return 0
        self.counters["exists_hits"] += found
        return found

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Fill the host pool pages at ``host_indices`` (prefetch I/O thread); per page, whether it came.

        Each hit is read straight into its page's fragments in the pool
        (``staging.load_pages``).  A page of the wrong
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
            assert self._kv is not None
            ptrs, sizes = self._kv.fragments_of(host_indices, n)
            with link.lock:
                link.begin()
                dm, position = self._marks.of_call(link, bkeys, extra_info, "batch_get_v1")
                load_pages(link, self._kv, bkeys, ptrs, sizes, dm, position, out, self._log)
        except Exception as e:
            self._log.failed(link, "load", e)
        hits = sum(out)
        self.counters["get_hits"] += hits
        self._stats.prefetched(hits, t0, self.page_bytes)
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
            assert self._kv is not None
            ptrs, sizes = self._kv.fragments_of(host_indices, n)
            with link.lock:
                link.begin()
                dm, position = self._marks.of_call(link, bkeys, extra_info, "batch_set_v1")
                store_pages(link, self._kv, bkeys, ptrs, sizes, dm, position, out, self.settings.retention)
        except Exception as e:
            self._log.failed(link, "store", e)
        stored_n = sum(out)
        self.counters["set_stored"] += stored_n
        self._stats.backed_up(stored_n, t0, self.page_bytes)
        return out

    # ---- hybrid (v2) interface: the extra pools of Mamba, SWA and DSA models (storage threads) ----
    #
    # SGLang calls these only for a hybrid model (its host pool is a HostPoolGroup and a request's
    # operation carries pool transfers): the KV pages still go through v1 (batch_get_v1 /
    # batch_set_v1, the same objects as for any model); v2 moves the other pools' parts of those
    # pages, each under pool_page_key(its tag, page key).  A page is restored whole or not at all:
    # batch_exists_v2 counts a prefix only when the KV pages and every pool's required parts are
    # there, and batch_get_v2 / batch_set_v2 report a page for no pool unless every pool's part
    # of it came (``all_or_none``).

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[list] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The longest restorable prefix of ``keys`` (prefetch thread), per SGLang's hit policies.

        The KV pages must lead; then, per extra pool, ``ALL_PAGES`` (e.g. a DSA indexer) needs its
        part of every page of the prefix, and ``TRAILING_PAGES`` (Mamba and SWA states, which
        SGLang backs up only for the last page(s) of each backup) needs the last
        ``len(transfer.keys)`` pages of the prefix; any other policy is read as ``ALL_PAGES``.
        ``kv_hit_pages`` is the longest prefix every pool allows, ``restorable_prefix_pages``
        all such prefix lengths.  A pool that was never registered, or cannot be stored, allows
        none.  Never raises; an empty result when the gateway is down, slow or refuses.
        """
        n = len(keys)
        link = self._lookups
        if not n or link is None or self.closed:
            return PoolTransferResult(0, {}, [])
        self.counters["exists_v2_calls"] += 1
        self.counters["exists_v2_pages"] += n
        try:
            extras = [(t, self._extra_pool(t.name)) for t in (pool_transfers or ())
                      if as_pool_name(t.name) != as_pool_name(PoolName.KV)]  # the KV pages are ``keys`` themselves
            bkeys = page_keys(keys)
            with link.lock:
                link.begin()
                dm, position = self._marks.of_call(link, bkeys, extra_info, "batch_exists_v2")
                kv = 0
                for start, end, dialog in dm.spans(position, n):
                    c = link.budget().lookup(bkeys[start:end], dialog=dialog)
                    kv += c
                    if c < end - start:
                        break
                have = [[False] * kv for _ in extras]
                if extras and kv:  # one exists_many per dialog run, every pool's keys at once
                    for start, end, dialog in dm.spans(position, kv):
                        m = end - start
                        ask = [pool.key(b) for _, pool in extras for b in bkeys[start:end]]
                        got = link.budget().exists_many(ask, dialog=dialog)
                        for j in range(len(extras)):
                            have[j][start:end] = [bool(x) for x in got[j * m:(j + 1) * m]]
        except Exception as e:
            self._log.failed(link, "lookup", e)
            return PoolTransferResult(0, {}, [])
        hits, restorable = restorable_prefixes(kv, [t for t, _ in extras], have)
        final = max(restorable, default=0)
        self.counters["exists_v2_hits"] += final
        return PoolTransferResult(final, hits, sorted(restorable))

    def _v2_io(self, what: str, link: Optional[GatewayLink], transfers: list,
               extra_info: Optional[HiCacheStorageExtraInfo]) -> dict:
        """batch_get_v2 / batch_set_v2: every transfer's pages (``load_pages`` / ``store_pages``),
        under one time budget; per pool name, per key, whether it moved (all or none per page)."""
        transfers = list(transfers or ())
        out = {t.name: [False] * len(t.keys or ()) for t in transfers}
        n = sum(len(r) for r in out.values())
        if not n:
            return out
        if what == "store" and self.settings.retention == "none":
            return {name: [True] * len(r) for name, r in out.items()}
        if link is None or self.closed:
            return out
        c = "get_v2" if what == "load" else "set_v2"
        self.counters[f"{c}_calls"] += 1
        self.counters[f"{c}_pages"] += n
        try:
            plans = []
            for t in transfers:
                if not t.keys:
                    continue
                pool = self._extra_pool(t.name)
                ptrs, sizes = pool.fragments_of(t.host_indices, len(t.keys))
                bkeys = page_keys(t.keys)
                plans.append((t, pool, bkeys, ptrs, sizes))
            with link.lock:
                link.begin()
                # SGLang groups the transfers of one call so that prefix_keys + keys is one chain for each
                dm, position = self._marks.of_call(link, plans[0][2], extra_info, f"batch_{c}")
                for t, pool, bkeys, ptrs, sizes in plans:
                    skeys = [pool.key(b) for b in bkeys]
                    if what == "load":
                        load_pages(link, pool, skeys, ptrs, sizes, dm, position, out[t.name], self._log)
                    else:
                        store_pages(link, pool, skeys, ptrs, sizes, dm, position, out[t.name], self.settings.retention)
        except Exception as e:
            self._log.failed(link, what, e)
        all_or_none(transfers, out)
        self.counters["get_v2_hits" if what == "load" else "set_v2_stored"] += sum(sum(r) for r in out.values())
        return out

    def batch_get_v2(self, transfers: list, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Fill each transfer's pool pages at its ``host_indices`` from its keys (prefetch I/O thread).

        The same path as ``batch_get_v1``, one pool after another, all under one
        ``kvgate.io_timeout``.  Per pool name (as SGLang named it), per key, whether it came; a
        page is reported for no pool unless every pool of the call restored its part, and pages
        after a missing one are not reported either.  Never raises, never returns None.
        """
        return self._v2_io("load", self._loads, transfers, extra_info)

    def batch_set_v2(self, transfers: list, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Store each transfer's pool pages under its keys (backup thread); per pool name, per key,
        whether it was stored, all or none per page as in ``batch_get_v2``.  With
        ``kvgate.retention: none`` nothing is stored and every page reports True."""
        return self._v2_io("store", self._stores, transfers, extra_info)

    # ---- the legacy (non-zero-copy) interface: SGLang uses it only without interface_v1 --------

    def _needs_v1(self, *_: Any, **__: Any) -> Any:
        self._log.warn_once("legacy", "kvgate backend: SGLang called the legacy page-copy interface: add "
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
        """Delete everything stored under this engine's namespace (SGLang's cache flush; an engine session
        cleans its own namespace only).  A gateway on shared storage refuses (other engines use those
        pages): logged, nothing raised.  Bounded by ``kvgate.io_timeout``."""
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
            self._log.failed(link, "clear", e)
            logger.warning("kvgate backend: clear failed (%s: %s): nothing deleted", type(e).__name__, e)

    def get_stats(self) -> Any:
        """Pages and bandwidth (GB/s) per transfer since the last call, as SGLang's ``StorageMetrics``."""
        return self._stats.collect()

    def close(self) -> None:
        """Detach (scheduler thread, after SGLang stopped its storage threads): close connections and
        staging regions.  Calls still in flight on other threads are aborted first."""
        self.closed = True
        self._close_links()
        logger.info("kvgate backend: closed; %s", self.counters)
