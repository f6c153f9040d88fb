"""Reads an engine on this host waits on run at SCHED_RR in a real gateway, and nothing else
does (`read_priority`, tiers/io.py "Urgent calls"): seen from /proc, per thread of the gateway."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kvgate.client import Client
from kvgate.tiers.io import realtime_permitted
from tests.helpers import free_port

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not realtime_permitted(), reason="SCHED_RR is not permitted here")]

N = 8


def _realtime_threads(pid: int) -> int:
    """Threads of ``pid`` whose scheduling policy is SCHED_RR (field 41 of /proc/<pid>/task/<tid>/stat)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        n += int(fields[38]) == os.SCHED_RR
    return n


def _objects() -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(5)
    return [f"rt-{i}".encode() for i in range(N)], [rng.integers(0, 256, 300_000, dtype=np.uint8) for _ in range(N)]


def test_card_reads_run_at_sched_rr_and_writes_do_not(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"])  # no RAM tier: every get reads the card
    assert gw.stats()["gateway"]["read_priority"] == "realtime"
    keys, vals = _objects()
    with gw.client(namespace="rt") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        assert _realtime_threads(gw.pid) == 0  # start-up scan, writes: normal priority
        got = c.get_many(keys)
        assert all(g is not None and bytes(g) == v.tobytes() for g, v in zip(got, vals))
        assert _realtime_threads(gw.pid) >= 1  # the card threads that served the get


def test_read_priority_normal_runs_everything_at_normal_priority(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0", "--read-priority", "normal"])
    assert gw.stats()["gateway"]["read_priority"] == "normal"
    keys, vals = _objects()
    with gw.client(namespace="rt") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        assert all(g is not None for g in c.get_many(keys))
    assert _realtime_threads(gw.pid) == 0


def test_reads_for_clients_on_other_hosts_stay_at_normal_priority(gateway_factory) -> None:
    """A TCP client is served at normal priority: it must not take the CPU from the engine beside the gateway."""
    port = free_port()
    gw = gateway_factory(["--max-bytes", "0", "--port", str(port)])
    keys, vals = _objects()
    with Client.connect(f"127.0.0.1:{port}", namespace="rt") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        assert c.exists_many(keys) == [True] * N
        got = c.get_many(keys)
        assert all(g is not None and bytes(g) == v.tobytes() for g, v in zip(got, vals))
    assert _realtime_threads(gw.pid) == 0
    with gw.client(namespace="rt") as c:  # the same gateway, over its local socket
        assert all(g is not None for g in c.get_many(keys))
    assert _realtime_threads(gw.pid) >= 1


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops CAP_SYS_NICE with setpriv (root)")
def test_without_cap_sys_nice_reads_run_at_normal_priority_and_the_gateway_says_so(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"], start=False)
    gw.argv = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", *gw.argv]
    gw.start()
    assert gw.stats()["gateway"]["read_priority"] == "normal"
    assert "may not use SCHED_RR" in gw.log()
    keys, vals = _objects()
    with gw.client(namespace="rt") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        got = c.get_many(keys)
        assert all(g is not None and bytes(g) == v.tobytes() for g, v in zip(got, vals))
    assert _realtime_threads(gw.pid) == 0
