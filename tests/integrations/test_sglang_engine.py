"""The README's SGLang CPU command, run as written, with KvgateHiCacheStorage against a real gateway
(about 4 min).

The server is the README's CPU command (``sglang_server.SGLangServer`` reads it from README.md), its
backend finding the gateway on the default socket as the README's bare ``kvgate serve`` has it,
under ``.venv-sglang/bin/python`` (``make sglang-venv``); skipped when that venv is missing.  The
model is the vLLM tests' tiny random-weight Llama (2 layers, hidden 256) with a word-level
tokenizer; prompts are token ids.  CUDA-only kernel ops are stood in for by
``tests/integrations/sglang_stubs`` (test scaffolding only, named by the README's command).

Two server starts, one per scenario:

server 1: prompt P (720 tokens) is computed (an OpenAI completion); its 45 full pages are backed
          up to kvgate; ``kvgate router`` in front of it answers P as the server does.
server 2 (a restart: nothing in SGLang's device or host cache), on a second gateway B with an empty card
          of its own that lists the first as a peer (no router: the gateway pulls on its own):
  - the same completion of P is restored through B, every page pulled from A's RAM tier (B's peer
    counters, A's peer listener), same greedy output as server 1;
  - P with another ``cache_salt``: 0 storage hits (SGLang folds the salt into its page hashes);
  - the gateway is killed (SIGKILL): prompt Q (never seen) and P with a third salt are still
    served, promptly; the backend says once that the gateway is gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers import GatewayProcess, free_port
from tests.integrations.sglang_server import VENV_PY, SGLangServer, build_model, storage_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the SGLang venv first (make sglang-venv)"),
]

PROMPT_TOKENS = 720  # SGLang's torch_native attention in bf16 is slow on CPU: ~1 s to compute
PAGE = 16
FULL_PAGES = PROMPT_TOKENS // PAGE  # 45


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


P = prompt(1)
Q = prompt(2)


def gateway_hits(gw: GatewayProcess) -> int:
    return sum(r["hits"] for ns, r in gw.stats()["namespaces"].items() if ns.startswith("sglang|"))


def through_router(workdir, server: SGLangServer) -> dict:
    """``kvgate router`` in front of the running server (one endpoint, SGLang's page size as the block
    size): its start line, P completed through it, its /health and /metrics."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "router", "--endpoint", f"http://127.0.0.1:{server.port}",
                             "--block-size", str(PAGE), "--host", "127.0.0.1", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=open(workdir / "router.log", "wb"), text=True)
    out: dict = {}
    try:
        line = proc.stdout.readline()
        out["line"] = line
        if "serving on 127.0.0.1:" in line:
            base = "http://127.0.0.1:" + line.split("serving on 127.0.0.1:")[1].split()[0]
            out["routed"] = server.complete(P, via=base)
            for path in ("health", "metrics"):
                with urllib.request.urlopen(f"{base}/{path}", timeout=10) as r:
                    out[path] = r.read().decode()
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        out["rc"] = proc.wait(20)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang_engine")
    model_dir = workdir / "tiny-llama"
    build_model(model_dir)
    run = workdir / "run"  # XDG_RUNTIME_DIR of the gateway and the server, as on a systemd login
    run.mkdir()
    run_b = workdir / "run-b"  # server 2's: gateway B
    run_b.mkdir()
    token = workdir / "peer.token"
    token.write_text("sglang-peer-token")
    peer_port = free_port()
    gw = GatewayProcess(workdir, ["--max-bytes", "256M", "--peer-listen", f"127.0.0.1:{peer_port}",
                                  "--peer-token-file", str(token)], name="gw",
                        socket_path=run / "kvgate-5557.sock").start()
    gw_b = GatewayProcess(workdir, ["--max-bytes", "256M", "--peers", f"127.0.0.1:{peer_port}", "--peer-token-file",
                                    str(token), "--peer-timeout-ms", "5000"], name="gw-b",
                          card=workdir / "card-b", socket_path=run_b / "kvgate-5557.sock").start()
    out: dict = {"gw": gw}
    try:
        s1 = SGLangServer(workdir, model_dir, gw.socket, name="server1").start()
        try:
            out["computed"] = s1.complete(P)
            # Backups are asynchronous (write_through, then the backup thread): wait for all of P's pages.
            out["sets_after_1"] = gw.wait_ram_sets(FULL_PAGES)
            out["router"] = through_router(workdir, s1)
        finally:
            s1.stop()
            out["log1"] = s1.log()

        s2 = SGLangServer(workdir, model_dir, gw_b.socket, name="server2").start()
        try:
            out["hits_before"] = gateway_hits(gw_b)
            out["restored"] = s2.complete(P)
            out["hits_after"] = gateway_hits(gw_b)
            out["b_stats"], out["a_stats"] = gw_b.stats(), gw.stats()
            out["salted"] = s2.generate(P, cache_salt="tenant-b")
            gw_b.kill(signal.SIGKILL)
            out["killed_at"] = time.monotonic()
            out["after_kill_q"] = s2.generate(Q)
            out["after_kill_p"] = s2.generate(P, cache_salt="tenant-c")
        finally:
            s2.stop()
            out["log2"] = s2.log()
        yield out
    finally:
        gw_b.cleanup()
        gw.cleanup()


