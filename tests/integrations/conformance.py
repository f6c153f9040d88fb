"""Running an engine's own contract cases against a real gateway, and judging each case.

Each ``*_conformance.py`` / ``*_contract.py`` script runs in its engine's venv (the engine's classes
load only there), walks the engine's interface the way its own tests do against the gateway whose
socket it is given, and writes ``{"cases": {name: "ok" | failure text}, ...}`` as JSON.  The pytest
side (``test_*_conformance.py``) runs it once per module (``run_script``) and turns each case into a
test (``judge``): a case kvgate fails by a documented choice is an expected failure that must fail
the documented way, and starts failing the test when it passes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess, kvgate_env


def run_script(workdir: Path, python: Path, script: Path, env: dict[str, str] | None = None) -> dict:
    """The script's findings (its JSON, with its stderr as ``log``), from one run against a fresh gateway."""
    gw = GatewayProcess(workdir).start()
    try:
        out = workdir / "cases.json"
        proc = subprocess.run([str(python), str(script), gw.socket, str(out)], capture_output=True, text=True,
                              env=kvgate_env(env or {}), timeout=400, cwd=workdir)
        assert proc.returncode == 0 and out.exists(), (f"{script.name} failed (rc {proc.returncode}):\n"
                                                       f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        found = json.loads(out.read_text())
        found["log"] = proc.stderr
        assert gw.alive(), f"the gateway died during the cases:\n{gw.log()[-3000:]}"
        return found
    finally:
        gw.stop()


def judge(found: dict, case: str, expected_failures: dict[str, tuple[str, str]]) -> None:
    """Pass, fail or xfail one case; ``expected_failures``: case -> (what its failure must say, why)."""
    result = found["cases"].get(case, "not run")
    if case in expected_failures:
        says, why = expected_failures[case]
        assert result != "ok", f"{case} now passes: take it off EXPECTED_FAILURES"
        assert says in result, f"{case} failed otherwise than documented ({says!r}):\n{result}"
        pytest.xfail(why)
    assert result == "ok", result
