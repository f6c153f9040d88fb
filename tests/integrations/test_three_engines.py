"""One cache, three engines: vLLM, SGLang and an LMCache-backed vLLM on the same card.

Each engine has its own gateway; the three gateways share one directory card
(``shared_storage: true``), as engines on one host share a disk.  All three
engines are given the same prompt (the same token ids), so the only thing
keeping their entries apart is the namespace each integration derives from
its engine's model and KV layout.

phase 1: each engine computes P and stores it through its gateway.
restart: the three gateways stop and start again (RAM empty; what they serve
         comes from the card), and each engine is a new process.
phase 2: each engine restores P from the card, with the output it computed
         in phase 1.

SGLang and LMCache run as their README sections say: SGLang's CPU command and LMCache's ``lmcache
server`` and vLLM OpenAI server commands are read from README.md (``sglang_server``,
``lmcache_servers``), with only ports, paths, sizes and the model filled in.

Then: the card holds exactly three namespaces (counted by a gateway's scan
after the restart); each gateway served hits to its own engine's namespace
only; ``kvgate stat`` shows the three rows.

Needs all three engine venvs (``make test`` builds them); skipped otherwise.
``make demo-engines`` runs this module and prints the ``kvgate stat`` table.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess, run_kvgate
from tests.integrations import lmcache_servers, sglang_server, test_vllm_e2e

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not (test_vllm_e2e.VENV_PY.exists() and sglang_server.VENV_PY.exists()
                            and lmcache_servers.VENV_PY.exists()),
                       reason="needs .venv-vllm, .venv-sglang and .venv-lmcache (make test builds them)"),
]

PROMPT_TOKENS = 800
P = [random.Random(21).randrange(10, 4000) for _ in range(PROMPT_TOKENS)]
VLLM_CHUNKS = PROMPT_TOKENS // 128  # vLLM's CPU KV block: 6 blocks, 768 tokens
SGLANG_PAGES = PROMPT_TOKENS // 16  # 50 pages
LMCACHE_CHUNKS = PROMPT_TOKENS // lmcache_servers.CHUNK  # 3 chunks, 768 tokens
ENGINES = ("vllm", "sglang", "lmcache")


def own_namespace(rows: dict[str, dict], engine: str) -> str:
    (ns,) = [ns for ns in rows if ns.startswith(engine + "|")]
    return ns


def run_vllm(workdir: Path, name: str, gw: GatewayProcess, model: Path, drain: bool) -> dict:
    return test_vllm_e2e.run_engine(workdir, name, gw, model, [{"name": "P", "prompt_token_ids": P}],
                                    drain={"expect_sets": VLLM_CHUNKS, "timeout": 60} if drain else None)


def run_sglang(workdir: Path, name: str, gw: GatewayProcess, model: Path) -> dict:
    server = sglang_server.SGLangServer(workdir, model, gw.socket, name=name).start()
    try:
        return server.generate(P)
    finally:
        server.stop()


def run_lmcache(workdir: Path, name: str, gw: GatewayProcess, model: Path, drain: bool) -> dict:
    """The README's LMCache commands as written (``lmcache server`` and vLLM's OpenAI server): one completion
    of P, then both stopped with Ctrl-C; ``external_hits``: vLLM's external prefix-cache hits; ``kv_left``:
    the KV cache segments the stopped vLLM left in /dev/shm (removed)."""
    server = lmcache_servers.LMCacheServer(workdir, gw, name + "-server").start()
    try:
        engine = lmcache_servers.VLLMServer(workdir, name, server, model).start()
        out: dict = {}
        try:
            out.update(engine.complete(P))
            out["external_hits"] = engine.metric("vllm:external_prefix_cache_hits_total")
            if drain:  # stores are asynchronous: the engine runs on until the gateway holds P's chunks
                out["sets"] = gw.wait_ram_sets(LMCACHE_CHUNKS)
        finally:
            out["kv_left"] = engine.stop()
        return out
    finally:
        server.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("three_engines")
    card = workdir / "shared-card"
    models = {"vllm": workdir / "tiny-llama-vllm", "sglang": workdir / "tiny-llama-sglang",
              "lmcache": workdir / "tiny-llama-lmcache"}
    sglang_server.build_model(models["sglang"])
    sglang_server.build_model(models["lmcache"])  # with a tokenizer: the README's vLLM server loads one
    for e in ENGINES:  # each gateway on the default socket in an XDG_RUNTIME_DIR of its own (SGLang's README way)
        (workdir / f"run-{e}").mkdir()
    gws = {e: GatewayProcess(workdir, ["--max-bytes", "256M", "--shared-memory-size", "64M",
                                       "--shared-storage", "true"], card=card, name=f"gw-{e}",
                             socket_path=workdir / f"run-{e}" / "kvgate-5557.sock") for e in ENGINES}
    out: dict = {}
    try:
        for gw in gws.values():
            gw.start()
        out["vllm1"] = run_vllm(workdir, "vllm1", gws["vllm"], models["vllm"], drain=True)
        out["sglang1"] = run_sglang(workdir, "sglang1", gws["sglang"], models["sglang"])
        out["sglang_sets"] = gws["sglang"].wait_ram_sets(SGLANG_PAGES)
        out["lmcache1"] = run_lmcache(workdir, "lmcache1", gws["lmcache"], models["lmcache"], drain=True)

        for gw in gws.values():
            gw.stop()
        for gw in gws.values():
            gw.start()
        out["scanned"] = {e: gw.wait_scanned(timeout=30)["namespaces"] for e, gw in gws.items()}

        out["vllm2"] = run_vllm(workdir, "vllm2", gws["vllm"], models["vllm"], drain=False)
        out["sglang2"] = run_sglang(workdir, "sglang2", gws["sglang"], models["sglang"])
        out["lmcache2"] = run_lmcache(workdir, "lmcache2", gws["lmcache"], models["lmcache"], drain=False)
        out["after"] = {e: gw.stats()["namespaces"] for e, gw in gws.items()}
        r = run_kvgate("stat", "--socket", gws["vllm"].socket, env={"COLUMNS": "250"})
        assert r.returncode == 0, r.stderr
        out["stat"] = r.stdout
        print("\n" + r.stdout)
        yield out
    finally:
        for gw in gws.values():
            gw.cleanup()
        Path(f"/dev/shm/lmcache_l1_pool_kvgate-test-{__import__('os').getpid()}").unlink(missing_ok=True)


def test_each_engine_restores_its_own_prompt_from_the_shared_card(runs) -> None:
    v1, v2 = runs["vllm1"]["by_name"]["P"], runs["vllm2"]["by_name"]["P"]
    assert v1["external_prefix_cache_hits_delta"] == 0
    assert v2["external_prefix_cache_hits_delta"] == VLLM_CHUNKS * 128, v2
    assert v2["output_token_ids"] == v1["output_token_ids"]

    s1, s2 = runs["sglang1"], runs["sglang2"]
    assert runs["sglang_sets"] >= SGLANG_PAGES
    assert sglang_server.storage_tokens(s1) == 0
    assert sglang_server.storage_tokens(s2) >= (SGLANG_PAGES - 1) * 16, s2["meta_info"]
    assert s2["output_ids"] == s1["output_ids"]

    l1, l2 = runs["lmcache1"], runs["lmcache2"]
    assert l1["external_hits"] == 0 and l1["sets"] >= LMCACHE_CHUNKS, l1
    assert l2["external_hits"] == LMCACHE_CHUNKS * lmcache_servers.CHUNK, l2
    assert len(l2["output_ids"]) == 8 and l2["output_ids"] == l1["output_ids"]
    # What docs/integrations/lmcache.md's shared-memory note says: each vLLM stop leaves its KV cache segment behind.
    assert len(l1["kv_left"]) >= 1 and all("/dev/shm/lmcache_kv_" in p for p in l1["kv_left"]), l1["kv_left"]


def test_the_card_holds_three_namespaces_and_each_gateway_serves_only_its_own(runs) -> None:
    for engine, rows in runs["scanned"].items():
        on_card = {ns: r["card_objects"] for ns, r in rows.items() if r["card_objects"]}
        assert len(on_card) == 3, (engine, on_card)
        for e in ENGINES:  # every gateway's scan found each engine's namespace
            own_namespace(on_card, e)
    for engine, rows in runs["after"].items():
        mine = own_namespace(rows, engine)
        assert rows[mine]["hits"] > 0, (engine, rows)
        assert all(r["hits"] == 0 for ns, r in rows.items() if ns != mine), (engine, rows)


def test_kvgate_stat_shows_bytes_and_hits_per_namespace(runs) -> None:
    out = runs["stat"]
    assert "namespaces" in out
    for engine in ENGINES:
        assert f"{engine}|" in out, out
