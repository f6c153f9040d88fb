"""KvgateL2Adapter passes LMCache's own tests of its L2 adapter interface, against a real gateway.

``lmcache_l2_conformance.py`` runs under .venv-lmcache/bin/python (skipped when
that venv is missing: make lmcache-venv): the L2 adapter test LMCache 0.5.6's wheel
ships (``lmcache.v1.check.check_mode_test_l2_adapter``, run as is), and, case by
case with the same steps and expectations, LMCache's contract tests of
``L2AdapterInterface`` (its repository's ``test_mock_l2_adapter.py``), its delete
convention for locked keys (``TestDeleteRespectsLocks``) and its fs adapter's
delete tests (see the script's docstring for what each follows and what differs).
The script runs once per module; each case is a test here.  No case is expected
to fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import venv_python
from tests.integrations.conformance import judge, run_script

VENV_PY = venv_python(".venv-lmcache")
SCRIPT = Path(__file__).resolve().parent / "lmcache_l2_conformance.py"

CASES = [
    "check_mode_test_l2_adapter",
    "TestEventFdInterface::test_event_fds_are_valid_and_different",
    "TestStoreInterface::test_submit_store_task_signals_event_fd",
    "TestStoreInterface::test_pop_completed_store_tasks_returns_completed_then_clears",
    "TestStoreInterface::test_submit_multiple_store_tasks",
    "TestStoreInterface::test_store_batch_of_objects",
    "TestLookupAndLockInterface::test_lookup_signals_event_fd",
    "TestLookupAndLockInterface::test_lookup_nonexistent_existing_and_mixed",
    "TestLookupAndLockInterface::test_query_lookup_result_unknown_task_and_once_only",
    "TestUnlockInterface::test_unlock_never_raises",
    "TestLoadInterface::test_load_signals_event_fd_and_nonexistent_is_zero",
    "TestLoadInterface::test_load_existing_key_copies_data",
    "TestEndToEndWorkflow::test_store_lookup_load_unlock_workflow",
    "TestCloseInterface::test_close_with_and_without_operations",
    # a delete removed keys a lookup had locked (fixed): the four below failed before
    "TestDeleteRespectsLocks::test_delete_skips_locked_key",
    "TestDeleteRespectsLocks::test_delete_locked_key_succeeds_after_unlock",
    "TestDeleteRespectsLocks::test_delete_partial_lock_batch",
    "TestDeleteRespectsLocks::test_delete_locked_key_preserves_usage",
    "TestDeleteRespectsLocks::test_delete_skips_a_key_a_lookup_queued_before_it_locks",
    "TestDelete::test_delete_removes_keys_and_notifies",
    "TestDelete::test_delete_missing_key_is_noop",  # listeners were told of keys never stored (fixed)
    "TestDelete::test_double_delete_is_idempotent",  # ... and twice of a key deleted twice (fixed)
    "TestDelete::test_empty_key_list_is_noop",
    "TestDelete::test_load_after_delete_is_miss",
    "TestDelete::test_delete_after_close_does_not_raise",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),  # the first test waits for the whole script
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the LMCache venv first "
                                                    "(make lmcache-venv)"),
]


@pytest.fixture(scope="module")
def conformance(tmp_path_factory) -> dict:
    """The script's findings, from one run against one gateway."""
    return run_script(tmp_path_factory.mktemp("lmcache-conformance"), VENV_PY, SCRIPT, {"LMCACHE_TRACK_USAGE": "false"})


def test_every_case_of_the_script_is_listed_here(conformance) -> None:
    assert conformance["lmcache"] == "0.5.6"
    assert sorted(conformance["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_lmcache_adapter_case(conformance, case: str) -> None:
    judge(conformance, case, {})  # no case fails by a choice of kvgate
