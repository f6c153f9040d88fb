"""What a crash leaves on a card is cleared, and counted, by the next start.

A write killed before its rename leaves a temp file; the start-up scan
removes it at once when the writer is known dead (a card held exclusively:
every writer but this gateway is; a shared card: this host's dead pids), and
keeps the age rule only for other hosts' temp files.  Objects with a broken
header or a truncated file are deleted and counted in
``kvgate_corrupt_objects_total``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvgate.cards.base import HOST_TAG
from kvgate.cards.directory.scan import STALE_TEMP_SECONDS
from tests.helpers import GatewayProcess, wait_until


def dead_pid() -> int:
    """A pid that ran here a moment ago and has exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def object_files(card: Path) -> list[Path]:
    return sorted(p for p in card.glob("db*/*/*") if ".tmp." not in p.name)


def leave_temp(next_to: Path, owner: str, age_s: float = 0.0) -> Path:
    """A temp file as a write killed before its rename leaves it: partial bytes, the writer in its name."""
    tmp = next_to.with_name(f"{next_to.name}.tmp.{owner}")
    tmp.write_bytes(b"\0" * 4096 + b"partial payload")
    if age_s:
        t = time.time() - age_s
        os.utime(tmp, (t, t))
    return tmp


def wait_gone(paths: list[Path], gw: GatewayProcess, timeout: float = 10.0) -> None:
    wait_until(lambda: not any(p.exists() for p in paths), timeout,
               lambda: f"left on the card: {[p.name for p in paths if p.exists()]}\n{gw.log()}")


def fill(gw: GatewayProcess, n: int) -> list[bytes]:
    keys = [f"k{i}".encode() for i in range(n)]
    with gw.client("ns") as c:
        assert c.put_many(keys, [np.full(8192, i, dtype=np.uint8) for i in range(n)]) == [True] * n
    return keys


def test_temp_files_of_a_killed_gateway_are_gone_after_an_exclusive_restart(gateway_factory, tmp_path) -> None:
    gw = gateway_factory(name="first")
    fill(gw, 4)
    gw.kill(signal.SIGKILL)
    card = Path(gw.card)
    objs = object_files(card)
    left = [
        leave_temp(objs[0], f"{HOST_TAG}.{dead_pid()}.140000000000001"),  # this host, the writer is dead
        leave_temp(objs[1], f"{HOST_TAG}.{os.getpid()}.140000000000002"),  # this host, a pid that runs
        leave_temp(objs[2], "0badc0de-0badc0de.4242.140000000000003"),  # another host, fresh
        leave_temp(objs[3], "4242.140000000000004"),  # named as before host tags
    ]
    again = gateway_factory(["--storage-devices", gw.card], name="again")
    wait_gone(left, again)  # alone on the card: no write in progress is anyone else's
    again.wait_scanned()
    assert again.stats()["cards"][0]["objects"] == 4
    assert again.stats()["corrupt_objects"] == 0


def test_a_shared_gateway_removes_only_temp_files_known_dead(gateway_factory, tmp_path) -> None:
    shared = ["--shared-storage", "true"]
    gw = gateway_factory(shared, name="first")
    fill(gw, 5)
    gw.kill(signal.SIGKILL)
    objs = object_files(Path(gw.card))
    dead = [
        leave_temp(objs[0], f"{HOST_TAG}.{dead_pid()}.140000000000001"),
        leave_temp(objs[1], f"{HOST_TAG[:8]}-00000000.{os.getpid()}.140000000000002"),  # this host, earlier boot
        leave_temp(objs[2], "0badc0de-0badc0de.4242.140000000000003", age_s=STALE_TEMP_SECONDS + 60),
    ]
    alive = [
        leave_temp(objs[3], f"{HOST_TAG}.{os.getpid()}.140000000000004"),  # a writer that runs (this test)
        leave_temp(objs[4], "0badc0de-0badc0de.4242.140000000000005"),  # another host's, may be writing now
    ]
    again = gateway_factory(["--storage-devices", gw.card, *shared], name="again")
    wait_gone(dead, again)
    again.wait_scanned()
    assert all(p.exists() for p in alive)


def test_corrupt_and_truncated_objects_found_by_the_scan_are_counted(gateway_factory, tmp_path) -> None:
    gw = gateway_factory(name="first")
    fill(gw, 6)
    gw.stop()
    # Without an index snapshot the scan reads every header (with one, each object's first read checks it:
    # tests/tiers/test_restart.py).
    (Path(gw.card) / "kvgate-index").unlink()
    objs = object_files(Path(gw.card))
    assert len(objs) == 6
    with open(objs[0], "r+b") as f:  # a flipped bit in the header
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0x10]))
    os.truncate(objs[1], os.path.getsize(objs[1]) - 100)  # a torn file
    os.truncate(objs[2], 10)  # not even a header
    again = gateway_factory(["--storage-devices", gw.card, "--metrics-port", "0"], name="again")
    st = again.wait_scanned()
    assert st["cards"][0]["objects"] == 3
    assert st["corrupt_objects"] == 3
    assert not any(p.exists() for p in objs[:3])
    assert "deleted 3 corrupt objects" in again.log()


def test_session_regions_of_a_killed_gateway_are_removed_at_the_next_start_and_no_others(gateway_factory) -> None:
    """A SIGKILLed gateway leaves its session regions in /dev/shm; the next gateway removes them, but
    never a region whose owner runs, nor one of a gateway in another PID namespace (a pid it cannot see
    is not a dead one)."""
    from kvgate import shmowners
    from kvgate.gateway.shm import REGION_KIND

    gw = gateway_factory(name="first")
    with gw.client("ns"):
        (region,) = [f.path for f in shmowners.owned_files(REGION_KIND) if f.pid == gw.pid]
        os.kill(gw.pid, signal.SIGKILL)  # the helper's own clean-up of killed gateways is not called
        gw.proc.wait(10)
    assert os.path.exists(region)
    alive = shmowners.create_owned(REGION_KIND, "alive-test")  # ours: this process runs
    ns = os.stat("/proc/self/ns/pid").st_ino
    elsewhere = os.path.join(shmowners.SHM_DIR, f"kvgate-{REGION_KIND}.{dead_pid()}.1.{ns + 1}.elsewhere-test")
    Path(elsewhere).touch(mode=0o600)
    try:
        again = gateway_factory(["--storage-devices", gw.card], name="again")
        assert not os.path.exists(region)
        assert os.path.exists(alive) and os.path.exists(elsewhere)
        assert "removed 1 shared-memory regions left by gateways that died" in again.log()
    finally:
        for p in (alive, elsewhere, region):
            Path(p).unlink(missing_ok=True)
