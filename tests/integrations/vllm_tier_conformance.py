"""KvgateTier walked through vLLM's own tests of secondary tiers, against a real gateway; run with .venv-vllm/bin/python.

    python vllm_tier_conformance.py SOCKET OUT.json

vLLM (0.32) ships no tests in its wheel.  Its tests of secondary tiers live in its
repository: ``tests/v1/kv_offload/tiering/test_fs_tier.py`` (the fs tier,
``FileSystemTierManager``) and ``tests/v1/kv_offload/tiering/test_tier_factory.py``
(``SecondaryTierFactory``).  Each case below is one of those tests, with the same
steps and the same expectations, with the fs tier's directory replaced by the gateway
at SOCKET; where a test reads the fs tier's files or internals, the case asks the
gateway instead (named in the case's docstring).  Tests of what only the fs tier has
(O_DIRECT, its C extension, its thread pool, its file mapper) have no case, nor its
cascade test (vLLM's tiering manager on a mocked region, for the fs tier's KV events).
Cases that fail for a documented choice of kvgate (TP in the namespace) or a feature
kvgate does not have (KV events from the tier) are listed, with why, by the test.

Every case gets a new tier with a namespace of its own (nothing one case stored is
seen by another), built as vLLM's tests build theirs: a CPU tier of ``NUM_BLOCKS``
rows of ``BLOCK_ELEMENTS`` float32, a spec carrying an ``OffloadingConfig``, one
``ReqContext``.  Writes {"vllm": version, "cases": {name: "ok" | "FAIL: ..."}}
to OUT.json; the exit status is 0 whatever the cases found (the test reads them).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch
import vllm
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvgate.client import Client
from kvgate.integrations.vllm import KvgateTier

NUM_BLOCKS = 8
BLOCK_ELEMENTS = 16 * 1024  # 64 KiB rows: five fit the gateway's small test session region
CTX = ReqContext(req_id="test")
ENGINE = "vllm-conformance"  # one engine (this process) for every tier: a gateway serves one engine

SOCKET = ""
cases: dict[str, object] = {}
results: dict[str, str] = {}


def case(fn):
    cases[fn.__name__] = fn
    return fn


def spec(tag: str, *, events: bool = False, tp_size: int = 1, rank: int = 0, world_size: int | None = None,
         replicated_layout: bool = False) -> SimpleNamespace:
    """What vLLM's ``_make_offloading_spec`` gives a tier: the normalized config (here a model name of
    the case's own, so that its namespace is too), blocks_per_chunk and the KV events flag."""
    config = OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=events, extra_config={},
        engine_id=ENGINE, model=OffloadingModelConfig(name=f"test-model-{tag}", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size or tp_size, tp_size=tp_size, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
        replicated_layout=replicated_layout)
    return SimpleNamespace(config=config, blocks_per_chunk=1, _kvgate_vllm_config=None,
                           kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=events,
                                                                     self_describing_kv_events=False))


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int] | None = None,
             is_promotion: bool = False) -> TransferJob:
    if chunk_ids is None:
        chunk_ids = list(range(len(keys)))
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64),
                       is_promotion=is_promotion, req_context=CTX)


