"""A gateway started by systemd (``Type=notify``) says when it is ready, reloading and stopping."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from kvgate.gateway import sdnotify


@pytest.fixture
def manager(tmp_path):
    """A datagram socket standing for systemd's notify socket."""
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(20)
    yield path, s
    s.close()


def _next(s: socket.socket) -> list[str]:
    return s.recv(4096).decode().split("\n")


def test_ready_reloading_and_stopping_reach_the_service_manager(gateway_factory, manager) -> None:
    path, s = manager
    gw = gateway_factory(env={"NOTIFY_SOCKET": path})
    ready = _next(s)
    assert ready[0] == "READY=1" and ready[1].startswith("STATUS=serving; 1 cards")
    assert gw.stats()["gateway"]["pid"] == gw.pid, "ready means it answers"
    os.kill(gw.pid, signal.SIGHUP)
    assert _next(s)[0] == "RELOADING=1"
    assert _next(s)[0] == "READY=1", "ready again once the config is applied"
    assert gw.stop() == 0, "SIGTERM is a clean stop"
    assert _next(s) == ["STOPPING=1"]


def test_without_a_notify_socket_nothing_is_sent_and_a_dead_one_is_said_once(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    monkeypatch.setattr(sdnotify, "_failed", False)
    assert sdnotify.notify("READY=1") is False and sdnotify.notify("STOPPING=1") is False
    assert caplog.text.count("could not tell the service manager") == 1
