"""How a figure is measured: passes of each side in alternating rounds, and the ratio to the physical limit.

``measure`` runs on the bench's own thread and blocks for the figure's
budget; a contender's pass may hand work to threads of its own, but returns
only once its bytes have moved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

GIB = float(1 << 30)


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 4)) == 0:
            v = n / (1 << shift)
            return f"{v:g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Plan:
    """How long each figure runs; both sides of a figure always get the same number of rounds."""

    object_size: int
    batch: int
    threads: int
    quick: bool
    budget_s: float  # wall time of the measured rounds of one warm figure (both sides together)
    min_rounds: int
    max_rounds: int
    cold_rounds: int
    lookup_reps: int

    @property
    def pass_bytes(self) -> int:
        return self.object_size * self.batch

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Plan":
        if args.quick:
            return cls(args.object_size, args.batch, args.threads, True, budget_s=1.0, min_rounds=3,
                       max_rounds=50, cold_rounds=2, lookup_reps=200)
        return cls(args.object_size, args.batch, args.threads, False, budget_s=2.5, min_rounds=5,
                   max_rounds=1000, cold_rounds=3, lookup_reps=2000)


@dataclass
class Series:
    """Seconds of each timed pass of one contender; every pass moves ``nbytes``."""

    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_gib_s(self) -> float:
        return self.nbytes / min(self.seconds) / GIB

    @property
    def median_gib_s(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / GIB

    def to_json(self) -> dict[str, Any]:
        return {"best_gib_s": self.best_gib_s, "median_gib_s": self.median_gib_s, "passes": len(self.seconds),
                "best_s": min(self.seconds), "median_s": statistics.median(self.seconds)}


@dataclass
class Contender:
    """One side of a figure: a timed pass plus the untimed work around it."""

    name: str
    run: Callable[[int], None]  # one timed pass; gets the round number (for fresh keys)
    before: Callable[[], None] | None = None  # untimed, e.g. drop the page cache
    after: Callable[[int], None] | None = None  # untimed, e.g. delete what the pass wrote


def measure(contenders: Sequence[Contender], nbytes: int, *, budget_s: float, min_rounds: int,
            max_rounds: int, warmup: bool = True) -> dict[str, Series]:
    """Alternate the contenders round by round until the budget is spent.

    Alternating, rather than all of one then all of the other, means a load
    spike on the shared machine lands on both sides, and both sides always get
    the same number of passes.
    """
    if warmup:
        for c in contenders:
            if c.before:
                c.before()
            c.run(-1)
            if c.after:
                c.after(-1)
    out = {c.name: Series(nbytes) for c in contenders}
    start = time.monotonic()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.monotonic() - start < budget_s):
        for c in contenders:
            if c.before:
                c.before()
            t0 = time.perf_counter()
            c.run(rounds)
            out[c.name].seconds.append(time.perf_counter() - t0)
            if c.after:
                c.after(rounds)
        rounds += 1
    return out


def ratio(gw: Series, base: dict[str, Any]) -> dict[str, Any]:
    return {"kvgate": gw.to_json(), "baseline": base, "ratio": gw.best_gib_s / base["best_gib_s"],
            "ratio_median": gw.median_gib_s / base["median_gib_s"]}


def figure(series: dict[str, Series], name: str, thread_counts: Sequence[int], what: str) -> dict[str, Any]:
    """``name`` against the fastest raw series: the physical limit is the best the machine does.

    Raw series are ``raw<n>`` (buffered reads or writes on n threads) and, for
    cold reads, ``direct<n>`` (the same reads with ``O_DIRECT``); ``verified<n>``,
    where measured, are the buffered ones with each payload hashed, reported
    beside the baseline (``verified``, ``bound``, ``ratio_verified``), never as it.
    """
    raw = [(kind, n) for kind in ("raw", "direct") for n in thread_counts if f"{kind}{n}" in series]
    kind, best = max(raw, key=lambda kn: series[f"{kn[0]}{kn[1]}"].best_gib_s)
    base = {**series[f"{kind}{best}"].to_json(), "what": what + (" with O_DIRECT" if kind == "direct" else ""),
            "o_direct": kind == "direct", "threads": best,
            "by_threads": {str(n): series[f"raw{n}"].to_json() for n in thread_counts}}
    direct = {str(n): series[f"direct{n}"].to_json() for n in thread_counts if f"direct{n}" in series}
    if direct:
        base["direct_by_threads"] = direct
    out = ratio(series[name], base)
    checked = [n for n in thread_counts if f"verified{n}" in series]
    if checked:
        # The raw pass plus one XXH3 pass over each payload: no path that checks every byte beats it, so
        # ``bound`` is the most ``ratio`` can be, and ``ratio_verified`` what the gateway adds past the hash.
        n = max(checked, key=lambda t: series[f"verified{t}"].best_gib_s)
        v = series[f"verified{n}"]
        out["verified"] = {**v.to_json(), "threads": n,
                           "by_threads": {str(t): series[f"verified{t}"].to_json() for t in checked}}
        out["bound"] = v.best_gib_s / base["best_gib_s"]
        out["ratio_verified"] = series[name].best_gib_s / v.best_gib_s
    return out


def script_main(doc: str, default_dir: str, seconds: float, run: Callable[[str, float], dict[str, dict]],
                width: int = 34) -> None:
    """The command line of a ``benchmarks/`` script: ``--dir`` (made fresh, removed at the end), ``--seconds``
    per figure, ``--json``; ``run(dir, seconds)`` returns the figures by name, printed as best (median)."""
    import json
    import os
    import shutil

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--dir", default=default_dir, help="where its files go (removed at the end)")
    p.add_argument("--seconds", type=float, default=seconds, help="measured time per figure")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    try:
        out = run(args.dir, args.seconds)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for name, f in out.items():
        if "best_ms" in f:
            print(f"{name:{width}} {f['best_ms']:6.2f} ({f['median_ms']:5.2f}) ms for {f['objects']} objects")
            continue
        print(f"{name:{width}} {f['best_gib_s']:6.2f} ({f['median_gib_s']:5.2f}) GiB/s"
              + (f"   {f['ratio']:.2f} ({f['ratio_median']:.2f}) of {f['of']}" if "ratio" in f else ""))
