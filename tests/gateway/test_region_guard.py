"""Which clients' regions the gateway guards: those of a client that could not stop it anyway.

``could_stop_gateway`` is asked of real processes: this one, one of another
user, one in a PID namespace of its own.  What guarding means for a shrunk
region is ``test_shrunk_regions``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from kvgate.gateway.shm import could_stop_gateway
from tests.helpers import kvgate_env

pytestmark = pytest.mark.slow  # real processes

NOBODY = 65534
ROOT = os.geteuid() == 0


def test_a_process_of_our_own_user_in_our_pid_namespace_could_stop_us() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert could_stop_gateway(child.pid, os.geteuid())
        assert could_stop_gateway(os.getpid(), os.geteuid())
    finally:
        child.kill()
        child.wait()


def test_unknown_credentials_are_guarded() -> None:
    assert not could_stop_gateway(None, os.geteuid())
    assert not could_stop_gateway(os.getpid(), None)
    assert not could_stop_gateway(0, os.geteuid())
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not could_stop_gateway(gone.pid, os.geteuid())  # nothing left to look at


def test_another_user_is_guarded() -> None:
    other = NOBODY if os.geteuid() != NOBODY else 1
    assert not could_stop_gateway(os.getpid(), other)


@pytest.mark.skipif(not ROOT or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_process_in_a_pid_namespace_of_its_own_is_guarded_though_root() -> None:
    """A container's root cannot name the gateway's pid, so it could not signal it."""
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "30"])
    try:
        inner = _inner_pid(child)
        assert os.readlink(f"/proc/{inner}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert not could_stop_gateway(inner, 0)
        assert could_stop_gateway(child.pid, 0)  # unshare itself stayed in ours
    finally:
        child.kill()
        child.wait()


def _inner_pid(outer: subprocess.Popen) -> int:
    """The process ``unshare --fork`` started inside its new PID namespace."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = open(f"/proc/{outer.pid}/task/{outer.pid}/children").read().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError("unshare started nothing")


ASK_AS_NOBODY = r"""
import json, sys
from kvgate.gateway.shm import could_stop_gateway
print(json.dumps([could_stop_gateway(int(p), 0) for p in sys.argv[1:]]))
"""


@pytest.mark.skipif(not ROOT or shutil.which("unshare") is None or shutil.which("setpriv") is None,
                    reason="needs root, unshare and setpriv")
def test_a_gateway_that_is_not_root_knows_a_root_peer_of_its_pid_namespace() -> None:
    """A sidecar gateway runs as its own user beside a root engine: it may not read the engine's
    namespace link, so the engine's status (readable by all) tells; one in a namespace below is guarded."""
    here = subprocess.Popen(["sleep", "30"])
    below = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "30"])
    try:
        inner = _inner_pid(below)
        run = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                              sys.executable, "-c", ASK_AS_NOBODY, str(here.pid), str(inner)],
                             env=kvgate_env(), cwd="/", capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == [True, False]
    finally:
        for p in (here, below):
            p.kill()
            p.wait()
