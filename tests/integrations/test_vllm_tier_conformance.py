"""KvgateTier passes vLLM's own tests of secondary tiers (its fs tier's and its tier factory's), against a real gateway.

vLLM's wheel ships no tests: ``vllm_tier_conformance.py`` walks the tests of
``tests/v1/kv_offload/tiering/test_fs_tier.py`` and ``test_tier_factory.py`` of
vLLM's repository case by case, with the same steps and expectations, under
.venv-vllm/bin/python (skipped when that venv is missing: make vllm-venv).  The
script runs once per session (vLLM takes seconds to import); each case is a
test here.  No case is expected to fail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess, kvgate_env, venv_python

VENV_PY = venv_python(".venv-vllm")
SCRIPT = Path(__file__).resolve().parent / "vllm_tier_conformance.py"

CASES = [
    # test_fs_tier.py
    "test_lookup_empty_tier",
    "test_store_creates_file_and_lookup_succeeds",
    "test_store_then_load_roundtrip",
    "test_invalid_locality_raises_at_construction",
    "test_factory_forwards_locality_to_the_tier",
    "test_failed_load_missing_file",
    "test_multiple_jobs_tracked_independently",
    "test_multi_block_job_partial_failure",
    "test_shutdown_discards_pending_tasks",
    "test_store_load_data_integrity[0]",
    "test_store_load_data_integrity[1]",
    "test_store_load_data_integrity[2]",
    "test_store_load_data_integrity[5]",
    "test_batch_lookup_dispatch",
    "test_out_of_bounds_block_id_smoke",  # a store past the CPU tier's end reported success (fixed)
    "test_out_of_bounds_block_id_in_a_batch",
    "test_failed_load_corrects_verdict",
    "test_batched_partial_load_failure_keeps_loaded_blocks",
    "test_batched_load_first_block_fails_marks_it_a_miss",
    # test_tier_factory.py
    "test_kvgate_tier_is_a_secondary_tier_manager",
    "test_create_tier_preserves_extra_config",
    "test_create_multiple_tiers",
    "test_register_new_tier_type",
    "test_unknown_entry_key_raises",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),  # the first test waits for the whole script
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                    "(make vllm-venv)"),
]


@pytest.fixture(scope="module")
def conformance(tmp_path_factory) -> dict:
    """The script's findings, from one run against one gateway."""
    workdir = tmp_path_factory.mktemp("vllm-conformance")
    gw = GatewayProcess(workdir).start()
    try:
        out = workdir / "cases.json"
        proc = subprocess.run([str(VENV_PY), str(SCRIPT), gw.socket, str(out)], capture_output=True, text=True,
                              env=kvgate_env({"VLLM_LOGGING_LEVEL": "WARNING"}), timeout=400, cwd=workdir)
        assert proc.returncode == 0 and out.exists(), (f"vllm_tier_conformance.py failed (rc {proc.returncode}):\n"
                                                       f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        found = json.loads(out.read_text())
        found["log"] = proc.stderr
        assert gw.alive(), f"the gateway died during the cases:\n{gw.log()[-3000:]}"
        return found
    finally:
        gw.stop()


def test_every_case_of_the_script_is_listed_here(conformance) -> None:
    assert sorted(conformance["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_vllm_tier_case(conformance, case: str) -> None:
    assert conformance["cases"].get(case) == "ok", conformance["cases"].get(case, "not run")
