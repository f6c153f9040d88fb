"""A hybrid model's host pools (SGLang 0.5.23's own classes, on CPU) through KvgateHiCacheStorage's v2
interface against a real gateway, without an engine.

Run with .venv-sglang/bin/python:  python sglang_hybrid.py PLAN.json

PLAN: {"socket", "pages", "seed", "phase": "backup" | "restore", "out": path}

The pools are those SGLang registers for a hybrid model, built as SGLang builds them (all
``page_first``, which SGLang's Mamba host pool requires):
- ``kv``: the anchor ``MHATokenToKVPoolHost`` (full-attention layers), moved by v1;
- ``swa``: an ``MHATokenToKVPoolHost`` of the sliding-window layers (other geometry), a
  ``TRAILING_PAGES`` sidecar with a window of 2 pages, as for SWA models;
- ``mamba``: a ``MambaPoolHost`` (one state slot per backup), a ``TRAILING_PAGES`` sidecar of 1;
- ``indexer``: an ``MHATokenToKVPoolHost`` standing in for a KV-derived ``ALL_PAGES`` pool (a DSA
  indexer; SGLang's ``DSAIndexerPoolHost`` needs an NSA device pool): its pages share the KV
  pool's indices, and every page of a prefix needs its part.

backup:  random bytes in every pool; the pages backed up as SGLang's hybrid controller does, in
         two operations of ``pages/2`` pages (``batch_set_v2`` per ``_trailing_chain_groups``
         group, then ``batch_set_v1`` for the KV pages); writes each pool's page digests.
restore: a new backend and fresh pools; ``batch_exists_v2``, ``batch_get_v1`` + ``batch_get_v2``
         (the KV-derived pool alone, then the trailing sidecars, as SGLang calls them) at both
         backup boundaries, digests compared; then one pool's object of one page deleted at a time
         (``Client.delete_many`` with ``KvgateHiCacheStorage.pool_key``) and what exists/get
         report; then the never-raise cases (an unregistered pool, wrong indices, a gateway that
         is not there, a closed backend).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PAGE = 16
DEVICE_TOKENS = 512
SWA_WINDOW = 2  # pages of the sliding window SGLang backs up with each operation


def build_pools():
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def mha(layers: int, heads: int, dim: int):
        device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, heads, dim, layers, "cpu", False,
                                  enable_alt_stream=False)
        return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                    pin_memory=False, device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                    end_layer=layers)

    slots = 8
    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots, 4, 8, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, slots, 3, 32, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    return {"kv": mha(2, 2, 64), "swa": mha(1, 1, 32), "mamba": mamba, "indexer": mha(1, 1, 16)}


def backend_for(socket: str, pools: dict, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName

    from kvgate.integrations.sglang import KvgateHiCacheStorage

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="tiny-hybrid-model",
                               extra_config={"kvgate.socket": socket, **extra})
    be = KvgateHiCacheStorage(cfg, {})
    # SGLang's order (HybridCacheController.attach_storage_backend): the anchor, then every entry
    # of the host pool group by its PoolName, then the end of the burst.
    be.register_mem_pool_host(pools["kv"])
    for name in ("kv", "swa", "mamba", "indexer"):
        be.register_mem_host_pool_v2(pools[name], PoolName(name))
    be.on_host_pools_registered()
    return be


def fill(host, indices: torch.Tensor, rng: random.Random) -> None:
    ptrs, sizes = host.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes):
        ctypes.memmove(int(p), rng.randbytes(int(s)), int(s))


def digests(host, indices: torch.Tensor) -> list[str]:
    """One SHA-256 per page, read through the pool's own page description (as a backend sees them)."""
    ptrs, sizes = host.get_page_buffer_meta(indices)
    per = len(ptrs) // (indices.numel() // host.page_size)
    out = []
    for i in range(0, len(ptrs), per):
        out.append(hashlib.sha256(b"".join(ctypes.string_at(int(p), int(s))
                                           for p, s in zip(ptrs[i:i + per], sizes[i:i + per]))).hexdigest())
    return out


