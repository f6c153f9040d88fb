"""What each eviction policy costs per block: the trace replayed in process, timed per policy.

    PYTHONPATH=src python benchmarks/eviction_cost.py [--trace FILE] [--capacities 2,10,40] [--repeat 3]

Every policy sees the same calls (a touch per restored block, an add per
stored one, a victim and a remove per eviction), so the difference between
two rows is the difference between the policies; the replay's own work
(dialog digests, the presence map) is in every row.  The CPU time of the
best of ``--repeat`` runs, per block of a request, and each policy's ratio
to ``prefix`` in the same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvgate.bench.trace import load_trace, simulate, trace_marks, unique_blocks

TRACE = Path(__file__).resolve().parent / "data" / "mooncake-synthetic-trace.jsonl"
POLICIES = ("prefix", "adaptive", "lru", "sampled-prefix", "sampled-adaptive")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--capacities", default="2,10,40", help="cache sizes, in %% of the distinct blocks")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    requests = load_trace(args.trace)
    marks = trace_marks(requests)
    unique = unique_blocks(requests)
    for pct in (float(c) for c in args.capacities.split(",")):
        capacity = int(unique * pct / 100)
        us: dict[str, float] = {}
        for name in POLICIES:
            best = float("inf")
            for _ in range(args.repeat):
                t = time.process_time()
                sim = simulate(requests, marks, name, [capacity])
                best = min(best, time.process_time() - t)
            us[name] = best / sim.total * 1e6
        print(f"cache {pct:g} % ({capacity:,} blocks): " +
              ", ".join(f"{n} {v:.1f} us ({v / us['prefix']:.2f}x)" for n, v in us.items()))


if __name__ == "__main__":
    main()
