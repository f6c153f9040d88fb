"""KvgateRemoteConnector (LMCache 0.5.6's in-process remote storage plugin) against real gateway processes.

LMCache's in-process path needs a GPU end to end (LMCacheConnectorV1 finds no
CPU connector), so these checks build what constructs on CPU: LMCache's own
LMCacheEngineConfig, LMCacheMetadata, LocalCPUBackend (the objects a get
returns are allocated there), CacheEngineKeys, and its RemoteBackend loading
the plugin from ``remote_storage_plugins``.  They run under
.venv-lmcache/bin/python (lmcache_remote_checks.py); skipped when that venv
is missing (make lmcache-venv builds it).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port, kvgate_env, run_json_script, venv_python

VENV_PY = venv_python(".venv-lmcache")
CHECKS = Path(__file__).resolve().parent / "lmcache_remote_checks.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the LMCache venv first (make lmcache-venv)"),
]

ENV = {"LMCACHE_TRACK_USAGE": "false"}


def run_checks(scenario: str, target: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{scenario}.json"
    return run_json_script(VENV_PY, CHECKS, [scenario, target, out], out, env={"LMCACHE_TRACK_USAGE": "false"})


def test_round_trip_batches_and_misses(gateway_factory, tmp_path):
    """put / batched_put, lookups, gets into LocalCPUBackend MemoryObjs, one gateway call per batch, misses."""
    gw = gateway_factory()
    r = run_checks("direct", gw.socket, tmp_path)
    assert r["allocator"] == "MixedMemoryAllocator"
    assert "Traceback" not in r["log"] and "unavailable" not in r["log"]


def test_over_tcp(gateway_factory, tmp_path):
    port = free_port()
    gw = gateway_factory(["--port", str(port)])
    run_checks("direct", f"127.0.0.1:{port}", tmp_path)


def test_through_lmcaches_plugin_loading(gateway_factory, tmp_path):
    """RemoteBackend(plugin_name="kvgate") -> CreateConnector -> remote_storage_plugins / extra_config."""
    gw = gateway_factory()
    r = run_checks("factory", gw.socket, tmp_path)
    assert r["connection"].startswith("InstrumentedRemoteConnector(<KvgateRemoteConnector")
    assert "Creating dynamic connector kvgate via KvgateRemoteConnector" in r["log"]
    assert r["calls"]["put_many"] == 1 and r["status"]["stored"] == 4


def test_gateway_killed_then_back(gateway_factory, tmp_path):
    """SIGKILL: misses and failed stores at once, no exception, one log line; restarted: works again."""
    gw = gateway_factory()
    out = tmp_path / "outage.json"
    err = tmp_path / "outage.stderr"
    with open(err, "w") as ef:
        proc = subprocess.Popen([str(VENV_PY), str(CHECKS), "outage", gw.socket, str(out)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=ef, text=True, env=kvgate_env(ENV))
        try:
            assert proc.stdout.readline().strip() == "KILL", err.read_text()[-4000:]
            gw.kill()
            proc.stdin.write("killed\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "RESTART", err.read_text()[-4000:]
            gw.start()  # its card directory holds what was stored before the kill
            proc.stdin.write("restarted\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "OK", err.read_text()[-4000:]
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    r = json.loads(out.read_text())
    log = err.read_text()
    assert log.count("kvgate: gateway") == 2, log  # one line down, one line back
    assert "reachable again" in log and "Traceback" not in log
    assert r["twenty_calls_down_s"] < 3.0, r
