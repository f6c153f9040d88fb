"""``kvgate bench --route``: the router's scoring of one long prompt over many endpoints.

The index is filled through ``KvIndex.apply`` with event batches as engines and gateways send them:
each of ``endpoints`` engines holds on GPU a prefix of the measured prompt (random length) and
``other_blocks`` blocks of other prompts; each gateway holds a longer prefix in RAM; ``cards`` cards,
each mounted by several gateways, hold prefixes too.  The last endpoint holds the whole prompt
somewhere, so every block of the prompt is held by someone and ``score`` works on the full span (its
worst case).  Figures: ``score`` p50/p99 (bar: p99 <= 1 ms), the prompt's hashing from scratch and
again (the hasher's LRU), and the index's size.
"""

from __future__ import annotations

import random
import time
from typing import Any

from kvgate.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU, BlockStored, EventBatch
from kvgate.routing.hashing import BlockHasher
from kvgate.routing.index import CARD_TOPIC_MARK, KvIndex
from kvgate.routing.score import Endpoint, Scorer, best

__all__ = ["BAR_SCORE_P99_MS", "route_bench", "print_route"]

BAR_SCORE_P99_MS = 1.0
TOPIC = "kvgate"


def _stored(keys: list[int], medium: str) -> BlockStored:
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None)


def _pct(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1e3


def route_bench(tokens: int = 32768, endpoints: int = 64, cards: int = 8, mounts_per_card: int = 8,
                other_blocks: int = 20_000, reps: int = 2000, seed: int = 1) -> dict[str, Any]:
    """Measure; returns the figures as a dict (``print_route`` prints them)."""
    rng = random.Random(seed)
    hasher = BlockHasher("sha256", 16, seed="0")
    prompt = [rng.randrange(32000) for _ in range(tokens)]
    t0 = time.perf_counter()
    keys = hasher.keys(prompt)
    t1 = time.perf_counter()
    hasher.keys(prompt)
    t2 = time.perf_counter()
    n = len(keys)
    index = KvIndex()
    filled0 = time.perf_counter()
    eps = []
    for e in range(endpoints):
        engine, gateway = f"engine-{e}", f"gateway-{e}"
        gpu_len = n if e == endpoints - 1 else rng.randrange(n // 2)
        other = [rng.getrandbits(64) for _ in range(other_blocks)]
        index.apply(engine, "", EventBatch(0.0, [_stored(keys[:gpu_len] + other, MEDIUM_GPU)]))
        ram_len = min(n, gpu_len + rng.randrange(n // 2))
        index.apply(gateway, TOPIC, EventBatch(0.0, [_stored(keys[:ram_len] + other[: other_blocks // 2],
                                                                MEDIUM_CPU)]))
        eps.append(Endpoint(f"ep-{e}", engine=engine, gateway=gateway, running=rng.randrange(8),
                            waiting=rng.randrange(3)))
    for c in range(cards):
        card_len = rng.randrange(n)
        for m in range(mounts_per_card):
            gateway = f"gateway-{(c * mounts_per_card + m) % endpoints}"
            index.apply(gateway, f"{TOPIC}{CARD_TOPIC_MARK}card{c}",
                        EventBatch(0.0, [_stored(keys[:card_len], "STORAGE")]))
    filled = time.perf_counter() - filled0
    scorer = Scorer(index)
    for _ in range(20):
        scorer.score(keys, eps)
    times = []
    for _ in range(reps):
        s = time.perf_counter()
        scores = scorer.score(keys, eps)
        times.append(time.perf_counter() - s)
    times.sort()
    chosen = best(scores)
    p99 = _pct(times, 0.99)
    return {
        "mode": "route",
        "config": {"tokens": tokens, "blocks": n, "endpoints": endpoints, "cards": cards,
                   "mounts_per_card": mounts_per_card, "other_blocks_per_engine": other_blocks, "reps": reps},
        "figures": {
            "score_p50_ms": _pct(times, 0.50), "score_p99_ms": p99,
            "hash_cold_ms": (t1 - t0) * 1e3, "hash_cached_ms": (t2 - t1) * 1e3,
            "index_entries": len(index), "index_fill_s": filled,
        },
        "best": {"endpoint": chosen.endpoint, "gpu": chosen.gpu, "cpu": chosen.cpu, "storage": chosen.storage,
                 "prefill": chosen.prefill, "cost": chosen.cost},
        "bar_limits": {"score_p99_ms_max": BAR_SCORE_P99_MS},
        "bars": {"score_p99": p99 <= BAR_SCORE_P99_MS},
    }


def print_route(result: dict[str, Any]) -> None:
    """The figures as a few lines of text."""
    c, f, b = result["config"], result["figures"], result["best"]
    bar = "ok" if result["bars"]["score_p99"] else "FAILS"
    print(f"kvgate bench --route: a {c['tokens']}-token prompt ({c['blocks']} blocks) over {c['endpoints']} "
          f"endpoints, {c['cards']} cards each mounted by {c['mounts_per_card']} gateways")
    print(f"  score      p50 {f['score_p50_ms']:.3f} ms   p99 {f['score_p99_ms']:.3f} ms   "
          f"(bar p99 <= {result['bar_limits']['score_p99_ms_max']} ms: {bar})")
    print(f"  hashing    {f['hash_cold_ms']:.2f} ms from scratch, {f['hash_cached_ms']:.2f} ms again (sha256)")
    print(f"  index      {f['index_entries']} entries, filled in {f['index_fill_s']:.2f} s")
    print(f"  best       {b['endpoint']}: gpu {b['gpu']} cpu {b['cpu']} storage {b['storage']} "
          f"prefill {b['prefill']} cost {b['cost']:.1f}")
