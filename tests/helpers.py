"""Real gateway processes for end-to-end tests.

``GatewayProcess`` runs ``python -m kvgate serve ...`` with PYTHONPATH set to
this checkout's ``src``, captures its stderr in a file, and waits until its
Unix socket accepts a connection.  The ``gateway_factory`` fixture in
``tests/conftest.py`` starts them and always stops them at teardown.

    gw = GatewayProcess(tmp_path, ["--max-bytes", "128M"]).start()
    with gw.client("ns") as c: ...
    gw.kill(signal.SIGKILL); gw.log()
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
SRC = str(REPO / "src")

# Small, fast defaults: no TCP or HTTP listener, a small RAM tier and small
# per-session shared-memory regions (each local engine session fallocates one).
DEFAULT_FLAGS: dict[str, list[str]] = {
    "--max-bytes": ["64M"],
    "--port": ["0"],
    "--metrics-port": ["0"],
    "--card-capacity": ["1G"],
    "--shared-memory-size": ["8M"],
    "--thread-pool-size": ["2"],
}

_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes; keep a margin


def kvgate_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def venv_python(venv: str) -> Path:
    """The interpreter of one of the engine venvs the Makefile builds (``.venv-vllm``, ``.venv-sglang``...)."""
    return REPO / venv / "bin" / "python"


def run_json_script(python: Path, script: Path, args: Sequence[str | os.PathLike], out: Path, *,
                    env: dict[str, str] | None = None, timeout: float = 240,
                    cwd: str | os.PathLike | None = None) -> dict:
    """Run ``script`` under another venv's ``python`` (this checkout's ``src`` first on its path); it writes
    its findings as JSON to ``out``, returned with its stderr under ``"log"``.  A failed run fails the test
    with the script's output."""
    proc = subprocess.run([str(python), str(script), *map(str, args)], capture_output=True, text=True,
                          env=kvgate_env(env), timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, (f"{Path(script).name} {' '.join(map(str, args))} failed (rc {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(Path(out).read_text()) | {"log": proc.stderr}


def run_plan(python: Path, script: Path, workdir: Path, name: str, plan: dict, **kw) -> dict:
    """``run_json_script`` with a JSON plan file as its one argument; the plan's ``"out"`` is set here."""
    plan = {**plan, "out": str(workdir / f"{name}.json")}
    path = workdir / f"{name}.plan.json"
    path.write_text(json.dumps(plan))
    return run_json_script(python, script, [path], Path(plan["out"]), cwd=workdir, **kw)


def run_kvgate(*args: str, timeout: float = 30.0, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a ``kvgate`` CLI command to completion (stat, clean, fingerprint, serve that must fail...)."""
    return subprocess.run([sys.executable, "-m", "kvgate", *args], env=kvgate_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _is_redis(location: str) -> bool:
    return location.startswith(("redis://", "rediss://", "unix://"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag_groups(args: Sequence[str]) -> list[tuple[str, list[str]]]:
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


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class GatewayProcess:
    """One ``kvgate serve`` process.

    ``workdir``: where the card (``card`` unless given), the log and (when the
    path is short enough) the socket live.  ``args``: extra ``serve`` flags;
    a flag given here replaces the default of the same name.
    ``create_cards``: ``start`` creates the directories of the plain
    ``--storage-devices`` paths first (a gateway creates no configured card
    directory itself); off, a test sees what a missing one does.
    """

    _count = 0

    def __init__(self, workdir: str | os.PathLike, args: Sequence[str] = (), *, card: str | os.PathLike | None = None,
                 socket_path: str | os.PathLike | None = None, defaults: bool = True, name: str | None = None,
                 create_cards: bool = True):
        GatewayProcess._count += 1
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name or f"gw{GatewayProcess._count}"
        self._sockdir: str | None = None
        if socket_path is None:
            socket_path = self.workdir / f"{self.name}.sock"
            if len(str(socket_path)) > _SUN_PATH_MAX:
                self._sockdir = tempfile.mkdtemp(prefix="kvg-", dir="/tmp")
                socket_path = Path(self._sockdir) / f"{self.name}.sock"
        self.socket = str(socket_path)
        self.card = str(card if card is not None else self.workdir / "card")
        flags: dict[str, list[str]] = dict(DEFAULT_FLAGS) if defaults else {}
        flags["--storage-devices"] = [self.card]
        flags["--socket"] = [self.socket]
        for flag, values in _flag_groups(list(args)):
            flags[flag] = values
        if "--storage-devices" in flags:
            self.card = flags["--storage-devices"][0]
        self.card_dirs = [p for p in flags.get("--storage-devices", []) if not _is_redis(p) and not glob.has_magic(p)]
        self.create_cards = create_cards
        self.argv = [sys.executable, "-m", "kvgate", "serve"] + [x for f, v in flags.items() for x in (f, *v)]
        self.log_path = self.workdir / f"{self.name}.stderr.log"
        self.out_path = self.workdir / f"{self.name}.stdout.log"
        self.proc: subprocess.Popen | None = None
        self._shm_files: set[str] = set()

    # ---- life cycle ------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> "GatewayProcess":
        if self.create_cards:
            for d in self.card_dirs:
                (self.workdir / d).mkdir(parents=True, exist_ok=True)  # relative paths: the gateway's cwd
        with open(self.log_path, "ab") as err, open(self.out_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=kvgate_env(), stdout=out, stderr=err,
                                         cwd=str(self.workdir), start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"gateway {self.name} exited with code {rc} before it was ready; "
                                   f"argv {self.argv}; stderr:\n{self.log()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(self.socket)
                # the TCP and HTTP listeners start after the Unix socket: wait for them too
                for port in (self.tcp_port, self.metrics_port):
                    if port:
                        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                # and the socket must be this process's, not another gateway's on the same path
                with self.admin(timeout=5.0) as c:
                    pid = c.stats()["gateway"]["pid"]
                if pid == self.pid:
                    return
                last_error = RuntimeError(f"{self.socket} is served by another gateway (pid {pid})")
            except OSError as e:
                last_error = e
            time.sleep(0.05)
        raise TimeoutError(f"gateway {self.name} did not accept connections on {self.socket} within {timeout} s "
                           f"(last error: {last_error}); stderr:\n{self.log()}")

    def _flag(self, name: str) -> str | None:
        if name in self.argv:
            i = self.argv.index(name)
            return self.argv[i + 1] if i + 1 < len(self.argv) else None
        return None

    @property
    def tcp_port(self) -> int:
        """The TCP port given with --port (0: no TCP listener)."""
        v = self._flag("--port")
        return int(v) if v is not None else 5557

    @property
    def metrics_port(self) -> int:
        v = self._flag("--metrics-port")
        return int(v) if v is not None else 9557

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> int | None:
        """Send ``sig``; for SIGKILL/SIGTERM wait for the exit and return the exit code."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self._note_shm()
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                return self.proc.wait(timeout)
            finally:
                self._reap_shm()
        return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit in time); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._note_shm()
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
            self._reap_shm()
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        if self._sockdir is not None:
            try:
                for p in Path(self._sockdir).iterdir():
                    p.unlink()
                os.rmdir(self._sockdir)
            except OSError:
                pass

    def _note_shm(self) -> None:
        """Remember the session regions this process has mapped (a killed gateway leaves them)."""
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/kvgate-"):
                        self._shm_files.add(path.replace(" (deleted)", ""))
        except OSError:
            pass

    def _reap_shm(self) -> None:
        for path in self._shm_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._shm_files.clear()

    # ---- helpers ---------------------------------------------------------------

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, namespace: str = "test-ns", **kwargs):
        from kvgate.client import Client

        kwargs.setdefault("timeout", 30.0)
        return Client.connect(self.socket, namespace=namespace, **kwargs)

    def admin(self, **kwargs):
        from kvgate.client import Client

        kwargs.setdefault("timeout", 30.0)
        return Client.connect(self.socket, role="admin", want_shm=False, **kwargs)

    def stats(self) -> dict:
        with self.admin() as c:
            return c.stats()

    def ram_sets(self) -> int:
        """Objects stored into its RAM tier so far (engine stores are asynchronous: tests wait on this)."""
        return int(self.stats()["tiers"]["ram"]["sets"])

    def wait_ram_sets(self, n: int, timeout: float = 60.0) -> int:
        """Wait until at least ``n`` objects were stored (or ``timeout``); returns the count."""
        deadline = time.monotonic() + timeout
        while (sets := self.ram_sets()) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return sets

    def wait_scanned(self, timeout: float = 10.0) -> dict:
        """Wait until every active card's startup index scan is done; returns the stats."""
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


# ---- the page cache ---------------------------------------------------------------------


def evict(path: str | os.PathLike) -> None:
    """Push a file out of the page cache (no root needed: it is clean once synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pages_cached(path: str | os.PathLike) -> int | None:
    """Pages of the file in the page cache; None where the kernel cannot say (no cachestat)."""
    from kvgate.cards.directio import cached_pages

    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd)
    finally:
        os.close(fd)


def as_newer_format(obj: bytes, full_key: bytes) -> bytes:
    """``obj`` (a whole stored object) as a newer kvgate would write it: the format
    version one up, the header hash recomputed, so the header is whole."""
    import struct

    import xxhash

    from kvgate.cards.objectformat import FIXED_SIZE, VERSION

    out = bytearray(obj)
    struct.pack_into("<H", out, 4, VERSION + 1)
    struct.pack_into("<Q", out, FIXED_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(out[: FIXED_SIZE - 8]) + full_key))
    return bytes(out)
