"""What kvgate.integrations.vllm.compat takes from vLLM, checked against the installed vLLM; run with .venv-vllm/bin/python.

    python vllm_compat_checks.py OUT.json

Each check asserts (exit status 0 when all held): the signatures and fields
compat names, and each internal it reaches behind a function, used on real
vLLM objects: the ReqContext factory hook (with the salt probe on top), a
request's remote_kv_source through its ReqContext to the tier's lookups and
loads, a ReqContext's key positions, an attachment on a TransferJob, an
AsyncLookupManager's thread, a TieringOffloadingSpec's manager, worker and
regions (a small primary tier in /dev/shm, removed again), the VllmConfig
found in a caller's frame.  Writes {"vllm": version, "checked": [names]} to OUT.json.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import sys
import time
from types import SimpleNamespace

import vllm
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.request import Request

from kvgate.integrations.vllm import compat
from kvgate.integrations.vllm.engine import RequestSalt, install_salt_probe

checked: list[str] = []


def check(name: str):
    def run(fn):
        fn()
        checked.append(name)
        return fn
    return run


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@check("signatures")
def _signatures() -> None:
    assert params(compat.SecondaryTierManager.__init__) == [
        "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"]
    assert params(compat.AsyncLookupManager.__init__) == ["tier_type"]
    assert params(compat.AsyncLookupManager.batch_lookup) == ["keys", "req_context"]
    for method in ("lookup", "flush", "cleanup", "mark_miss", "drain_results"):
        assert callable(getattr(compat.AsyncLookupManager, method)), method
    assert params(compat.TieringOffloadingSpec.__init__) == ["config"]
    assert params(compat.TieringOffloadingSpec.get_worker) == ["kv_caches"]
    assert {"engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"} <= set(
        params(compat.SharedOffloadRegion.__init__))
    assert params(compat.SharedOffloadRegion.create_next_worker_view) == ["tensor_page_size"]
    assert params(compat.GPULoadStoreSpec.__init__) == ["block_ids", "group_sizes", "block_indices"]
    assert params(compat.OffloadingWorker.submit_store) == ["job_id", "src_spec", "dst_spec"]
    # 0.33 adds expedited=False, passed as True under sync_load_budget_bytes: the CPU worker takes it on both
    assert params(compat.OffloadingWorker.submit_load) in (["job_id", "src_spec", "dst_spec"],
                                                           ["job_id", "src_spec", "dst_spec", "expedited"])
    from kvgate.integrations.vllm.worker import HostCopyOffloadingWorker
    assert params(HostCopyOffloadingWorker.submit_load) == ["job_id", "src_spec", "dst_spec", "expedited"]
    assert {"job_id", "success", "successful_keys", "transfer_time", "transfer_bytes"} <= fields(compat.JobResult)
    assert {"job_id", "keys", "chunk_ids", "req_context"} <= fields(compat.TransferJob)
    assert {"job_id", "success", "transfer_size", "transfer_time"} <= fields(compat.TransferResult)
    assert {"req_id", "kv_transfer_params", "_offload_key_positions"} <= fields(compat.ReqContext)
    assert {"tensors", "group_data_refs"} <= fields(compat.CanonicalKVCaches)
    assert {"tensor", "page_size_bytes"} <= fields(CanonicalKVCacheTensor)
    assert {"tensor_idx", "page_size_bytes"} <= fields(CanonicalKVCacheRef)
    assert {"engine_id", "model", "cache", "parallel", "groups", "worker_kv_bytes_per_block", "kv_cache_layout",
            "canonical_layout", "replicated_layout"} <= fields(compat.OffloadingConfig)
    assert {"rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"} <= fields(OffloadingParallelConfig)
    assert compat.Medium.STORAGE.value == "STORAGE" and compat.Locality("LOCAL") is compat.Locality.LOCAL
    assert {"MISS", "HIT", "RETRY"} <= set(compat.LookupResult.__members__)
    assert "revision" in inspect.signature(ModelConfig).parameters
    assert "prefix_caching_hash_algo" in inspect.signature(CacheConfig).parameters
    assert compat.platform_name() == "cpu" and not compat.stock_worker_supported()


@check("req_context_hook")
def _req_context_hook() -> None:
    # The connector calls the factory by its module-global name, so the wrapper is what it calls.
    assert "_create_req_context(request)" in inspect.getsource(sched.OffloadingConnectorScheduler)
    assert "self.cache_salt" in inspect.getsource(Request.__init__)
    assert install_salt_probe()
    for salt, salted in (("tenant", True), (None, False)):
        req = SimpleNamespace(request_id="r", kv_transfer_params=None, kv_hints=None, cache_salt=salt)
        assert sched._create_req_context(req).get_state(RequestSalt) == RequestSalt(salted)


@check("req_context_positions_and_job_attachment")
def _positions() -> None:
    ctx = compat.ReqContext(req_id="r")
    key = compat.OffloadKey(b"hash" + (0).to_bytes(4, "big"))
    ctx.set_offload_key_position(key, 128)
    assert compat.offload_key_positions(ctx) == {key: 128}
    job = compat.TransferJob(job_id=1, keys=[key], chunk_ids=None, is_promotion=False, req_context=ctx)
    compat.attach_to_job(job, ("state",))
    assert compat.job_attachment(job) == ("state",)


@check("req_context_source")
def _source() -> None:
    # llm-d's remote_kv_source reaches the tier in the ReqContext vLLM makes of the request, and the tier's
    # lookups and loads of the request name it (its gateway then asks only its peers on that host).
    from kvgate.integrations.ratelimit import RateLimitedLog
    from kvgate.integrations.vllm.request_state import RequestStates
    from kvgate.integrations.vllm.settings import TierSettings
    from kvgate.integrations.vllm.tier import KvgateTier

    source = {"kv_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 8200}
    req = SimpleNamespace(request_id="r", kv_transfer_params={"remote_kv_source": source}, kv_hints=None,
                          cache_salt=None)
    ctx = sched._create_req_context(req)
    log = RateLimitedLog(logging.getLogger("kvgate-compat-check"))
    states = RequestStates(TierSettings.build(socket="/nonexistent/kvgate.sock", affinity_chunks=1), log, {})
    st = states.of(ctx)
    assert st.source == "10.0.0.7:8200"
    assert states.of(compat.ReqContext(req_id="plain")).source is None
    asked: list[tuple[str, str | None]] = []

    class Client:
        def exists_many(self, keys, dialog=None, *, source=None):
            asked.append(("exists", source))
            return [True] * len(keys)

        def get_many(self, keys, into=None, dialog=None, *, source=None):
            asked.append(("get", source))
            return list(into)

    conn = SimpleNamespace(get=Client)
    tier = SimpleNamespace(counters=dict.fromkeys(("lookups", "lookup_hits", "loads", "loaded_chunks",
                                                   "load_failures"), 0),
                           _lookup_conn=conn, _requests=states, _aborted=False, _log=log, block_size_bytes=8,
                           _refuse_bad_chunks=lambda job, what: False, _release=KvgateTier._release,
                           _rows=lambda ids: [memoryview(bytearray(8)) for _ in ids])
    key = compat.OffloadKey(b"hash" + (0).to_bytes(4, "big"))
    assert KvgateTier._batch_exists(tier, [key], ctx) == [True]
    job = compat.TransferJob(job_id=1, keys=[key], chunk_ids=[0], is_promotion=False, req_context=ctx)
    compat.attach_to_job(job, (st, None, [None]))
    assert KvgateTier._run_load(tier, job, conn).success
    assert asked == [("exists", "10.0.0.7:8200"), ("get", "10.0.0.7:8200")], asked


@check("lookup_thread")
def _lookup_thread() -> None:
    class Lookup(compat.AsyncLookupManager):
        def batch_lookup(self, keys, req_context):
            return [True] * len(keys)

    lookup = Lookup(tier_type="check")
    ctx = compat.ReqContext(req_id="r")
    key = compat.OffloadKey(b"k" * 4)
    assert lookup.lookup(key, ctx) is None
    lookup.flush()
    deadline = time.monotonic() + 10
    while lookup.lookup(key, ctx) is None and time.monotonic() < deadline:
        time.sleep(0.01)
        lookup.drain_results()  # what a lookup after the next flush does
    assert lookup.lookup(key, ctx) is True
    compat.stop_lookup_thread(lookup)
    compat.lookup_thread(lookup).join(10)
    assert not compat.lookup_thread(lookup).is_alive()


@check("spec_state_and_regions")
def _spec() -> None:
    page = 4096
    cfg = compat.OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False, extra_config={"cpu_bytes_to_use": 4 * page},
        engine_id=f"kvgate-compat-check-{os.getpid()}", model=OffloadingModelConfig(name="m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    spec = compat.TieringOffloadingSpec(cfg)
    assert not compat.manager_built(spec) and compat.built_worker(spec) is None
    assert compat.scheduler_region_path(spec) is None and compat.chunk_bytes(spec) == page
    manager = spec.get_manager()
    try:
        path = compat.scheduler_region_path(spec)
        assert compat.manager_built(spec) and path == f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap"
        assert os.path.exists(path)
        region = compat.open_worker_region(spec, 0)
        view = region.create_next_worker_view(page)
        assert tuple(view.shape) == (4, page)
        del view
        region.cleanup()
        worker = SimpleNamespace()
        assert compat.keep_worker(spec, worker) is worker and compat.built_worker(spec) is worker
    finally:
        manager.shutdown()
    assert not os.path.exists(path)


@check("vllm_config")
def _vllm_config() -> None:
    def connector_init(vllm_config):  # as OffloadingConnector.__init__ holds it while the spec is built
        return compat.current_vllm_config()

    config = VllmConfig()
    assert connector_init(config) is config
    assert compat.block_hash_algo(config) == "sha256" and compat.model_revision(config) is None


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        json.dump({"vllm": vllm.__version__, "checked": checked}, out)
