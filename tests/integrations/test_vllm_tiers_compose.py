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
B's RAM tier), with the same output as computing it; the two gateways told
each other what their engines' namespace stands for, and it is the same one.
Then A is SIGKILLed in the middle of the pull of Q (B reaches A through a
relay that kills A once part of Q's objects has passed): Q is recomputed,
with the same output as engine 1's, and the engine goes on serving.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import GatewayProcess, Relay, free_port
from tests.integrations.test_vllm_e2e import CACHEABLE, FULL_CHUNKS, P, Q, VENV_PY, run_engine
from tests.integrations.vllm_engine import gateway_stats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                   "(make vllm-venv)"),
]

KVGATE_ONLY = {"kv_load_tiers": [{"medium": "STORAGE", "locality": "REMOTE"}]}
FS_ONLY = {"kv_load_tiers": [{"medium": "STORAGE", "locality": "LOCAL"}]}
KILL_AFTER = 256 << 10  # bytes of Q's pull that reach B before A is killed (Q: 23 objects of 128 KiB)


class KillMidPull:
    """The relay's cut: once ``armed`` exists, A is SIGKILLed when ``KILL_AFTER`` more bytes have come from it
    (its peer listener's counters are read first: what it served before)."""

    def __init__(self, armed, gateway: GatewayProcess) -> None:
        self.armed, self.gateway = armed, gateway
        self.passed = 0
        self.killed = False
        self.served_before: dict = {}

    def __call__(self, n: int) -> bool:
        if not self.armed.exists():
            return False
        if not self.served_before:
            self.served_before = gateway_stats(self.gateway.socket)["peer_listen"]
        self.passed += n
        if self.passed < KILL_AFTER:
            return False
        os.kill(self.gateway.proc.pid, signal.SIGKILL)
        self.killed = True
        return True


def test_kvgate_beside_vllms_fs_tier_and_a_pull_from_a_peer_gateway(tmp_path):
    fs_root = tmp_path / "fs"
    fs_root.mkdir()
    token = tmp_path / "peer.token"
    token.write_text("fleet-secret")
    peer_port = free_port()
    gw = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M", "--peer-listen",
                                   f"127.0.0.1:{peer_port}", "--peer-token-file", str(token)],
                        card=tmp_path / "card-a", name="A")
    armed = tmp_path / "armed"
    kill = KillMidPull(armed, gw)
    relay = Relay(peer_port, cut=kill)  # B reaches A through it
    gw_b = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M", "--peers",
                                     f"127.0.0.1:{relay.port}", "--peer-token-file", str(token),
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

        run = run_engine(tmp_path, "run", gw, tmp_path / "tiny-llama", [{"name": "P", "prompt_token_ids": P},
                                                                         {"name": "Q", "prompt_token_ids": Q}],
                         extra={"secondary_tiers": tiers}, add_socket=False,
                         drain={"expect_sets": 2 * FULL_CHUNKS, "timeout": 60, "settle": 2.0},
                         after_drain=[reset("reset-1"),
                                      {"name": "P-kvgate", "prompt_token_ids": P, "kv_transfer_params": KVGATE_ONLY},
                                      reset("reset-2"),
                                      {"name": "P-fs", "prompt_token_ids": P, "kv_transfer_params": FS_ONLY},
                                      reset("reset-3"),
                                      {"name": "P-first", "prompt_token_ids": P}])
        a_tiers = gateway_stats(gw.socket)["tiers"]
        fs_files = [f for f in fs_root.rglob("*") if f.is_file()]
        pulled = run_engine(tmp_path, "pull", gw_b, tmp_path / "tiny-llama",
                            [{"name": "P", "prompt_token_ids": P}, {"name": "arm", "touch": str(armed)},
                             {"name": "Q", "prompt_token_ids": Q}])
        b_end = gateway_stats(gw_b.socket)
        a_died = gw.proc.wait(timeout=10)
    finally:
        relay.close()
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
    # gateway A stored P's and Q's chunks once, and served P-kvgate's (and P-first's when it answered first), never P-fs's
    assert a_tiers["ram"]["sets"] == 2 * FULL_CHUNKS, a_tiers
    served = a_tiers["ram"]["hits"] + a_tiers["long"]["hits"]
    assert served in (FULL_CHUNKS, 2 * FULL_CHUNKS), (f"gateway A served {served} chunks: P-kvgate's {FULL_CHUNKS}, "
                                                      "and P-first's if it answered first", a_tiers)

    # engine 2, on gateway B: P came from A by a pull, verified, and is now in B's RAM tier
    again = pulled["by_name"]["P"]
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    assert b_end["tiers"]["long"]["hits"] == 0  # nothing of P was on B's own card
    assert kill.served_before["served_objects"] == FULL_CHUNKS, kill.served_before  # P's, before Q
    (peer,) = b_end["peers"]
    # the engines' namespace was told both ways, and it is one namespace: not refused
    assert peer["namespaces_known"] == 1 and peer["namespace_refused"] == 0, peer

    # A SIGKILLed mid-pull of Q: what B had of it was partial; Q recomputed (at least in part), the same output
    assert kill.killed and a_died == -signal.SIGKILL, (kill.passed, a_died)
    q_ref, q = by["Q"], pulled["by_name"]["Q"]
    assert q_ref["num_cached_tokens"] == 0 and q["output_token_ids"] == q_ref["output_token_ids"], q
    assert q["external_prefix_cache_hits_delta"] < CACHEABLE, q  # not all of it came from A
    assert peer["failures"] >= 1 and FULL_CHUNKS <= peer["hits"] < 2 * FULL_CHUNKS, peer
    assert "failed unexpectedly" not in pulled["log"] and "BufferError" not in pulled["log"], pulled["log"][-4000:]
