"""Every ``kvgate`` command runs in each engine's environment (.venv-vllm, .venv-sglang, .venv-lmcache).

An engine's venv is where its operator runs kvgate too (``pip install kvgate[lmcache]`` beside the
engine), and its pins are not the project venv's: LMCache 0.5.6 pins grpcio 1.78.0, under which
etcd3aio's generated gRPC code refuses to load.  The command line must not need etcd3aio for
anything but the cluster commands, and those must say what is missing instead of a traceback.

Each environment: ``kvgate --help``, ``serve --help``, ``cluster --help``; a gateway started
with that venv's Python (``kvgate serve``) answers that venv's ``kvgate stat``; ``stat`` without a
gateway says it cannot reach one; ``cluster cards`` against a port where no etcd listens either
reaches etcd3aio and says etcd at that address failed, or says etcd3aio cannot be loaded here and why.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import GatewayProcess, free_port, kvgate_env, venv_python

pytestmark = pytest.mark.slow

ENVS = (".venv-vllm", ".venv-sglang", ".venv-lmcache")


def kvgate(venv: str, *args: str) -> subprocess.CompletedProcess:
    """The venv's own ``kvgate`` console script, as its operator runs it."""
    return subprocess.run([str(venv_python(venv).parent / "kvgate"), *args], env=kvgate_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("venv", ENVS)
def test_every_command_runs_in_the_engines_environment(venv, tmp_path) -> None:
    if not venv_python(venv).exists():
        pytest.skip(f"{venv} is missing (make test builds it)")
    for args in (["--help"], ["serve", "--help"], ["cluster", "--help"], ["stat", "--help"]):
        r = kvgate(venv, *args)
        assert r.returncode == 0 and "usage: kvgate" in r.stdout, (args, r.stderr[-3000:])

    gw = GatewayProcess(tmp_path, name="gw", python=venv_python(venv)).start()
    try:
        r = kvgate(venv, "stat", "--socket", gw.socket)
        assert r.returncode == 0 and "tiers" in r.stdout, r.stderr[-3000:]
    finally:
        gw.cleanup()

    r = kvgate(venv, "stat", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 2 and "cannot reach the gateway" in r.stderr and "Traceback" not in r.stderr, r.stderr

    etcd = f"127.0.0.1:{free_port()}"
    r = kvgate(venv, "cluster", "cards", "--etcd-endpoints", etcd, "--timeout", "0.5")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert etcd in r.stderr or ("needs etcd3aio" in r.stderr and "grpcio" in r.stderr), r.stderr
    if "needs etcd3aio" in r.stderr:  # then a gateway in cluster mode cannot start either, and says why
        r = kvgate(venv, "serve", "--cluster-etcd-endpoints", etcd, "--port", "0", "--metrics-port", "0",
                   "--socket", str(tmp_path / "cluster.sock"))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "cluster mode (cluster_etcd_endpoints) needs etcd3aio" in r.stderr, r.stderr
