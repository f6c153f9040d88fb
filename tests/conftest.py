"""Shared fixtures.  Only ``gateway_factory`` / ``gateway`` start processes, and only when a test asks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:  # test the checkout, as the gateway processes do (helpers.kvgate_env)
    sys.path.insert(0, _SRC)

from tests.helpers import GatewayProcess  # noqa: E402


@pytest.fixture
def gateway_factory(tmp_path):
    """``make(args=(), **kw) -> GatewayProcess`` (started unless start=False); all stopped at teardown."""
    procs: list[GatewayProcess] = []

    def make(args=(), *, start: bool = True, timeout: float = 20.0, **kwargs) -> GatewayProcess:
        gw = GatewayProcess(kwargs.pop("workdir", tmp_path), args, **kwargs)
        procs.append(gw)
        if start:
            gw.start(timeout)
        return gw

    yield make
    for gw in reversed(procs):
        gw.cleanup()


@pytest.fixture
def gateway(gateway_factory) -> GatewayProcess:
    """One started gateway with the default test flags."""
    return gateway_factory()
