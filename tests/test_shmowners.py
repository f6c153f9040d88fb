"""Owned /dev/shm files (``kvgate.shmowners``): removed once their owner process is gone, never before,
never another namespace's, never on the word of another user's file.  Real processes, real /dev/shm."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from kvgate import shmowners
from kvgate.shmowners import SHM_DIR, create_owned, owned_files, owned_name, parse_owned, reap_dead_owners
from tests.helpers import kvgate_env


@pytest.fixture
def kind():
    """A kind of its own for each test, and whatever of it is left removed afterwards."""
    k = f"t{secrets.token_hex(4)}"
    yield k
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"kvgate-{k}.") or name.startswith(f"{k}-engine-"):
            os.unlink(os.path.join(SHM_DIR, name))


# A process that owns a file and an engine-named file beside it, then waits for a line on stdin.
OWNER = textwrap.dedent("""
    import os, sys
    from kvgate.shmowners import create_owned
    kind = sys.argv[1]
    engine_file = os.path.join("/dev/shm", f"{kind}-engine-{os.getpid()}")
    with open(engine_file, "wb") as f:
        f.write(b"x" * 4096)
    print(create_owned(kind, os.path.basename(engine_file)), engine_file, flush=True)
    sys.stdin.readline()
""")


def start_owner(kind: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=kvgate_env())
    mark, engine_file = proc.stdout.readline().split()
    return proc, mark, engine_file


def engine_files(f: shmowners.OwnedFile) -> list[str]:
    return [f.rest]


@pytest.mark.slow  # runs owner processes
def test_a_dead_owners_files_go_and_a_live_ones_stay(kind) -> None:
    live, live_mark, live_file = start_owner(kind)
    dead, dead_mark, dead_file = start_owner(kind)
    killed, killed_mark, killed_file = start_owner(kind)
    try:
        dead.stdin.write("\n")
        dead.stdin.flush()
        assert dead.wait(10) == 0
        killed.kill()  # SIGKILL: nothing of its own cleanup runs
        killed.wait(10)
        assert {f.pid for f in owned_files(kind)} == {live.pid, dead.pid, killed.pid}
        removed = reap_dead_owners(kind, engine_files)
        assert sorted(removed) == sorted([dead_mark, dead_file, killed_mark, killed_file])
        for path in (dead_mark, dead_file, killed_mark, killed_file):
            assert not os.path.exists(path)
        assert os.path.exists(live_mark) and os.path.exists(live_file)
        assert reap_dead_owners(kind, engine_files) == []
    finally:
        live.kill()
        live.wait(10)
    assert sorted(reap_dead_owners(kind, engine_files)) == sorted([live_mark, live_file])


def test_a_reused_pid_is_not_the_owner_and_another_namespace_is_not_judged(kind) -> None:
    # Our own pid with another start time: the process that made it is gone (the pid was reused).
    pid, start, ns, _ = parse_owned(owned_name(kind, "x"), kind)
    reused = os.path.join(SHM_DIR, f"kvgate-{kind}.{pid}.{start + 1}.{ns}.{kind}-engine-reused")
    other_ns = os.path.join(SHM_DIR, f"kvgate-{kind}.999999.1.{ns + 1}.{kind}-engine-other-ns")
    for path in (reused, other_ns, os.path.join(SHM_DIR, f"{kind}-engine-reused"),
                 os.path.join(SHM_DIR, f"{kind}-engine-other-ns")):
        open(path, "wb").close()
    mine = create_owned(kind, f"{kind}-engine-mine")
    open(os.path.join(SHM_DIR, f"{kind}-engine-mine"), "wb").close()
    removed = reap_dead_owners(kind, engine_files)
    assert sorted(removed) == sorted([reused, os.path.join(SHM_DIR, f"{kind}-engine-reused")])
    assert os.path.exists(other_ns) and os.path.exists(os.path.join(SHM_DIR, f"{kind}-engine-other-ns"))
    assert os.path.exists(mine) and os.path.exists(os.path.join(SHM_DIR, f"{kind}-engine-mine"))


@pytest.mark.slow  # runs a process as another user
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as uid 65534")
def test_another_users_file_cannot_make_us_remove_ours(kind) -> None:
    # uid 65534 plants an owned-looking file of a dead pid that names one of our engine files.
    ours = os.path.join(SHM_DIR, f"{kind}-engine-victim")
    with open(ours, "wb") as f:
        f.write(b"kv" * 100)
    _, _, ns, _ = parse_owned(owned_name(kind, "x"), kind)
    planted = os.path.join(SHM_DIR, f"kvgate-{kind}.999999.1.{ns}.{kind}-engine-victim")
    code = f"import os; os.setgid(65534); os.setuid(65534); open({planted!r}, 'wb').close()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert os.stat(planted).st_uid == 65534
    assert owned_files(kind) == [] and reap_dead_owners(kind, engine_files) == []
    assert os.path.exists(ours) and os.path.exists(planted)


def test_names_say_kind_owner_and_rest_and_refuse_what_would_break_them(kind) -> None:
    name = owned_name(kind, "vllm_offload_a-b.c.mmap")
    pid, start, ns, rest = parse_owned(name, kind)
    assert pid == os.getpid() and rest == "vllm_offload_a-b.c.mmap" and start > 0 and ns > 0
    assert parse_owned(name, kind + "x") is None and parse_owned(f"kvgate-{kind}.1.2.x", kind) is None
    assert parse_owned(f"kvgate-{os.getpid()}-4-abcdef", kind) is None  # a gateway session region
    for bad_kind in ("", "a.b", "1x", "a-b"):
        with pytest.raises(ValueError, match="kind"):
            owned_name(bad_kind, "x")
    with pytest.raises(ValueError, match="'/'"):
        owned_name(kind, "../etc")


def test_without_proc_a_name_is_still_made_and_never_judged(monkeypatch) -> None:
    """A process that cannot read /proc (none mounted, a sandbox) still names its files, with 0 for
    what /proc would have said, and no file is judged dead from there or made so."""
    import kvgate.shmowners as so

    real_stat = os.stat

    def no_proc(path, *a, **kw):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_stat(path, *a, **kw)

    real_open = open

    def no_proc_open(path, *a, **kw):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(so.os, "stat", no_proc)
    monkeypatch.setattr("builtins.open", no_proc_open)
    name = so.owned_name("blindtest", "x")
    assert name == f"kvgate-blindtest.{os.getpid()}.0.0.x"
    pid, start, ns, rest = so.parse_owned(name, "blindtest")
    assert so.owner_gone(so.OwnedFile("/dev/shm/" + name, "blindtest", pid, start, ns, rest)) is None
    monkeypatch.undo()
    # and a file named so is never judged by a process that can read /proc either
    assert so.owner_gone(so.OwnedFile("/dev/shm/" + name, "blindtest", 999999, 0, 0, "x")) is None
