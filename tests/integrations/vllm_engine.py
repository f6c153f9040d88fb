"""One vLLM (CPU build) engine run with the kvgate offloading spec; run with .venv-vllm/bin/python.

    python vllm_engine.py PLAN.json

PLAN: {"model_dir", "arch"?: "llama" | "hybrid" | "mla", "kv_cache_dtype"?, "socket", "extra": {extra kv_connector_extra_config keys},
       "add_socket": true (false: no kvgate.socket key; "extra" configures the tier),
       "requests": [{"name", "prompt_token_ids", "cache_salt"?, "kv_transfer_params"?, "max_tokens"?}
                    | {"name", "reset_cache": true} | {"name", "touch": path} (create the file: a test's
                    signal that the requests before it are done) | {"name", "wait_for": path, "timeout": s}
                    (wait until the file exists, stepping: the engine serves its p2p peers meanwhile)],
       "drain": {"expect_sets": N, "timeout": s, "settle": s} (optional),
       "frozen": {"gateway_pid", "requests": [...], "signal"?} (optional: SIGSTOP the gateway, run these,
                 SIGCONT; with "signal": 9 the gateway is killed instead),
       "kv_transfer_config": {...} (optional: replaces the kvgate OffloadingConnector config, e.g.
                 LMCacheMPConnector talking to an `lmcache server`),
       "card_away": {"card", "moved_to", "requests": [...], "inactive_timeout": s,
                     "requests_after": [...]} (optional: rename the gateway's card directory, run
                     "requests" at once, wait until the gateway reports the card inactive, run
                     "requests_after"; the test puts the directory back),
       "out": path}

Builds the tiny random-weight Llama in model_dir when it is missing.  Each
request is its own generate() call (in order), so its counters are its own.
Writes to "out": per request the output token ids, num_cached_tokens, its
time to first token (vLLM's request metrics) and the external/local
prefix-cache-hit counter deltas; the gateway's RAM-tier sets
after the drain; and for "card_away" the gateway's card stats before, when it
reported the card inactive, and at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def build_model(model_dir: str, arch: str = "llama") -> None:
    """A tiny random-weight model: ``llama`` (2 layers), ``hybrid`` (a Llama whose layers alternate
    sliding-window and full attention: two KV groups) or ``mla`` (DeepSeek-V2 attention, 576-wide latent KV)."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, max_position_embeddings=8192,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    if arch == "mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        # The CPU MLA decode kernel takes only a 576-wide latent (kv_lora_rank 512 + rope 64).
        cfg = DeepseekV2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                               q_lora_rank=None, first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
                               num_experts_per_tok=2, moe_intermediate_size=128, **common)
        model = DeepseekV2ForCausalLM(cfg)
    elif arch == "hybrid":
        cfg = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=256, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    tmp = model_dir + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, model_dir)


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                      "vllm:external_prefix_cache_queries"):
            out[m.name] = out.get(m.name, 0) + float(getattr(m, "value", 0))
    return out


def gateway_stats(socket_path: str) -> dict:
    from kvgate.client import Client

    with Client.connect(socket_path, role="admin", want_shm=False, timeout=10) as c:
        return c.stats()


def gateway_sets(socket_path: str) -> int:
    return int(gateway_stats(socket_path)["tiers"]["ram"]["sets"])


