"""KvgateHiCacheStorage's hybrid (v2) interface with SGLang 0.5.23's own host pools on CPU (a KV anchor,
an SWA pool, a Mamba state pool, a KV-derived ALL_PAGES pool) against a real gateway, without an
engine (two processes, about 40 s).

Runs ``sglang_hybrid.py`` under ``.venv-sglang/bin/python``; skipped when that venv is missing.

- backup as SGLang's hybrid controller does (batch_set_v2 per trailing-chain group, batch_set_v1
  for KV), then a new backend and fresh pools: batch_exists_v2 reports the prefixes SGLang may
  restore (both backup boundaries), and every pool's pages come back byte-identical;
- one pool's object of one page deleted: exists/get report that page, and the pages after it,
  as missing for every pool (all or none);
- an unregistered pool, wrong indices, an absent gateway, a closed backend: misses, no raise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import GatewayProcess, run_plan, venv_python

VENV_PY = venv_python(".venv-sglang")
SCRIPT = Path(__file__).resolve().parent / "sglang_hybrid.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the SGLang venv first (make sglang-venv)"),
]

PAGES = 12
HALF = PAGES // 2


def run(tmp_path: Path, name: str, plan: dict) -> dict:
    return run_plan(VENV_PY, SCRIPT, tmp_path, name, plan)


def test_hybrid_pools_back_up_restore_whole_and_go_missing_together(gateway_factory, tmp_path):
    gw: GatewayProcess = gateway_factory()
    plan = {"socket": gw.socket, "pages": PAGES, "seed": 11}
    b = run(tmp_path, "backup", {**plan, "phase": "backup"})
    # Per operation: the indexer (its own group), SWA and Mamba (one trailing group each), then KV (v1).
    sets = b["results"]
    assert all(all(v) for r in sets for v in r.values()), sets
    assert sorted(k for r in sets for k in r) == sorted(["indexer", "swa", "mamba", "kv"] * 2)
    assert b["counters"]["set_v2_stored"] == 2 * (HALF + 2 + 1) and b["counters"]["errors"] == 0

    r = run(tmp_path, "restore", {**plan, "phase": "restore"})
    s = r["steps"]
    assert r["namespace"] == b["namespace"]
    # Mamba and SWA states exist only where a backup ended: those two prefixes are restorable.
    assert s["exists_all"] == {"kv_hit_pages": PAGES, "restorable": [HALF, PAGES],
                               "pools": {"kv": PAGES, "indexer": PAGES, "swa": PAGES, "mamba": PAGES}}
    assert s["get_kv"] == {"kv": [True] * PAGES}
    assert s["get_indexer"] == {"indexer": [True] * PAGES}
    assert s["get_sidecars_end"] == {"swa": [True, True], "mamba": [True]}
    assert s["get_sidecars_half"] == {"swa": [True, True], "mamba": [True]}
    want, got = b["expected"], r["restored"]
    assert set(got) == set(want) == {"kv", "indexer", f"swa@{HALF}", f"swa@{PAGES}", f"mamba@{HALF}",
                                     f"mamba@{PAGES}"}
    for pool in want:
        assert got[pool] == want[pool], pool  # byte-identical, page by page, every pool

    # The indexer's part of page 8 gone: nothing from page 8 on, for any pool.
    assert r["deleted_indexer_8"] == 1
    assert s["exists_no_indexer_8"]["kv_hit_pages"] == HALF and s["exists_no_indexer_8"]["restorable"] == [HALF]
    assert s["exists_no_indexer_8"]["pools"]["indexer"] == 8
    assert s["get_indexer_no_8"] == {"indexer": [True] * 8 + [False] * 4}
    assert s["get_combined_no_indexer_8"] == {"indexer": [True] * 8 + [False] * 4, "swa": [False, False],
                                              "mamba": [False]}
    # The Mamba state of the first backup gone too: no prefix is restorable.  SGLang reads SWA and
    # Mamba windows of different lengths in separate calls (one per prefix-key chain) and needs
    # each pool's own verdict; in one call (no prefix keys), the window's last page, the Mamba
    # page, is missing for SWA as well.
    assert r["deleted_mamba_half"] == 1
    assert s["exists_no_mamba_half"]["kv_hit_pages"] == 0 and s["exists_no_mamba_half"]["restorable"] == []
    assert s["get_sidecars_half_no_mamba"] == {"swa": [True, True], "mamba": [False]}
    assert s["get_sidecars_half_no_mamba_one_call"] == {"swa": [True, False], "mamba": [False]}
    # A KV page gone (the v1 object): the KV prefix ends before it.
    assert r["deleted_kv_2"] == 1
    assert s["exists_no_kv_2"]["kv_hit_pages"] == 0 and s["exists_no_kv_2"]["pools"].get("kv") == 2

    # Misses, never an exception or None.
    assert s["exists_unregistered"] == 0 and s["get_unregistered"] == {"draft": [False]}
    assert s["set_bad_indices"] == {"indexer": [False] * PAGES, "swa": [False] * 2, "mamba": [False]}
    assert s["exists_closed"] == 0
    assert s["get_closed"] == {"indexer": [False] * PAGES, "swa": [False] * 2, "mamba": [False]}
    down = s["down"]
    assert down["exists"] == 0 and down["seconds"] < 1.0
    assert down["get"] == down["set"] == {"indexer": [False] * PAGES, "swa": [False] * 2, "mamba": [False]}
    assert "Traceback" not in r["log"], r["log"][-3000:]
