"""An etcd member an agent runs as its child, so that the storage and witness hosts are the etcd cluster.

``EtcdMember.run`` starts the real ``etcd`` binary, waits until it answers
(``/health`` on its client URL says it has a leader), starts it again when it
exits (after a pause that doubles up to ``MAX_BACKOFF_S`` while it keeps
failing), and ``stop`` ends it with SIGTERM, then SIGKILL after
``STOP_GRACE_S``.  The child gets SIGTERM too if the agent dies without
stopping it (``PR_SET_PDEATHSIG``): an orphaned member would hold the ports the
agent's next start needs.

``--initial-cluster-state new`` only when the data directory holds no member
yet; a member restarted on its data comes back as the member it was (etcd
ignores the initial flags then).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

log = logging.getLogger("kvgate.cluster.agent")

STOP_GRACE_S: Final = 10.0
MAX_BACKOFF_S: Final = 10.0
STEADY_S: Final = 30.0  # up this long: the next exit restarts it at once again
_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the agent's thread that started it goes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the agent's own stop is the only one


class EtcdMember:
    """One etcd member: its flags, its process, and its supervision (module docstring)."""

    def __init__(self, name: str, peer_url: str, client_url: str, initial_cluster: str,
                 data_dir: str | os.PathLike, token: str = "kvgate", log_level: str = "warn") -> None:
        for flag, url in (("--etcd-peer-url", peer_url), ("--etcd-client-url", client_url)):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(f"{flag} {url!r}: a URL such as http://10.0.0.5:2380 (scheme, host and port)")
        members = dict(m.split("=", 1) for m in initial_cluster.split(",") if "=" in m)
        if members.get(name) != peer_url:
            raise ValueError(f"--etcd-initial-cluster {initial_cluster!r} must list this member as "
                             f"{name}={peer_url} (its --etcd-member and --etcd-peer-url)")
        self.name, self.peer_url, self.client_url = name, peer_url, client_url
        self.initial_cluster = initial_cluster
        self.data_dir = Path(data_dir)
        self.token, self.log_level = token, log_level
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise ValueError("--etcd-member: no etcd binary on PATH (install etcd-server, or leave the member out "
                             "and give --etcd-endpoints)")
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self._stopping = False

    @property
    def endpoint(self) -> str:
        """host:port of its client URL, for an etcd client."""
        parts = urlsplit(self.client_url)
        return f"{parts.hostname}:{parts.port}"

    def args(self) -> list[str]:
        state = "existing" if (self.data_dir / "member").is_dir() else "new"
        return [str(self.binary), "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--log-level", self.log_level]

    async def start(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        args = self.args()
        self.proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                         preexec_fn=_die_with_parent)
        self.starts += 1
        log.info("etcd member %s started (pid %d, %s, initial cluster state %s)", self.name, self.proc.pid,
                 self.client_url, args[args.index("--initial-cluster-state") + 1])

    async def answers(self, timeout: float = 1.0) -> bool:
        """Whether the member says it is healthy (it has a leader): GET /health on its client URL."""
        parts = urlsplit(self.client_url)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
                try:
                    writer.write(f"GET /health HTTP/1.0\r\nHost: {parts.hostname}\r\n\r\n".encode())
                    body = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return False
        return b'"health":"true"' in body

    async def wait_answering(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.returncode is not None:
                return False
            if await self.answers():
                return True
            await asyncio.sleep(0.2)
        return False

    async def run(self, ready_timeout: float = 30.0) -> None:
        """Keep the member running until cancelled (``stop`` ends the process)."""
        backoff = 0.5
        while not self._stopping:
            await self.start()
            started = time.monotonic()
            if await self.wait_answering(ready_timeout):
                log.info("etcd member %s answers (%.1f s after its start)", self.name, time.monotonic() - started)
            elif self.proc is not None and self.proc.returncode is None:
                log.warning("etcd member %s does not answer %.0f s after its start (the other members of "
                            "--etcd-initial-cluster not up yet?): waiting on it", self.name, ready_timeout)
            assert self.proc is not None
            rc = await self.proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started > STEADY_S:
                backoff = 0.5
            log.warning("etcd member %s exited with %s: starting it again in %.1f s (its log is the agent's "
                        "output)", self.name, rc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
        self._stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await proc.wait()
        except TimeoutError:
            log.warning("etcd member %s did not stop within %.0f s of SIGTERM: SIGKILL", self.name, STOP_GRACE_S)
            proc.kill()
            await proc.wait()
        # etcd hands its leadership over before it exits (1.9 s measured for a leader of three, 2.0 s for a
        # member without quorum): the figure says where an agent's slow stop went.
        log.info("etcd member %s stopped %.1f s after SIGTERM", self.name, time.monotonic() - sent)
