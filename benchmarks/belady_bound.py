"""How far eviction could go on a trace: an offline policy that knows the future, beside LRU and the default.

    PYTHONPATH=src python benchmarks/belady_bound.py [--trace FILE] [--heads 0,1,4,16] [--capacities 5,10,20]

Belady's rule at request granularity: when over capacity, evict the block
whose next request is farthest away (or never comes).  It ignores that a
restore needs a whole prefix, so it is not an exact optimum, but no online
policy beats it by much: it shows how much headroom there is over LRU
on the trace, with a shared head of N blocks in front of every request.
The default policy and LRU are replayed in process (``replay_policies``).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
from collections import defaultdict
from pathlib import Path

from kvgate.bench.trace import _ids_of, load_trace, replay_policies, unique_blocks, with_shared_head

TRACE = Path(__file__).resolve().parent / "data" / "mooncake-synthetic-trace.jsonl"


def belady(reqs: list[list[int]], capacity: int) -> float:
    """Share of all blocks restored (leading blocks held) under the farthest-next-use rule."""
    uses: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(reqs):
        for b in set(ids):
            uses[b].append(i)
    never = len(reqs) + 1

    def next_use(b: int, i: int) -> int:
        u = uses[b]
        j = bisect.bisect_right(u, i)
        return u[j] if j < len(u) else never

    held: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    restored = total = 0
    for i, ids in enumerate(reqs):
        total += len(ids)
        for b in ids:
            if b not in held:
                break
            restored += 1
        for b in set(ids):
            held[b] = nxt = next_use(b, i)
            heapq.heappush(heap, (-nxt, b))
        while len(held) > capacity:
            nxt, b = heapq.heappop(heap)
            if held.get(b) == -nxt:
                del held[b]
    return restored / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--heads", default="0,1,4,16")
    ap.add_argument("--capacities", default="5,10,20", help="percent of the distinct blocks")
    args = ap.parse_args()
    base = load_trace(args.trace)
    print("head  capacity   LRU     default (vs LRU)   farthest-next-use (vs LRU)")
    for head in (int(h) for h in args.heads.split(",")):
        reqs = with_shared_head(base, head)
        ids = _ids_of(reqs)
        distinct = unique_blocks(reqs)
        for pct in (float(c) for c in args.capacities.split(",")):
            cap = int(distinct * pct / 100)
            r = replay_policies(reqs, cap, ["prefix", "lru"])
            b = belady(ids, cap)
            print(f"{head:4d}  {pct:6.0f} %   {r['lru']:.4f}  {r['prefix']:.4f} ({r['prefix'] / r['lru'] - 1:+.1%})"
                  f"   {b:.4f} ({b / r['lru'] - 1:+.1%})")


if __name__ == "__main__":
    main()
