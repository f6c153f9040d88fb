"""SGLang 0.5.23's own storage-backend test, shipped in its wheel, run on KvgateHiCacheStorage against a real gateway.

``sglang_backend_contract.py`` runs under .venv-sglang/bin/python (skipped when
that venv is missing: make sglang-venv): SGLang's
``sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store`` as shipped,
its backend class bound to kvgate's (see the script).  Each case its ``__main__``
runs is a test here.  A case that fails for a documented choice of kvgate is in
``EXPECTED_FAILURES`` with the reason and the failure it must show; it is
reported as xfail with that reason, and a test fails if such a case starts
passing (the list would be stale) or fails otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import venv_python
from tests.integrations.conformance import judge, run_script

VENV_PY = venv_python(".venv-sglang")
SCRIPT = Path(__file__).resolve().parent / "sglang_backend_contract.py"

CASES = [
    "test_single_operation",
    "test_batch_operation[mha-tp1]",
    "test_batch_operation[mla-tp1]",
    "test_batch_operation[mha-tp4-rank1]",
    "test_batch_operation[mla-tp8-rank3]",
]

# case -> (what its failure must say, why kvgate fails it)
EXPECTED_FAILURES = {
    "test_single_operation": (
        "set operation failed",
        "it calls the legacy page-copy interface (set/get/exists of one key at a raw address); kvgate's "
        "backend serves only SGLang's zero-copy v1 interface (interface_v1: 1, docs/integrations/sglang.md): "
        "set answers False and logs how to fix the config, nothing is stored"),
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),  # the first test waits for the whole script
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the SGLang venv first "
                                                    "(make sglang-venv)"),
]


@pytest.fixture(scope="module")
def contract(tmp_path_factory) -> dict:
    """The script's findings, from one run against one gateway."""
    return run_script(tmp_path_factory.mktemp("sglang-contract"), VENV_PY, SCRIPT, {})


def test_every_case_of_the_shipped_test_ran(contract) -> None:
    assert contract["sglang"] == "0.5.23"
    assert sorted(contract["cases"]) == sorted(CASES)


def test_the_legacy_interface_is_refused_with_the_fix_named(contract) -> None:
    """Why test_single_operation fails: the backend says so in the log, naming the setting."""
    assert 'add "interface_v1": 1 to --hicache-storage-backend-extra-config' in contract["log"]


def test_tp_ranks_in_the_namespace(contract) -> None:
    """The batch cases pass with TP configs because each rank keeps its pages in a namespace of its own
    (MHA: the rank's KV heads differ), while an MLA model's ranks share one (their latent KV is the same):
    docs/integrations/sglang.md's ``kvgate.namespace`` row."""
    ns = contract["namespaces"]
    assert "|tp1of4|" in ns["test_batch_operation[mha-tp4-rank1]"]
    assert "|tp0of1|" in ns["test_batch_operation[mha-tp1]"]
    assert ns["test_batch_operation[mla-tp1]"] == ns["test_batch_operation[mla-tp8-rank3]"]


@pytest.mark.parametrize("case", CASES)
def test_sglang_shipped_case(contract, case: str) -> None:
    judge(contract, case, EXPECTED_FAILURES)
