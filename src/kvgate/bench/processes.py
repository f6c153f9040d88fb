"""Real processes for the bench, the benchmarks and the demo: ``kvgate serve`` gateways and cluster agents.

``kvgate bench`` starts its gateways here, and so do the scripts of
``benchmarks/`` and ``demo/``.  The test suite builds on these classes
(``tests/helpers.py`` adds its default flags and test-only conveniences);
what only tests use (``redis-server`` children, ``freeze``) lives in
``tests/processes.py``.  Scripts that run under an engine's venv import this
module too, with nothing from ``tests/``: it needs only the standard library
and kvgate, and loads the client and the cards only where a gateway is made
or asked for its stats.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvgate.config import Config

# The directory holding this kvgate package: a child must import this very
# kvgate, however its parent was started.
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes; keep a margin


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (``ip_local_port_range``; 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on every address a moment ago, below the kernel's ephemeral range where there is room.

    A process started with it may bind it minutes later (a vLLM engine binds its KV events port after its
    model loads); a port of the ephemeral range can be taken meanwhile by any outgoing connection, one
    below it only by another explicit bind.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12288), low) if low > 2048 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # every address: an engine may bind a wildcard
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvgate_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with this kvgate first on PYTHONPATH and unbuffered output, then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def flag_groups(args: Sequence[str]) -> list[tuple[str, list[str]]]:
    """["--a", "1", "--b", "x", "y"] -> [("--a", ["1"]), ("--b", ["x", "y"])]."""
    groups: list[tuple[str, list[str]]] = []
    for a in args:
        if a.startswith("--"):
            groups.append((a, []))
        elif not groups:
            raise ValueError(f"value {a!r} before any flag")
        else:
            groups[-1][1].append(a)
    return groups


class GatewayProcess:
    """One ``kvgate serve`` child: its command line, socket, card directories and log.

    Made and driven by one thread of whoever runs it (the bench's thread, a
    benchmark script, a test): ``spawn`` returns at once; ``wait_ready`` and
    ``start`` block until the gateway answers on every listener its flags
    open, and raise with the tail of its log when it exits first or does not
    answer in time; ``stop`` blocks until it has exited (SIGTERM, then
    SIGKILL).  Nothing here runs on another thread or inside the gateway.

    ``flags`` are ``kvgate serve``'s.  Without ``--socket`` the socket goes in
    ``workdir``, or in a short temporary directory (removed by ``cleanup``)
    when that path is too long for a Unix socket.  ``log_path`` takes stderr,
    and stdout too unless ``out_path`` is given.  ``new_session``: the child
    gets a process group of its own, so a Ctrl-C at the terminal does not
    reach it.  ``create_cards``: ``spawn`` first creates the plain
    ``--storage-devices`` directories (a gateway creates no configured card
    directory itself; relative paths are relative to ``cwd``).
    """

    def __init__(self, workdir: str | os.PathLike, flags: Sequence[str] = (), *, name: str = "gateway",
                 python: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, log_path: str | os.PathLike | None = None,
                 out_path: str | os.PathLike | None = None, new_session: bool = True, create_cards: bool = True):
        from kvgate.cards import is_network, is_redis  # here: a script that only asks for a port loads no cards

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._sockdir: str | None = None
        flags = list(flags)
        if "--socket" not in flags:
            sock = self.workdir / f"{name}.sock"
            if len(str(sock)) > SUN_PATH_MAX:
                self._sockdir = tempfile.mkdtemp(prefix="kvg-", dir="/tmp")
                sock = Path(self._sockdir) / f"{name}.sock"
            flags += ["--socket", str(sock)]
        self.flags = dict(flag_groups(flags))
        self.socket = self.flags["--socket"][0]
        devices = self.flags.get("--storage-devices", [])
        self.card = devices[0] if devices else None
        self.card_dirs = [p for p in devices if not is_redis(p) and not is_network(p) and not glob.has_magic(p)]
        self.argv = [python or sys.executable, "-m", "kvgate", "serve", *flags]
        self.env = env
        self.cwd = cwd
        self.log_path = Path(log_path) if log_path is not None else self.workdir / f"{name}.log"
        self.out_path = Path(out_path) if out_path is not None else None
        self.new_session = new_session
        self.create_cards = create_cards
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False  # by stop(): an exit after it is no news

    # ---- life cycle ------------------------------------------------------------

    def spawn(self) -> "GatewayProcess":
        """Start the process and return at once (``wait_ready`` waits for it to answer)."""
        if self.create_cards:
            for d in self.card_dirs:
                os.makedirs(os.path.join(self.cwd or ".", d), exist_ok=True)
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(self.log_path, "ab"))
            out = files.enter_context(open(self.out_path, "ab")) if self.out_path is not None else None
            self.proc = subprocess.Popen(self.argv, env=self.env if self.env is not None else kvgate_env(),
                                         stdin=subprocess.DEVNULL, stdout=out or err,
                                         stderr=err if out else subprocess.STDOUT, cwd=self.cwd,
                                         start_new_session=self.new_session)
        self.stopped = False
        return self

    def start(self, timeout: float = 20.0) -> "GatewayProcess":
        """``spawn``, then ``wait_ready``."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the socket, the TCP and the HTTP listeners accept connections, and the socket is this process's."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"gateway {self.name} exited with code {rc} before it was ready; "
                                   f"argv {self.argv}; log:\n{self.log_tail()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(self.socket)
                # the TCP and HTTP listeners start after the Unix socket: wait for them too
                for port in (self.tcp_port, self.metrics_port):
                    if port:
                        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                # and the socket must be this process's, not another gateway's on the same path
                pid = self.stats(timeout=5.0)["gateway"]["pid"]
                if pid == self.pid:
                    return
                last_error = RuntimeError(f"{self.socket} is served by another gateway (pid {pid})")
            except OSError as e:
                last_error = e
            time.sleep(0.05)
        raise TimeoutError(f"gateway {self.name} did not accept connections on {self.socket} within {timeout} s "
                           f"(last error: {last_error}); log:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, and SIGKILL when it has not exited after ``timeout``; its exit code (None: never spawned)."""
        proc = self.proc
        if proc is None:
            return None
        self.stopped = True
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        return proc.returncode

    def cleanup(self) -> None:
        """``stop``, and remove the temporary socket directory, if one was made."""
        self.stop()
        if self._sockdir is not None:
            shutil.rmtree(self._sockdir, ignore_errors=True)

    def exit_note(self) -> str | None:
        """When it exited on its own (not by ``stop``): which way, with its log's tail; else None."""
        if self.proc is None or self.stopped or self.proc.poll() is None:
            return None
        return f"gateway {self.name} had exited with status {self.proc.returncode}:\n{self.log_tail()}"

    # ---- what it is ------------------------------------------------------------

    def _flag(self, name: str) -> str | None:
        values = self.flags.get(name)
        return values[0] if values else None

    @property
    def tcp_port(self) -> int:
        """The TCP port of its listener (0: no TCP listener)."""
        v = self._flag("--port")
        return int(v) if v is not None else Config().port

    @property
    def metrics_port(self) -> int:
        v = self._flag("--metrics-port")
        return int(v) if v is not None else Config().metrics_port

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip() or "(no output)"
        except OSError:
            return "(no log)"

    # ---- asking it ---------------------------------------------------------------

    def admin(self, **kwargs: Any):
        """An admin client on its socket (no session region)."""
        from kvgate.client import Client

        kwargs.setdefault("timeout", 30.0)
        return Client.connect(self.socket, role="admin", want_shm=False, **kwargs)

    def stats(self, timeout: float = 30.0) -> dict:
        with self.admin(timeout=timeout) as c:
            return c.stats()

    def wait_scanned(self, timeout: float = 10.0) -> dict:
        """Wait until every active card's start-up index scan is done; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if all(c["scanned"] for c in st["cards"] if c["active"]):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"card scan not finished after {timeout} s: {st['cards']}")
            time.sleep(0.05)

    def __repr__(self) -> str:
        return f"<GatewayProcess {self.name} pid={self.proc.pid if self.proc else None} socket={self.socket}>"


class AgentProcess:
    """A ``kvgate cluster serve`` process (this checkout first on PYTHONPATH), its output in a log file."""

    def __init__(self, workdir: str | os.PathLike, name: str, args: list[str]) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.args = [sys.executable, "-m", "kvgate", "cluster", "serve", "--name", name, *args]
        self.log_path = self.workdir / f"agent-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "AgentProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=kvgate_env(),
                                         cwd=self.workdir)
        return self

    def signal(self, sig: int, timeout: float = 15.0) -> int | None:
        """Send ``sig`` and wait for the exit; its status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
