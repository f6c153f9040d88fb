"""TTFT of a long prompt on vLLM (CPU build): computed vs restored through kvgate vs restored through vLLM's `fs` tier.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--prompts 3] [--prompt-tokens 8200] [--json out.json]
    make bench-vllm ARGS="--json var/bench-vllm/result.json"

One random-weight Llama (8 layers, hidden 1024, 16 heads, 4 KV heads,
vocab 32000, float32: an 8K-token prefill takes ~20 s on two cores) and N
prompts of random token ids that share no block, so every restore is a fresh
external hit.  Every engine has both secondary tiers (KvgateOffloadingSpec
with secondary_tiers = [KvgateTier, fs], the card and the fs root being two
directories of one filesystem); each restore request names its tier with
vLLM's per-request tier filter (kv_transfer_params "kv_load_tiers": the
kvgate tier is labelled locality REMOTE, the fs tier LOCAL, as routing labels
only), so kvgate and fs restores alternate in the same engine and share its
conditions.  Engines (each a new process, i.e. a restart):

  1. compute  each prompt computed once (TTFT "computed"); after each one the
              engine steps until both tiers hold all its chunks (drained)
  2. restore  gateway still up: kvgate restores come from its RAM tier
              ("kvgate, gateway RAM"), paired with restores from fs; after
              each pair, with only the engine's prefix cache emptied, the
              prompt once more from vLLM's own CPU tier, which the pair's
              restores filled ("vLLM CPU tier"): what a restore costs the
              engine when no secondary tier is read at all, the floor of
              every secondary tier's TTFT
     -- the gateway is stopped and started again on the same card (RAM tier
        empty: it reads the card) --
  3. restore  "cold" restores (the page cache dropped before each one) and
              "warm" ones (every card and fs file read through the page
              cache before each one), kvgate and fs

A restore engine runs --repeats rounds over the prompts and, for every
prompt, restores it through kvgate and through fs back to back (the order
alternating), so each kvgate figure has an fs figure taken beside it; after
every restore it empties its prefix cache and vLLM's CPU tier
(reset_prefix_cache(reset_connector=True)), so each request is a fresh
restore from a secondary tier.  A short request before each one keeps the
engine's code paths warm, and one unmeasured restore per tier at the start
takes the engine's one-time costs of a first restore.  TTFT is vLLM's
request metric (first_token_latency); rows report the median, and the
ratios are given both as ratios of medians and as medians of the per-pair
ratios.

Every restore must cover the prompt's full blocks with external prefix-cache
hits (vllm:external_prefix_cache_hits) and give the same greedy output as the
computed run.  The page cache is dropped with `echo 3 > /proc/sys/vm/drop_caches`
(root only; without it "cold" is reported as not cold).

First (engines 0a/0b, unless --miss-prompts 0) the cost of a miss: fresh prompts computed by
engines without KV offloading and with kvgate as their only secondary tier, in the order
without, with, with, without (--miss-rounds more of them), nothing to hit in either; TTFT with
kvgate over TTFT without. --miss-only stops after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from misscost import summary
from vllm_harness import (
    BLOCK,
    REPO,
    EngineRunner,
    Gateway,
    drop_page_cache,
    exit_on_sigterm,
    log,
    median,
)

BAR_VS_COMPUTED = 0.25
BAR_VS_FS = 1.0
MISS_SEED = 5000  # the miss prompts' seeds: apart from the restore prompts', so nothing of them is stored


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts per configuration (median over them)")
    p.add_argument("--repeats", type=int, default=3,
                   help="restore rounds over the prompts per configuration (caches emptied in between)")
    p.add_argument("--prompt-tokens", type=int, default=8200,
                   help="prompt length (8200: 64 full 128-token blocks restorable, 8 tokens computed)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens generated per request (compared)")
    p.add_argument("--workdir", default=str(REPO / "var" / "bench-vllm"),
                   help="model, gateway card, fs root, logs (card and fs data are wiped at start)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--skip-ram", action="store_true", help="skip engine 2 (restores from the gateway's RAM tier)")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the engine processes, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument of `kvgate serve`, e.g. --gateway-arg=--thread-pool-size=8 (repeatable)")
    p.add_argument("--engine-timeout", type=float, default=900.0)
    p.add_argument("--miss-prompts", type=int, default=6,
                   help="fresh prompts per engine for the miss cost (0: skip it); each is computed once")
    p.add_argument("--miss-tokens", type=int, default=2048, help="tokens in each miss prompt")
    p.add_argument("--miss-only", action="store_true", help="measure the miss cost only (engines 0a/0b)")
    p.add_argument("--miss-rounds", type=int, default=1,
                   help="rounds of four miss engines (without, with, with, without kvgate)")
    p.add_argument("--plot", metavar="FILE.svg|FILE.png",
                   help="draw TTFT per configuration, kvgate beside fs (needs matplotlib in this venv: "
                        ".venv-vllm/bin/pip install matplotlib)")
    p.add_argument("--replot", metavar="RESULT.json",
                   help="no engines: draw --plot from a result an earlier run wrote with --json (any venv with "
                        "matplotlib and kvgate, e.g. .venv/bin/python benchmarks/vllm_ttft.py --replot ...)")
    args = p.parse_args(argv)
    if args.replot and not args.plot:
        p.error("--replot needs --plot FILE")
    if args.plot and args.miss_only:
        p.error("--plot draws the restore rows, which --miss-only does not measure")
    return args


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        from kvgate.bench import BenchError
        from kvgate.bench.report import check_matplotlib, plot_ttft

        try:
            check_matplotlib()  # before any engine runs, not after seven minutes of them
        except BenchError as e:
            print(f"vllm_ttft: {e}", file=sys.stderr)
            return 2
        if args.replot:
            plot_ttft(json.loads(Path(args.replot).read_text()), args.plot)
            print(f"wrote {args.plot}")
            return 0
    exit_on_sigterm()
    t_start = time.monotonic()
    loadavg_start = _loadavg()
    work = Path(args.workdir).resolve()
    model_dir = work / f"llama-l{args.layers}-h{args.hidden}-kv{args.kv_heads}-v{args.vocab}-{args.dtype}"
    card = work / "card"
    miss_card = work / "miss-card"
    fs_root = work / "fs"
    logs = work / "runs"
    for d in (card, miss_card, fs_root, logs):
        shutil.rmtree(d, ignore_errors=True)
    for d in (work, card, miss_card, fs_root, logs):
        d.mkdir(parents=True, exist_ok=True)

    head_dim = args.hidden // args.heads
    elem = 4 if args.dtype == "float32" else 2
    kv_bytes_per_token = args.layers * 2 * args.kv_heads * head_dim * elem
    full_blocks = args.prompt_tokens // BLOCK
    hit_tokens = full_blocks * BLOCK
    if hit_tokens >= args.prompt_tokens:  # vLLM always computes at least the last token
        full_blocks -= 1
        hit_tokens -= BLOCK
    max_model_len = max(9216, args.prompt_tokens + args.max_tokens + 16)
    prompt_bytes = full_blocks * BLOCK * kv_bytes_per_token
    kv_space_gib = max(1, math.ceil(2.5 * max_model_len * kv_bytes_per_token / (1 << 30)))
    cpu_tier_bytes = max(256 << 20, int(prompt_bytes * (args.prompts + 1)))
    gateway_ram = f"{max(512, math.ceil(prompt_bytes * (args.prompts + 1) / (1 << 20)))}M"

    model = {"dir": str(model_dir), "dtype": args.dtype, "tokenizer": False, "config": {
        "vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(16384, max_model_len)}}
    llm = {"max_model_len": max_model_len}
    base_kv = {"spec_name": "KvgateOffloadingSpec", "spec_module_path": "kvgate.integrations.vllm",
               "cpu_bytes_to_use": cpu_tier_bytes}
    fs_tier = {"type": "fs", "root_dir": str(fs_root), "locality": "LOCAL"}
    prompts = [prompt_ids(i, args.prompt_tokens, args.vocab) for i in range(args.prompts)]
    names = [f"P{i + 1}" for i in range(args.prompts)]
    only = {"kvgate": {"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]},
            "fs": {"kv_load_tiers": [{"medium": "STORAGE", "locality": "LOCAL"}]}}

    def kv(gw: Gateway) -> dict[str, Any]:
        kvgate_tier = {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": gw.socket,
                       "locality": "REMOTE"}
        return {**base_kv, "secondary_tiers": [kvgate_tier, fs_tier]}

    def gen(i: int, tag: str, tier: str | None = None) -> dict[str, Any]:
        step = {"op": "generate", "name": f"{tag}:{names[i]}", "prompt_token_ids": prompts[i],
                "max_tokens": args.max_tokens}
        if tier:
            step["kv_transfer_params"] = only[tier]
        return step

    def rounds(kinds: list[str], tiers: tuple[str, ...] = ("kvgate", "fs")) -> list[dict]:
        """Restores of every prompt of every kind ("ram", "cold", "warm") through each tier, in
        pairs: the tiers restore the same prompt back to back (their order alternating), so a
        slow spell of this shared machine hits both sides of a pair alike.  A cold restore
        follows a page-cache drop, a warm one a read of every card and fs file through the
        page cache; every restore is followed by emptying the engine's prefix cache and
        vLLM's CPU tier, so the next one comes from a secondary tier again."""
        # The first restore of an engine pays one-time costs (first touch of vLLM's CPU tier
        # and of the code paths of a restore) whichever tier serves it: one unmeasured restore
        # of P1 through each tier first.
        steps: list[dict] = []
        for tier in tiers:
            steps += [{"op": "warmup"}, gen(0, f"first-restore-{tier}", tier), {"op": "reset_cache"}]
        n = 0
        for _rep in range(args.repeats):
            for kind in kinds:
                for i in range(args.prompts):
                    for tier in (tiers if n % 2 == 0 else tiers[::-1]):
                        if kind == "cold":
                            steps.append({"op": "drop_caches"})
                        elif kind == "warm":  # a cold restore before may have dropped these files
                            steps.append({"op": "warm_files", "dirs": [str(card), str(fs_root)]})
                        steps += [{"op": "warmup"}, gen(i, f"{tier}-{kind}", tier), {"op": "reset_cache"}]
                    if kind == "ram":  # the floor: the same prompt out of vLLM's CPU tier, filled by a restore
                        steps[-1:] = [{"op": "reset_device_cache"}, {"op": "warmup"}, gen(i, "cputier-ram"),
                                      {"op": "reset_cache"}]
                    n += 1
        return steps

    engine_env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    for item in args.engine_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-env wants KEY=VALUE, got {item!r}")
        engine_env[key] = value
    runner = EngineRunner(logs, env=engine_env)
    gw: Gateway | None = None
    runs: dict[str, dict] = {}
    timeline: list[tuple[str, float]] = []
    can_drop = drop_page_cache()
    if not can_drop:
        log("cannot drop the page cache (not root?): the 'cold' rounds will not be cold")
    log(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.kv_heads} KV heads, "
        f"vocab {args.vocab}, {args.dtype}; KV {kv_bytes_per_token // 1024} KiB/token, "
        f"{prompt_bytes / (1 << 20):.0f} MiB per prompt ({full_blocks} chunks of {BLOCK} tokens)")
    log(f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.repeats} restore rounds; workdir {work}")
    try:
        gw = Gateway(work, card, name="gw", max_bytes=gateway_ram, extra_args=args.gateway_arg).start()
        log(f"gateway up (pid {gw.proc.pid}, socket {gw.socket}, card {card}, RAM tier {gateway_ram})")

        # 0. the cost of a miss: fresh prompts computed by an engine without kvgate and by one
        # with kvgate configured (its only secondary tier), nothing to hit in either
        if args.miss_prompts:
            t = time.monotonic()
            log(f"engines 0a/0b: the cost of a miss, {args.miss_prompts} fresh prompts of {args.miss_tokens} "
                f"tokens each, without kvgate and with it")
            # its own gateway and card, so the restore runs' counts of stored chunks see none of these
            miss_gw = Gateway(work, miss_card, name="gw-miss", max_bytes=gateway_ram,
                              extra_args=args.gateway_arg).start()
            try:
                kvgate_only = {**base_kv, "secondary_tiers": [{"type": "KvgateTier", "module_path":
                                                                 "kvgate.integrations.vllm", "socket": miss_gw.socket}]}
                # Engines of either kind in the order A B B A (and again per further round): the
                # machine's speed drifts by about 10 % between engines here, which this order cancels
                # to first order; every prompt is fresh (its own seed), so nothing is ever hit.
                order = [("miss_plain", None), ("miss_kvgate", kvgate_only)]
                seq = []
                for r in range(args.miss_rounds):
                    seq += order + order[::-1] if r % 2 == 0 else order[::-1] + order
                for n, (run, plan_kv) in enumerate(seq):
                    steps = [{"op": "warmup"}]
                    for i in range(args.miss_prompts + 1):  # the first one takes the engine's one-time costs
                        ids = prompt_ids(MISS_SEED + 100 * n + i, args.miss_tokens, args.vocab)
                        name = f"first-miss:M{i}" if i == 0 else f"{run.replace('_', '-')}:M{n}.{i}"
                        steps += [{"op": "warmup"}, {"op": "generate", "name": name, "prompt_token_ids": ids,
                                                     "max_tokens": args.max_tokens}]
                    got = runner.run(f"0-{n}-{run}", {"model": model, "llm": llm, "steps": steps, "kv": plan_kv},
                                     timeout=args.engine_timeout)
                    runs.setdefault(run, {"results": []})["results"] += got["results"]
            finally:
                miss_gw.cleanup()
            timeline.append(("engines 0a/0b: miss cost", time.monotonic() - t))

        if args.miss_only:
            return _miss_report(args, runs, t_start)

        # 1. compute: every prompt computed once and stored in both tiers
        steps: list[dict] = [{"op": "warmup"}]
        for i in range(args.prompts):
            steps += [gen(i, "computed"), {"op": "drain", "kvgate_socket": gw.socket,
                                           "kvgate_sets": full_blocks * (i + 1), "fs_root": str(fs_root),
                                           "fs_files": full_blocks * (i + 1), "timeout": 180, "settle": 0.5}]
        t = time.monotonic()
        log("engine 1: compute, store in kvgate and fs")
        runs["compute"] = runner.run("1-compute", {"model": model, "llm": llm, "steps": steps, "kv": kv(gw)},
                                     timeout=args.engine_timeout)
        timeline.append(("engine 1: compute + store", time.monotonic() - t))
        bad = [r for r in runs["compute"]["results"] if r["name"] == "drain" and not r["done"]]
        if bad:
            raise RuntimeError(f"stores did not drain: {bad}")

        # 2. restart, gateway still up: kvgate restores come from its RAM tier
        if not args.skip_ram:
            t = time.monotonic()
            log("engine 2: restart; restores from the running gateway (RAM) and from fs")
            runs["ram"] = runner.run("2-restore-ram", {"model": model, "llm": llm, "kv": kv(gw),
                                                       "steps": rounds(["ram"])},
                                     timeout=args.engine_timeout)
            timeline.append(("engine 2: kvgate RAM / fs", time.monotonic() - t))
        gw_stats_1 = gw.stats()

        # the gateway restarts: its RAM tier is empty, everything comes from the card
        gw.cleanup()
        gw = Gateway(work, card, name="gw", max_bytes=gateway_ram, extra_args=args.gateway_arg).start()
        # restores start once the start-up scan is done, so every run measures the same thing (a
        # restore during the scan also works: the card is asked for what its index lacks)
        t = time.monotonic()
        cards = gw.wait_scanned(60.0)["cards"]
        log(f"gateway restarted (pid {gw.proc.pid}): RAM tier empty, "
            f"{sum(c['objects'] for c in cards)} objects on the card (scan done after {time.monotonic() - t:.2f} s)")

        t = time.monotonic()
        log("engine 3: restart; restores from the card and from fs, page cache dropped (cold) and warm")
        runs["card"] = runner.run("3-restore-card", {"model": model, "llm": llm, "kv": kv(gw),
                                                     "steps": rounds(["cold", "warm"])},
                                  timeout=args.engine_timeout)
        timeline.append(("engine 3: kvgate card / fs, cold and warm", time.monotonic() - t))
        gw_stats_2 = gw.stats()
    finally:
        runner.close()
        if gw is not None:
            gw.cleanup()

    report = summarize(args, runs, prompts, names, hit_tokens, can_drop)
    report["miss"] = summarize_miss(runs)
    report["setup"] = {
        "model": model["config"] | {"dtype": args.dtype}, "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts, "repeats": args.repeats, "restorable_tokens": hit_tokens,
        "miss_prompts": args.miss_prompts, "miss_tokens": args.miss_tokens,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_bytes_per_prompt": prompt_bytes, "VLLM_CPU_KVCACHE_SPACE_GiB": kv_space_gib,
        "cpu_bytes_to_use": cpu_tier_bytes, "gateway_max_bytes": gateway_ram, "gateway_args": args.gateway_arg,
        "page_cache_dropped": can_drop,
        "engine_env": engine_env | {"VLLM_CPU_OMP_THREADS_BIND": runner.env.get("VLLM_CPU_OMP_THREADS_BIND")},
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "engine_start_s": {k: v.get("engine_start_s") for k, v in runs.items()},
        "loadavg_start": loadavg_start, "loadavg_end": _loadavg(),
    }
    report["gateway"] = {"first": _gw_summary(gw_stats_1), "restarted": _gw_summary(gw_stats_2)}
    report["timeline_s"] = {k: round(v, 1) for k, v in timeline}
    report["total_s"] = round(time.monotonic() - t_start, 1)
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    if args.plot:
        from kvgate.bench.report import plot_ttft

        plot_ttft(report, args.plot)
        log(f"wrote {args.plot}")
    return 0 if report["checks_ok"] and not report["miss"].get("problems") else 1


