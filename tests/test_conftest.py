"""The suite's own rule: a test that starts a process is marked slow (``make test-fast`` starts none).

``tests/conftest.py`` marks the tests that use a process fixture, and its
``ProcessGuard`` fails any other unmarked test that starts a process.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from tests.helpers import ProcessGuard, UnmarkedProcess


@pytest.fixture
def guard():
    g = ProcessGuard()
    g.install()
    yield g
    g.uninstall()


def test_an_unmarked_test_cannot_start_a_process_any_way(guard: ProcessGuard) -> None:
    with guard.watching("tests/x.py::test_unmarked"):
        with pytest.raises(UnmarkedProcess, match=r"tests/x.py::test_unmarked starts a process .* not marked slow"):
            subprocess.run(["true"])
        with pytest.raises(UnmarkedProcess, match="test_unmarked"):
            multiprocessing.get_context("spawn").Process(target=print).start()
        with pytest.raises(UnmarkedProcess, match="test_unmarked"):
            os.fork()


def test_uninstall_puts_back_what_install_replaced() -> None:
    def calls():
        return subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork

    before = calls()
    g = ProcessGuard()
    g.install()
    try:
        assert all(now is not then for now, then in zip(calls(), before))
    finally:
        g.uninstall()
    assert calls() == before


@pytest.mark.slow  # it starts one
def test_a_slow_test_may_start_a_process(guard: ProcessGuard) -> None:
    with guard.watching(None):
        assert subprocess.run(["true"]).returncode == 0


def test_a_test_that_asks_for_a_gateway_is_marked_slow(gateway_factory, request) -> None:
    # Only the full suite runs this: the mark deselects it from -m "not slow", which is the point.
    assert request.node.get_closest_marker("slow") is not None
