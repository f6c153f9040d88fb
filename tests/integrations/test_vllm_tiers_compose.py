"""``KvgateTier`` beside vLLM's own ``fs`` tier in one ``secondary_tiers`` list, then a second engine whose
gateway pulls the same prompt from the first engine's gateway: two real vLLM CPU engines (0.32).

vLLM's tiering manager stores every new chunk to all of its secondary tiers
and loads a chunk from the first tier in list order that holds it, among
those a request's ``kv_load_tiers`` allows.  Engine 1 has
``[KvgateTier (STORAGE, REMOTE) on gateway A, fs (STORAGE, LOCAL)]``:

- P is computed: its chunks go to both tiers (gateway A holds them, the
  ``fs`` root has their files);
- vLLM's CPU tier and prefix cache emptied, P restored through kvgate only:
  every cacheable token an external hit, the same greedy output, gateway A
  served the gets;
- emptied again, P restored through ``fs`` only: the same, and A served
  nothing more;
- emptied again, P with no filter: from one of them (kvgate's lookups are
  asynchronous and fs's are not, so which answers first is a race).

Engine 2 runs on gateway B, with its own card, which lists A as a peer: P,
held only by A, is restored through B by a pull from A (verified, kept in
B's RAM tier), with the same output as computing it.
"""
from __future__ import annotations

import pytest

from tests.helpers import GatewayProcess, free_port
from tests.integrations.test_vllm_e2e import CACHEABLE, FULL_CHUNKS, P, VENV_PY, run_engine
from tests.integrations.vllm_engine import gateway_stats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                   "(make vllm-venv)"),
]

KVGATE_ONLY = {"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]}
FS_ONLY = {"kv_load_tiers": [{"medium": "STORAGE", "locality": "LOCAL"}]}


def test_kvgate_beside_vllms_fs_tier_and_a_pull_from_a_peer_gateway(tmp_path):
    fs_root = tmp_path / "fs"
    fs_root.mkdir()
    token = tmp_path / "peer.token"
    token.write_text("fleet-secret")
    peer_port = free_port()
    gw = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M", "--peer-listen",
                                   f"127.0.0.1:{peer_port}", "--peer-token-file", str(token)],
                        card=tmp_path / "card-a", name="A")
    gw_b = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M", "--peers",
                                     f"127.0.0.1:{peer_port}", "--peer-token-file", str(token),
                                     "--peer-timeout-ms", "5000"], card=tmp_path / "card-b", name="B")
    gw.start()
    gw_b.start()
    try:
        tiers = [{"type": "KvgateTier", "module_path": "kvgate.integrations.vllm", "socket": gw.socket,
                  "locality": "REMOTE"},
                 {"type": "fs", "root_dir": str(fs_root), "locality": "LOCAL", "n_read_threads": 2,
                  "n_write_threads": 2}]

        def reset(name: str) -> dict:
            return {"name": name, "reset_cache": True}

        run = run_engine(tmp_path, "run", gw, tmp_path / "tiny-llama", [{"name": "P", "prompt_token_ids": P}],
                         extra={"secondary_tiers": tiers}, add_socket=False,
                         drain={"expect_sets": FULL_CHUNKS, "timeout": 60, "settle": 2.0},
                         after_drain=[reset("reset-1"),
                                      {"name": "P-kvgate", "prompt_token_ids": P, "kv_transfer_params": KVGATE_ONLY},
                                      reset("reset-2"),
                                      {"name": "P-fs", "prompt_token_ids": P, "kv_transfer_params": FS_ONLY},
                                      reset("reset-3"),
                                      {"name": "P-first", "prompt_token_ids": P}])
        a_tiers = gateway_stats(gw.socket)["tiers"]
        fs_files = [f for f in fs_root.rglob("*") if f.is_file()]
        pulled = run_engine(tmp_path, "pull", gw_b, tmp_path / "tiny-llama", [{"name": "P", "prompt_token_ids": P}])
        b_end, a_end = gateway_stats(gw_b.socket), gateway_stats(gw.socket)
    finally:
        gw_b.cleanup()
        gw.cleanup()
    by = run["by_name"]
    assert all(by[f"reset-{i}"]["done"] for i in (1, 2, 3)), run["results"]
    first = by["P"]
    assert first["num_cached_tokens"] == 0
    assert len(fs_files) >= FULL_CHUNKS, f"the fs tier holds {len(fs_files)} files, {FULL_CHUNKS} chunks stored"
    for name in ("P-kvgate", "P-fs", "P-first"):
        r = by[name]
        assert r["external_prefix_cache_hits_delta"] == CACHEABLE, (name, r)
        assert r["output_token_ids"] == first["output_token_ids"], name
    # gateway A stored P's chunks once, and served P-kvgate's (and P-first's when it answered first), never P-fs's
    assert a_tiers["ram"]["sets"] == FULL_CHUNKS, a_tiers
    served = a_tiers["ram"]["hits"] + a_tiers["long"]["hits"]
    assert served in (FULL_CHUNKS, 2 * FULL_CHUNKS), (f"gateway A served {served} chunks: P-kvgate's {FULL_CHUNKS}, "
                                                      "and P-first's if it answered first", a_tiers)

    # engine 2, on gateway B: P came from A by a pull, verified, and is now in B's RAM tier
    again = pulled["by_name"]["P"]
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    (peer,) = b_end["peers"]
    assert peer["hits"] == FULL_CHUNKS and peer["failures"] == 0, peer
    assert b_end["tiers"]["long"]["hits"] == 0  # nothing of P was on B's own card
    assert a_end["peer_listen"]["served_objects"] == FULL_CHUNKS, a_end["peer_listen"]