def card_away(llm, plan: dict, SamplingParams) -> tuple[list[dict], dict]:
    """Take the gateway's (only) card away mid-run by renaming its directory.

    Its storage_devices entry is a plain path, so the gateway cannot find it
    under the new name: reads fail (CardUnavailable) and its health check
    (once a second) fails; either takes the card out of service.
    """
    away = plan["card_away"]
    info: dict = {"before": gateway_stats(plan["socket"])["cards"]}
    os.rename(away["card"], away["moved_to"])
    t0 = time.monotonic()
    print("[engine] card directory renamed", flush=True)
    results = run_requests(llm, away["requests"], SamplingParams)
    deadline = t0 + away.get("inactive_timeout", 10)
    while True:
        cards = gateway_stats(plan["socket"])["cards"]
        if not cards[0]["active"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    info["inactive_after_s"] = round(time.monotonic() - t0, 3) if not cards[0]["active"] else None
    info["at_inactive"] = cards
    print(f"[engine] card inactive after {info['inactive_after_s']} s", flush=True)
    results += run_requests(llm, away.get("requests_after", []), SamplingParams)
    info["after"] = gateway_stats(plan["socket"])["cards"]
    return results, info


def run_requests(llm, requests, SamplingParams) -> list[dict]:
    results = []
    for r in requests:
        if r.get("reset_cache"):  # empty the engine's prefix cache and vLLM's CPU tier: the next restore
            ok = llm.reset_prefix_cache(reset_connector=True)  # comes from a secondary tier
            results.append({"name": r["name"], "done": bool(ok)})
            print(f"[engine] {r['name']}: reset_prefix_cache -> {ok}", flush=True)
            continue
        if r.get("touch"):
            open(r["touch"], "w").close()
            results.append({"name": r["name"], "done": True})
            continue
        if r.get("wait_for"):  # stepping meanwhile, as a served engine does: vLLM's p2p tier serves its
            deadline = time.monotonic() + r.get("timeout", 300)  # peers at the end of each scheduler step
            tick = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
            while not os.path.exists(r["wait_for"]) and time.monotonic() < deadline:
                llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], tick, use_tqdm=False)
                time.sleep(0.05)
            results.append({"name": r["name"], "done": os.path.exists(r["wait_for"])})
            continue
        prompt = {"prompt_token_ids": r["prompt_token_ids"]}
        if r.get("cache_salt"):
            prompt["cache_salt"] = r["cache_salt"]
        extra_args = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
        sp = SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 8), ignore_eos=True, detokenize=False,
                            extra_args=extra_args)
        before = counters(llm)
        t0 = time.monotonic()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        elapsed = time.monotonic() - t0
        after = counters(llm)
        results.append({
            "name": r["name"],
            "output_token_ids": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "seconds": round(elapsed, 3),
            "ttft": getattr(getattr(out, "metrics", None), "first_token_latency", None),
            **{k.split(":")[1] + "_delta": after.get(k, 0) - before.get(k, 0) for k in after},
        })
        print(f"[engine] {results[-1]['name']}: cached {out.num_cached_tokens}, "
              f"external hits +{results[-1].get('external_prefix_cache_hits_delta')}, {elapsed:.2f} s", flush=True)
    return results


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    build_model(plan["model_dir"], plan.get("arch", "llama"))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {
        "spec_name": "KvgateOffloadingSpec",
        "spec_module_path": "kvgate.integrations.vllm",
        "cpu_bytes_to_use": 64 << 20,
        **({"kvgate.socket": plan["socket"]} if plan.get("add_socket", True) else {}),
        **plan.get("extra", {}),
    }
    llm = LLM(
        model=plan["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
        max_model_len=4096,
        seed=0,
        **({"kv_cache_dtype": plan["kv_cache_dtype"]} if plan.get("kv_cache_dtype") else {}),
        # On a CPU with AMX vLLM picks its AMX MLA backend, which takes bf16/int8 weights only:
        # this float32 model needs the reference CPU MLA backend there too.
        **({"attention_backend": "CPU_MLA"} if plan.get("arch") == "mla" else {}),
        kv_transfer_config=KVTransferConfig(**plan["kv_transfer_config"]) if plan.get("kv_transfer_config") else
        KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra),
    )
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    with open(plan["out"] + ".engine_id", "w") as f:  # lets the test remove a /dev/shm region vLLM leaked
        f.write(engine_id)
    results = run_requests(llm, plan["requests"], SamplingParams)

    drain = plan.get("drain")
    sets = None
    if drain:
        # Stores are asynchronous: keep the engine stepping until the gateway holds what we
        # expect, then for "settle" seconds more (a store that should not happen shows up).
        deadline = time.monotonic() + drain.get("timeout", 30)
        short = SamplingParams(temperature=0.0, max_tokens=2, detokenize=False)
        settle_until = None
        while time.monotonic() < deadline:
            sets = gateway_sets(plan["socket"])
            if sets >= drain["expect_sets"]:
                if settle_until is None:
                    settle_until = time.monotonic() + drain.get("settle", 1.5)
                elif time.monotonic() >= settle_until:
                    break
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], short, use_tqdm=False)
            time.sleep(0.2)
        print(f"[engine] gateway sets after drain: {sets}", flush=True)

    results += run_requests(llm, plan.get("after_drain") or [], SamplingParams)

    frozen = plan.get("frozen")
    if frozen:
        # The gateway stops answering (SIGSTOP): the engine must keep serving.
        sig = frozen.get("signal", signal.SIGSTOP)
        os.kill(frozen["gateway_pid"], sig)
        print(f"[engine] gateway {'frozen' if sig == signal.SIGSTOP else 'sent signal %d' % sig}", flush=True)
        try:
            results += run_requests(llm, frozen["requests"], SamplingParams)
        finally:
            if sig == signal.SIGSTOP and frozen.get("resume", True):
                os.kill(frozen["gateway_pid"], signal.SIGCONT)
    away = None
    if plan.get("card_away"):
        more, away = card_away(llm, plan, SamplingParams)
        results += more
    json.dump({"results": results, "gateway_sets": sets, "card_away": away}, open(plan["out"], "w"), indent=1)


if __name__ == "__main__":
    main()
