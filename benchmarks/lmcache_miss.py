"""What kvgate costs LMCache + vLLM on a prompt nothing can restore: TTFT with kvgate as LMCache's L2
against the same ``lmcache server`` without an L2 adapter.

    .venv/bin/python benchmarks/lmcache_miss.py [--prompts 6] [--prompt-tokens 2048] [--json out.json]
    make bench-lmcache

The README's ``lmcache server`` command (tests/integrations/lmcache_servers.py), with the kvgate L2
adapter and without it, each time with a fresh server (L1 empty) and a fresh engine
(tests/integrations/vllm_engine.py: vLLM's CPU build, the tests' tiny random-weight Llama, LMCache's
connector), in the order without, with, with, without: the machine's speed drifts between engines, and
this order cancels it to first order.  Each engine computes one unmeasured prompt, then ``--prompts``
fresh ones (no prompt is ever seen twice: nothing can be hit in L1, L2 or vLLM's prefix cache); with
kvgate, LMCache also stores each chunk in the gateway meanwhile.  TTFT is vLLM's first-token latency of
each request; the figure is the median with kvgate over the median without.  ``--also-fs``: two engines
with LMCache's own ``fs`` L2 adapter in the middle (without, with, fs, fs, with, without): what any L2
adapter costs a miss in LMCache, beside kvgate's cost.  Runs in the project venv; the engines and
servers run in .venv-lmcache (make lmcache-venv).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from misscost import summary  # noqa: E402  (benchmarks/, this script's directory)
from tests.helpers import GatewayProcess  # noqa: E402
from tests.integrations.lmcache_servers import VENV_PY, LMCacheServer, run_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help="fresh prompts per engine, after one unmeasured")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt (the engine's limit: 4096)")
    ap.add_argument("--also-fs", action="store_true", help="engines with LMCache's own fs L2 adapter too")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if not VENV_PY.exists():
        print(f"{VENV_PY} is missing: make lmcache-venv", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvgate-lmcache-miss-"))
    model_dir = work / "tiny-llama"
    gw = GatewayProcess(work, ["--max-bytes", "1G"], name="gw").start()
    order = (("without", "with", "fs", "fs", "with", "without") if args.also_fs else
             ("without", "with", "with", "without"))
    l2 = {"without": None, "with": "kvgate", "fs": {"type": "fs", "base_path": str(work / "lmcache-fs")}}
    ttft: dict[str, list[float]] = {name: [] for name in order}
    engines, problems = [], []
    try:
        for n, name in enumerate(order):
            rng = random.Random(2000 + n)  # fresh prompts on every engine
            requests = [{"name": f"{name}-{n}.{i}", "max_tokens": 1,
                         "prompt_token_ids": [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]}
                        for i in range(args.prompts + 1)]
            server = LMCacheServer(work, gw, f"lmcache{n}-{name}", l2=l2[name]).start()
            try:
                result = run_engine(work, f"engine{n}-{name}", gw, server, model_dir, requests)
            finally:
                server.stop()
            got = []
            for r in result["results"][1:]:  # the first takes the engine's one-time costs
                if r.get("external_prefix_cache_hits_delta") or r.get("num_cached_tokens"):
                    problems.append(f"{r['name']}: a fresh prompt was hit ({r.get('num_cached_tokens')} cached tokens)")
                got.append(round(r["ttft"] if r.get("ttft") is not None else r["seconds"], 4))
            ttft[name] += got
            engines.append({"engine": n, "l2": name, "ttft_s": got, "median_s": statistics.median(got)})
            print(f"engine {n} (L2: {name}): TTFT median {statistics.median(got):.3f} s of {got}", flush=True)
        tiers = {t: {k: v.get(k) for k in ("objects", "sets")} for t, v in gw.stats()["tiers"].items()}
    finally:
        gw.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "prompt_tokens": args.prompt_tokens, "prompts_per_engine": args.prompts, "engines": engines,
        **summary(ttft),
        "gateway_tiers": tiers,  # what LMCache stored in kvgate meanwhile: the miss's cost includes it
        "problems": problems,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
