"""Everything the kvgate vLLM integration takes from vLLM, in one place.

vLLM's KV offloading framework (``vllm.v1.kv_offload``) is experimental: an
out-of-tree spec is loaded with a warning that it "is subject to change".
So every import from ``vllm.*``, and every attribute of a vLLM object that is
not part of a class's documented interface, is here and nowhere else in
``kvgate.integrations.vllm``; on a vLLM upgrade, check this list.  Each item
was checked against vLLM 0.32.0 (the CPU build in ``.venv-vllm``: signatures
with ``inspect``, behaviour in ``vllm/v1/kv_offload/``), and
``tests/integrations/test_vllm_compat.py`` checks them against the installed
vLLM.

Classes and objects imported (vLLM 0.32.0):

- ``vllm.v1.kv_offload.base``: ``OffloadingSpec``, ``OffloadingManager``,
  ``OffloadingWorker`` (``submit_store`` / ``submit_load(job_id, src_spec,
  dst_spec)``, in 0.33 ``submit_load(..., expedited=False)``, ``get_finished``, ``wait``, ``shutdown``), ``TransferResult(job_id,
  success, transfer_size, transfer_time)``, ``CanonicalKVCaches`` (``tensors``
  of ``.tensor`` / ``.page_size_bytes``; ``group_data_refs`` of ``.tensor_idx``
  / ``.page_size_bytes``), ``LoadStoreSpec``, ``BlockIDsLoadStoreSpec``
  (``block_ids``), ``GPULoadStoreSpec`` (``block_ids``, ``group_sizes``,
  ``block_indices``), ``ReqContext`` (``req_id``, ``kv_transfer_params``,
  ``get_state`` / ``set_state`` keyed by type, ``get_offload_key_position``),
  ``LookupResult`` (``MISS`` / ``HIT`` / ``RETRY``), ``Medium.STORAGE``,
  ``Locality``, ``OffloadKey`` (block hash + 4-byte big-endian group index),
  ``RequestOffloadingContext()``.
- ``vllm.v1.kv_offload.config.OffloadingConfig``: ``engine_id``,
  ``model.name`` / ``.dtype``, ``kv_cache_layout``, ``canonical_layout``,
  ``replicated_layout``, ``cache.tokens_per_hash`` / ``.blocks_per_chunk``,
  ``worker_kv_bytes_per_block``, ``parallel.rank`` / ``.world_size`` /
  ``.tp_size`` / ``.pp_size`` / ``.pcp_size`` / ``.dcp_size``, ``groups`` of
  ``.group_id`` / ``.tokens_per_block`` / ``.layer_names``.
- ``vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec(config)``:
  ``extra_config``, ``secondary_tier_configs`` (a list of dicts, read once
  its ``__init__`` returns, when it builds the manager), ``replicated_layout``,
  ``blocks_per_chunk``, ``get_manager()``, ``get_worker(kv_caches)`` (refuses
  the CPU platform).
- ``vllm.v1.kv_offload.tiering.base``: ``SecondaryTierManager(offloading_spec,
  primary_kv_view, tier_type, backpressure_detector=None)`` (``tier_type``,
  ``locality``, ``block_size_bytes``; the abstract methods a tier implements),
  ``TransferJob`` (``job_id``, ``keys``, ``chunk_ids``, ``req_context``),
  ``JobResult(job_id, success, successful_keys, transfer_time,
  transfer_bytes)``, ``JobId``.
- ``vllm.v1.kv_offload.tiering.async_lookup.AsyncLookupManager(tier_type)``:
  ``batch_lookup`` (overridden, runs on its thread), ``lookup`` (None until
  answered), ``flush``, ``cleanup``, ``mark_miss``, ``drain_results``.
- ``vllm.v1.kv_offload.tiering.backpressure.BackpressureDetector`` (type only).
- ``vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion``:
  ``create_next_worker_view(tensor_page_size)``, ``cleanup()``.
- ``vllm.platforms.current_platform``: ``device_type``, ``is_cuda_alike()``,
  ``is_xpu()``.

Internals, each behind a function below (vLLM 0.32.0):

- ``vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler.
  _create_req_context(req) -> ReqContext``, a module function the connector
  calls by its global name: wrapped (``install_req_context_hook``); and the
  ``cache_salt`` attribute of the ``vllm.v1.request.Request`` it is given.
- ``ReqContext._offload_key_positions``: key -> end token of every key the
  scheduler has positioned for the request.
- ``AsyncLookupManager._lookup_queue`` (``None`` stops its thread) and
  ``._thread``.
- ``TieringOffloadingSpec._scheduler_mmap`` (the scheduler's
  ``SharedOffloadRegion``, ``.mmap_path`` its ``/dev/shm`` file),
  ``._manager``, ``._worker`` (what ``get_manager`` / ``get_worker`` built),
  ``._engine_id``, and the ``CPUOffloadingSpec`` sizes ``num_chunks``,
  ``kv_bytes_per_chunk``, ``cpu_page_size_per_worker``.
- ``vllm.config.get_current_vllm_config_or_none()`` and ``VllmConfig``; the
  ``vllm_config`` argument of ``OffloadingConnector.__init__``, found in a
  caller frame (vLLM hands a spec only the ``OffloadingConfig``); of it,
  ``model_config.revision`` and ``cache_config.prefix_caching_hash_algo``.
- ``OffloadingSpec.offload_prompt_only`` (read from ``extra_config`` in its
  ``__init__``, default true; the connector's scheduler reads the spec's
  attribute): ``KvgateOffloadingSpec`` sets it false unless the config says.

vLLM 0.33.0 (the release wheel, commit 4ba787ec9, compared file by file with
0.32.0; every item above is the same there but these):

- ``OffloadingWorker.submit_load(job_id, src_spec, dst_spec, expedited=False)``:
  0.33 passes ``expedited=True`` for loads it waits on within the step (only
  with ``sync_load_budget_bytes`` > 0); the CPU-platform worker takes and
  ignores it (its copies are synchronous).  The compat checks accept both.
- ``OffloadingManager.lock``: callers of manager methods must hold it from a
  lookup HIT through ``prepare_load``.  kvgate calls no manager method (it
  returns vLLM's manager unwrapped and ``KvgateTier`` runs under vLLM's own
  hold of the lock); code that drives a manager must hold
  ``getattr(m, "lock", None) or contextlib.nullcontext()``, never around
  ``shutdown()``.
- ``OffloadingManager.on_reset_flushed()``: vLLM's tiering manager holds
  secondary lookups after ``reset_cache`` until its workers report every job
  in flight; ``KvgateTier.drain_jobs`` already waits for every job.
- ``config_info()`` / ``config_info_keys(extra_config)`` (metric labels per
  tier) and ``OffloadingEvent.metadata_only``: kvgate declares no labels and
  emits no offloading events, so the defaults (empty) apply.
- ``SecondaryTierManager``'s methods, ``ReqContext``'s fields and
  ``_create_req_context`` are unchanged.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Mapping

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    Locality,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = [
    "AsyncLookupManager", "BackpressureDetector", "BlockIDsLoadStoreSpec", "CanonicalKVCaches", "GPULoadStoreSpec",
    "JobId", "JobResult", "LoadStoreSpec", "Locality", "LookupResult", "Medium", "OffloadKey", "OffloadingConfig",
    "OffloadingManager", "OffloadingSpec", "OffloadingWorker", "ReqContext", "RequestOffloadingContext",
    "SecondaryTierManager", "SharedOffloadRegion", "TieringOffloadingSpec", "TransferJob", "TransferResult",
]

# ---- the platform ----------------------------------------------------------------------------


def platform_name() -> str:
    return str(getattr(current_platform, "device_type", "unknown"))


def stock_worker_supported() -> bool:
    """Whether vLLM's own CPU-tier worker runs here (it moves pages with CUDA/XPU streams)."""
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


