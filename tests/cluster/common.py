"""Cluster test support: real ``etcd`` members (free loopback ports, real signals), real agents, labelled cards."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from kvgate.bench.processes import free_port
from kvgate.cards import DirectoryCard
from kvgate.cluster.registry import CardRecord, CardState
from tests.processes import AgentProcess, freeze  # noqa: F401 - cluster tests import them from here

ETCD = shutil.which("etcd")


class EtcdServer:
    """One etcd member in ``workdir`` (by default a cluster of its own); ``start`` returns once it listens on
    its client port (a member of several answers once a quorum is up)."""

    def __init__(self, workdir: str | os.PathLike, name: str = "kvgate-test") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.peer_port = free_port()
        self.initial_cluster = f"{name}=http://127.0.0.1:{self.peer_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0, *, healthy: bool = True) -> "EtcdServer":
        """Start the member; with ``healthy``, return once it answers ``/health`` (it has a leader), else
        once its client port accepts connections.  A member alone needs ``healthy``: on a busy machine its
        port accepts well before its gRPC server answers, and a first call then times out."""
        assert ETCD is not None, "etcd is not installed (make test installs etcd-server)"
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        args = [ETCD, "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster, "--log-level", "warn"]
        with open(self.workdir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.listening():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd on port {self.port} did not listen: {self.log()}")
            time.sleep(0.02)
        if healthy:
            self.wait_healthy(max(0.0, deadline - time.monotonic()))
        return self

    def wait_healthy(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd on port {self.port} is not healthy after {timeout:.0f} s: {self.log()}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1.0) as r:
                return b'"health":"true"' in r.read()
        except (OSError, ValueError):
            return False

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: etcd is there and answers nothing (a partition, as a client sees it)."""
        assert self.proc is not None
        freeze(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        try:
            return (self.workdir / "etcd.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


class EtcdCluster:
    """``n`` etcd members on loopback ports, each an ``EtcdServer`` that can be killed and started again."""

    def __init__(self, workdir: str | os.PathLike, n: int = 3) -> None:
        self.members = [EtcdServer(Path(workdir) / f"m{i}", name=f"m{i}") for i in range(n)]
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> "EtcdCluster":
        for m in self.members:  # a member alone has no quorum: all listen first, then each has a leader
            m.start(healthy=False)
        for m in self.members:
            m.wait_healthy()
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def labelled_card(path: Path) -> CardRecord:
    """A new directory card at ``path``, labelled, as the registry would record it (active)."""
    path.mkdir()
    card = DirectoryCard(str(path))
    serial = card.open()
    card.close()
    return CardRecord(serial=serial, kind="directory", address=str(path), state=CardState.ACTIVE)
