"""A real network filesystem for tests: a directory served by ``sshd`` on a loopback port, mounted with ``sshfs``.

``SshfsMount(workdir).start()`` makes ``workdir/export`` (the storage
host's directory) visible at ``workdir/mnt`` through FUSE and SFTP, with
throwaway keys; ``stop`` unmounts and stops the server.  ``available()``
says why it cannot run here (no ``sshfs``/``sshd``, no ``/dev/fuse``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from kvgate.bench.processes import free_port

SSHD = "/usr/sbin/sshd"


def unavailable() -> str | None:
    """Why an sshfs mount cannot be made here, or None."""
    if shutil.which("sshfs") is None or not os.path.exists(SSHD):
        return "needs sshfs and openssh-server (make test installs them)"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    return None


class SshfsMount:
    def __init__(self, workdir: str | os.PathLike) -> None:
        self.workdir = Path(workdir)
        self.export = self.workdir / "export"
        self.mnt = self.workdir / "mnt"
        self.port = free_port()
        self.sshd: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> "SshfsMount":
        w = self.workdir
        self.export.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        for key in ("hostkey", "userkey"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(w / key)], check=True)
        shutil.copy(w / "userkey.pub", w / "authorized_keys")
        (w / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {w / 'hostkey'}\n"
            f"AuthorizedKeysFile {w / 'authorized_keys'}\nPasswordAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        # -D: in the foreground, a child of ours that a kill ends; -e: its log on stderr
        with open(w / "sshd.log", "ab") as log:
            self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(w / "sshd_config")], stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(["sshfs", "-p", str(self.port), "-o",
                                f"IdentityFile={w / 'userkey'},StrictHostKeyChecking=no,"
                                "UserKnownHostsFile=/dev/null,LogLevel=ERROR",
                                f"{getpass.getuser()}@127.0.0.1:{self.export}", str(self.mnt)],
                               capture_output=True, text=True)
            if r.returncode == 0:
                return self
            if time.monotonic() > deadline or self.sshd.poll() is not None:
                self.stop()
                raise RuntimeError(f"sshfs mount failed: {r.stderr.strip()}; sshd: {self.log()}")
            time.sleep(0.1)  # sshd not listening yet

    def log(self) -> str:
        try:
            return (self.workdir / "sshd.log").read_text(errors="replace")[-1000:]
        except OSError:
            return ""

    def stop(self) -> None:
        subprocess.run(["fusermount", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.send_signal(signal.SIGTERM)
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait(5)
        self.sshd = None
