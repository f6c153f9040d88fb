"""``KvgateTier`` in one ``secondary_tiers`` list with vLLM's own ``fs`` and ``p2p`` tiers, on two real vLLM
CPU engines (0.32) running at once; vLLM's p2p tier moves blocks CPU tier to CPU tier over NIXL (its UCX
backend runs on a CPU-only host).

Both engines have ``[KvgateTier (STORAGE, REMOTE), fs (STORAGE, LOCAL), p2p]``, each with its own gateway,
``fs`` root and p2p control port:

- engine A computes P: its chunks go to gateway A and to A's ``fs`` root; it then keeps stepping (its p2p
  tier serves peers at the end of each step);
- engine B asks P with ``remote_kv_source`` naming A's p2p port: neither B's gateway nor B's ``fs`` root
  holds it, so the p2p tier pulls it from A's CPU tier: every cacheable token an external hit, the output of
  computing it;
- engine B computes R: stored to gateway B through the same tier list; emptied and asked again, R comes
  back from kvgate.
"""
from __future__ import annotations

import subprocess
import threading
import time

import pytest

from tests.helpers import GatewayProcess, free_port
from tests.integrations.test_vllm_e2e import CACHEABLE, FULL_CHUNKS, P, R, VENV_PY, run_engine
from tests.integrations.vllm_engine import gateway_stats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                   "(make vllm-venv)"),
]

KVGATE_ONLY = {"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]}


def tiers(gw: GatewayProcess, fs_root, p2p_port: int) -> list[dict]:
    return [{"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": gw.socket,
             "locality": "REMOTE"},
            {"type": "fs", "root_dir": str(fs_root), "locality": "LOCAL", "n_read_threads": 2, "n_write_threads": 2},
            {"type": "p2p", "host": "127.0.0.1", "port": p2p_port, "num_threads": 1}]


def test_kvgate_beside_vllms_fs_and_p2p_tiers(tmp_path):
    has_nixl = subprocess.run([str(VENV_PY), "-c", "import nixl"], capture_output=True).returncode == 0
    assert has_nixl, (f"{VENV_PY} lacks NIXL (vLLM's p2p tier needs it): a venv made before the Makefile installed it; "
                      f"run {VENV_PY.parent}/pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")
    ports = free_port(), free_port()
    gws = [GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M"],
                          card=tmp_path / f"card-{n}", name=n) for n in "AB"]
    roots = [tmp_path / "fs-a", tmp_path / "fs-b"]
    for root in roots:
        root.mkdir()
    ready, done = tmp_path / "a-ready", tmp_path / "b-done"
    a_run: dict = {}
    for gw in gws:
        gw.start()
    try:
        def engine_a() -> None:
            try:
                a_run.update(run_engine(tmp_path, "a", gws[0], tmp_path / "tiny-llama",
                                        [{"name": "P", "prompt_token_ids": P}, {"name": "ready", "touch": str(ready)},
                                         {"name": "serve", "wait_for": str(done), "timeout": 400}],
                                        extra={"secondary_tiers": tiers(gws[0], roots[0], ports[0])},
                                        add_socket=False))
            finally:
                ready.touch()  # (a failed start: B does not wait for nothing)

        thread = threading.Thread(target=engine_a)
        thread.start()
        try:
            deadline = time.monotonic() + 400
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            source = {"remote_kv_source": {"kv_request_id": "p-from-a", "remote_host": "127.0.0.1",
                                           "remote_port": ports[0]}}
            b_run = run_engine(tmp_path, "b", gws[1], tmp_path / "tiny-llama",
                               [{"name": "P", "prompt_token_ids": P, "kv_transfer_params": source},
                                {"name": "done", "touch": str(done)},
                                {"name": "R", "prompt_token_ids": R}],
                               extra={"secondary_tiers": tiers(gws[1], roots[1], ports[1])}, add_socket=False,
                               drain={"expect_sets": FULL_CHUNKS, "timeout": 60, "settle": 1.0},
                               after_drain=[{"name": "reset", "reset_cache": True},
                                            {"name": "R-kvgate", "prompt_token_ids": R,
                                             "kv_transfer_params": KVGATE_ONLY}])
        finally:
            done.touch()
            thread.join(600)
        a_stats, b_stats = gateway_stats(gws[0].socket), gateway_stats(gws[1].socket)
    finally:
        for gw in gws:
            gw.cleanup()
    assert a_run, "engine A did not finish"
    p_a, p_b = a_run["by_name"]["P"], b_run["by_name"]["P"]
    assert p_a["num_cached_tokens"] == 0
    assert p_b["external_prefix_cache_hits_delta"] == CACHEABLE, (p_b, b_run["log"][-6000:])
    assert p_b["output_token_ids"] == p_a["output_token_ids"]
    # through the p2p tier: A's engine took B's connection; neither gateway served P (B's never held it)
    assert f"accepting incoming connection from 127.0.0.1:{ports[1]}" in a_run["log"], a_run["log"][-4000:]
    assert a_stats["tiers"]["ram"]["sets"] == FULL_CHUNKS and a_stats["tiers"]["ram"]["hits"] == 0, a_stats["tiers"]
    r, again = b_run["by_name"]["R"], b_run["by_name"]["R-kvgate"]
    assert r["num_cached_tokens"] == 0
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE and again["output_token_ids"] == r["output_token_ids"]
    assert b_stats["tiers"]["ram"]["hits"] == FULL_CHUNKS, b_stats["tiers"]  # R-kvgate's, nothing of P
