"""A real gateway in cluster mode: its cards come from the view in a real etcd, also across an etcd outage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import redis
from etcd3aio import Etcd3Client

from kvgate.cards import DirectoryCard
from kvgate.client import Client
from kvgate.cluster.registry import CardState, Registry, View
from kvgate.gateway.status import render
from tests.cards.common import start_redis_cluster
from tests.cluster.common import ETCD, EtcdServer, labelled_card
from tests.helpers import GatewayProcess, run_kvgate, wait_until
from tests.processes import REDIS_SERVER

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")]
SLOTS = 64



def _publish(etcd: EtcdServer, view: View) -> None:
    async def main() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            await Registry(client, "t", call_timeout_s=5).publish(view)

    asyncio.run(main())


def _serials(gw: GatewayProcess) -> list[str]:
    return sorted(c["serial"] for c in gw.stats()["cards"])


def test_a_gateway_follows_the_view_and_serves_the_kept_one_while_etcd_is_down(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    a, b = labelled_card(tmp_path / "a"), labelled_card(tmp_path / "b")
    flags = ["--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t",
             "--cluster-view-file", str(tmp_path / "view.json"), "--storage-slots", str(SLOTS),
             "--max-bytes", "0"]
    gw = GatewayProcess(tmp_path / "gw", flags)
    try:
        _publish(etcd, View.of(1, [a], SLOTS))
        gw.start()
        assert _serials(gw) == [a.serial], "the view's cards from the first request on"
        keys = [b"block-%d" % i for i in range(8)]
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            assert all(c.put_many(keys, [k * 100 for k in keys], dialog=b"d", position=0))

        _publish(etcd, View.of(2, [a, b], SLOTS))
        wait_until(lambda: _serials(gw) == sorted([a.serial, b.serial]), 10, "the second card joined")
        _publish(etcd, View.of(3, [a, msgspec.structs.replace(b, state=CardState.DRAINING)], SLOTS))
        wait_until(lambda: all(c["state"] != "serving" for c in gw.stats()["cards"] if c["serial"] == b.serial),
                   10, "the second card draining (or gone)")

        # Cards follow the view: a change by hand is refused, naming the command that makes it.
        refused = run_kvgate("cards", "add", str(tmp_path / "c"), "--socket", gw.socket)
        assert refused.returncode != 0 and "cluster mode" in refused.stderr + refused.stdout
        assert "kvgate cluster register" in refused.stderr + refused.stdout

        status = gw.stats()["cluster"]
        assert status["view_epoch"] == 3 and status["reachable"] and 0 <= status["last_good_poll_age_s"] < 5
        assert b"kvgate_cluster_view_epoch 3.0" in render(gw.stats())
        metrics = render(gw.stats())
        assert b'kvgate_cluster_leader{agent=""} 0.0' in metrics, "no agent leads this cluster"
        assert b"kvgate_cluster_cards_held_out 0.0" in metrics and b"kvgate_cluster_etcd_call_seconds_count" in metrics
        assert b'kvgate_cluster_cards{state="active"} 1.0' in metrics
        assert b'kvgate_cluster_cards{state="draining"} 1.0' in metrics

        etcd.pause()
        gw.stop()
        gw.start()  # etcd does not answer: the view kept on disk
        assert a.serial in _serials(gw)
        status = gw.stats()["cluster"]
        assert status["view_epoch"] == 3 and not status["reachable"] and status["last_good_poll_age_s"] == -1
        assert b"kvgate_cluster_registry_reachable 0.0" in render(gw.stats())
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            got = c.get_many(keys, dialog=b"d")
            assert [bytes(g) for g in got] == [k * 100 for k in keys], "restored from the card of the kept view"
        assert "unreachable" in gw.log()
    finally:
        gw.stop()
        etcd.stop()


def test_the_cluster_command_registers_publishes_and_drains(tmp_path: Path) -> None:
    from tests.helpers import run_kvgate

    etcd = EtcdServer(tmp_path / "etcd").start()
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--slots", str(SLOTS)]
    try:
        (tmp_path / "a").mkdir()
        r = run_kvgate("cluster", "register", str(tmp_path / "a"), *common)
        assert r.returncode == 0 and "registered (joining" in r.stdout, r.stderr
        again = run_kvgate("cluster", "register", str(tmp_path / "a"), *common)
        assert again.returncode == 1 and "registered already" in again.stderr
        view = run_kvgate("cluster", "view", *common)
        assert view.returncode == 1 and "no view published yet" in view.stderr
        assert run_kvgate("cluster", "publish", *common).returncode == 0
        got = msgspec.json.decode(run_kvgate("cluster", "view", "--json", *common).stdout)
        serial = DirectoryCard(str(tmp_path / "a")).check()
        assert got["epoch"] == 1 and set(got["owners"]) == {serial} and got["cards"][0]["state"] == "active"
        assert "is current: nothing to publish" in run_kvgate("cluster", "publish", *common).stdout
        bad = run_kvgate("cluster", "retire", serial, *common)
        assert bad.returncode == 1 and "is active: it cannot become retired" in bad.stderr
        last = run_kvgate("cluster", "drain", serial, *common)  # the only card: puts would have nowhere to go
        assert last.returncode == 1 and "last card in service" in last.stderr and "--force" in last.stderr, last
        assert [c["state"] for c in msgspec.json.decode(run_kvgate("cluster", "cards", "--json", *common).stdout)] \
            == ["active"]
        assert run_kvgate("cluster", "drain", serial, "--force", *common).returncode == 0
        cards = msgspec.json.decode(run_kvgate("cluster", "cards", "--json", *common).stdout)
        assert [c["state"] for c in cards] == ["draining"]
        etcd.pause()
        down = run_kvgate("cluster", "cards", "--timeout", "0.3", *common)
        assert down.returncode == 2 and ("bound 0.3 s" in down.stderr or "did not answer" in down.stderr), down.stderr
    finally:
        etcd.stop()


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server (make test installs it)")
def test_a_redis_cluster_registered_by_its_seed_serves_a_gateway_from_every_primary(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    nodes = start_redis_cluster(tmp_path / "redis")
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--slots", str(SLOTS)]
    gw = None
    try:
        r = run_kvgate("cluster", "register", nodes[0].url, *common)
        assert r.returncode == 0 and r.stdout.count("registered (joining") == 3, r.stdout + r.stderr
        assert run_kvgate("cluster", "publish", *common).returncode == 0
        gw = GatewayProcess(tmp_path / "gw", [
            "--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--max-bytes", "0",
            "--cluster-view-file", str(tmp_path / "view.json"), "--storage-slots", str(SLOTS)]).start()
        assert len(gw.stats()["cards"]) == 3 and all(c["kind"] == "redis" for c in gw.stats()["cards"])
        dialogs = {b"dialog-%d" % d: [b"d%d-page-%d" % (d, i) for i in range(4)] for d in range(24)}
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            for dialog, keys in dialogs.items():
                assert all(c.put_many(keys, [k * 1000 for k in keys], dialog=dialog, position=0))
            for dialog, keys in dialogs.items():
                assert [bytes(g) for g in c.get_many(keys, dialog=dialog)] == [k * 1000 for k in keys]
        held = [redis.Redis(port=n.port).dbsize() for n in nodes]
        assert all(n > 1 for n in held), f"every primary holds dialogs (keys per primary: {held})"
    finally:
        if gw is not None:
            gw.stop()
        for n in nodes:
            n.kill()
        etcd.stop()


def test_a_card_relocated_in_the_registry_is_found_at_its_new_address_and_restores(tmp_path: Path) -> None:
    """The card server moves to another port (as after a storage host's restart with other flags):
    ``kvgate cluster relocate`` and a publish, and the gateway reads the same card there, objects and all."""
    from kvgate.cards.network.server import CardExporter

    etcd = EtcdServer(tmp_path / "etcd").start()
    common = ["--etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--slots", str(SLOTS)]
    (tmp_path / "card").mkdir()
    first = CardExporter([DirectoryCard(str(tmp_path / "card"))], "127.0.0.1", 0).start()
    second = None
    gw = None
    try:
        (serial, url), = first.urls().items()
        r = run_kvgate("cluster", "register", url, *common)
        assert r.returncode == 0, r.stderr
        assert run_kvgate("cluster", "publish", *common).returncode == 0
        gw = GatewayProcess(tmp_path / "gw", [
            "--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--max-bytes", "0",
            "--cluster-view-file", str(tmp_path / "view.json"), "--storage-slots", str(SLOTS)]).start()
        keys = [b"block-%d" % i for i in range(6)]
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            assert all(c.put_many(keys, [k * 1000 for k in keys], dialog=b"d", position=0))

        first.stop()
        second = CardExporter([DirectoryCard(str(tmp_path / "card"))], "127.0.0.1", 0).start()
        moved = second.urls()[serial]
        assert moved != url
        bad = run_kvgate("cluster", "relocate", serial, *common)
        assert bad.returncode == 2 and "--address names where" in bad.stderr
        r = run_kvgate("cluster", "relocate", serial, "--address", moved, *common)
        assert r.returncode == 0 and f"reached at {moved}" in r.stdout, r.stderr
        cards = msgspec.json.decode(run_kvgate("cluster", "cards", "--json", *common).stdout)
        assert [(c["address"], c["state"], c["kind"]) for c in cards] == [(moved, "active", "kvgate")]
        assert run_kvgate("cluster", "publish", *common).returncode == 0
        wait_until(lambda: gw.stats()["cluster"]["view_epoch"] == 2, 10, gw.log)
        wait_until(lambda: [(c["location"], c["active"]) for c in gw.stats()["cards"]] == [(moved, True)], 15,
                   gw.log)
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            assert [bytes(g) for g in c.get_many(keys, dialog=b"d")] == [k * 1000 for k in keys]
        assert f"its address is now {moved}" in gw.log()
    finally:
        if gw is not None:
            gw.stop()
        for ex in (first, second):
            if ex is not None:
                ex.stop()
        etcd.stop()