def drain(tier: KvgateTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_and_wait(tier: KvgateTier, keys: list[OffloadKey], ctx: ReqContext = CTX,
                    timeout: float = 5.0) -> list[LookupResult]:
    """vLLM's full async lookup cycle: lookups, the step's end (the batch goes out), then scheduler steps
    (each ends with on_schedule_end, which takes in the answers that came) until none is RETRY."""
    for k in keys:
        tier.lookup(k, ctx)
    deadline = time.monotonic() + timeout
    while True:
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        got = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in got or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def cpu_tier(rand: bool = False) -> torch.Tensor:
    t = torch.zeros(NUM_BLOCKS, BLOCK_ELEMENTS, dtype=torch.float32)
    if rand:
        t[:] = torch.rand(NUM_BLOCKS, BLOCK_ELEMENTS)
    return t


def new_tier(tag: str, tensor: torch.Tensor, spec_kw: dict | None = None, **extra) -> KvgateTier:
    return KvgateTier(spec(tag, **(spec_kw or {})), memoryview(tensor.numpy()), "kvgate", socket=SOCKET,
                      io_timeout=10, lookup_timeout=5, **extra)


def with_events_tier(fn):
    """The fs tests' ``fs_tier_with_events`` fixture: KV events on, globally and for the tier."""
    def run():
        tier = new_tier(fn.__name__, cpu_tier(), {"events": True}, enable_kv_events=True, locality="LOCAL")
        try:
            fn(tier)
        finally:
            tier.shutdown()
    run.__name__ = fn.__name__
    return run


def stored_in_gateway(tier: KvgateTier, keys: list[OffloadKey]) -> list[bool]:
    """What the fs tests read as files on disk: whether the gateway holds each key's object."""
    with Client.connect(SOCKET, namespace=tier.namespace, engine_id=ENGINE, want_shm=False, timeout=10) as c:
        return c.exists_many([bytes(k) for k in keys])


def delete_in_gateway(tier: KvgateTier, keys: list[OffloadKey]) -> None:
    """What the fs tests do by truncating or removing a block file: the object is gone."""
    with Client.connect(SOCKET, namespace=tier.namespace, engine_id=ENGINE, want_shm=False, timeout=10) as c:
        c.delete_many([bytes(k) for k in keys])


def with_tier(fn):
    """The fs tests' ``fs_tier`` fixture: a tier over a zeroed CPU tier, shut down after the case."""
    def run():
        tensor = cpu_tier()
        tier = new_tier(fn.__name__, tensor)
        try:
            fn(tier, tensor)
        finally:
            tier.shutdown()
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# ---- test_fs_tier.py ----------------------------------------------------------------------------


@case
@with_tier
def test_lookup_empty_tier(tier, _):
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.MISS, LookupResult.MISS]


@case
@with_tier
def test_store_creates_file_and_lookup_succeeds(tier, _):
    """The file the fs test checks for: the gateway's object."""
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1 and results[0].success, results
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.HIT]
    assert stored_in_gateway(tier, [key(1)]) == [True]


@case
@with_tier
def test_store_then_load_roundtrip(tier, _):
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.HIT]
    tier.submit_load(make_job(2, [key(1), key(2)], [2, 3], is_promotion=True))
    assert all(r.success for r in drain(tier))
    # a load leaves the objects where they are
    assert stored_in_gateway(tier, [key(1), key(2)]) == [True, True]
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.HIT]


@case
def test_invalid_locality_raises_at_construction():
    for locality in ("local", ""):
        try:
            new_tier("bad-locality", cpu_tier(), locality=locality).shutdown()
        except ValueError as e:
            assert "Locality" in str(e), e
        else:
            raise AssertionError(f"locality {locality!r} was taken")


@case
def test_factory_forwards_locality_to_the_tier():
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": SOCKET, "locality": "LOCAL"},
        memoryview(cpu_tier().numpy()), spec("factory-locality"))
    try:
        assert isinstance(tier, KvgateTier) and tier.locality is Locality.LOCAL
    finally:
        tier.shutdown()


