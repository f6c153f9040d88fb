"""What each eviction policy costs per block: the trace replayed in process, timed per policy.

    PYTHONPATH=src python benchmarks/eviction_cost.py [--trace FILE] [--capacities 2,10,40] [--repeat 3]
                                                      [--copies K] [--policies P,P]

``--copies K`` replays K copies of the trace at once, request by request in
turn, each with block ids of its own: K times the traffic and the distinct
blocks, the same reuse pattern, so a cache of the same share holds K times
the blocks (the referee of the adaptive policies samples fewer dialogs as
the cache grows: its cost per block falls).

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

from kvgate.bench.trace import TraceRequest, load_trace, simulate, trace_marks, unique_blocks

TRACE = Path(__file__).resolve().parent / "data" / "mooncake-synthetic-trace.jsonl"
POLICIES = ("prefix", "adaptive", "lru", "sampled-prefix", "sampled-adaptive")


def interleaved(requests: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """``copies`` copies of a trace, one request of each in turn, each copy's block ids its own."""
    if copies == 1:
        return requests
    span = 1 + max((b for r in requests for b in r.ids), default=0)
    return [TraceRequest(tuple(b + c * span for b in r.ids)) for r in requests for c in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--capacities", default="2,10,40", help="cache sizes, in %% of the distinct blocks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--copies", type=int, default=1, help="replay this many copies of the trace at once")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    requests = interleaved(load_trace(args.trace), args.copies)
    policies = args.policies.split(",")
    marks = trace_marks(requests)
    unique = unique_blocks(requests)
    for pct in (float(c) for c in args.capacities.split(",")):
        capacity = int(unique * pct / 100)
        us: dict[str, float] = {}
        for name in policies:
            best = float("inf")
            for _ in range(args.repeat):
                t = time.process_time()
                sim = simulate(requests, marks, name, [capacity])
                best = min(best, time.process_time() - t)
            us[name] = best / sim.total * 1e6
        print(f"cache {pct:g} % ({capacity:,} blocks): " +
              ", ".join(f"{n} {v:.1f} us" + (f" ({v / us['prefix']:.2f}x)" if "prefix" in us else "")
                        for n, v in us.items()))


if __name__ == "__main__":
    main()