def test_a_restarted_server_restores_the_prompt_by_a_pull_from_a_peer_gateway(runs):
    computed, restored = runs["computed"], runs["restored"]
    assert runs["sets_after_1"] >= FULL_PAGES
    # Everything but the last partial page (SGLang keeps one token to compute) comes from kvgate: through
    # gateway B, which held none of it, pulled from gateway A (no router asked for it)
    hits = runs["hits_after"] - runs["hits_before"]
    assert hits >= FULL_PAGES - 1, (runs["hits_before"], runs["hits_after"])
    (peer,) = runs["b_stats"]["peers"]
    assert peer["hits"] >= FULL_PAGES - 1 and peer["failures"] == 0, peer
    assert runs["b_stats"]["tiers"]["long"]["hits"] == 0  # nothing of P was on B's own card
    assert runs["a_stats"]["peer_listen"]["served_objects"] >= FULL_PAGES - 1, runs["a_stats"]["peer_listen"]
    assert len(restored["output_ids"]) == 8 and restored["output_ids"] == computed["output_ids"]
    print(f"\nTTFT proxy (e2e, 8 tokens): computed {computed['seconds']} s, restored {restored['seconds']} s, "
          f"{hits} pages from kvgate")


def test_kvgate_router_in_front_of_sglang(runs):
    """The router takes an SGLang server as an endpoint: routable, its page size checked against the
    router's block size (SGLang's /server_info), the completion as the server gives it directly."""
    r = runs["router"]
    assert "1 of 1 endpoints routable" in r["line"], r
    assert r["routed"]["output_ids"] == runs["computed"]["output_ids"]
    (ep,) = json.loads(r["health"])["endpoints"]
    assert r["routed"]["headers"]["x-kvgate-endpoint"] == ep["url"]
    assert ep["state"] == "up" and "block_size" not in ep["unchecked"], ep
    assert f'kvgate_router_requests_total{{endpoint="{ep["url"]}",policy="cache-aware"}} 1.0' in r["metrics"]
    assert r["rc"] == 0


def test_the_readme_config_draws_no_warning_about_prefix_keys(runs):
    """SGLang's server hands every lookup of a prompt from its start ``prefix_keys=None`` although the
    README's config sets ``hicache_storage_pass_prefix_keys``: the backend must not tell the user to set it."""
    for log in (runs["log1"], runs["log2"]):
        assert "passed no prefix keys" not in log, log[-4000:]


def test_another_cache_salt_gets_no_storage_hits(runs):
    salted = runs["salted"]
    assert storage_tokens(salted) == 0 and salted["meta_info"]["cached_tokens"] == 0
    assert salted["output_ids"] == runs["computed"]["output_ids"]  # a salt changes keys, not the model


def test_a_killed_gateway_does_not_stop_serving(runs):
    q, p = runs["after_kill_q"], runs["after_kill_p"]
    assert len(q["output_ids"]) == 8 and storage_tokens(q) == 0
    assert p["output_ids"] == runs["computed"]["output_ids"]
    assert q["seconds"] < 30 and p["seconds"] < 30
    log = runs["log2"]
    # No traceback through kvgate (SGLang's own start-up may log one of its own, e.g. /freeze_gc).
    assert "kvgate/integrations" not in log and "treated as a miss" not in log, log[-4000:]
    assert 1 <= log.count("kvgate backend: gateway") - log.count("reachable again") <= 3, log[-4000:]
    assert "unreachable" in log
