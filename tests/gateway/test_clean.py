"""Who may clean what, against a real gateway: an engine its own namespace, an admin on the Unix socket any.

Objects go to the RAM tier and the card; a namespace's clean must take them
from both (a restart on the same card, RAM empty, still finds none), leave
every other namespace's (one whose name starts with the cleaned one's too),
and the log must say who asked.
"""

from __future__ import annotations

import re

import pytest

from kvgate.client import Client, GatewayError
from tests.helpers import free_port, run_kvgate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

A, B, AB = "clean-a", "clean-b", "clean-a-longer"  # AB starts with A's name: its keys must stay
N_A = 1500  # past one delete batch of a card (tiers.card.CLEAN_BATCH)


def _keys(ns: str, n: int) -> list[bytes]:
    return [f"{ns}/{i}".encode() for i in range(n)]


def _fill(gw) -> None:
    for ns, n in ((A, N_A), (B, 20), (AB, 20)):
        with gw.client(ns, engine_id="engine") as c:
            keys = _keys(ns, n)
            assert c.put_many(keys, [k * 3 for k in keys]) == [True] * n


def _present(gw, ns: str, n: int) -> int:
    with gw.client(ns, engine_id="engine") as c:
        keys = _keys(ns, n)
        got = c.get_many(keys)
        assert all(g is None or g == k * 3 for g, k in zip(got, keys))
        return sum(g is not None for g in got)


def test_an_engine_cleans_only_its_own_namespace(gateway_factory, tmp_path) -> None:
    port = free_port()
    gw = gateway_factory(["--port", str(port)])
    _fill(gw)
    with gw.client(A, engine_id="engine") as c:
        with pytest.raises(GatewayError) as ei:
            c.clean(B)
        assert ei.value.code == "NOT_AUTHORIZED" and "own namespace" in ei.value.message
        assert c.clean(A) == N_A  # its own, named
    with gw.client(A, engine_id="engine") as c:
        assert c.clean() == 0  # nothing left of it
    assert _present(gw, A, N_A) == 0 and _present(gw, B, 20) == 20 and _present(gw, AB, 20) == 20
    assert gw.stats()["cards"][0]["objects"] == 40
    log = gw.log()
    assert re.search(rf"clean: session \d+ \(engine, pid \d+ uid 0, Unix socket, namespace '{A}'\) cleaned "
                     rf"namespace '{A}': deleted {N_A} objects from cards, dropped \d+ from RAM", log), log
    assert "clean refused: session" in log and f"asked to clean namespace '{B}'" in log

    # the card holds none of A's either: a restart on it (RAM empty) finds B's and AB's only
    assert gw.stop() == 0
    gw = gateway_factory(["--port", str(port)], card=gw.card, name="again")
    assert gw.stats()["tiers"]["ram"]["objects"] == 0
    assert _present(gw, A, N_A) == 0 and _present(gw, B, 20) == 20 and _present(gw, AB, 20) == 20


def test_every_namespace_is_an_admin_session_on_the_unix_socket(gateway_factory) -> None:
    port = free_port()
    gw = gateway_factory(["--port", str(port)])
    _fill(gw)
    # over TCP an admin session may look, not clean (all, or one namespace)
    with Client.connect(f"127.0.0.1:{port}", role="admin", want_shm=False, timeout=30) as admin:
        for ns in (None, B):
            with pytest.raises(GatewayError) as ei:
                admin.clean(ns)
            assert ei.value.code == "NOT_AUTHORIZED" and "Unix socket" in ei.value.message
        assert admin.stats()["cards"][0]["objects"] == N_A + 40
    r = run_kvgate("clean", "--address", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "NOT_AUTHORIZED" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # over the socket: one namespace, then all
    r = run_kvgate("clean", "--socket", gw.socket, "--namespace", B)
    assert r.returncode == 0 and "deleted 20 objects" in r.stdout, r.stdout + r.stderr
    assert _present(gw, B, 20) == 0 and _present(gw, A, N_A) == N_A and _present(gw, AB, 20) == 20
    r = run_kvgate("clean", "--socket", gw.socket)
    assert r.returncode == 0, r.stderr
    assert _present(gw, A, N_A) == 0 and _present(gw, AB, 20) == 0
    assert gw.stats()["cards"][0]["objects"] == 0
    log = gw.log()
    assert re.search(rf"clean: session \d+ \(admin, pid \d+ uid 0, Unix socket\) cleaned namespace '{B}'", log), log
    assert re.search(r"clean: session \d+ \(admin, pid \d+ uid 0, Unix socket\) cleaned every namespace", log), log
    assert re.search(r"clean refused: session \d+ \(admin, 127\.0\.0\.1:\d+ uid 0, TCP\) is not on the Unix "
                     r"socket", log), log
