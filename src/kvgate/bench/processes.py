"""Real processes for the bench: ``kvgate serve`` children."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from kvgate.bench import BenchError


class GatewayProcess:
    """A ``kvgate serve`` child with its own socket, card and log; stopped with SIGTERM."""

    def __init__(self, name: str, workdir: str, sockdir: str, *, max_bytes: int, threads: int, card_capacity: int,
                 cards: int = 1, tcp: bool = False, extra: Sequence[str] = ()):
        self.name = name
        # One card: card-<name>; several: card-<name>-0 .. card-<name>-<N-1>, each a directory card of its own.
        self.card_dirs = ([os.path.join(workdir, f"card-{name}")] if cards == 1 else
                          [os.path.join(workdir, f"card-{name}-{i}") for i in range(cards)])
        self.card_dir = self.card_dirs[0]
        self.socket_path = os.path.join(sockdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"gateway-{name}.log")
        self.args = [
            # TCP needs a port of its own: --port 0 turns the listener off
            "--storage-devices", *self.card_dirs, "--max-bytes", str(max_bytes), "--port", str(free_port() if tcp else 0),
            "--metrics-port", "0", "--socket", self.socket_path, "--card-capacity", str(card_capacity),
            "--thread-pool-size", str(threads), "--log-level", "warning", *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for d in self.card_dirs:  # a gateway never creates a configured card directory itself
            os.makedirs(d, exist_ok=True)
        # The child must import this very kvgate, however the bench was started.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvgate", "serve", *self.args], env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the socket accepts a connection (the RAM tier is touched by then)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"gateway {self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                try:
                    s.connect(self.socket_path)
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise BenchError(f"gateway {self.name} did not listen on {self.socket_path} within {timeout_s:.0f} s:\n"
                                 f"{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

