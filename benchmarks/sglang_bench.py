"""SGLang HiCache backend: restore throughput against memcpy, and TTFT restored vs computed.

    .venv-sglang/bin/python benchmarks/sglang_bench.py io   [--pages 512] [--rounds 7] [--json out.json]
    .venv-sglang/bin/python benchmarks/sglang_bench.py ttft [--prompt-tokens 4096] [--prompts 3] [--layers 16]
    .venv-sglang/bin/python benchmarks/sglang_bench.py miss [--prompt-tokens 4096] [--prompts 3] [--layers 16]
    make bench-sglang ARGS="io"

io:   SGLang's own ``MHATokenToKVPoolHost`` (layer_first, bf16, 8 layers, 8 KV heads of 128, pages
      of 16 tokens: 16 fragments of 32 KiB, 512 KiB a page) and a real gateway (RAM tier).  The
      pages are stored with ``batch_set_v1`` in SGLang's batches of 128, then read back with
      ``batch_get_v1`` (gateway RAM -> pool fragments, read by the backend out of the gateway's
      memory where it may: ``gateway_get_paths`` counts the lent gets) over several rounds.
      In the same run, the baseline: a memcpy of the same pages, fragment by fragment, from
      the pool into other pool pages (what one copy of these bytes costs here).  Reports
      GB/s (best and median of the rounds) and their ratio.
ttft: the real SGLang server (CPU) with the kvgate backend, on the tests' random-weight Llama
      (hidden 256) made 16 layers deep: server 1 computes prompts A1..An; after a restart,
      server 2 restores each Ai from kvgate and, right after it, computes a new prompt Bi of
      the same length.  TTFT is the request's time with max_new_tokens=1; medians.
miss: what kvgate costs a prompt nothing can restore: the same server (the README's command) without
      a storage backend and with kvgate's, in the order without, with, with, without (the machine's
      speed drifts between servers; this order cancels it to first order), each computing --prompts
      fresh prompts after one unmeasured; no prompt is ever seen twice, so nothing is hit.  TTFT
      with kvgate over TTFT without, medians; with kvgate every prompt is also stored (write-through).
      --also-file: two servers with SGLang's own file backend in the middle (without, with, file,
      file, with, without): what any storage backend costs a miss in SGLang, beside kvgate's cost.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
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
        paths = gw.stats()["get_paths"]  # lent: read by the backend out of the gateway's memory, one copy
        be.close()
    finally:
        gw.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "pages": pages, "page_bytes": be.page_bytes, "fragments_per_page": be.fragments, "bytes": nbytes,
        "rounds": args.rounds, "identical": same, "gateway_get_paths": paths,
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
    model = work / f"tiny-llama-{args.layers}l"
    build_model(model, layers=args.layers)
    rng = random.Random(11)
    n, tokens = args.prompts, args.prompt_tokens
    a = [[rng.randrange(10, 4000) for _ in range(tokens)] for _ in range(n)]
    b = [[rng.randrange(10, 4000) for _ in range(tokens)] for _ in range(n)]
    gw = GatewayProcess(work, ["--max-bytes", "1G"], name="gw").start()
    out: dict = {"prompt_tokens": tokens, "prompts": n, "layers": args.layers}
    first, computed1, restored, computed2, hits, same = [], [], [], [], [], []
    try:
        s1 = SGLangServer(work, model, gw.socket, name="server1", max_total_tokens=4 * tokens + 4096).start()
        try:
            s1.generate([5, 6, 7], max_new_tokens=1)  # the first request's one-time costs, unmeasured
            for p in a:
                r = s1.generate(p, max_new_tokens=1, timeout=900)
                computed1.append(r["seconds"])
                first.append(r["output_ids"])
            time.sleep(5)  # backups are asynchronous
        finally:
            s1.stop()
        s2 = SGLangServer(work, model, gw.socket, name="server2", max_total_tokens=4 * tokens + 4096).start()
        try:
            s2.generate([5, 6, 7], max_new_tokens=1)
            for i in range(n):  # restore and compute alternate: both under the same conditions
                r = s2.generate(a[i], max_new_tokens=1, timeout=900)
                restored.append(r["seconds"])
                hits.append(storage_tokens(r))
                same.append(r["output_ids"] == first[i])
                computed2.append(s2.generate(b[i], max_new_tokens=1, timeout=900)["seconds"])
        finally:
            s2.stop()
    finally:
        gw.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    out.update({
        "computed_server1_s": computed1, "restored_server2_s": restored, "computed_server2_s": computed2,
        "restored_tokens": hits, "same_output": all(same),
        "median_computed_s": med(computed1 + computed2), "median_restored_s": med(restored),
    })
    out["speedup_median"] = round(out["median_computed_s"] / out["median_restored_s"], 1)
    return out


def bench_miss(args) -> dict:
    from misscost import summary  # benchmarks/, this script's directory
    from tests.helpers import GatewayProcess
    from tests.integrations.sglang_server import SGLangServer, build_model, storage_tokens

    work = Path(tempfile.mkdtemp(prefix="kvgate-sglang-miss-"))
    model = work / f"tiny-llama-{args.layers}l"
    build_model(model, layers=args.layers)
    tokens = args.prompt_tokens
    gw = GatewayProcess(work, ["--max-bytes", "1G"], name="gw").start()
    order = ("without", "with", "file", "file", "with", "without") if args.also_file else \
        ("without", "with", "with", "without")
    storage = {"without": None, "with": "kvgate", "file": "file"}
    ttft: dict[str, list[float]] = {name: [] for name in order}
    per_server, problems = [], []
    try:
        for n, name in enumerate(order):
            rng = random.Random(1000 + n)  # fresh prompts on every server: nothing to hit, in any tier
            srv = SGLangServer(work, model, gw.socket, name=f"server{n}-{name}", storage=storage[name],
                               max_total_tokens=2 * tokens + 4096).start()
            got = []
            try:
                for i in range(args.prompts + 1):  # the first one takes the server's one-time costs, unmeasured
                    r = srv.generate([rng.randrange(10, 4000) for _ in range(tokens)], max_new_tokens=1,
                                     timeout=900)
                    if storage_tokens(r):
                        problems.append(f"server {n} (storage: {storage[name]}): a fresh prompt restored "
                                        f"{storage_tokens(r)} tokens from storage")
                    if i:
                        got.append(r["seconds"])
            finally:
                srv.stop()
            ttft[name] += got
            per_server.append({"server": n, "storage": storage[name], "ttft_s": got,
                               "median_s": statistics.median(got)})
        stats = gw.stats()
    finally:
        gw.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "prompt_tokens": tokens, "prompts_per_server": args.prompts, "layers": args.layers, "servers": per_server,
        **summary(ttft),
        # what the servers with kvgate stored meanwhile (write-through): the miss's cost includes it
        "gateway_tiers": {t: {k: v.get(k) for k in ("objects", "sets")} for t, v in stats["tiers"].items()},
        "problems": problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["io", "ttft", "miss"])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16, help="ttft: layers of the random-weight Llama")
    ap.add_argument("--also-file", action="store_true", help="miss: servers with SGLang's file backend too")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    result = {"io": bench_io, "ttft": bench_ttft, "miss": bench_miss}[args.part](args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
