"""KvgateTier passes vLLM's own tests of secondary tiers (its fs tier's and its tier factory's), against a real gateway.

vLLM's wheel ships no tests: ``vllm_tier_conformance.py`` walks the tests of
``tests/v1/kv_offload/tiering/test_fs_tier.py`` and ``test_tier_factory.py`` of
vLLM's repository case by case, with the same steps and expectations, under
.venv-vllm/bin/python (skipped when that venv is missing: make vllm-venv).  The
script runs once per module (vLLM takes seconds to import); each case is a
test here.  A case that fails for a documented choice of kvgate, or for a
feature kvgate does not have, is in ``EXPECTED_FAILURES`` with the reason and the
failure it must show; it is reported as xfail with that reason, and a test fails
if such a case starts passing (the list would be stale) or fails otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import venv_python
from tests.integrations.conformance import judge, run_script

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
    "test_fs_tier_cross_tp_round_trip",
    "test_events_disabled_by_default",
    "test_successful_store_emits_stored_event",
    "test_store_event_uses_configured_locality",
    "test_load_job_emits_no_event",
    "test_mixed_job_results_emit_event_only_for_successful_job",
    "test_partially_failed_store_emits_no_event",
    "test_events_require_global_kv_events_flag",
    # test_tier_factory.py
    "test_kvgate_tier_is_a_secondary_tier_manager",
    "test_create_tier_preserves_extra_config",
    "test_create_multiple_tiers",
    "test_register_new_tier_type",
    "test_unknown_entry_key_raises",
]

_NO_EVENTS = ("got an unexpected keyword argument 'enable_kv_events'",
              "KvgateTier emits no KV events (vLLM's BlockStored events for what a tier stored): it takes no "
              "enable_kv_events, and take_events yields nothing; a feature not built yet")

# case -> (what its failure must say, why kvgate fails it)
EXPECTED_FAILURES = {
    "test_fs_tier_cross_tp_round_trip": (
        "TP is part of the namespace",
        "kvgate's derived vLLM namespace includes the TP (and PP) sizes (the kvgate.namespace row of "
        "docs/integrations/vllm.md), also for a replicated layout, so engines of other TP sizes do not share objects; the fs tier's file "
        "mapper leaves TP out of a replicated layout's path"),
    "test_successful_store_emits_stored_event": _NO_EVENTS,
    "test_store_event_uses_configured_locality": _NO_EVENTS,
    "test_load_job_emits_no_event": _NO_EVENTS,
    "test_mixed_job_results_emit_event_only_for_successful_job": _NO_EVENTS,
    "test_partially_failed_store_emits_no_event": _NO_EVENTS,
    "test_events_require_global_kv_events_flag": _NO_EVENTS,
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),  # the first test waits for the whole script
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                    "(make vllm-venv)"),
]


@pytest.fixture(scope="module")
def conformance(tmp_path_factory) -> dict:
    """The script's findings, from one run against one gateway."""
    return run_script(tmp_path_factory.mktemp("vllm-conformance"), VENV_PY, SCRIPT, {"VLLM_LOGGING_LEVEL": "WARNING"})


def test_every_case_of_the_script_is_listed_here(conformance) -> None:
    assert sorted(conformance["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_vllm_tier_case(conformance, case: str) -> None:
    judge(conformance, case, EXPECTED_FAILURES)
