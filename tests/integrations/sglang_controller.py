"""SGLang's own HiCacheController and host pool against a kvgate gateway, without an engine.

Run with .venv-sglang/bin/python:  python sglang_controller.py PLAN.json

PLAN: {"socket", "extra": {extra config keys}, "pages", "seed",
       "phase": "backup" | "restore" | "faults" | "shared", "workdir" (faults), "out": path,
       "conversations", "head_pages" (shared)}

backup:  fills the host pool's first ``pages`` pages with seeded random bytes, backs them up
         through ``HiCacheController.write_storage`` (the controller's backup thread calls
         ``batch_set_v1``), waits for the ack, detaches the backend (``close``).
restore: a new controller and a zeroed host pool; ``prefetch`` of the same tokens (the prefetch
         thread calls ``batch_exists``), the hit taken from ``prefetch_hit_queue``, host pages
         allocated and put on ``prefetch_buffer`` (the I/O thread calls ``batch_get_v1``);
         writes the restored pages' SHA-256 and the expected one.
faults:  the backend alone on a real host pool, its gateway started, frozen, killed and
         restarted by this script (``tests.helpers.GatewayProcess``): every v1 call returns
         misses promptly and never raises while the gateway is away, and the backend
         reconnects by itself.  Writes the timings of each step.
shared:  ``conversations`` prompts that share their first ``head_pages`` pages (a system prompt),
         each then ``pages`` of its own, backed up as SGLang's radix cache does (the first whole;
         the others only their own pages, SGLang's ``prefix_keys`` naming the system prompt's);
         then a new controller and a zeroed host pool prefetch each whole prompt.  Writes per
         conversation the pages hit and whether the restored pages are byte-identical.
Writes {"digest", "expected", "hits", "completed_tokens", "counters", "namespace", "seconds"}.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch

PAGE = 16
LAYERS = 2
HEADS = 2
HEAD_DIM = 64
DEVICE_TOKENS = 2048


def build(plan: dict):
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{plan['out']}.pg", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0)
    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              enable_alt_stream=False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "layer_first",
                                pin_memory=False, device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS)
    allocator = SimpleNamespace(get_kvcache=lambda: device)
    extra = {"backend_name": "kvgate", "module_path": "kvgate.integrations.sglang",
             "class_name": "KvgateHiCacheStorage", "interface_v1": 1, "kvgate.socket": plan["socket"],
             **plan.get("extra", {})}
    ctrl = HiCacheController(allocator, host, PAGE, dist.group.WORLD, threading.Event(),
                             write_policy="write_through", io_backend="direct", storage_backend="dynamic",
                             prefetch_threshold=PAGE, model_name="tiny-test-model",
                             storage_backend_extra_config=extra)
    return ctrl, host


def page_bytes_of(host, indices: torch.Tensor) -> bytes:
    """The pages' bytes, read through the pool's own page description (as a backend sees them)."""
    import ctypes

    ptrs, sizes = host.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def faults(plan: dict) -> dict:
    """Never raise, never block past the timeouts, reconnect by itself (see the module docstring)."""
    import signal

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from kvgate.integrations.sglang import KvgateHiCacheStorage
    from tests.helpers import GatewayProcess, freeze

    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              enable_alt_stream=False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "layer_first",
                                pin_memory=False, device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS)
    gw = GatewayProcess(plan["workdir"], ["--shared-storage", "true"], socket_path=plan["socket"], name="faultgw")
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=False,
                               model_name="tiny-test-model",
                               extra_config={"kvgate.socket": plan["socket"], "kvgate.io_timeout": 0.5,
                                             "kvgate.lookup_timeout": 0.3, "kvgate.connect_timeout": 0.3})
    be = KvgateHiCacheStorage(cfg, {})
    n = 8
    idx = host.alloc(n * PAGE)
    g = torch.Generator().manual_seed(3)
    host.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, host.kv_buffer.shape, generator=g,
                                                         dtype=torch.int16))
    want = page_bytes_of(host, idx)
    keys = [hashlib.sha256(f"page{i}".encode()).hexdigest() for i in range(n)]
    out: dict = {"steps": {}}

    def step(name: str, fn):
        t = time.monotonic()
        r = fn()
        out["steps"][name] = {"result": r if not isinstance(r, list) else [bool(x) for x in r],
                              "seconds": round(time.monotonic() - t, 3)}
        return r

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    info = HiCacheStorageExtraInfo(prefix_keys=[])
    step("register_down", lambda: be.register_mem_pool_host(host))  # gateway not started: no raise
    step("exists_down", lambda: be.batch_exists(keys, info))
    step("set_down", lambda: be.batch_set_v1(keys, idx, info))
    step("get_down", lambda: be.batch_get_v1(keys, idx, info))
    gw.start()
    time.sleep(1.2)  # past the connect back-off
    step("set_up", lambda: be.batch_set_v1(keys, idx, info))
    step("exists_up", lambda: be.batch_exists(keys, info))
    host.kv_buffer.zero_()
    step("get_up", lambda: be.batch_get_v1(keys, idx, info))
    out["identical"] = page_bytes_of(host, idx) == want
    step("bad_indices", lambda: be.batch_get_v1(keys, idx[:PAGE], info))  # too few indices: misses
    freeze(gw.pid)
    step("exists_frozen", lambda: be.batch_exists(keys, info))
    step("set_frozen", lambda: be.batch_set_v1(keys, idx, info))
    step("get_frozen", lambda: be.batch_get_v1(keys, idx, info))
    os.kill(gw.pid, signal.SIGCONT)
    gw.kill(signal.SIGKILL)
    step("exists_killed", lambda: be.batch_exists(keys, info))
    step("get_killed", lambda: be.batch_get_v1(keys, idx, info))
    step("set_killed", lambda: be.batch_set_v1(keys, idx, info))
    gw2 = GatewayProcess(plan["workdir"], ["--shared-storage", "true"], socket_path=plan["socket"],
                         card=gw.card, name="faultgw2").start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(be.batch_set_v1(keys, idx, info)):
        time.sleep(0.2)
    out["reconnected_after_s"] = round(time.monotonic() - (deadline - 15), 3)
    step("exists_again", lambda: be.batch_exists(keys, info))
    step("clear_shared", lambda: be.clear())  # refused by a shared-storage gateway: logged, no raise
    stats = be.get_stats()
    out["stats_type"] = type(stats).__name__
    out["backup_pgs"] = list(stats.backup_pgs)
    out["counters"] = dict(be.counters)
    be.close()
    step("exists_closed", lambda: be.batch_exists(keys, info))
    gw2.cleanup()
    gw.cleanup()
    return out


def prefetch(ctrl, host, rid: str, tokens: list[int]) -> tuple[int, object]:
    """``HiCacheController.prefetch`` of a whole prompt into a zeroed host pool: (pages hit, host indices)."""
    ctrl.prefetch(rid, tokens, None, prefix_keys=[])
    op = ctrl.prefetch_hit_queue.get(timeout=60)
    idx = host.alloc(op.storage_hit_count)
    if op.storage_hit_count:
        op.host_indices = idx
        ctrl.prefetch_buffer.put(op)
        while not ctrl.ack_prefetch_queue.get(timeout=60).completed_req:
            pass
    return op.storage_hit_count // PAGE, idx


def shared(plan: dict) -> dict:
    """Conversations behind one system prompt, backed up and restored (see the module docstring)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n, head, own = plan["conversations"], plan["head_pages"], plan["pages"]
    g = torch.Generator().manual_seed(plan["seed"])
    system = torch.randint(10, 4000, (head * PAGE,), generator=g).tolist()
    prompts = [system + torch.randint(10, 4000, (own * PAGE,), generator=g).tolist() for _ in range(n)]
    ctrl, host = build(plan)
    g = torch.Generator().manual_seed(plan["seed"] + 1)
    host.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, host.kv_buffer.shape, generator=g,
                                                         dtype=torch.int16))
    head_idx = host.alloc(head * PAGE)  # one copy of the system prompt's KV, as in the radix cache
    expected = []
    for i, tokens in enumerate(prompts):
        own_idx = host.alloc(own * PAGE)
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        if i == 0:
            op_id = ctrl.write_storage(torch.cat([head_idx, own_idx]), tokens, hash_value=hashes, prefix_keys=[])
        else:  # the system prompt's node is backed up already: only this conversation's node is new
            op_id = ctrl.write_storage(own_idx, tokens[head * PAGE:], hash_value=hashes[head:],
                                       prefix_keys=hashes[:head])
        assert ctrl.ack_backup_queue.get(timeout=60).id == op_id
        expected.append(hashlib.sha256(page_bytes_of(host, torch.cat([head_idx, own_idx]))).hexdigest())
    ctrl.detach_storage_backend()
    ctrl, host = build(plan)  # a new controller, a new (zeroed) host pool
    host.kv_buffer.zero_()
    out: dict = {"namespace": ctrl.storage_backend.namespace, "conversations": []}
    for i, tokens in enumerate(prompts):
        pages, idx = prefetch(ctrl, host, f"req-{i}", tokens)
        out["conversations"].append({"pages": pages, "identical": pages == head + own and hashlib.sha256(
            page_bytes_of(host, idx)).hexdigest() == expected[i]})
    out["counters"] = dict(ctrl.storage_backend.counters)
    ctrl.detach_storage_backend()
    return out


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    if plan["phase"] in ("faults", "shared"):
        result = faults(plan) if plan["phase"] == "faults" else shared(plan)
        json.dump(result, open(plan["out"], "w"))
        print(json.dumps(result), flush=True)
        os._exit(0)
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pages = plan["pages"]
    g = torch.Generator().manual_seed(plan["seed"])
    tokens = torch.randint(10, 4000, (pages * PAGE,), generator=g).tolist()
    t_build = time.monotonic()
    ctrl, host = build(plan)
    backend = ctrl.storage_backend
    t0 = time.monotonic()
    print(f"[controller] built in {t0 - t_build:.2f} s", flush=True)
    result: dict = {"namespace": backend.namespace}
    if plan["phase"] == "backup":
        idx = host.alloc(pages * PAGE)
        g = torch.Generator().manual_seed(plan["seed"] + 1)
        host.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, host.kv_buffer.shape, generator=g,
                                                             dtype=torch.int16))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        print(f"[controller] filled in {time.monotonic() - t0:.2f} s", flush=True)
        op_id = ctrl.write_storage(idx, tokens, hash_value=hashes, prefix_keys=[])
        op = ctrl.ack_backup_queue.get(timeout=60)
        assert op.id == op_id
        result["completed_tokens"] = op.completed_tokens
        result["expected"] = hashlib.sha256(page_bytes_of(host, idx)).hexdigest()
    else:
        host.kv_buffer.zero_()
        op = ctrl.prefetch("req-1", tokens, None, prefix_keys=[])
        op = ctrl.prefetch_hit_queue.get(timeout=60)
        result["hits"] = op.storage_hit_count
        idx = host.alloc(op.storage_hit_count)
        if op.storage_hit_count:
            op.host_indices = idx
            ctrl.prefetch_buffer.put(op)
            completed = 0
            while True:  # progress acks (completed_tokens per batch), then one with completed_req
                ack = ctrl.ack_prefetch_queue.get(timeout=60)
                if ack.completed_req:
                    break
                completed += ack.completed_tokens or 0
            result["completed_tokens"] = completed
        else:
            result["completed_tokens"] = 0
        result["digest"] = hashlib.sha256(page_bytes_of(host, idx)).hexdigest() if op.storage_hit_count else None
    result["seconds"] = round(time.monotonic() - t0, 3)
    result["counters"] = dict(backend.counters)
    ctrl.detach_storage_backend()
    json.dump(result, open(plan["out"], "w"))
    print(json.dumps(result), flush=True)
    os._exit(0)  # gloo and SGLang's daemon threads: no slow interpreter teardown


if __name__ == "__main__":
    main()
