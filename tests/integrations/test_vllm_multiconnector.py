"""kvgate as one child of vLLM's ``MultiConnector``, beside a second connector, in one real vLLM CPU engine (0.32).

``MultiConnector`` (``kv_connector_extra_config.connectors``: a list of
child ``kv_transfer_config`` dicts, each with its own ``kv_role`` and
``kv_connector_extra_config``) saves every request's KV through all of its
children and loads it from the first child, in list order, that reports
matched tokens.  On GPUs the second child is a P-to-D transport (NIXL, see
docs/integrations/vllm.md); NIXL does not run on a CPU, so here it is
vLLM's ``ExampleConnector``, which writes each prompt's KV to
``shared_storage_path`` as one safetensors file per layer and runs on the
CPU platform.

The config is the CPU one of docs/integrations/vllm.md ("Beside a P/D
transport"), read from the page and run as written but for the gateway's
socket and the storage directory: kvgate's ``OffloadingConnector`` first,
``ExampleConnector`` second (``test_doc_configs`` checks the page's GPU
config too, which cannot run here).  One engine start:

- P is computed: it is stored through both children (the gateway holds its
  chunks; ExampleConnector's directory for P has one file per layer, with
  P's cacheable tokens);
- the engine's prefix cache and vLLM's CPU tier are emptied
  (``reset_prefix_cache(reset_connector=True)``, which ``MultiConnector``
  passes to every child);
- P again: both children hold it, and kvgate, first in the list, restores
  it: every cacheable token an external hit, the same greedy output, the
  gateway served P's chunks, and ExampleConnector, which also reported the
  match, injected nothing.

Only this order is tested: one engine run cannot have both, and in the
other order ExampleConnector (whose match is synchronous and complete)
would restore P and the gateway would serve nothing, which tests vLLM, not
kvgate.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess
from tests.integrations.test_vllm_e2e import CACHEABLE, FULL_CHUNKS, P, VENV_PY, run_engine_plan

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "vllm.md"
SECTION = "## Beside a P/D transport (MultiConnector)"
NUM_LAYERS = 2  # the tiny Llama vllm_engine.py builds
SOCKET = "/run/kvgate/kvgate.sock"  # the doc's paths, which the test replaces with its own
STORAGE = "/var/lib/vllm/example-connector"
KVGATE_CHILD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
    "spec_name": "KvgateOffloadingSpec", "spec_module_path": "kvgate.integrations.vllm", "kvgate.socket": SOCKET}}


def doc_configs() -> dict[str, dict]:
    """The section's ``json`` blocks, by their second child's connector (``NixlConnector``: the GPU config,
    ``ExampleConnector``: the one this test runs)."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    configs = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]
    by_child: dict[str, dict] = {}
    for config in configs:
        names = [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]]
        by_child["NixlConnector" if "NixlConnector" in names else names[-1]] = config
    return by_child


def children(config: dict) -> list[dict]:
    assert config["kv_connector"] == "MultiConnector" and config["kv_role"] == "kv_both", config
    return config["kv_connector_extra_config"]["connectors"]


def without_size(child: dict) -> dict:
    extra = {k: v for k, v in child.get("kv_connector_extra_config", {}).items() if k != "cpu_bytes_to_use"}
    return {**child, "kv_connector_extra_config": extra}


def test_doc_configs():
    """Both configs are valid JSON of the shape MultiConnector reads, kvgate's child the usual OffloadingConnector
    entry; NIXL first on GPUs, kvgate first in the one the engine test runs (the doc says why)."""
    configs = doc_configs()
    assert set(configs) == {"NixlConnector", "ExampleConnector"}, configs
    nixl, kvgate = children(configs["NixlConnector"])
    assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert without_size(kvgate) == KVGATE_CHILD
    kvgate, example = children(configs["ExampleConnector"])
    assert without_size(kvgate) == KVGATE_CHILD
    assert example == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": STORAGE}}


def multi_config(socket: str, storage: Path) -> dict:
    """The doc's CPU config, verbatim but for the gateway socket and the storage directory."""
    text = json.dumps(doc_configs()["ExampleConnector"])
    assert text.count(SOCKET) == 1 and text.count(STORAGE) == 1, text
    return json.loads(text.replace(SOCKET, socket).replace(STORAGE, str(storage)))


def example_connector_dir(storage: Path, prompt: list[int]) -> Path:
    """Where ExampleConnector keeps a prompt: md5 of its int64 token ids, all but the last token, down to whole
    blocks (``align_to_block_size(len - 1)``: P's 2944 cacheable tokens)."""
    kept = prompt[:CACHEABLE]
    return storage / hashlib.md5(struct.pack(f"<{len(kept)}q", *kept)).hexdigest()


def safetensors_shape(path: Path) -> list[int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))["kv_cache"]["shape"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                "(make vllm-venv)")
def test_kvgate_first_beside_a_second_connector_in_multiconnector(tmp_path):
    storage = tmp_path / "example-connector"
    storage.mkdir()
    gw = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M"], name="gw")
    gw.start()
    try:
        run = run_engine_plan(tmp_path, "multi", {
            "model_dir": str(tmp_path / "tiny-llama"), "socket": gw.socket,
            "kv_transfer_config": multi_config(gw.socket, storage),
            "requests": [{"name": "P", "prompt_token_ids": P}],
            "drain": {"expect_sets": FULL_CHUNKS, "timeout": 60, "settle": 2.0},
            "after_drain": [{"name": "reset", "reset_cache": True}, {"name": "P-again", "prompt_token_ids": P}],
        }, timeout=600)
        tiers = gw.stats()["tiers"]
    finally:
        gw.cleanup()
    by, log = run["by_name"], run["log"]
    first, again = by["P"], by["P-again"]

    # P computed, and stored through both children
    assert first["num_cached_tokens"] == 0, first
    assert run["gateway_sets"] == FULL_CHUNKS and tiers["ram"]["sets"] == FULL_CHUNKS, (run["gateway_sets"], tiers)
    p_dir = example_connector_dir(storage, P)
    files = sorted(p_dir.glob("*.safetensors")) if p_dir.is_dir() else []
    assert len(files) == NUM_LAYERS, (f"ExampleConnector's directory for P holds {[f.name for f in files]}; "
                                      f"storage has {sorted(p.name for p in storage.iterdir())}")
    for f in files:
        assert safetensors_shape(f)[0] == CACHEABLE, (f.name, safetensors_shape(f))

    # emptied, then P restored through kvgate, the first child that reported matched tokens
    assert by["reset"]["done"], run["results"]
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["num_cached_tokens"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    served = tiers["ram"]["hits"] + tiers["long"]["hits"]
    assert served == FULL_CHUNKS, tiers
    assert tiers["ram"]["sets"] == FULL_CHUNKS  # nothing of P stored twice
    # ExampleConnector matched P too (it logs the hit), but was not chosen: it injected no KV
    after_reset = log[log.index("[engine] reset: reset_prefix_cache"):log.index("[engine] P-again:")]
    assert "External Cache Hit!" in after_reset, after_reset[-3000:]
    assert "Inject KV cache" not in log, log[-4000:]
    assert "transfers are zero copy" in log  # kvgate's child registered vLLM's CPU tier with the gateway
    assert "failed unexpectedly" not in log and "BufferError" not in log, log[-4000:]