# ---- the engine's config ---------------------------------------------------------------------


def current_vllm_config() -> Any:
    """The engine's VllmConfig, for what OffloadingConfig lacks (model revision, hash algorithm).

    vLLM does not hand it to specs: use the current config when one is set,
    else the ``vllm_config`` of the connector that is constructing this spec
    (a local of one of the calling frames).  None when neither is found.
    """
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none  # noqa: PLC0415

        cfg = get_current_vllm_config_or_none()
        if cfg is not None:
            return cfg
        frame = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                break
            cand = frame.f_locals.get("vllm_config")
            if isinstance(cand, VllmConfig):
                return cand
            frame = frame.f_back
    except Exception:
        pass
    return None


def model_revision(vllm_config: Any) -> str | None:
    return getattr(getattr(vllm_config, "model_config", None), "revision", None)


def block_hash_algo(vllm_config: Any) -> str | None:
    """``prefix_caching_hash_algo``: with PYTHONHASHSEED, what makes block hashes (kvgate keys) stable."""
    return getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", None)


# ---- requests --------------------------------------------------------------------------------


def install_req_context_hook(hook: Callable[[ReqContext, Any], None]) -> bool:
    """Call ``hook(ctx, request)`` on every ReqContext the offloading connector creates.

    vLLM's ReqContext carries no more of the request than its id and
    ``kv_transfer_params``; the hook may attach state (``ctx.set_state``) from
    the request.  A hook that raises is ignored.  Returns False when this vLLM
    has no such factory to wrap.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched  # noqa: PLC0415

        original = sched._create_req_context
    except (ImportError, AttributeError):
        return False

    def create_req_context(req):
        ctx = original(req)
        try:
            hook(ctx, req)
        except Exception:
            pass
        return ctx

    create_req_context.__wrapped__ = original  # type: ignore[attr-defined]
    sched._create_req_context = create_req_context
    return True


def request_cache_salt(request: Any) -> str | None:
    return getattr(request, "cache_salt", None)


def offload_key_positions(ctx: ReqContext) -> Mapping[OffloadKey, int] | None:
    """Every key the scheduler has positioned for this request -> the end token of its block."""
    return getattr(ctx, "_offload_key_positions", None)


def attach_to_job(job: TransferJob, state: Any) -> None:
    """What the scheduler thread resolved for a job, for the I/O thread that runs it."""
    setattr(job, "_kvgate", state)


def job_attachment(job: TransferJob) -> Any:
    return getattr(job, "_kvgate")


# ---- AsyncLookupManager's thread -------------------------------------------------------------


def stop_lookup_thread(lookup: AsyncLookupManager) -> None:
    """Ask the lookup thread to stop once its queued batches are done (without waiting, unlike ``shutdown``)."""
    lookup._lookup_queue.put(None)


def lookup_thread(lookup: AsyncLookupManager) -> threading.Thread:
    return lookup._thread


# ---- TieringOffloadingSpec's state ------------------------------------------------------------


def scheduler_region_path(spec: Any) -> str | None:
    """The /dev/shm file behind the primary CPU tier (the scheduler's mapping of it), once built."""
    region = getattr(spec, "_scheduler_mmap", None)
    return getattr(region, "mmap_path", None)


def manager_built(spec: TieringOffloadingSpec) -> bool:
    return spec._manager is not None


def built_worker(spec: TieringOffloadingSpec) -> OffloadingWorker | None:
    return spec._worker


def keep_worker(spec: TieringOffloadingSpec, worker: OffloadingWorker) -> OffloadingWorker:
    """Keep ``worker`` where ``get_worker`` keeps the one it built, and return it."""
    spec._worker = worker  # type: ignore[assignment]
    return worker


def chunk_bytes(spec: Any) -> int:
    """Bytes of one chunk row of the primary CPU tier (all workers, padded to a page)."""
    return int(getattr(spec, "kv_bytes_per_chunk", 0))


def open_worker_region(spec: TieringOffloadingSpec, rank: int) -> SharedOffloadRegion:
    """The primary CPU tier's shared region, mapped for worker ``rank``, as vLLM's own worker maps it."""
    return SharedOffloadRegion(
        engine_id=spec._engine_id,
        num_chunks=spec.num_chunks,
        rank=rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