@case
@with_tier
def test_failed_load_missing_file(tier, _):
    tier.submit_load(make_job(1, [key(99)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success, results


@case
@with_tier
def test_multiple_jobs_tracked_independently(tier, _):
    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(tier)} == {1, 2}
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.HIT]


@case
@with_tier
def test_multi_block_job_partial_failure(tier, _):
    tier.submit_store(make_job(1, [key(10), key(11)], [0, 1]))
    assert all(r.success for r in drain(tier))
    tier.submit_load(make_job(2, [key(10), key(11), key(99)], [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].job_id == 2 and not results[0].success, results


@case
def test_shutdown_discards_pending_tasks():
    """The fs test reads its pool's queues; here: shut down at once, every job is answered or dropped,
    and the tier's threads are gone."""
    tensor = cpu_tier()
    tier = new_tier("shutdown", tensor)
    for i in range(10):
        tier.submit_store(make_job(i, [key(i)], [i % 4]))
    tier.shutdown()
    assert not any(t.is_alive() for t in tier._threads), [t.name for t in tier._threads if t.is_alive()]


def _integrity(batch_size: int):
    def run():
        tensor = cpu_tier()
        tier = new_tier(f"integrity-{batch_size}", tensor)
        try:
            tensor[:] = torch.rand(NUM_BLOCKS, BLOCK_ELEMENTS)
            keys = [key(i) for i in range(batch_size)]
            load_ids = list(range(NUM_BLOCKS - batch_size, NUM_BLOCKS))
            expected = tensor[:batch_size].clone()
            tier.submit_store(make_job(1, keys, list(range(batch_size))))
            store_results = drain(tier)
            assert len(store_results) == 1 and store_results[0].success, store_results
            assert all(stored_in_gateway(tier, keys)) if keys else True
            tensor[:] = 0.0  # what comes back comes from the gateway
            tier.submit_load(make_job(2, keys, load_ids, is_promotion=True))
            load_results = drain(tier)
            assert len(load_results) == 1 and load_results[0].success, load_results
            for i, cid in enumerate(load_ids):
                assert torch.equal(tensor[cid], expected[i]), f"chunk {cid}: other bytes after store+load"
        finally:
            tier.shutdown()
    run.__name__ = f"test_store_load_data_integrity[{batch_size}]"
    return run


for _n in (0, 1, 2, 5):
    _fn = _integrity(_n)
    cases[_fn.__name__] = _fn


@case
@with_tier
def test_batch_lookup_dispatch(tier, _):
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.MISS]


@case
@with_tier
def test_out_of_bounds_block_id_smoke(tier, tensor):
    """A chunk id past the CPU tier's end fails the job, store and load alike; and (what the fs tier
    gets from the same check) nothing is stored, so the key stays a miss."""
    past_end = tensor.shape[0]
    tier.submit_store(make_job(1, [key(1)], [past_end]))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success, f"a store past the end reported {results}"
    assert stored_in_gateway(tier, [key(1)]) == [False], "a store past the end left an object"
    assert lookup_and_wait(tier, [key(1)], ReqContext(req_id="after-oob")) == [LookupResult.MISS]
    tier.submit_load(make_job(2, [key(1)], [past_end], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success, results


@case
@with_tier
def test_out_of_bounds_block_id_in_a_batch(tier, tensor):
    """One chunk id of a batch out of range (past the end, or negative): the whole job fails and
    nothing of it is stored (vLLM's fs tier checks every offset before writing any)."""
    for job_id, ids in ((1, [0, tensor.shape[0] + 3]), (2, [1, -1])):
        keys = [key(10 * job_id), key(10 * job_id + 1)]
        tier.submit_store(make_job(job_id, keys, ids))
        results = drain(tier)
        assert len(results) == 1 and not results[0].success, (ids, results)
        assert stored_in_gateway(tier, keys) == [False, False], f"chunk ids {ids}: part of the job was stored"
    tier.submit_store(make_job(3, [key(1)], [0]))
    tier.submit_load(make_job(4, [key(1)], [-1], is_promotion=True))
    results = {r.job_id: r for r in drain(tier)}
    assert results[3].success and not results[4].success, results


@case
@with_tier
def test_failed_load_corrects_verdict(tier, _):
    """The fs test truncates the block file; here the gateway loses the object.  The failed load
    turns the same request's cached HIT into a MISS; a fresh request misses too."""
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="livelock-req")
    assert lookup_and_wait(tier, [key(1)], ctx=ctx) == [LookupResult.HIT]
    tier.submit_load(make_job(2, [key(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.lookup(key(1), ctx) == LookupResult.HIT
    delete_in_gateway(tier, [key(1)])
    tier.submit_load(make_job(3, [key(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tier.lookup(key(1), ctx) == LookupResult.MISS
    assert lookup_and_wait(tier, [key(1)], ctx=ReqContext(req_id="fresh")) == [LookupResult.MISS]


@case
@with_tier
def test_batched_partial_load_failure_keeps_loaded_blocks(tier, _):
    keys = [key(1), key(2), key(3)]
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-req")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3
    delete_in_gateway(tier, [key(3)])
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tuple(results[0].successful_keys) == (key(1), key(2)), results[0]
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    tier.on_request_finished(ctx)
    assert lookup_and_wait(tier, keys, ctx=ReqContext(req_id="fresh-batch-req")) == [
        LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


@case
@with_tier
def test_batched_load_first_block_fails_marks_it_a_miss(tier, _):
    """The fs tier stops at the first bad block (successful_keys None); the gateway answers per key, so
    the keys after it may load: vLLM's contract (``JobResult.successful_keys``) asks a subset of the
    job's keys, and the failed one a miss for the request."""
    keys = [key(1), key(2), key(3)]
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-first-fail")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3
    delete_in_gateway(tier, [key(1)])
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert set(results[0].successful_keys or ()) <= set(keys[1:])
    assert tier.lookup(key(1), ctx) == LookupResult.MISS


@case
def test_fs_tier_cross_tp_round_trip():
    """A TP=2 writer and a TP=4 reader of a replicated layout share their objects (the fs tier's file
    mapper leaves TP out of its path when the layout is replicated)."""
    writer_tensor = cpu_tier(rand=True)
    expected = writer_tensor[0].clone()
    writer = new_tier("cross-tp", writer_tensor, {"tp_size": 2, "rank": 0, "replicated_layout": True})
    try:
        writer.submit_store(make_job(1, [key(7)], [0]))
        assert all(r.success for r in drain(writer))
    finally:
        writer.shutdown()
    reader_tensor = cpu_tier()
    reader = new_tier("cross-tp", reader_tensor, {"tp_size": 4, "rank": 3, "replicated_layout": True})
    try:
        assert reader.namespace == writer.namespace, (
            f"TP is part of the namespace: the TP=2 writer stored under {writer.namespace!r}, the TP=4 reader "
            f"looks under {reader.namespace!r}")
        assert lookup_and_wait(reader, [key(7)]) == [LookupResult.HIT]
        reader.submit_load(make_job(2, [key(7)], [1], is_promotion=True))
        assert all(r.success for r in drain(reader))
        assert torch.equal(reader_tensor[1], expected)
    finally:
        reader.shutdown()


# ---- test_fs_tier.py: KV events ----------------------------------------------------------------


@case
@with_tier
def test_events_disabled_by_default(tier, _):
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert list(tier.take_events()) == []


@case
@with_events_tier
def test_successful_store_emits_stored_event(tier):
    keys = [key(1), key(2)]
    tier.submit_store(make_job(1, keys, [0, 1]))
    assert all(r.success for r in drain(tier))
    events = list(tier.take_events())
    assert len(events) == 1 and events[0].keys == keys and events[0].medium == Medium.STORAGE
    assert events[0].locality is Locality.LOCAL and not events[0].removed
    assert list(tier.take_events()) == []


@case
def test_store_event_uses_configured_locality():
    tier = new_tier("events-locality", cpu_tier(), {"events": True}, enable_kv_events=True, locality="REMOTE")
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert all(r.success for r in drain(tier))
        events = list(tier.take_events())
        assert len(events) == 1 and events[0].locality is Locality.REMOTE
    finally:
        tier.shutdown()


@case
@with_events_tier
def test_load_job_emits_no_event(tier):
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    assert len(list(tier.take_events())) == 1
    tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
    assert all(r.success for r in drain(tier))
    assert list(tier.take_events()) == []


@case
@with_events_tier
def test_mixed_job_results_emit_event_only_for_successful_job(tier):
    """The fs test fails one job by injecting a write error; here it names a chunk outside the CPU tier."""
    tier.submit_store(make_job(1, [key(1)], [NUM_BLOCKS]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    by_id = {r.job_id: r for r in drain(tier)}
    assert not by_id[1].success and by_id[2].success
    events = list(tier.take_events())
    assert len(events) == 1 and events[0].keys == [key(2)]


@case
@with_events_tier
def test_partially_failed_store_emits_no_event(tier):
    """A store job with any chunk that fails (here: outside the CPU tier) emits no event for the job."""
    tier.submit_store(make_job(1, [key(1), key(2)], [0, NUM_BLOCKS]))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert list(tier.take_events()) == []


@case
def test_events_require_global_kv_events_flag():
    tier = new_tier("events-global-off", cpu_tier(), enable_kv_events=True)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert all(r.success for r in drain(tier))
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


# ---- test_tier_factory.py -----------------------------------------------------------------------


@case
def test_kvgate_tier_is_a_secondary_tier_manager():
    """The factory's CI sentinel: the class a tier entry names imports and is a SecondaryTierManager."""
    cls = SecondaryTierFactory.get_tier_class({"type": "KvgateTier", "module_path": "kvgate.integrations.vllm"})
    assert cls is KvgateTier and issubclass(cls, SecondaryTierManager)


@case
def test_create_tier_preserves_extra_config():
    """``create_secondary_tier`` with an out-of-tree entry (module_path): the tier_type, and the
    entry's other keys reach the constructor."""
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": SOCKET,
         "namespace": "conformance-extra", "retention": "short"},
        memoryview(cpu_tier().numpy()), spec("factory-extra"))
    try:
        assert isinstance(tier, KvgateTier) and tier.tier_type == "KvgateTier"
        assert tier.namespace == "conformance-extra" and tier.settings.retention == "short"
    finally:
        tier.shutdown()


@case
def test_create_multiple_tiers():
    view = memoryview(cpu_tier().numpy())
    tiers = [SecondaryTierFactory.create_secondary_tier(
        {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": SOCKET,
         "namespace": f"conformance-multi-{i}"}, view, spec(f"factory-multi-{i}")) for i in range(2)]
    try:
        assert [t.tier_type for t in tiers] == ["KvgateTier", "KvgateTier"]
        assert [t.namespace for t in tiers] == ["conformance-multi-0", "conformance-multi-1"]
    finally:
        for t in tiers:
            t.shutdown()


@case
def test_register_new_tier_type():
    """How an external tier gets a short name (vLLM's example of registering one)."""
    SecondaryTierFactory.register_tier("kvgate", "kvgate.integrations.vllm", "KvgateTier")
    tier = SecondaryTierFactory.create_secondary_tier({"type": "kvgate", "socket": SOCKET},
                                                      memoryview(cpu_tier().numpy()), spec("factory-registered"))
    try:
        assert isinstance(tier, KvgateTier) and tier.tier_type == "kvgate"
    finally:
        tier.shutdown()


@case
def test_unknown_entry_key_raises():
    """The factory passes every other key of the entry to the constructor: one the tier does not take
    fails the entry, naming it (never ignored)."""
    try:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": SOCKET, "sockett": "x"},
            memoryview(cpu_tier().numpy()), spec("factory-unknown"))
    except TypeError as e:
        assert "sockett" in str(e), e
    else:
        raise AssertionError("an unknown key was taken")


if __name__ == "__main__":
    SOCKET, out = sys.argv[1], sys.argv[2]
    for name, fn in cases.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - every case is reported, the next one runs
            results[name] = f"FAIL: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        print(f"{name}: {results[name].splitlines()[0]}", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump({"vllm": vllm.__version__, "cases": results}, f)