def _miss_report(args, runs: dict[str, dict], t_start: float) -> int:
    """``--miss-only``: the miss cost, printed and written as JSON alone."""
    miss = summarize_miss(runs)
    a, b = miss["miss_plain"], miss["miss_kvgate"]
    print(f"\nmiss cost, {args.miss_prompts} fresh prompts of {args.miss_tokens} tokens per engine: TTFT median "
          f"{a['median_ttft_s']:.3f} s without kvgate ({a['ttft_s']}), {b['median_ttft_s']:.3f} s with it "
          f"({b['ttft_s']}): ratio {miss['ttft_ratio']:.3f}; whole request {miss['wall_ratio']:.3f}; per engine "
          f"{a['engine_medians_s']} without, {b['engine_medians_s']} with; "
          f"{time.monotonic() - t_start:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"miss": miss}, indent=1))
    return 0 if not miss["problems"] else 1


def summarize_miss(runs: dict[str, dict]) -> dict[str, Any]:
    """TTFT and whole-request time of fresh prompts, with kvgate configured and without: what a miss costs."""
    if "miss_plain" not in runs or "miss_kvgate" not in runs:
        return {}
    out: dict[str, Any] = {"problems": []}
    for run in ("miss_plain", "miss_kvgate"):
        tag = run.replace("_", "-") + ":"
        samples = [r for r in runs[run]["results"] if r["name"].startswith(tag)]
        if any(r["external_prefix_cache_hits"] for r in samples):
            out["problems"].append(f"{run}: a fresh prompt had external hits")
        out[run] = {"ttft_s": [round(r["ttft_s"] if r["ttft_s"] is not None else r["wall_s"], 4) for r in samples],
                    "wall_s": [round(r["wall_s"], 4) for r in samples]}
        engines: dict[str, list[float]] = {}
        for r, t in zip(samples, out[run]["ttft_s"]):
            engines.setdefault(r["name"].split(":")[1].split(".")[0], []).append(t)
        out[run]["engine_medians_s"] = {k: median(v) for k, v in engines.items()}
        out[run]["median_ttft_s"] = median(out[run]["ttft_s"])
        out[run]["median_wall_s"] = median(out[run]["wall_s"])
    ttft = summary({"without": out["miss_plain"]["ttft_s"], "with": out["miss_kvgate"]["ttft_s"]})
    out["ttft_ratio"] = ttft["ttft_ratio"]
    out["wall_ratio"] = round(out["miss_kvgate"]["median_wall_s"] / out["miss_plain"]["median_wall_s"], 4)
    out["bar"] = ttft["bar"]
    return out


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _gw_summary(st: dict) -> dict:
    return {tier: {k: v[k] for k in ("objects", "sets", "gets", "hits", "misses", "bytes_read")}
            for tier, v in st["tiers"].items()}


ROWS = [
    ("computed", "computed (no cache)", "compute", "computed"),
    ("kvgate_ram", "kvgate, gateway RAM", "ram", "kvgate-ram"),
    ("fs_ram", "vLLM fs tier (same engine as kvgate RAM)", "ram", "fs-ram"),
    ("cputier_ram", "vLLM's own CPU tier (no secondary tier read: the floor)", "ram", "cputier-ram"),
    ("kvgate_cold", "kvgate, card, page cache dropped", "card", "kvgate-cold"),
    ("fs_cold", "vLLM fs tier, page cache dropped", "card", "fs-cold"),
    ("kvgate_warm", "kvgate, card, page cache warm", "card", "kvgate-warm"),
    ("fs_warm", "vLLM fs tier, page cache warm", "card", "fs-warm"),
]


def summarize(args, runs, prompts, names, hit_tokens, can_drop) -> dict[str, Any]:
    computed_out = {}
    for r in runs["compute"]["results"]:
        if r["name"].startswith("computed:"):
            computed_out[r["name"].split(":")[1]] = r["output_token_ids"]
    rows: dict[str, Any] = {}
    problems: list[str] = []
    for key, label, run, tag in ROWS:
        if run not in runs:
            continue
        samples = [r for r in runs[run]["results"] if r["name"].startswith(tag + ":")]
        ttfts = [r["ttft_s"] if r["ttft_s"] is not None else r["wall_s"] for r in samples]
        restored = key != "computed"
        hits_ok = all(r["external_prefix_cache_hits"] == (hit_tokens if restored else 0) for r in samples)
        same = all(r["output_token_ids"] == computed_out.get(r["name"].split(":")[1]) for r in samples)
        if not hits_ok:
            problems.append(f"{label}: external hits {[r['external_prefix_cache_hits'] for r in samples]}, "
                            f"expected {hit_tokens if restored else 0} each")
        if not same:
            problems.append(f"{label}: greedy output differs from the computed run")
        rows[key] = {"label": label, "ttft_s": [round(x, 4) for x in ttfts], "median_s": round(median(ttfts), 4),
                     "min_s": round(min(ttfts), 4), "max_s": round(max(ttfts), 4),
                     "external_hits": [r["external_prefix_cache_hits"] for r in samples],
                     "local_hits": [r["prefix_cache_hits"] for r in samples],
                     "hits_ok": hits_ok, "same_output": same}
    med = {k: v["median_s"] for k, v in rows.items()}

    def ratio(a, b):
        return round(med[a] / med[b], 4) if a in med and b in med and med[b] else None

    ratios = {
        "kvgate_cold/computed": ratio("kvgate_cold", "computed"),
        "kvgate_warm/computed": ratio("kvgate_warm", "computed"),
        "kvgate_ram/computed": ratio("kvgate_ram", "computed"),
        "kvgate_ram/fs_ram": ratio("kvgate_ram", "fs_ram"),
        "cputier_ram/fs_ram": ratio("cputier_ram", "fs_ram"),
        "kvgate_cold/fs_cold": ratio("kvgate_cold", "fs_cold"),
        "kvgate_warm/fs_warm": ratio("kvgate_warm", "fs_warm"),
    }
    # Each kvgate restore has an fs restore of the same prompt right beside it (rounds()): the
    # median of those per-pair ratios is the figure least moved by this machine's slow spells.
    paired = {}
    for num, den in (("kvgate_ram", "fs_ram"), ("kvgate_cold", "fs_cold"), ("kvgate_warm", "fs_warm"),
                     ("cputier_ram", "fs_ram")):
        a, b = rows.get(num), rows.get(den)
        if a and b and len(a["ttft_s"]) == len(b["ttft_s"]):
            paired[f"{num}/{den}"] = round(median([x / y for x, y in zip(a["ttft_s"], b["ttft_s"])]), 4)
    bars = {
        f"kvgate/computed <= {BAR_VS_COMPUTED}": all(
            v <= BAR_VS_COMPUTED for k, v in ratios.items() if k.endswith("/computed") and v is not None),
        f"kvgate/fs <= {BAR_VS_FS}": all(
            v <= BAR_VS_FS for k, v in ratios.items() if k.startswith("kvgate") and "/fs" in k and v is not None),
    }
    first = {run: {r["name"].split(":")[0]: r["ttft_s"] for r in runs[run]["results"]
                   if r["name"].startswith("first-restore-")} for run in runs if run in ("ram", "card")}
    return {"rows": rows, "ratios": ratios, "paired_ratios": paired, "bars": bars, "problems": problems,
            "first_restores_s": first,
            "checks_ok": not problems, "cold_is_cold": can_drop}


def print_report(rep: dict[str, Any]) -> None:
    s = rep["setup"]
    m = s["model"]
    print()
    print(f"TTFT, {s['prompt_tokens']}-token prompt ({s['restorable_tokens']} tokens restorable), "
          f"Llama {m['num_hidden_layers']} layers / hidden {m['hidden_size']} / {m['num_key_value_heads']} KV heads "
          f"/ {m['dtype']}, random weights; vLLM 0.32 CPU, {s['cpus']} cores; "
          f"{s['kv_bytes_per_prompt'] / (1 << 20):.0f} MiB of KV per prompt; median of {s['prompts']} prompts x {s['repeats']} rounds "
          f"(computed: each prompt once); engine env {s['engine_env']}")
    print()
    comp = rep["rows"].get("computed", {}).get("median_s")
    table = [("configuration", "TTFT median", "min - max", "vs computed", "external hits", "same output")]
    for r in rep["rows"].values():
        hits = "/".join(str(h) for h in sorted({int(h) for h in r["external_hits"]}))
        table.append((r["label"], f"{r['median_s']:.3f} s", f"{r['min_s']:.3f} - {r['max_s']:.3f} s",
                      f"{r['median_s'] / comp:.3f}" if comp else "-", hits, "yes" if r["same_output"] else "NO"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("| " + " | ".join(cells) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print()
    for k, v in rep["ratios"].items():
        if v is not None:
            print(f"  {k:<22} {v:.3f}")
    for k, v in rep.get("paired_ratios", {}).items():
        print(f"  {k:<22} {v:.3f} (median of per-pair ratios)")
    for k, ok in rep["bars"].items():
        print(f"  bar {k}: {'met' if ok else 'NOT met'}")
    if not rep["cold_is_cold"]:
        print("  note: the page cache could not be dropped; 'cold' rows are not cold")
    for run, first in rep.get("first_restores_s", {}).items():
        print(f"  unmeasured first restores of engine '{run}' (one-time costs): "
              + ", ".join(f"{k.replace('first-restore-', '')} {v:.3f} s" for k, v in first.items() if v))
    miss = rep.get("miss")
    if miss:
        a, b = miss["miss_plain"], miss["miss_kvgate"]
        print(f"  miss cost, {s['miss_prompts']} fresh prompts of {s['miss_tokens']} tokens per engine: TTFT median "
              f"{a['median_ttft_s']:.3f} s without kvgate, {b['median_ttft_s']:.3f} s with it "
              f"(ratio {miss['ttft_ratio']:.3f}); whole request {miss['wall_ratio']:.3f}")
        for k, ok in miss["bar"].items():
            print(f"  bar {k}: {'met' if ok else 'NOT met'}")
    for p in rep["problems"] + (miss or {}).get("problems", []):
        print(f"  PROBLEM: {p}")
    print(f"  engine start (s): {s['engine_start_s']}; total {rep['total_s']} s; "
          f"load average {s['loadavg_start']} at start, {s['loadavg_end']} at the end")


if __name__ == "__main__":
    sys.exit(main())
