"""kvgate demo: a vLLM engine restarts and restores a long prompt's KV from kvgate instead of recomputing it.

    make demo                       # or: .venv-vllm/bin/python demo/vllm_restart.py

1. builds a small random-weight Llama and a byte-level BPE tokenizer locally
   (transformers + tokenizers, nothing is downloaded) under var/demo/model;
2. starts a kvgate gateway (`python -m kvgate serve`, card var/demo/card, its
   own socket, no TCP or HTTP listener);
3. run 1: a vLLM (CPU) engine process computes a long prompt; its KV goes to
   vLLM's CPU tier and from there to the gateway (KvgateOffloadingSpec);
4. run 2: a new engine process (a restart: empty caches) gets the same prompt
   and restores it from the gateway;
5. prints TTFT computed vs restored, run 2's external prefix-cache hits and
   whether the greedy outputs match; stops the gateway (also on errors).

The engines run in one process each (vLLM's in-process engine core and
executor) to start faster; `--multiprocess` uses vLLM's default processes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from vllm_harness import (
    BLOCK,
    EngineFailed,
    EngineRunner,
    Gateway,
    build_tokenizer,
    corpus_text,
    exit_on_sigterm,
)

MODEL = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 16384}


def say(msg: str = "") -> None:
    print(msg, flush=True)


def make_prompt(model_dir: Path, tokens: int) -> tuple[str, int]:
    """A deterministic text prompt of about ``tokens`` tokens (text the tokenizer was not trained on)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = corpus_text(4_000_000)[1_500_000:]
    ids = tok.encode(text[: tokens * 8]).ids[:tokens]
    prompt = "Summarize the following source code.\n\n" + tok.decode(ids)
    return prompt, len(tok.encode(prompt).ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="kvgate + vLLM restart demo")
    p.add_argument("--workdir", default=str(REPO / "var" / "demo"))
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--multiprocess", action="store_true",
                   help="vLLM's default engine-core and worker processes (slower to start)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    t0 = time.monotonic()

    work = Path(args.workdir).resolve()
    model_dir = work / "model"
    card = work / "card"
    runs = work / "runs"
    for d in (card, runs):  # a fresh card: run 1 must compute
        shutil.rmtree(d, ignore_errors=True)
    runs.mkdir(parents=True, exist_ok=True)

    say("kvgate demo: restart a vLLM engine, restore a long prompt from kvgate")
    build_tokenizer(model_dir, MODEL["vocab_size"])
    prompt, n_tokens = make_prompt(model_dir, args.prompt_tokens)
    full_blocks = (n_tokens - 1) // BLOCK  # vLLM computes at least the last token
    say(f"  model      random-weight Llama, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"vocab {MODEL['vocab_size']}, float32 ({model_dir})")
    say(f"  prompt     {n_tokens} tokens of text ({full_blocks} full blocks of {BLOCK} tokens can be restored)")

    engine_env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    llm: dict = {"max_model_len": max(8192, n_tokens + args.max_tokens + 64)}
    if not args.multiprocess:
        engine_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm["distributed_executor_backend"] = "uni"
    runner = EngineRunner(runs, env=engine_env)
    gw: Gateway | None = None
    ok = False
    try:
        gw = Gateway(work, card, name="gateway", max_bytes="256M").start()
        say(f"  gateway    pid {gw.proc.pid}, socket {gw.socket}, card {card}")
        model = {"dir": str(model_dir), "dtype": "float32", "tokenizer": True, "config": MODEL}
        kv = {"spec_name": "KvgateOffloadingSpec", "spec_module_path": "kvgate.integrations.vllm",
              "cpu_bytes_to_use": 256 << 20, "kvgate.socket": gw.socket}
        gen = {"op": "generate", "prompt": prompt, "max_tokens": args.max_tokens}

        say("\nrun 1: a new engine process computes the prompt ...")
        r1 = runner.run("run1", {"model": model, "llm": llm, "kv": kv, "steps": [
            {"op": "warmup"}, {**gen, "name": "computed"},
            {"op": "drain", "kvgate_socket": gw.socket, "kvgate_sets": full_blocks, "timeout": 60, "settle": 0.3},
        ]}, timeout=300, echo=False)
        first, drain = r1["results"][0], r1["results"][1]
        if not drain["done"]:
            raise RuntimeError(f"the gateway holds {drain['kvgate_sets']} of {full_blocks} chunks after 60 s")
        say(f"  TTFT {first['ttft_s']:.3f} s (computed), engine start {r1['engine_start_s']:.0f} s; "
            f"{drain['kvgate_sets']} chunks stored in kvgate")

        say("run 2: the engine restarts (a new process, empty caches) and gets the same prompt ...")
        r2 = runner.run("run2", {"model": model, "llm": llm, "kv": kv, "steps": [
            {"op": "warmup"}, {**gen, "name": "restored"}]}, timeout=300, echo=False)
        second = r2["results"][0]
        say(f"  TTFT {second['ttft_s']:.3f} s (restored), engine start {r2['engine_start_s']:.0f} s")

        same = first["output_token_ids"] == second["output_token_ids"]
        hits = int(second["external_prefix_cache_hits"])
        speedup = first["ttft_s"] / second["ttft_s"] if second["ttft_s"] else float("inf")
        st = gw.stats()["tiers"]
        say("\nresult")
        say(f"  TTFT computed (run 1)         {first['ttft_s']:.3f} s")
        say(f"  TTFT restored (run 2)         {second['ttft_s']:.3f} s   ({speedup:.1f}x faster)")
        say(f"  external prefix-cache hits    {hits} of {second['prompt_tokens']} prompt tokens (run 2)")
        say(f"  greedy outputs identical      {'yes' if same else 'NO'}   "
            f"({len(first['output_token_ids'])} tokens: {(first['output_text'] or '')[:60]!r})")
        say(f"  gateway                       {st['ram']['sets']} chunks written, {st['ram']['hits']} read from "
            f"its RAM tier, {st['long']['objects']} on the card")
        ok = same and hits == full_blocks * BLOCK
        if not ok:
            say(f"  PROBLEM: expected {full_blocks * BLOCK} external hits and identical outputs")
    except EngineFailed as e:
        say(f"\ndemo failed: {e}")
        return 1
    finally:
        runner.close()
        if gw is not None:
            gw.cleanup()
            say("gateway stopped")
    say(f"demo took {time.monotonic() - t0:.0f} s (logs in {runs})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
