"""vLLM (the real CPU build, 0.32) with KvgateOffloadingSpec against real gateways.

Engines run as subprocesses under ``.venv-vllm/bin/python`` (see the Makefile
for how that venv is built); the test is skipped when it is missing.  The
model is a tiny random-weight Llama built on the spot; prompts are token ids.

Four engine processes (each engine start costs 20-60 s on two cores, so the
cases are combined).  Runs 1-3 share gateway 1; run 4 uses gateway 2, a
replica on the same card directory (both with shared_storage):

run 1 (derived namespace): Q with kvgate_retention=none, then P and S (3000
      tokens each); drains until the gateway holds P's and S's 2 x 23 chunks.
run 2 (new process, same config): P -> restored from kvgate (external hits,
      same greedy output as run 1); P with another cache_salt -> no hits;
      Q -> no hits (retention none stored nothing).
run 3 (the tier as a ``secondary_tiers`` entry, over TCP, with its own
      namespace and skip_unsalted): P -> no hits (other namespace) and not
      stored (unsalted); P salted -> stored.
      Then the gateway is frozen (SIGSTOP): a new prompt R and P again are
      still served promptly (lookups time out as misses, stores fail), and the
      engine shuts down cleanly.
run 4 (a replica in cluster mode: gateway 2 follows a card registry in a real
      etcd, where a ``kvgate cluster serve`` agent registered gateway 1's card
      directory and serves it over TCP, ``kvgate://``; gateway 2 has
      ``--max-bytes 0``, so nothing can come from its RAM, and is restarted
      once before the engine starts): P -> restored from the card that
      gateway 1 wrote, through the agent (external hits, same greedy output
      as run 1).  Then the card directory is renamed away: S, asked at once,
      and Q, asked once gateway 2 reports the card inactive, are both recomputed
      promptly (0 external hits, same greedy output as runs 1 and 2) although
      the card holds them.  S's lookup usually still finds its keys in gateway
      2's index; its load then fails (the card's server answers that the card
      is gone) and vLLM recomputes.  Q's lookups are misses.  The directory is
      put back afterwards.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from tests.cluster.common import AgentProcess, EtcdServer
from tests.helpers import GatewayProcess, free_port, kvgate_env, run_kvgate, run_logged_plan, wait_until

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv-vllm" / "bin" / "python"
ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the vLLM CPU venv first (make vllm-venv)"),
]

PROMPT_TOKENS = 3000
BLOCK = 128  # the CPU platform's KV block size
FULL_CHUNKS = PROMPT_TOKENS // BLOCK  # 23 chunks stored per 3000-token prompt
CACHEABLE = FULL_CHUNKS * BLOCK  # 2944


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


P = prompt(1)
Q = prompt(2)
R = prompt(3)
S = prompt(4)


def run_engine(workdir: Path, name: str, gw: GatewayProcess, model_dir: Path, requests: list[dict],
               extra: dict | None = None, drain: dict | None = None, frozen: dict | None = None,
               card_away: dict | None = None, add_socket: bool = True, timeout: float = 400,
               arch: str = "llama", kv_cache_dtype: str | None = None, after_drain: list[dict] | None = None,
               ) -> dict:
    """One engine process (``vllm_engine.py``): ``requests``, then the ``drain`` until the gateway holds what
    they stored, then ``after_drain`` (where ``{"name": ..., "reset_cache": True}`` empties the engine's
    prefix cache and vLLM's CPU tier), then the ``frozen`` or ``card_away`` phase."""
    plan = {"model_dir": str(model_dir), "socket": gw.socket, "extra": extra or {}, "requests": requests,
            "drain": drain, "frozen": frozen, "card_away": card_away, "add_socket": add_socket,
            "arch": arch, "kv_cache_dtype": kv_cache_dtype, "after_drain": after_drain}
    return run_engine_plan(workdir, name, plan, timeout)


def run_engine_plan(workdir: Path, name: str, plan: dict, timeout: float = 400) -> dict:
    """``vllm_engine.py`` on ``plan`` (its keys: see that script) in a process of its own; the results, with
    the engine's ``log`` and the results ``by_name``.  Fails the test with the log's tail if the run fails."""
    env = kvgate_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    env.pop("PYTHONHASHSEED", None)
    try:
        return run_logged_plan(VENV_PY, ENGINE, workdir, name, plan, env=env, timeout=timeout)
    finally:
        # vLLM's tiering spec unlinks its /dev/shm CPU tier only in a clean shutdown; when it
        # force-kills its engine core (about 5 s after shutdown starts) the file stays (under a
        # MultiConnector, kvgate's child keeps the engine's id: the same file).  The engine names
        # its id in a file beside its results (workdir/<name>.json).
        id_file = workdir / f"{name}.json.engine_id"
        if id_file.exists():
            leaked = Path(f"/dev/shm/vllm_offload_{id_file.read_text().strip()}.mmap")
            if leaked.exists():
                leaked.unlink()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm_e2e")
    model_dir = workdir / "tiny-llama"
    port = free_port()
    gw = GatewayProcess(workdir, ["--max-bytes", "256M", "--shared-memory-size", "64M", "--port", str(port),
                                  "--shared-storage", "true"], name="gw")
    gw2 = agent = etcd = None
    gw.start()
    try:
        r1 = run_engine(workdir, "run1", gw, model_dir, [
            {"name": "Q-none", "prompt_token_ids": Q, "kv_transfer_params": {"kvgate_retention": "none"}},
            {"name": "P", "prompt_token_ids": P},
            {"name": "S", "prompt_token_ids": S},
        ], drain={"expect_sets": 2 * FULL_CHUNKS, "timeout": 60})
        sets1 = gw.ram_sets()
        r2 = run_engine(workdir, "run2", gw, model_dir, [
            {"name": "P", "prompt_token_ids": P},
            {"name": "P-salted", "prompt_token_ids": P, "cache_salt": "tenant-b"},
            {"name": "Q", "prompt_token_ids": Q},
        ], drain={"expect_sets": 4 * FULL_CHUNKS, "timeout": 60})
        sets2 = gw.ram_sets()
        try:
            r3 = run_engine(workdir, "run3", gw, model_dir, [
                {"name": "P-unsalted", "prompt_token_ids": P},
                {"name": "P-salted", "prompt_token_ids": P, "cache_salt": "tenant-c"},
            ], add_socket=False, extra={"secondary_tiers": [{
                "type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "address": f"127.0.0.1:{port}",
                "namespace": "another-deployment", "skip_unsalted": True}]},
                drain={"expect_sets": 5 * FULL_CHUNKS, "timeout": 60, "settle": 2.0},
                frozen={"gateway_pid": gw.pid, "resume": False, "requests": [
                    {"name": "R-frozen", "prompt_token_ids": R, "cache_salt": "tenant-d"},
                    {"name": "P-frozen", "prompt_token_ids": P},
                ]})
        finally:
            os.kill(gw.pid, signal.SIGCONT)
        # counted by the engine after its drain, before the freeze (R's interrupted store may
        # still land once the gateway runs again)
        sets3 = r3["gateway_sets"]

        # Run 4: a replica in cluster mode, with no RAM tier: whatever it restores comes from the card,
        # written there by gateway 1 and served to it by an agent over TCP.
        etcd = EtcdServer(workdir / "etcd").start()
        agent = AgentProcess(workdir, "storage-host", [
            "--cards", gw.card, "--export", f"127.0.0.1:{free_port()}", "--etcd-endpoints", etcd.endpoint,
            "--cluster-name", "vllm", "--liveness-ttl", "2", "--interval", "0.5"]).start()
        wait_until(lambda: run_kvgate("cluster", "view", "--etcd-endpoints", etcd.endpoint, "--cluster-name",
                                      "vllm").returncode == 0, 30, agent.log_tail)
        gw2 = GatewayProcess(workdir, ["--max-bytes", "0", "--shared-memory-size", "64M", "--shared-storage", "true",
                                       "--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "vllm",
                                       "--cluster-view-file", str(workdir / "gw2-view.json")], name="gw2")
        gw2.start()
        gw2.stop()
        gw2.start()  # restarted: on the cluster's view again
        gw2_start = gw2.wait_scanned(timeout=30)
        card, moved = Path(gw.card), Path(gw.card + ".away")
        try:
            r4 = run_engine(workdir, "run4", gw2, model_dir, [
                {"name": "P", "prompt_token_ids": P},
            ], card_away={"card": str(card), "moved_to": str(moved), "inactive_timeout": 10, "requests": [
                {"name": "S-card-away", "prompt_token_ids": S},
            ], "requests_after": [
                {"name": "Q-card-inactive", "prompt_token_ids": Q},
            ]})
            gw2_end = gw2.stats()
        finally:
            if moved.exists() and not card.exists():
                moved.rename(card)  # the card comes back (and the fixture cleanup finds it)
        yield {"run1": r1, "run2": r2, "run3": r3, "run4": r4, "sets": (sets1, sets2, sets3),
               "gateway_log": gw.log, "gw2_log": gw2.log(), "gw2_start": gw2_start, "gw2_end": gw2_end}
    finally:
        if gw2 is not None:
            gw2.cleanup()
        if agent is not None:
            agent.stop()
        if etcd is not None:
            etcd.stop()
        gw.cleanup()


def test_restart_restore(runs):
    """A new engine process restores a 3000-token prefix from kvgate: external hits, same greedy output."""
    first = runs["run1"]["by_name"]["P"]
    again = runs["run2"]["by_name"]["P"]
    assert first["num_cached_tokens"] == 0
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["num_cached_tokens"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    log = runs["run2"]["log"]
    assert "transfers are zero copy" in log, "the CPU tier was not registered with the gateway"
    assert "prefix_caching_hash_algo=sha256" in log  # key-stability report at start


def test_other_namespace_misses(runs):
    r = runs["run3"]["by_name"]["P-unsalted"]
    assert r["num_cached_tokens"] == 0 and r["external_prefix_cache_hits_delta"] == 0, r
    log = runs["run3"]["log"]
    assert "namespace 'another-deployment'" in log
    assert "over TCP" in log  # run 3 talks to the gateway over its TCP address


def test_frozen_gateway_keeps_engine_serving(runs):
    """A gateway that stops answering costs misses, not a stuck or crashed engine."""
    r = runs["run3"]["by_name"]["R-frozen"]
    assert r["num_cached_tokens"] == 0 and len(r["output_token_ids"]) == 8
    assert r["seconds"] < 15, f"a request waited {r['seconds']} s on a frozen gateway"
    p = runs["run3"]["by_name"]["P-frozen"]
    assert p["output_token_ids"] == runs["run1"]["by_name"]["P"]["output_token_ids"]
    assert p["seconds"] < 15
    log = runs["run3"]["log"]
    assert "failed unexpectedly" not in log and "BufferError" not in log, log[-4000:]
    # R's lookups reached the frozen gateway and timed out (or its reconnect did)
    assert "kvgate: lookup failed" in log or "kvgate: cannot connect" in log, log[-4000:]


def test_cache_salt_changes_keys(runs):
    r = runs["run2"]["by_name"]["P-salted"]
    assert r["num_cached_tokens"] == 0 and r["external_prefix_cache_hits_delta"] == 0, r


def test_retention_none_stores_nothing(runs):
    sets1, _, _ = runs["sets"]
    assert sets1 == 2 * FULL_CHUNKS, f"run 1 stored {sets1} objects; only P's and S's {2 * FULL_CHUNKS} chunks expected"
    r = runs["run2"]["by_name"]["Q"]
    assert r["num_cached_tokens"] == 0 and r["external_prefix_cache_hits_delta"] == 0, r


def test_skip_unsalted(runs):
    _, sets2, sets3 = runs["sets"]
    assert sets2 == 4 * FULL_CHUNKS  # run 2 stored salted P and Q
    # run 3 (skip_unsalted): the salted prompt was stored, the unsalted one was not
    assert sets3 == sets2 + FULL_CHUNKS, (sets2, sets3)


def test_replica_restores_from_shared_card(runs):
    """A second gateway on the same card, in cluster mode and restarted, with no RAM tier, restores for another
    engine what run 1 wrote, through an agent that serves the card over TCP."""
    start = runs["gw2_start"]
    assert start["gateway"]["shared_storage"] is True
    assert start["tiers"]["ram"]["capacity_bytes"] == 0  # --max-bytes 0: nothing can come from its RAM
    # in cluster mode, its one card served by the agent over TCP
    assert start["cluster"]["view_epoch"] >= 1 and [c["kind"] for c in start["cards"]] == ["kvgate"], start["cards"]
    # its start-up scan found on the card what gateway 1 wrote (P, S, salted P, Q, run 3's salted P)
    assert start["cards"][0]["objects"] >= 5 * FULL_CHUNKS, start["cards"]
    first = runs["run1"]["by_name"]["P"]
    again = runs["run4"]["by_name"]["P"]
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["num_cached_tokens"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    before = runs["run4"]["card_away"]["before"][0]
    assert before["active"] and before["hits"] >= FULL_CHUNKS, before  # read from the card by gateway 2
    assert "transfers are zero copy" in runs["run4"]["log"]  # run 4's CPU tier was registered with gateway 2


def test_card_taken_away_engine_recomputes(runs):
    """A card renamed away mid-run: the gateway takes it out of service, the engine recomputes promptly."""
    away = runs["run4"]["card_away"]
    assert away["before"][0]["active"] is True
    assert away["inactive_after_s"] is not None, f"card still active 10 s after it was taken away: {away['after']}"
    assert away["at_inactive"][0]["active"] is False and away["after"][0]["active"] is False
    assert "moved from active to inactive" in runs["gw2_log"], runs["gw2_log"][-3000:]
    by_name = runs["run4"]["by_name"]
    # S (stored by run 1, asked right after the rename) and Q (stored by run 2, asked once the
    # gateway reported the card inactive) would both be restored from the card otherwise.
    for name, ref in (("S-card-away", runs["run1"]["by_name"]["S"]), ("Q-card-inactive", runs["run2"]["by_name"]["Q"])):
        r = by_name[name]
        assert ref["num_cached_tokens"] == 0 and ref["external_prefix_cache_hits_delta"] == 0, ref  # computed
        assert r["external_prefix_cache_hits_delta"] == 0 and r["num_cached_tokens"] == 0, r
        assert r["output_token_ids"] == ref["output_token_ids"], name
        assert r["seconds"] < 10, f"{name} took {r['seconds']} s with its card gone"
    log = runs["run4"]["log"]
    assert "failed unexpectedly" not in log and "BufferError" not in log, log[-4000:]
