"""Which clients' regions the gateway guards: those of a client that could not stop it anyway.

``could_stop_gateway`` is asked of real processes: this one, one of another
user, one in a PID namespace of its own.  What guarding means for a shrunk
region is ``test_shrunk_regions``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from kvgate.gateway.shm import could_stop_gateway

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
        deadline = time.monotonic() + 10
        inner = None
        while inner is None and time.monotonic() < deadline:  # the sleep, forked inside the namespace
            kids = open(f"/proc/{child.pid}/task/{child.pid}/children").read().split()
            inner = int(kids[0]) if kids else None
            time.sleep(0.05)
        assert inner is not None
        assert os.readlink(f"/proc/{inner}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert not could_stop_gateway(inner, 0)
        assert could_stop_gateway(child.pid, 0)  # unshare itself stayed in ours
    finally:
        child.kill()
        child.wait()
