"""What a lookup of 1,000 keys costs in a card's index, without the gateway around it.

    python benchmarks/index_probes.py [--rows 200000] [--rounds 2000]

Prints the median time of: the key digests of 1,000 keys (``key_digests``
against calling ``key_digest`` per key), the full keys and the joined digests
of 1,000 keys by the compiled loops (``kvgate/_keys.c``, where it is built)
and by the Python ones, and a batched ``DigestRows.find``
of 1,000 keys that are all there and of 1,000 that none is, by the
compiled probe (``kvgate/_probe.c``, where it is built) and by the numpy
one it replaces.  These are the figures the comments of
``kvgate.keys.key_digests`` and ``kvgate.tiers.rows`` quote.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvgate import keys as keys_module
from kvgate.keys import full_keys, joined_digests, key_digest, key_digests
from kvgate.tiers import rows as rows_module
from kvgate.tiers.rows import DigestRows, digest_array


def median_us(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def both_ways(module, attr: str, what: str, figures) -> None:
    """``figures("compiled")`` with ``module.attr`` (a compiled helper) as loaded, then ``figures("python")``
    with it set to None, as where it is not built."""
    helper = getattr(module, attr)
    if helper is None:
        print(f"{what} is not built here (make install builds it)")
    else:
        figures("compiled")
    setattr(module, attr, None)
    try:
        figures("python")
    finally:
        setattr(module, attr, helper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args()
    keys = [b"bench-key-%d" % i for i in range(args.rows)]
    batch = keys[:1000]
    print(f"key digests of 1,000 keys: key_digests {median_us(lambda: key_digests(batch), args.rounds):.0f} us, "
          f"one key_digest per key {median_us(lambda: [key_digest(k) for k in batch], args.rounds):.0f} us")

    def keys_figures(way: str) -> None:
        print(f"1,000 keys, {way} loops: full_keys {median_us(lambda: full_keys(b'bench', batch), args.rounds):.0f} us, "
              f"joined_digests {median_us(lambda: joined_digests(batch), args.rounds):.0f} us")

    both_ways(keys_module, "_keys", "the compiled key helper", keys_figures)
    rows = DigestRows({"v": np.int64})
    stored = digest_array(key_digests(keys))
    rows.add_many(stored[:, 0].copy(), stored[:, 1].copy())
    present = stored[:1000]
    absent = digest_array(key_digests([b"absent-%d" % i for i in range(1000)]))

    def find_figures(way: str) -> None:
        for name, batch in (("present", present), ("absent", absent)):
            lo, hi = batch[:, 0].copy(), batch[:, 1].copy()
            print(f"find of 1,000 {name} keys in {args.rows:,} rows, {way} probe: "
                  f"{median_us(lambda: rows.find(lo, hi), args.rounds):.0f} us")

    both_ways(rows_module, "_probe_many", "the compiled probe", find_figures)


if __name__ == "__main__":
    main()
