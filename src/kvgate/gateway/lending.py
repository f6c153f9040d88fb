"""The gateway's side of cross-memory reads: may its own user's processes read its memory?

A local client of the gateway's user reads a get's bytes straight out of the
gateway's memory (``process_vm_readv``, ``pidfd_getfd``: kvgate.client.crossmem).
Linux allows that where the reader could ptrace the gateway: the same user,
and, where Yama's ``ptrace_scope`` is 1, a target that named it its tracer.
``allow_readers`` runs once at start; what it did is logged.  Sessions are
lent objects only where ``supported`` and only for the gateway's own user
(``Sessions``), so what they can read is what they could read anyway.
"""

from __future__ import annotations

import ctypes
import os
import sys

from kvgate.memcopy import syscall

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"

supported = sys.platform.startswith("linux") and syscall("process_vm_readv") is not None
try:
    _libc = ctypes.CDLL(None, use_errno=True) if supported else None
except OSError:
    _libc = None


def ptrace_scope() -> int | None:
    """Yama's ``ptrace_scope`` (None where Yama is not in the kernel)."""
    try:
        with open(_YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_readers() -> str:
    """Let the processes of our user read our memory where Yama would keep them out (scope 1); what was
    done, for the log."""
    scope = ptrace_scope()
    if scope is None or scope == 0:
        return "allowed by the kernel's rules (same user)"
    if scope >= 2 or _libc is None:
        return f"not possible: Yama ptrace_scope is {scope} (clients copy through their session region)"
    if _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        return f"not possible: prctl(PR_SET_PTRACER) failed: {os.strerror(e)}"
    return "allowed: Yama ptrace_scope is 1, so this gateway named its user's processes its tracers"
