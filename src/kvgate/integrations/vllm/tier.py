"""KvgateTier: a secondary tier of vLLM's KV offloading framework backed by a kvgate gateway.

It runs in vLLM's scheduler process and never blocks it:

- lookups are collected during a scheduler step and sent as one batch per
  request on a background thread when the step ends (vLLM's
  ``AsyncLookupManager``, as the in-tree ``fs`` tier does); until the answer
  is in, a lookup answers RETRY;
- stores (primary CPU tier -> gateway) and loads (gateway -> primary) are
  jobs run by two background threads, reported by ``get_finished_jobs``;
- on one host the primary tier's shared-memory file is registered with the
  gateway, so the gateway reads and writes chunk rows in place (zero copy);
- a gateway that is down, slow or refusing means misses and failed stores,
  never an exception into vLLM.

Each thread's gateway session is a ``connection.TierConnection``; what the tier keeps per
request (retention, dialog mark) is ``request_state``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import ClassVar

from kvgate.client import GatewayError
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.vllm import compat
from kvgate.integrations.vllm.compat import (
    AsyncLookupManager,
    BackpressureDetector,
    JobId,
    JobResult,
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTierManager,
    TransferJob,
)
from kvgate.integrations.vllm.connection import GatewayDown, Outage, TierConnection
from kvgate.integrations.vllm.cputier import claim_cpu_tier
from kvgate.integrations.vllm.engine import describe_engine, install_salt_probe
from kvgate.integrations.vllm.request_state import ReqState, RequestStates
from kvgate.integrations.vllm.settings import TierSettings, chunk_runs

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")


class _KvgateLookup(AsyncLookupManager):
    """vLLM's per-step batched async lookups, answered by the gateway."""

    def __init__(self, tier: "KvgateTier"):
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._batch_exists(keys, req_context)


