"""SGLang HiCache backend: restore throughput against memcpy, and TTFT restored vs computed.

    .venv-sglang/bin/python benchmarks/sglang_bench.py io   [--pages 512] [--rounds 7] [--json out.json]
    .venv-sglang/bin/python benchmarks/sglang_bench.py ttft [--prompt-tokens 2048] [--json out.json]
    make bench-sglang ARGS="io"

io:   SGLang's own ``MHATokenToKVPoolHost`` (layer_first, bf16, 8 layers, 8 KV heads of 128, pages
      of 16 tokens: 16 fragments of 32 KiB, 512 KiB a page) and a real gateway (RAM tier).  The
      pages are stored with ``batch_set_v1`` in SGLang's batches of 128, then read back with
      ``batch_get_v1`` (gateway RAM -> staging region -> pool fragments) over several rounds.
      In the same run, the baseline: a memcpy of the same pages, fragment by fragment, from
      the pool into other pool pages (what one copy of these bytes costs here).  Reports
      GB/s (best and median of the rounds) and their ratio.
ttft: the real SGLang server (CPU, tiny random-weight Llama, 2 layers) with the kvgate backend:
      server 1 computes prompt A; after a restart, server 2 restores A from kvgate and computes
      prompt B of the same length.  TTFT is the request's time with max_new_tokens=1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def bench_io(args) -> dict:
    import ctypes

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from kvgate.integrations.sglang import KvgateHiCacheStorage
    from tests.helpers import GatewayProcess

    page, layers, heads, dim = 16, 8, 8, 128
    pages = args.pages
    device_tokens = pages * page  # the host pool holds 2x: the pages, and as many as memcpy targets
    work = Path(tempfile.mkdtemp(prefix="kvgate-sglang-io-"))
    gw = GatewayProcess(work, ["--max-bytes", f"{pages * 2}M"], name="gw").start()
    try:
        device = MHATokenToKVPool(device_tokens, page, torch.bfloat16, heads, dim, layers, "cpu", False,
                                  enable_alt_stream=False)
        host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, "layer_first",
                                    pin_memory=False, device_capacity_tokens=device_tokens, start_layer=0,
                                    end_layer=layers)
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name="bench-model", extra_config={"kvgate.socket": gw.socket})
        be = KvgateHiCacheStorage(cfg, {})
        be.register_mem_pool_host(host)
        src = host.alloc(pages * page)
        dst = host.alloc(pages * page)
        host.kv_buffer.view(torch.int16).random_(-30000, 30000)
        keys = [f"{i:064x}" for i in range(1, pages + 1)]
        batch = 128  # SGLang's STORAGE_BATCH_SIZE
        nbytes = pages * be.page_bytes

        def batches(indices):
            for b in range(0, pages, batch):
                yield b, keys[b:b + batch], indices[b * page:(b + batch) * page]

        t = time.perf_counter()
        for b, ks, idx in batches(src):
            assert all(be.batch_set_v1(ks, idx, HiCacheStorageExtraInfo(prefix_keys=keys[:b])))
        set_s = time.perf_counter() - t

        sp, ss = host.get_page_buffer_meta(src)
        dp, _ = host.get_page_buffer_meta(dst)
        get_gbs, copy_gbs = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for p_, d_, s_ in zip(sp, dp, ss):
                ctypes.memmove(d_, p_, s_)
            copy_gbs.append(nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            for b, ks, idx in batches(dst):
                assert all(be.batch_get_v1(ks, idx, HiCacheStorageExtraInfo(prefix_keys=keys[:b])))
            get_gbs.append(nbytes / (time.perf_counter() - t) / 1e9)
        # The restored pages are the stored ones, byte for byte.
        same = all(ctypes.string_at(a, n) == ctypes.string_at(b, n) for a, b, n in zip(sp, dp, ss))
        be.close()
    finally:
        gw.cleanup()
    out = {
        "pages": pages, "page_bytes": be.page_bytes, "fragments_per_page": be.fragments, "bytes": nbytes,
        "rounds": args.rounds, "identical": same,
        "batch_set_v1_GBps": round(nbytes / set_s / 1e9, 2),
        "batch_get_v1_GBps": {"best": round(max(get_gbs), 2), "median": round(statistics.median(get_gbs), 2)},
        "memcpy_GBps": {"best": round(max(copy_gbs), 2), "median": round(statistics.median(copy_gbs), 2)},
    }
    out["ratio_best"] = round(max(get_gbs) / max(copy_gbs), 3)
    out["ratio_median"] = round(statistics.median(get_gbs) / statistics.median(copy_gbs), 3)
    return out


def bench_ttft(args) -> dict:
    from tests.helpers import GatewayProcess
    from tests.integrations.sglang_server import SGLangServer, build_model, storage_tokens

    work = Path(tempfile.mkdtemp(prefix="kvgate-sglang-ttft-"))
    model = work / "tiny-llama"
    build_model(model)
    rng = random.Random(11)
    a = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
    b = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
    gw = GatewayProcess(work, ["--max-bytes", "512M"], name="gw").start()
    out: dict = {"prompt_tokens": args.prompt_tokens}
    try:
        s1 = SGLangServer(work, model, gw.socket, name="server1", max_total_tokens=16384).start()
        try:
            r = s1.generate(a, max_new_tokens=1, timeout=600)
            out["computed_A_server1_s"] = r["seconds"]
            first = r["output_ids"]
            time.sleep(3)  # backups are asynchronous
        finally:
            s1.stop()
        s2 = SGLangServer(work, model, gw.socket, name="server2", max_total_tokens=16384).start()
        try:
            r = s2.generate(a, max_new_tokens=1, timeout=600)
            out["restored_A_server2_s"] = r["seconds"]
            out["restored_tokens"] = storage_tokens(r)
            out["same_output"] = r["output_ids"] == first
            r = s2.generate(b, max_new_tokens=1, timeout=600)
            out["computed_B_server2_s"] = r["seconds"]
        finally:
            s2.stop()
    finally:
        gw.cleanup()
    out["speedup_vs_server2_compute"] = round(out["computed_B_server2_s"] / out["restored_A_server2_s"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["io", "ttft"])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    result = bench_io(args) if args.part == "io" else bench_ttft(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
