"""Files under /dev/shm that belong to one process, named so that a later process can tell its owner is gone.

Engines leave shared memory behind whenever they die without their own cleanup (SIGKILL, an OOM
kill, ``vllm serve`` force-killing its engine core at every Ctrl-C), and restarts are kvgate's whole
workflow: each leftover holds its size in RAM until reboot.  A file is *owned* when its name says
which process made it::

    kvgate-<kind>.<pid>.<start>.<pidns>.<rest>

``start`` is the process's start time (clock ticks since boot, ``/proc/<pid>/stat``), so a reused
pid is not mistaken for the owner; ``pidns`` is the inode of the owner's PID namespace, so a
process in another namespace (a container sharing ``/dev/shm``) never judges a pid it cannot see.
Where /proc does not tell them (none mounted, a sandbox), both are 0 and the file is never judged.
``reap_dead_owners`` removes the files of one kind whose owner is gone, and with each the files an
engine made under names of its own that the owned file stands for (``companions``: vLLM names its
CPU tier ``vllm_offload_<engine id>.mmap``, so kvgate's vLLM integration keeps an empty owned file
naming that engine id beside it).

Used by the engine integrations and by the gateway for its session regions (kind ``region``).
Standard library only, below every other kvgate layer.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Callable, Iterable

SHM_DIR = "/dev/shm"
_PREFIX = "kvgate-"


@dataclass(frozen=True)
class OwnedFile:
    """One owned file found under the directory: its path and what its name says."""

    path: str
    kind: str
    pid: int
    start: int
    pidns: int
    rest: str


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it start past the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[19])  # field 22 of stat(5)


def _pid_namespace() -> int:
    """The inode of this process's PID namespace, or 0 where /proc does not tell (then no owner is judged)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owned_name(kind: str, rest: str) -> str:
    """The name of a file this process owns: ``kvgate-<kind>.<pid>.<start>.<pidns>.<rest>``.

    ``kind`` (letters, digits, ``_``) groups the files one reaper looks after; ``rest`` is free
    (no ``/``), e.g. an engine id."""
    if not kind or not kind.replace("_", "").isalnum() or kind[0].isdigit():
        raise ValueError(f"owned file kind {kind!r}: letters, digits and _, not starting with a digit")
    if "/" in rest or "\0" in rest:
        raise ValueError(f"owned file name part {rest!r} may not contain '/'")
    pid = os.getpid()
    return f"{_PREFIX}{kind}.{pid}.{_start_time(pid) or 0}.{_pid_namespace()}.{rest}"


def create_owned(kind: str, rest: str, shm_dir: str = SHM_DIR) -> str:
    """Create an empty owned file (mode 0600) and return its path; an existing one is kept."""
    path = os.path.join(shm_dir, owned_name(kind, rest))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    return path


def parse_owned(name: str, kind: str) -> tuple[int, int, int, str] | None:
    """(pid, start, pidns, rest) of an owned file's name of ``kind``, or None for any other name."""
    head = f"{_PREFIX}{kind}."
    if not name.startswith(head):
        return None
    parts = name[len(head):].split(".", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]


def owner_gone(f: OwnedFile) -> bool | None:
    """True when the owner process has exited, False while it runs, None when this process cannot tell
    (the owner lived in another PID namespace, or /proc did not tell its namespace or start)."""
    ours = _pid_namespace()
    if not ours or f.pidns != ours or not f.start:
        return None
    return _start_time(f.pid) != f.start


def _ours(path: str) -> bool:
    """A regular file (not a link) of this process's user: only those are judged or removed, so a file
    another user planted cannot make us remove one of our own."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def owned_files(kind: str, shm_dir: str = SHM_DIR) -> list[OwnedFile]:
    """Every owned file of ``kind`` under ``shm_dir`` that belongs to this process's user."""
    found = []
    for name in sorted(os.listdir(shm_dir)):
        parsed = parse_owned(name, kind)
        path = os.path.join(shm_dir, name)
        if parsed is not None and _ours(path):
            found.append(OwnedFile(path, kind, *parsed))
    return found


def reap_dead_owners(kind: str, companions: Callable[[OwnedFile], Iterable[str]] | None = None,
                     shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the owned files of ``kind`` whose owner is gone, each after the files it stands for.

    ``companions(f)``: names (no ``/``) of files under ``shm_dir`` that the dead owner leaves behind
    under names of their own; each is removed when it is a regular file of this user.  Files of
    owners alive, or in another PID namespace, stay.  Returns the paths removed.  Best effort: a file
    that cannot be removed (gone already, or not ours) is skipped.  Cost: one directory listing and a
    ``/proc`` read per owned file; call it at start, not on a request's path.
    """
    removed: list[str] = []
    for f in owned_files(kind, shm_dir):
        if owner_gone(f) is not True:
            continue
        names = [] if companions is None else list(companions(f))
        for name in names:
            if "/" in name or not name:
                continue
            path = os.path.join(shm_dir, name)
            if _ours(path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
        try:
            os.unlink(f.path)
            removed.append(f.path)
        except OSError:
            pass
    return removed
