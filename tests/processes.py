"""Processes only the tests start or stop: ``redis-server`` children, ``freeze``, and the test-only
conveniences of the shipped gateway and agent processes' classes.

The gateway and agent classes are ``kvgate.bench.processes``'s (the bench,
``benchmarks/`` and ``demo/`` start them too); ``tests/helpers.py`` and
``tests/cluster/common.py`` build on them.  What is here no shipped code uses.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from kvgate.bench import processes
from kvgate.bench.processes import free_port
from kvgate.cluster.agent import AgentSettings
from kvgate.cluster.member import STOP_GRACE_S

REDIS_SERVER = shutil.which("redis-server")


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    ``kill`` returns when the signal is queued; each thread stops when it is next scheduled, which on a
    busy machine can be after a request sent right after ``kill`` was answered.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in glob.glob(f"/proc/{pid}/task/*/stat"):
            with contextlib.suppress(OSError):
                with open(task) as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
        if not states or all(s in "tTZX" for s in states):  # gone, or every thread stopped
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s of SIGSTOP: thread states {states}")
        time.sleep(0.002)


class RedisServer:
    """One ``redis-server`` on a free loopback port (and a Unix socket in ``workdir`` with ``unix_socket``),
    no persistence; it can be paused, killed and restarted empty on the same port.

    Driven by one thread of its owner (a test, a benchmark); ``start`` blocks
    until the server answers PING.  ``policy`` is its ``maxmemory-policy``,
    ``extra`` more server flags, which win over the ones given here.
    """

    def __init__(self, workdir: str | os.PathLike, policy: str = "allkeys-lru", extra: Sequence[str] = (), *,
                 unix_socket: bool = False):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.extra = tuple(extra)
        self.port = free_port()
        self.sock = str(self.workdir / "redis.sock") if unix_socket else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        assert self.sock is not None, "made without unix_socket"
        return f"unix://{self.sock}"

    def start(self, policy: str | None = None, extra: Sequence[str] | None = None,
              timeout: float = 15.0) -> "RedisServer":
        """Start it (with another policy or other flags, when given); returns once it answers PING."""
        assert REDIS_SERVER is not None, "redis-server is not installed"
        if policy is not None:
            self.policy = policy
        if extra is not None:
            self.extra = tuple(extra)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                *(["--unixsocket", self.sock] if self.sock else []), "--daemonize", "no", "--dir", str(self.workdir),
                "--maxmemory-policy", self.policy, *self.extra]
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer: {self.log()}")
            time.sleep(0.01)
        return self

    def answers(self) -> bool:
        """PING (on the Unix socket when it has one); a NOAUTH answer counts: it is up, with a password."""
        try:
            if self.sock is not None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(0.5)
                s.connect(self.sock)
            else:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
            with s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def log(self) -> str:
        try:
            return (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def raw(self, **kw: Any):
        """A redis-py client of it (on the Unix socket when it has one)."""
        import redis

        where = {"unix_socket_path": self.sock} if self.sock else {"host": "127.0.0.1", "port": self.port}
        return redis.Redis(socket_timeout=5, **where, **kw)

    def pause(self) -> None:
        assert self.proc is not None
        freeze(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a paused server too
            self.proc.wait(10)

    def restart_empty(self) -> None:
        self.kill()
        self.start()


class AgentProcess(processes.AgentProcess):
    """``kvgate.bench.processes.AgentProcess`` with what tests ask of it besides: a hard stop, a log tail for
    a failed wait's message."""

    # The agent's documented stop bound (two etcd calls and its member's grace), and room for a loaded
    # machine: the exit must come within it.
    STOP_WITHIN_S = 2 * AgentSettings.call_timeout_s + STOP_GRACE_S + 10.0

    def signal(self, sig: int, timeout: float = STOP_WITHIN_S) -> int | None:
        """``sig``, and the exit status; a failed assertion with the agent's log when it has not exited in time."""
        try:
            return super().signal(sig, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.name} still runs {timeout:.0f} s after signal {sig}\n"
                                 f"{self.log_tail()}") from None

    def stop(self) -> None:
        """SIGKILL (no clean shutdown: teardown only) and wait for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)

    def log_tail(self, chars: int = 3000) -> str:
        return f"agent {self.name} log:\n{self.log()[-chars:]}"
