"""The real ``lmcache server`` (LMCache 0.5.6, multiprocess mode) with the kvgate L2 adapter, and vLLM
(CPU build, 0.32) with ``LMCacheMPConnector`` (``lmcache_driven``).

Processes run under .venv-lmcache/bin/python (make lmcache-venv); the test is
skipped when that venv is missing.  ``lmcache server`` is the README's command (``LMCacheServer``,
tests/integrations/lmcache_servers.py, reads it from README.md).  The engine is tests/integrations/vllm_engine.py
(tiny random-weight Llama, token-id prompts) with an LMCache kv_transfer_config.

run 1: gateway G, lmcache server L (L1 in /dev/shm, registered with G), engine:
       P (768 tokens) computed; drains until G holds P's 3 chunks.
run 2: L and the engine restarted (L1 empty): Q (768 new tokens) computed, then P restored from G
       through L (external prefix-cache hits, same greedy output as run 1); then G is killed
       (SIGKILL): R (new) and P again are still served by L and vLLM.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess
from tests.integrations.lmcache_servers import CHUNK, VENV_PY, LMCacheServer, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the LMCache venv first (make lmcache-venv)"),
]

PROMPT_TOKENS = 800
CHUNKS = PROMPT_TOKENS // CHUNK  # 3
CACHEABLE = CHUNKS * CHUNK  # 768


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


P, Q, R = prompt(11), prompt(12), prompt(13)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lmcache_e2e")
    model_dir = workdir / "tiny-llama"
    gw = GatewayProcess(workdir, ["--max-bytes", "256M", "--shared-memory-size", "16M"], name="gw")
    gw.start()
    servers: list[LMCacheServer] = []
    try:
        timeouts = {"kvgate.io_timeout": 5, "kvgate.lookup_timeout": 2}
        s1 = LMCacheServer(workdir, gw, "lmcache1", timeouts).start()
        servers.append(s1)
        t0 = time.monotonic()
        r1 = run_engine(workdir, "run1", gw, s1, model_dir, [{"name": "P", "prompt_token_ids": P}],
                        drain={"expect_sets": CHUNKS, "timeout": 60, "settle": 1.0})
        r1["wall_s"] = time.monotonic() - t0
        s1.stop()
        s2 = LMCacheServer(workdir, gw, "lmcache2", timeouts).start()
        servers.append(s2)
        t0 = time.monotonic()
        r2 = run_engine(workdir, "run2", gw, s2, model_dir, [
            {"name": "Q-computed", "prompt_token_ids": Q},
            {"name": "P-restored", "prompt_token_ids": P},
        ], frozen={"gateway_pid": gw.pid, "signal": signal.SIGKILL, "requests": [
            {"name": "R-gateway-dead", "prompt_token_ids": R},
            {"name": "P-gateway-dead", "prompt_token_ids": P},
        ]})
        r2["wall_s"] = time.monotonic() - t0
        s2_alive = s2.proc is not None and s2.proc.poll() is None
        s2.stop()
        yield {"run1": r1, "run2": r2, "lmcache1": s1.log(), "lmcache2": s2.log(), "s2_alive": s2_alive,
               "card": gw.card}
    finally:
        for s in servers:
            s.stop()
        gw.cleanup()
        # LMCache unlinks its L1 file on a clean exit only (and a stale one at its next start)
        Path(f"/dev/shm/lmcache_l1_pool_kvgate-test-{os.getpid()}").unlink(missing_ok=True)


def test_restart_restores_through_lmcache_and_kvgate(runs):
    first = runs["run1"]["by_name"]["P"]
    again = runs["run2"]["by_name"]["P-restored"]
    computed = runs["run2"]["by_name"]["Q-computed"]
    print(f"\nTTFT computed (Q, {PROMPT_TOKENS} tokens) {computed['ttft']}, restored (P) {again['ttft']}; "
          f"run1 {runs['run1']['wall_s']:.1f} s, run2 {runs['run2']['wall_s']:.1f} s")
    assert first["num_cached_tokens"] == 0 and computed["external_prefix_cache_hits_delta"] == 0
    assert again["external_prefix_cache_hits_delta"] > 0, again
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    assert runs["run1"]["gateway_sets"] >= CHUNKS
    log = runs["lmcache1"]
    assert "kvgate L2 adapter: gateway" in log and "registered with the gateway" in log, log[-4000:]


def test_every_chunk_went_to_the_card_with_its_conversations_dialog_and_position(runs):
    """The adapter took each request's dialog mark at its lookup: every chunk on the card carries a dialog
    and its place in the prompt, and one dialog holds P's chunks at positions 0..CHUNKS-1."""
    import collections

    from kvgate.cards.objectformat import peek_header
    from kvgate.keys import NO_DIALOG

    metas = []
    for f in Path(runs["card"]).glob("db*/*/*"):
        if ".tmp." in f.name:  # a write still landing (layout: <name>.tmp.<host>-<boot>.<pid>.<thread>)
            continue
        raw = f.read_bytes()
        metas.append(peek_header(raw[:4096], len(raw), lambda n, raw=raw: raw[:n]).meta)
    assert metas and all(m.dialog != NO_DIALOG and m.position >= 0 for m in metas), metas
    by_dialog = collections.defaultdict(set)
    for m in metas:
        by_dialog[m.dialog].add(m.position)
    assert set(range(CHUNKS)) in by_dialog.values(), by_dialog


def test_gateway_killed_lmcache_keeps_serving(runs):
    r2 = runs["run2"]["by_name"]
    for name in ("R-gateway-dead", "P-gateway-dead"):
        assert len(r2[name]["output_token_ids"]) == 8, r2[name]
        assert r2[name]["seconds"] < 30, r2[name]
    # P is still in the restarted server's L1: same output
    assert r2["P-gateway-dead"]["output_token_ids"] == runs["run1"]["by_name"]["P"]["output_token_ids"]
    assert runs["s2_alive"], runs["lmcache2"][-4000:]
    log = runs["lmcache2"]
    assert "Traceback" not in log, log[-4000:]