def transfers_for(pools: dict, hashes: list[str], end: int, kv_idx: torch.Tensor | None, swa_idx, mamba_idx):
    """SGLang's sidecar transfers of a span ending at page ``end``; ``kv_idx`` given: with the
    KV-derived indexer over pages [0, end)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    out = []
    if kv_idx is not None:
        out.append(PoolTransfer(name=PoolName.INDEXER, host_indices=kv_idx, keys=hashes[:end],
                                hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV))
    out.append(PoolTransfer(name=PoolName.SWA, host_indices=swa_idx, keys=hashes[end - SWA_WINDOW:end],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES))
    out.append(PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_idx, keys=hashes[end - 1:end],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES))
    return out


def plain(result: dict) -> dict:
    return {str(k): [bool(x) for x in v] for k, v in result.items()}


def backup(plan: dict) -> dict:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups

    pools = build_pools()
    be = backend_for(plan["socket"], pools)
    n, half = plan["pages"], plan["pages"] // 2
    hashes = page_hashes(plan)
    rng = random.Random(plan["seed"] + 1)
    kv_idx = pools["kv"].alloc(n * PAGE)
    fill(pools["kv"], kv_idx, rng)
    fill(pools["indexer"], kv_idx, rng)  # KV-derived: the KV pool's indices
    expected = {"kv": digests(pools["kv"], kv_idx), "indexer": digests(pools["indexer"], kv_idx)}
    results = []
    for a, b in ((0, half), (half, n)):
        swa_idx = pools["swa"].alloc(SWA_WINDOW * PAGE)
        mamba_idx = pools["mamba"].alloc(1)
        fill(pools["swa"], swa_idx, rng)
        fill(pools["mamba"], mamba_idx, rng)
        expected[f"swa@{b}"] = digests(pools["swa"], swa_idx)
        expected[f"mamba@{b}"] = digests(pools["mamba"], mamba_idx)
        span = transfers_for(pools, hashes, b, kv_idx[a * PAGE:b * PAGE], swa_idx, mamba_idx)
        span[0].keys = hashes[a:b]
        for info, group in _trailing_chain_groups(hashes[:a], hashes[a:b], span):
            results.append(plain(be.batch_set_v2(group, extra_info=info)))
        results.append({"kv": be.batch_set_v1(hashes[a:b], kv_idx[a * PAGE:b * PAGE],
                                              HiCacheStorageExtraInfo(prefix_keys=hashes[:a]))})
    out = {"expected": expected, "results": results, "namespace": be.namespace, "counters": dict(be.counters)}
    be.close()
    return out


def page_hashes(plan: dict) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    g = torch.Generator().manual_seed(plan["seed"])
    tokens = torch.randint(10, 4000, (plan["pages"] * PAGE,), generator=g).tolist()
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def restore(plan: dict) -> dict:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups

    from kvgate.client import Client

    pools = build_pools()
    be = backend_for(plan["socket"], pools)
    n, half = plan["pages"], plan["pages"] // 2
    hashes = page_hashes(plan)
    rng = random.Random(plan["seed"] + 99)  # fresh pools hold other bytes: nothing matches by chance
    kv_idx = pools["kv"].alloc(n * PAGE)
    fill(pools["kv"], kv_idx, rng)
    fill(pools["indexer"], kv_idx, rng)
    swa_idx = {b: pools["swa"].alloc(SWA_WINDOW * PAGE) for b in (half, n)}
    mamba_idx = {b: pools["mamba"].alloc(1) for b in (half, n)}
    for b in (half, n):
        fill(pools["swa"], swa_idx[b], rng)
        fill(pools["mamba"], mamba_idx[b], rng)
    none = HiCacheStorageExtraInfo(prefix_keys=[])
    out: dict = {"namespace": be.namespace, "steps": {}}

    def exists(name: str) -> None:
        r = be.batch_exists_v2(hashes, transfers_for(pools, hashes, n, kv_idx, swa_idx[n], mamba_idx[n]), none)
        out["steps"][name] = {"kv_hit_pages": r.kv_hit_pages, "restorable": r.restorable_prefix_pages,
                              "pools": {str(k): v for k, v in r.extra_pool_hit_pages.items()}}

    def sidecars(name: str, end: int) -> None:
        """The trailing sidecars of the prefix ending at ``end``, as ``_page_transfer_sidecar`` reads them."""
        got: dict = {}
        for info, group in _trailing_chain_groups([], hashes[:end],
                                                  transfers_for(pools, hashes, end, None, swa_idx[end],
                                                                mamba_idx[end])):
            got.update(plain(be.batch_get_v2(group, extra_info=info)))
        out["steps"][name] = got

    def derived(name: str) -> None:
        """The KV-derived pool of the whole span, as ``_page_transfer_kv_batch`` reads it."""
        t = PoolTransfer(name=PoolName.INDEXER, host_indices=kv_idx, keys=hashes)
        out["steps"][name] = plain(be.batch_get_v2([t], extra_info=none))

    def combined(name: str) -> None:
        out["steps"][name] = plain(be.batch_get_v2(transfers_for(pools, hashes, n, kv_idx, swa_idx[n],
                                                                 mamba_idx[n]), extra_info=none))

    exists("exists_all")
    out["steps"]["get_kv"] = {"kv": be.batch_get_v1(hashes, kv_idx, none)}
    derived("get_indexer")
    sidecars("get_sidecars_end", n)
    sidecars("get_sidecars_half", half)
    out["restored"] = {"kv": digests(pools["kv"], kv_idx), "indexer": digests(pools["indexer"], kv_idx)}
    for b in (half, n):
        out["restored"][f"swa@{b}"] = digests(pools["swa"], swa_idx[b])
        out["restored"][f"mamba@{b}"] = digests(pools["mamba"], mamba_idx[b])

    with Client.connect(plan["socket"], namespace=be.namespace, engine_id=be.engine_id) as c:
            # (as the same engine: a gateway serves one)
    # One pool's object of one page at a time; each case keeps the earlier deletions.
        out["deleted_indexer_8"] = c.delete_many([be.pool_key(PoolName.INDEXER, hashes[8])])
        exists("exists_no_indexer_8")
        derived("get_indexer_no_8")
        combined("get_combined_no_indexer_8")
        out["deleted_mamba_half"] = c.delete_many([be.pool_key(PoolName.MAMBA, hashes[half - 1])])
        exists("exists_no_mamba_half")
        sidecars("get_sidecars_half_no_mamba", half)
        # Without prefix keys SGLang sends every trailing sidecar in one call (one chain group).
        ts = transfers_for(pools, hashes, half, None, swa_idx[half], mamba_idx[half])
        out["steps"]["get_sidecars_half_no_mamba_one_call"] = plain(
            be.batch_get_v2(ts, extra_info=HiCacheStorageExtraInfo(prefix_keys=None)))
        out["deleted_kv_2"] = c.delete_many([be.pool_key(PoolName.KV, hashes[2])])
        exists("exists_no_kv_2")

    # Never raise, never None: a pool nobody registered, indices that do not fit, no indices.
    draft = PoolTransfer(name=PoolName.DRAFT, host_indices=kv_idx[:PAGE], keys=hashes[:1],
                         hit_policy=PoolHitPolicy.ALL_PAGES)
    r = be.batch_exists_v2(hashes[:2], [draft], none)
    out["steps"]["exists_unregistered"] = r.kv_hit_pages
    out["steps"]["get_unregistered"] = plain(be.batch_get_v2([draft], none))
    bad = transfers_for(pools, hashes, n, kv_idx[:PAGE], swa_idx[n], None)
    out["steps"]["set_bad_indices"] = plain(be.batch_set_v2(bad, none))
    out["counters"] = dict(be.counters)
    be.close()
    out["steps"]["exists_closed"] = be.batch_exists_v2(hashes, [], none).kv_hit_pages
    out["steps"]["get_closed"] = plain(be.batch_get_v2(transfers_for(pools, hashes, n, kv_idx, swa_idx[n],
                                                                     mamba_idx[n]), none))
    # A gateway that is not there: misses at once.
    gone = backend_for(str(Path(plan["out"]).parent / "nowhere.sock"), pools, **{"kvgate.connect_timeout": 0.3})
    t = time.monotonic()
    ts = transfers_for(pools, hashes, n, kv_idx, swa_idx[n], mamba_idx[n])
    down = {"exists": gone.batch_exists_v2(hashes, ts, none).kv_hit_pages,
            "get": plain(gone.batch_get_v2(ts, none)), "set": plain(gone.batch_set_v2(ts, none))}
    down["seconds"] = round(time.monotonic() - t, 3)
    out["steps"]["down"] = down
    gone.close()
    return out


def main() -> None:
    sys.path.insert(0, str(REPO))
    plan = json.load(open(sys.argv[1]))
    t = time.monotonic()
    result = backup(plan) if plan["phase"] == "backup" else restore(plan)
    result["seconds"] = round(time.monotonic() - t, 3)
    json.dump(result, open(plan["out"], "w"))
    print(json.dumps(result), flush=True)
    os._exit(0)  # SGLang's daemon threads: no slow interpreter teardown


if __name__ == "__main__":
    main()
