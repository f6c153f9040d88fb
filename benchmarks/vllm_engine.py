"""One vLLM (CPU build) engine process for the demo and the benchmark; run with .venv-vllm/bin/python.

    python benchmarks/vllm_engine.py PLAN.json

PLAN (JSON):
  "model":  {"dir", "config": LlamaConfig kwargs, "dtype", "tokenizer": bool}
            (the random-weight model is built when missing)
  "llm":    extra keyword arguments of vllm.LLM (max_model_len, ...)
  "kv":     kv_connector_extra_config of the OffloadingConnector (null: no connector)
  "steps":  run in order:
    {"op": "generate", "name", "prompt_token_ids" | "prompt", "max_tokens", "kv_transfer_params"}
        one generate() call, greedy; records TTFT (vLLM's request metric
        first_token_latency; the wall time of the call as a fallback), the
        output, num_cached_tokens and the prefix-cache counter deltas
    {"op": "warmup"}            a 4-token request (no full block: no lookups, no stores)
    {"op": "drain", "kvgate_socket", "kvgate_sets", "fs_root", "fs_files", "timeout", "settle"}
        keep the engine stepping (short requests) until the gateway's card
        writes reach kvgate_sets and fs_root holds fs_files chunk files
    {"op": "drop_caches"}       sync; echo 3 > /proc/sys/vm/drop_caches
    {"op": "reset_cache"}       empty the engine's prefix cache and vLLM's CPU tier
    {"op": "reset_device_cache"} empty the engine's prefix cache only: vLLM's CPU tier keeps
                                what it holds, so the next request of a prompt loads from there
  "out": where the results go (JSON)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_harness import build_model, drop_page_cache

COUNTERS = ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


def say(msg: str) -> None:
    print(f"[engine] {msg}", flush=True)


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0))
    return out


def count_fs_files(root: str) -> int:
    n = 0
    for _dir, _dirs, files in os.walk(root):
        n += sum(1 for f in files if f.endswith(".bin"))
    return n


def gateway_card_sets(socket_path: str) -> int:
    from kvgate.client import Client

    with Client.connect(socket_path, role="admin", want_shm=False, timeout=10) as c:
        return int(c.stats()["tiers"]["long"]["sets"])


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    m = plan["model"]
    t_build = time.monotonic()
    build_model(Path(m["dir"]), m["config"], m.get("dtype", "float32"))
    build_s = time.monotonic() - t_build

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    kwargs = {"model": m["dir"], "skip_tokenizer_init": not m.get("tokenizer", False),
              "dtype": m.get("dtype", "float32"), "enforce_eager": True, "enable_prefix_caching": True,
              "disable_log_stats": False, "seed": 0}
    kwargs.update(plan.get("llm", {}))
    if plan.get("kv") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                        kv_connector_extra_config=plan["kv"])
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    say(f"engine started in {start_s:.1f} s")
    if plan.get("kv") is not None:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        with open(plan["out"] + ".engine_id", "w") as f:  # lets the caller remove a /dev/shm file vLLM leaked
            f.write(engine_id)

    short = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    results: list[dict] = []
    for step in plan["steps"]:
        op = step["op"]
        if op == "generate":
            prompt = ({"prompt_token_ids": step["prompt_token_ids"]} if "prompt_token_ids" in step
                      else {"prompt": step["prompt"]})
            extra_args = {"kv_transfer_params": step["kv_transfer_params"]} if step.get("kv_transfer_params") else None
            sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True,
                                detokenize=bool(m.get("tokenizer", False)), extra_args=extra_args)
            before = counters(llm)
            started_at = time.time()
            t = time.monotonic()
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            wall = time.monotonic() - t
            after = counters(llm)
            metrics = getattr(out, "metrics", None)
            ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
            r = {
                "name": step["name"],
                "prompt_tokens": len(out.prompt_token_ids or []),
                "ttft_s": round(ttft, 4) if ttft else None,
                "wall_s": round(wall, 4),
                "started_at": started_at,
                "num_cached_tokens": out.num_cached_tokens,
                "output_token_ids": list(out.outputs[0].token_ids),
                "output_text": out.outputs[0].text if m.get("tokenizer") else None,
                **{k.split(":")[1]: after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
            }
            results.append(r)
            say(f"{r['name']}: TTFT {r['ttft_s'] if r['ttft_s'] is not None else wall:.3f} s, "
                f"{r['prompt_tokens']} prompt tokens, cached {r['num_cached_tokens']}, "
                f"external hits +{r['external_prefix_cache_hits']:.0f}")
        elif op == "warmup":
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], short, use_tqdm=False)
        elif op == "drain":
            # Stores are asynchronous (engine -> vLLM's CPU tier -> kvgate / fs): keep the engine
            # stepping until every tier holds what the caller expects.
            deadline = time.monotonic() + step.get("timeout", 120)
            t = time.monotonic()
            sets = files = None
            while True:
                sets = gateway_card_sets(step["kvgate_socket"]) if step.get("kvgate_socket") else None
                files = count_fs_files(step["fs_root"]) if step.get("fs_root") else None
                done = ((sets is None or sets >= step.get("kvgate_sets", 0))
                        and (files is None or files >= step.get("fs_files", 0)))
                if done or time.monotonic() > deadline:
                    break
                llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], short, use_tqdm=False)
                time.sleep(0.1)
            if done and step.get("settle"):
                time.sleep(step["settle"])
            results.append({"name": "drain", "done": done, "kvgate_sets": sets, "fs_files": files,
                            "seconds": round(time.monotonic() - t, 2)})
            say(f"drain: {'ok' if done else 'TIMED OUT'} after {time.monotonic() - t:.1f} s "
                f"(kvgate card objects {sets}, fs files {files})")
        elif op == "warm_files":
            # Read every file under the given directories through the page cache, so that the
            # next restore finds them there ("warm").
            n = 0
            buf = bytearray(8 << 20)  # one buffer for every read, no bytes object per chunk
            for root in step["dirs"]:
                for dirpath, _dirs, files in os.walk(root):
                    for name in files:
                        with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                            while f.readinto(buf):
                                pass
                        n += 1
            results.append({"name": "warm_files", "files": n})
        elif op == "drop_caches":
            ok = drop_page_cache()
            results.append({"name": "drop_caches", "done": ok})
            if not ok:
                say("cannot drop the page cache (not permitted): 'cold' results are not cold")
        elif op in ("reset_cache", "reset_device_cache"):
            ok = llm.reset_prefix_cache(reset_connector=op == "reset_cache")
            results.append({"name": op, "done": bool(ok)})
            if not ok:
                say(f"reset_prefix_cache failed ({op})")
        else:
            raise ValueError(f"unknown step {op!r}")

    with open(plan["out"], "w") as f:
        json.dump({"results": results, "engine_start_s": round(start_s, 1), "model_build_s": round(build_s, 1)},
                  f, indent=1)


if __name__ == "__main__":
    main()
