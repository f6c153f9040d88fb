"""Gateways of a cluster find their peers in the registry: real etcd, two real gateways, no ``peers`` listed.

Each gateway reports the address it serves peers on (``GatewayReport.peer``)
and pulls from every other live gateway of its key layout: what a client
stored in gateway A's RAM tier only is found and read by a client of gateway
B.  A gateway that leaves (SIGTERM revokes its report) is gone from the
other's peers within a few polls.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from etcd3aio import Etcd3Client

from kvgate.cluster.follower import ViewFollower
from kvgate.cluster.registry import GatewayReport, Registry, View
from tests.cluster.common import ETCD, EtcdServer, labelled_card
from tests.helpers import GatewayProcess, free_port, peer_payload, pulled_from_ram, wait_until

SLOTS = 64
NS = "peer-ns"


def _peers(gw: GatewayProcess) -> list[str]:
    return [p["address"] for p in gw.stats()["peers"]]


@pytest.mark.slow
@pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")
def test_gateways_find_each_other_in_the_registry_and_pull_what_the_other_holds(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    card = labelled_card(tmp_path / "card")
    token = tmp_path / "peer.token"
    token.write_text("peer-secret\n")

    async def publish() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            await Registry(client, "t", call_timeout_s=5).publish(View.of(1, [card], SLOTS))

    ports = {"A": free_port(), "B": free_port()}
    gws = {name: GatewayProcess(tmp_path / name, [
        "--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--storage-slots", str(SLOTS),
        "--cluster-view-file", str(tmp_path / name / "view.json"), "--shared-storage", "true",
        "--shared-memory-size", "16M", "--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", str(token),
        "--peer-timeout-ms", "2000"], name=name) for name, port in ports.items()}
    a, b = gws["A"], gws["B"]
    try:
        asyncio.run(publish())
        a.start()
        b.start()
        wait_until(lambda: _peers(b) == [f"127.0.0.1:{ports['A']}"], 10, lambda: "B found A: " + b.log())
        wait_until(lambda: _peers(a) == [f"127.0.0.1:{ports['B']}"], 10, lambda: "A found B: " + a.log())
        cluster = b.stats()["cluster"]
        assert cluster["peer"] == f"127.0.0.1:{ports['B']}" and cluster["peers_found"] == [f"127.0.0.1:{ports['A']}"]

        keys = pulled_from_ram(a, b, NS, 4)
        (row,) = b.stats()["peers"]
        assert row["hits"] == 4 and row["bytes_read"] == 4 * len(peer_payload(0)), row
        assert a.stats()["peer_listen"]["served_objects"] == 4

        a.stop()  # SIGTERM: its report is revoked
        wait_until(lambda: _peers(b) == [], 5, lambda: "A gone from B's peers: " + b.log())
        with b.client(NS) as c:  # pulled before: now in B's RAM tier
            assert c.get_many(keys[:1]) == [peer_payload(0)]
    finally:
        b.stop()
        a.stop()
        etcd.stop()


def test_the_peers_are_the_configs_and_those_of_other_gateways_of_this_layout(tmp_path: Path, caplog) -> None:
    """``_follow_peers`` alone (no etcd): the config's peers first, then the registry's (sorted), this
    gateway's own address and a gateway without a peer listener left out, another layout skipped, said once."""
    caplog.set_level(logging.WARNING, "kvgate.cluster")
    got: list[list[str]] = []
    cards = SimpleNamespace(fingerprint="f1")
    unconnected = Registry(Etcd3Client(["127.0.0.1:1"]), "t")  # _follow_peers makes no etcd call
    follower = ViewFollower(unconnected, cards, tmp_path / "view.json", gateway_id="me",  # type: ignore[arg-type]
                            peer="h0:1", peers=["h9:1", "h0:1"], set_peers=got.append)
    reports = {"me": GatewayReport(epoch=1, fingerprint="f1", peer="h0:1"),
               "c": GatewayReport(epoch=1, fingerprint="f1", peer="h3:1"),
               "b": GatewayReport(epoch=1, fingerprint="f1", peer="h2:1"),
               "same-address": GatewayReport(epoch=1, fingerprint="f1", peer="h0:1"),
               "silent": GatewayReport(epoch=1, fingerprint="f1"),
               "other": GatewayReport(epoch=1, fingerprint="f2", peer="h4:1"),
               "dup": GatewayReport(epoch=1, fingerprint="f1", peer="h9:1")}
    follower._follow_peers(reports)
    assert got[-1] == ["h9:1", "h2:1", "h3:1"]
    assert follower.found_peers == ["h2:1", "h3:1", "h9:1"] and list(follower.peers_skipped) == ["other"]
    warned = [r.getMessage() for r in caplog.records if "not pulled from" in r.getMessage()]
    assert len(warned) == 1 and all(s in warned[0] for s in ("gateway other", "f2", "f1", "h4:1")), warned
    follower._follow_peers(reports)
    assert len([r for r in caplog.records if "not pulled from" in r.getMessage()]) == 1, "said once"
    cards.fingerprint = "f2"  # this gateway applied the other's layout: now it is the others that differ
    follower._follow_peers(reports)
    assert got[-1] == ["h9:1", "h4:1"] and sorted(follower.peers_skipped) == ["b", "c", "dup"]