class KvgateTier(SecondaryTierManager):
    """A kvgate gateway as a secondary tier of vLLM's tiering KV offloading.

    Built by ``TieringOffloadingSpec.get_manager`` in the scheduler process;
    vLLM's tiering manager calls its ``SecondaryTierManager`` methods on the
    scheduler thread, and none of them waits on the gateway: lookups are
    answered by the lookup thread (``_KvgateLookup``), stores and loads by
    two job threads, each with its own gateway session.

    As a ``secondary_tiers`` entry::

        {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm",
         "socket": "/run/kvgate.sock"}

    Keyword arguments (the entry's other keys): ``socket`` or ``address``
    (host:port), ``token_file``, ``namespace`` (derived from the model config
    when absent), ``affinity_chunks`` (unset: the gateway's mark, taken past
    any prompt head shared by many requests), ``refuse_unsalted``,
    ``skip_unsalted``, ``retention`` (default per request: long),
    ``connect_timeout``, ``io_timeout`` (stores, loads), ``lookup_timeout``
    (seconds; a lookup not answered in time is a miss).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        socket: str | None = None,
        address: str | None = None,
        token_file: str | None = None,
        namespace: str | None = None,
        affinity_chunks: int | str | None = None,
        refuse_unsalted: bool = False,
        skip_unsalted: bool = False,
        retention: str = "long",
        connect_timeout: float = 2.0,
        io_timeout: float = 10.0,
        lookup_timeout: float = 2.0,
        locality: str | None = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        install_salt_probe()  # also when the tier is an entry of vLLM's own TieringOffloadingSpec

        self.settings = TierSettings.build(
            socket=socket, address=address, token_file=token_file, namespace=namespace,
            affinity_chunks=affinity_chunks, refuse_unsalted=refuse_unsalted, skip_unsalted=skip_unsalted,
            retention=retention, connect_timeout=connect_timeout, io_timeout=io_timeout,
            lookup_timeout=lookup_timeout)
        if locality is not None:
            self.locality = Locality(locality)
        self._spec = offloading_spec
        # One flat byte view of the CPU tier; chunk c is [c * block_size_bytes, +block_size_bytes).
        # It and every slice of it are released before vLLM unmaps the tier (shutdown()).
        self._flat: memoryview | None = primary_kv_view.cast("B")
        info = describe_engine(offloading_spec)
        # Dead engines' CPU tier files go; ours is marked for the next start (vLLM leaves it at every kill).
        claim_cpu_tier(self.region_path())
        self.engine_id: str = info.engine_id
        self.namespace: str = self.settings.namespace or info.namespace
        self.salt_detection: bool = info.salt_detection
        self._log = RateLimitedLog(logger)
        logger.info("kvgate tier: gateway %s, namespace %r%s, affinity_chunks=%s, default retention %s%s",
                    self.settings.target, self.namespace,
                    "" if self.settings.namespace else " (derived from the model config)",
                    self.settings.affinity_chunks or "auto (the gateway's mark)", self.settings.retention,
                    ", salted requests only" if self.settings.salted_only else "")
        if not self.settings.namespace:
            logger.info("kvgate tier: namespace inputs %s", info.namespace_description)
        if self.settings.salted_only and not self.salt_detection:
            logger.warning("kvgate tier: refuse_unsalted/skip_unsalted is set but this vLLM build does not let "
                           "the tier see cache_salt; every request is treated as unsalted (nothing is cached)")

        # Job bookkeeping.  _finished is filled by the I/O threads, drained on the scheduler thread.
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._outstanding = 0
        self._idle = threading.Condition()
        self._closing = False  # shutdown started: no new jobs
        self._aborted = False  # drain time is over: queued jobs fail without I/O
        self.counters = {"stores": 0, "stored_chunks": 0, "store_failures": 0, "skipped_stores": 0,
                         "loads": 0, "loaded_chunks": 0, "load_failures": 0, "lookups": 0, "lookup_hits": 0}

        self._requests = RequestStates(self.settings, self._log, info.tokens_per_chunk)

        outage = Outage()  # one for the three sessions: a gateway back is logged once
        # What each key is, for the KV events a gateway publishes (Hello.block_keys): vLLM's offloading
        # key, make_offload_key(block_hash, group_idx) = hash + 4-byte big-endian group index.  In vLLM 0.32
        # (offloading/scheduler.py update_offload_keys, _make_boundary_key) a key covers one chunk of
        # blocks_per_chunk GPU blocks (tokens_per_chunk tokens) and its hash is request.block_hashes of the
        # chunk's LAST hash block (index (k+1) * hashes_per_chunk - 1, hashes made every tokens_per_hash
        # tokens by the engine's prefix_caching_hash_algo): the same hash a vLLM engine's own BlockStored
        # carries for that block.  block_size: tokens per key, when every group has the same (0 if not).
        chunk_sizes = set(info.tokens_per_chunk.values())
        block_size = chunk_sizes.pop() if len(chunk_sizes) == 1 else 0

        def connection(name: str, timeout: float, bulk: bool = True) -> TierConnection:
            # primary_kv_view is registered with a local gateway: transfers in place
            return TierConnection(name, timeout, settings=self.settings, namespace=self.namespace,
                                  engine_id=self.engine_id, region_path=self.region_path,
                                  region_view=primary_kv_view, log=self._log, bulk=bulk, outage=outage,
                                  block_size=block_size, namespace_inputs=info.namespace_description)

        self._store_conn = connection("stores", self.settings.io_timeout)
        self._load_conn = connection("loads", self.settings.io_timeout)
        self._lookup_conn = connection("lookups", self.settings.lookup_timeout, bulk=False)
        self._load_q: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._store_q: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._job_loop, args=(self._load_q, self._load_conn, True),
                             name="kvgate_tier_loads", daemon=True),
            threading.Thread(target=self._job_loop, args=(self._store_q, self._store_conn, False),
                             name="kvgate_tier_stores", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._lookup = _KvgateLookup(self)

    # ---- helpers ----------------------------------------------------------------------

    def region_path(self) -> str | None:
        """The /dev/shm file behind the primary tier (the scheduler's mapping of it)."""
        return compat.scheduler_region_path(self._spec)

    def _job_started(self) -> None:
        with self._idle:
            self._outstanding += 1

    def _job_done(self, result: JobResult) -> None:
        self._finished.put(result)
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    # ---- SecondaryTierManager: scheduler thread ------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._requests.of(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        st = self._requests.of(req_context)
        if not st.enabled or self._closing:
            return LookupResult.MISS
        self._requests.mark(req_context, st)
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        ctx = job_metadata.req_context
        st = self._requests.of(ctx)
        self._job_started()
        if not st.enabled or st.retention == "none" or self._closing:
            self.counters["skipped_stores"] += 1
            self._job_done(JobResult(job_id=job_metadata.job_id, success=True, transfer_bytes=0))
            return
        keys = list(job_metadata.keys)
        # Everything read from the (scheduler-owned) request context is resolved here.
        job_metadata.keys = keys
        self._requests.mark(ctx, st)
        ends = [ctx.get_offload_key_position(k) for k in keys]
        compat.attach_to_job(job_metadata, (st, [self._requests.position(ctx, k) for k in keys], ends))
        self._store_q.put(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        ctx = job_metadata.req_context
        st = self._requests.of(ctx)
        keys = list(job_metadata.keys)
        job_metadata.keys = keys
        self._load_keys[job_metadata.job_id] = keys
        self._job_started()
        self._requests.mark(ctx, st)
        compat.attach_to_job(job_metadata, (st, None, [ctx.get_offload_key_position(k) for k in keys]))
        self._load_q.put(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                r = self._finished.get_nowait()
            except queue.Empty:
                break
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success:
                ok = set(r.successful_keys or ())
                # Stop offering what failed to load, or the scheduler would retry it forever.
                self._lookup.mark_miss([k for k in keys if k not in ok])
            results.append(r)
        return results

    def has_pending_work(self) -> bool:
        return self._outstanding > 0

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        with self._idle:
            while self._outstanding > 0:
                self._idle.wait(1.0)

    def shutdown(self, drain_s: float = 1.0) -> None:
        """Finish what completes within ``drain_s`` (vLLM kills the engine core about 5 s after
        shutdown starts), then abort the rest and release every view of vLLM's CPU tier."""
        t0 = time.monotonic()
        self._closing = True
        logger.info("kvgate tier: shutting down, %d job(s) in flight", self._outstanding)
        deadline = t0 + drain_s
        with self._idle:
            while self._outstanding > 0 and time.monotonic() < deadline:
                self._idle.wait(0.05)
        self._aborted = True
        for conn in (self._store_conn, self._load_conn, self._lookup_conn):
            conn.abort()
        self._load_q.put(None)
        self._store_q.put(None)
        compat.stop_lookup_thread(self._lookup)
        threads = [*self._threads, compat.lookup_thread(self._lookup)]
        for t in threads:
            t.join(timeout=max(0.1, t0 + drain_s + 2.0 - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            logger.error("kvgate tier: thread(s) %s did not stop; vLLM may fail to unmap its CPU tier", stuck)
        else:
            self._lookup.drain_results()
            for conn in (self._store_conn, self._load_conn, self._lookup_conn):
                conn.close()
            if self._flat is not None:
                try:
                    self._flat.release()
                except BufferError:
                    logger.error("kvgate tier: a view of vLLM's CPU tier is still in use")
                self._flat = None
        logger.info("kvgate tier: shut down in %.2f s; %s", time.monotonic() - t0, self.counters)

    # ---- background threads ----------------------------------------------------------------

    def _batch_exists(self, keys: list[OffloadKey], ctx: ReqContext) -> list[bool]:
        st = ctx.get_state(ReqState)
        self.counters["lookups"] += len(keys)
        try:
            client = self._lookup_conn.get()
            dm = self._requests.dialog(st, client)
            ends = [ctx.get_offload_key_position(k) for k in keys] if st is not None and st.shared_tokens else \
                [None] * len(keys)
            present = []
            source = st.source if st is not None else None
            for start, end, dialog in self._requests.runs(st, dm, ends):
                present += client.exists_many([bytes(k) for k in keys[start:end]], dialog=dialog, source=source)
        except GatewayDown:
            return [False] * len(keys)
        except Exception as e:
            self._connection_error(self._lookup_conn, "lookup", e)
            return [False] * len(keys)
        # A prefix restores up to its first miss: report nothing past it.
        out: list[bool] = []
        for p in present:
            if not p:
                break
            out.append(True)
        out += [False] * (len(keys) - len(out))
        self.counters["lookup_hits"] += sum(out)
        return out

    def _connection_error(self, conn: TierConnection, what: str, e: Exception) -> None:
        if isinstance(e, GatewayError):
            self._log.warning(f"refused-{what}", "kvgate: gateway refused a %s: %s", what, e)
            if e.code in ("ENGINE_BUSY", "NOT_AUTHORIZED", "UNSALTED_REFUSED", "BAD_VERSION"):
                conn.drop()
            return
        if not self._closing:
            self._log.warning(f"error-{what}", "kvgate: %s failed (%s: %s); the connection is reopened",
                              what, type(e).__name__, e)
        conn.drop()

    def _job_loop(self, q: "queue.SimpleQueue[TransferJob | None]", conn: TierConnection, is_load: bool) -> None:
        # Open the sessions now, not in the first request's lookup and load: connecting and
        # registering the CPU tier cost the first restore after an engine start ~30 ms.
        for c in (self._lookup_conn, conn) if is_load else (conn,):
            try:
                c.get()
            except Exception:  # GatewayDown (logged): retried when a request needs it
                pass
        while True:
            job = q.get()
            if job is None:
                return
            try:
                result = self._run_load(job, conn) if is_load else self._run_store(job, conn)
            except BaseException as e:  # never let a job vanish: the scheduler waits for every one
                logger.exception("kvgate tier: job %s failed unexpectedly: %s", job.job_id, e)
                result = JobResult(job_id=job.job_id, success=False)
            self._job_done(result)

    def _rows(self, chunk_ids) -> list[memoryview]:
        flat, step = self._flat, self.block_size_bytes
        if flat is None:
            raise GatewayDown("the tier is shut down")
        return [flat[int(c) * step:(int(c) + 1) * step] for c in chunk_ids]

    def _refuse_bad_chunks(self, job: TransferJob, what: str) -> bool:
        """True (logged) when the job names a chunk id that is no whole row of the CPU tier (negative, or
        past its end): the job then fails whole, before any I/O, as vLLM's fs tier does (its
        ``_validate_offsets``).  Unchecked, a slice past the end of a memoryview is clamped, not
        refused: such a chunk was stored as a 0-byte object that later lookups reported as a hit."""
        flat = self._flat
        rows = 0 if flat is None else flat.nbytes // self.block_size_bytes
        bad = [int(c) for c in job.chunk_ids if not 0 <= int(c) < rows]
        if not bad or flat is None:  # shut down: _rows says so
            return False
        self._log.warning(f"bad-chunk-{what}", "kvgate tier: a %s job names chunk(s) %s outside the CPU tier's "
                          "%d chunks: the job fails, nothing is %s", what, bad[:8], rows,
                          "stored" if what == "store" else "loaded")
        return True

    @staticmethod
    def _release(views: list[memoryview]) -> None:
        for v in views:
            try:
                v.release()
            except Exception:
                pass

    def _run_store(self, job: TransferJob, conn: TierConnection) -> JobResult:
        st, positions, ends = compat.job_attachment(job)
        keys = [bytes(k) for k in job.keys]
        t0 = time.monotonic()
        if self._aborted:
            # Shut down: do not start new writes (vLLM is about to unmap the CPU tier).
            return JobResult(job_id=job.job_id, success=False)
        if self._refuse_bad_chunks(job, "store"):
            self.counters["store_failures"] += 1
            return JobResult(job_id=job.job_id, success=False)
        rows = self._rows(job.chunk_ids)
        ok = 0
        try:
            client = conn.get()
            dm = self._requests.dialog(st, client)
            for d_start, d_end, dialog in self._requests.runs(st, dm, ends):
                for start, end, pos in chunk_runs(positions[d_start:d_end]):
                    start, end = start + d_start, end + d_start
                    stored = client.put_many(keys[start:end], rows[start:end], retention=st.retention,
                                             dialog=dialog, position=pos)
                    ok += sum(1 for s in stored if s)
        except GatewayDown:
            pass
        except Exception as e:
            self._connection_error(conn, "store", e)
        finally:
            self._release(rows)
        success = ok == len(keys)
        self.counters["stores"] += 1
        self.counters["stored_chunks"] += ok
        if not success:
            self.counters["store_failures"] += 1
        return JobResult(job_id=job.job_id, success=success, transfer_time=time.monotonic() - t0,
                         transfer_bytes=ok * self.block_size_bytes)

    def _run_load(self, job: TransferJob, conn: TierConnection) -> JobResult:
        st, _, ends = compat.job_attachment(job)
        keys = list(job.keys)
        t0 = time.monotonic()
        if self._aborted:
            return JobResult(job_id=job.job_id, success=False)
        if self._refuse_bad_chunks(job, "load"):
            self.counters["load_failures"] += 1
            return JobResult(job_id=job.job_id, success=False)
        rows = self._rows(job.chunk_ids)
        good: list[OffloadKey] = []
        try:
            client = conn.get()
            dm = self._requests.dialog(st, client)
            sizes: list[int | None] = []
            for start, end, dialog in self._requests.runs(st, dm, ends):
                got = client.get_many([bytes(k) for k in keys[start:end]], into=rows[start:end], dialog=dialog,
                                      source=st.source if st is not None else None)
                sizes += [None if g is None else g.nbytes for g in got]
                got = None  # drop the views of the CPU tier that get_many returned
            for k, size, row in zip(keys, sizes, rows):
                if size is not None and size == row.nbytes:
                    good.append(k)
                elif size is not None:
                    self._log.warning("size", "kvgate: object for a chunk is %d bytes, the CPU tier's chunk %d: "
                                      "ignored (namespace shared by engines with different layouts?)",
                                      size, row.nbytes)
        except GatewayDown:
            pass
        except Exception as e:
            self._connection_error(conn, "load", e)
        finally:
            self._release(rows)
        self.counters["loads"] += 1
        self.counters["loaded_chunks"] += len(good)
        elapsed = time.monotonic() - t0
        nbytes = len(good) * self.block_size_bytes
        if len(good) == len(keys):
            return JobResult(job_id=job.job_id, success=True, transfer_time=elapsed, transfer_bytes=nbytes)
        self.counters["load_failures"] += 1
        return JobResult(job_id=job.job_id, success=False, successful_keys=tuple(good) or None,
                         transfer_time=elapsed, transfer_bytes=nbytes)
