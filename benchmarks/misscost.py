"""The summary the miss-cost benchmarks print (``sglang_bench.py miss``, ``lmcache_miss.py``; ``vllm_ttft.py``
takes its ratio and aim): TTFT medians of fresh prompts per configuration, each over the median without
kvgate, and the aim."""

from __future__ import annotations

import statistics

BAR_MISS = 1.02  # TTFT with kvgate configured and nothing to hit, over TTFT without kvgate


def summary(ttft: dict[str, list[float]]) -> dict:
    """``ttft``: the TTFTs of each configuration, ``"without"`` and ``"with"`` (kvgate) among them, and
    maybe the engine's own storage beside them."""
    med = {name: statistics.median(times) for name, times in ttft.items()}
    ratio = med["with"] / med["without"]
    out = {
        "median_without_s": med["without"], "median_with_s": med["with"], "ttft_ratio": round(ratio, 4),
        "bar": {f"ttft with kvgate, nothing to hit / without <= {BAR_MISS}": ratio <= BAR_MISS},
    }
    for name in ttft.keys() - {"with", "without"}:
        out[f"median_{name}_s"] = med[name]
        out[f"{name}_ttft_ratio"] = round(med[name] / med["without"], 4)
    return out
