"""Shared fixtures, and the rule that keeps ``make test-fast`` (``-m "not slow"``) free of processes.

Only ``gateway_factory`` / ``gateway`` start gateways, and only when a test
asks.  Every test that starts a process is marked ``slow``: a test that uses
a fixture of ``PROCESS_FIXTURES`` is marked here, a test that starts one
itself carries the marker, and ``ProcessGuard`` fails any other test that
starts one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:  # test the checkout, as the gateway processes do (helpers.kvgate_env)
    sys.path.insert(0, _SRC)

from tests.helpers import GatewayProcess, ProcessGuard  # noqa: E402

# Fixtures that start processes: gateways, and redis-servers (tests/cards/test_redis.py,
# tests/gateway/test_card_capacity.py; other modules import them).
PROCESS_FIXTURES = frozenset({"gateway_factory", "server_factory", "redis_server"})

_guard = ProcessGuard()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    _guard.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _guard.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Setup, call and teardown: a module fixture starts its process in the setup of its first test.
    with _guard.watching(None if item.get_closest_marker("slow") else item.nodeid):
        return (yield)


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
