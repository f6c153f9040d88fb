"""The vLLM integration reaches vLLM only through its compat module, and what compat names holds on the installed vLLM.

The static checks need no vLLM.  The last test runs vllm_compat_checks.py
under .venv-vllm/bin/python (skipped when that venv is missing: make
vllm-venv): every signature, field and internal compat relies on, used on
real vLLM objects, and the installed version is the one compat's docstring
says its items were checked against.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers import REPO, run_json_script, venv_python

PACKAGE = REPO / "src" / "kvgate" / "integrations" / "vllm"
COMPAT = PACKAGE / "compat.py"
VENV_PY = venv_python(".venv-vllm")
CHECKS = Path(__file__).resolve().parent / "vllm_compat_checks.py"

# vLLM's private names compat reaches behind its functions: no other module may use them.
INTERNALS = ("_create_req_context", "_offload_key_positions", "_lookup_queue", "_thread", "_scheduler_mmap",
             "_manager", "_worker", "_engine_id", "_primary_kv_view")


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def other_modules() -> list[Path]:
    paths = sorted(p for p in PACKAGE.glob("*.py") if p != COMPAT)
    assert {"spec.py", "tier.py", "worker.py"} <= {p.name for p in paths}
    return paths


def test_only_compat_imports_vllm() -> None:
    for path in other_modules():
        vllm = {m for m in imported_modules(path) if m == "vllm" or m.startswith("vllm.")}
        assert not vllm, (path.name, vllm)
    assert "vllm.v1.kv_offload.tiering.base" in imported_modules(COMPAT)


def test_only_compat_uses_vllm_internals() -> None:
    for path in other_modules():
        text = path.read_text()
        used = [name for name in INTERNALS if re.search(rf"\.{name}\b|[\"']{name}[\"']", text)]
        assert not used, (path.name, used)


def test_spec_and_tier_do_not_import_each_other() -> None:
    assert "kvgate.integrations.vllm.tier" not in imported_modules(PACKAGE / "spec.py")
    assert "kvgate.integrations.vllm.spec" not in imported_modules(PACKAGE / "tier.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first (make vllm-venv)")
def test_compat_holds_on_the_installed_vllm(tmp_path) -> None:
    out = tmp_path / "compat.json"
    result = run_json_script(VENV_PY, CHECKS, [out], out)
    assert "spec_state_and_regions" in result["checked"]
    named = re.search(r"checked\s+against\s+vLLM\s+(\d[\w.]*\w)", COMPAT.read_text()).group(1)
    assert result["vllm"] == named, (f"compat's items were checked against vLLM {named}, .venv-vllm has "
                                     f"{result['vllm']}: check each against it and update compat's docstring")
