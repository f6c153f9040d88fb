"""``kvgate bench --route`` runs and prints its figures (quick)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgate.bench.route import route_bench


def test_route_bench_figures_small() -> None:
    r = route_bench(tokens=16 * 64, endpoints=8, cards=2, mounts_per_card=2, other_blocks=100, reps=50)
    f = r["figures"]
    assert r["config"]["blocks"] == 64 and 0 < f["score_p50_ms"] <= f["score_p99_ms"]
    assert f["hash_cold_ms"] > 0 and f["index_entries"] > 64
    # the last endpoint holds the whole prompt on GPU: the best choice unless its load outweighs it
    assert r["best"]["gpu"] + r["best"]["cpu"] + r["best"]["storage"] + r["best"]["prefill"] == 64
    assert set(r["bars"]) == {"score_p99"}


@pytest.mark.slow
def test_kvgate_bench_route_prints_its_figures() -> None:
    p = subprocess.run([sys.executable, "-m", "kvgate", "bench", "--route", "--quick", "--json"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["mode"] == "route" and r["config"]["endpoints"] == 64 and r["config"]["blocks"] == 2048
    for k in ("score_p50_ms", "score_p99_ms", "hash_cold_ms", "hash_cached_ms", "index_entries"):
        assert r["figures"][k] > 0, k
    p = subprocess.run([sys.executable, "-m", "kvgate", "bench", "--route", "--quick"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "score      p50" in p.stdout and "bar p99 <= 1.0 ms" in p.stdout
