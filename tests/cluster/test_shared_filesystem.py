"""A card on a real network filesystem (sshfs over loopback), registered by a glob and found by serial."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from etcd3aio import Etcd3Client

from kvgate.cards import DirectoryCard
from kvgate.client import Client
from kvgate.cluster.registry import CardRecord, CardState, Registry, View
from kvgate.keys import full_key
from tests.cluster.common import ETCD, EtcdServer
from tests.cluster.sshfs import SshfsMount, unavailable
from tests.helpers import GatewayProcess

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)"),
              pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")]
SLOTS = 64


def test_a_gateway_reaches_a_card_on_a_network_filesystem_by_its_glob_and_keeps_what_it_stored(
        tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    share = SshfsMount(tmp_path / "share").start()
    try:
        # The storage host labels its card where it has it; gateways mount the share elsewhere and find it
        # by serial under the glob the registry holds (the other directory it matches is not a card).
        (share.export / "card-7").mkdir()
        (share.export / "card-other").mkdir()
        card = DirectoryCard(str(share.export / "card-7"))
        serial = card.open()
        card.close()
        record = CardRecord(serial=serial, kind="directory", address=str(share.mnt / "card-*"),
                            state=CardState.ACTIVE)

        async def publish() -> None:
            async with Etcd3Client([etcd.endpoint]) as client:
                await Registry(client, "t", call_timeout_s=5).publish(View.of(1, [record], SLOTS))
        asyncio.run(publish())

        flags = ["--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t", "--max-bytes", "0",
                 "--cluster-view-file", str(tmp_path / "view.json"), "--storage-slots", str(SLOTS)]
        gw = GatewayProcess(tmp_path / "gw", flags).start()
        rows = gw.stats()["cards"]
        assert [(r["serial"], r["location"]) for r in rows] == [(serial, str(share.mnt / "card-7"))]

        keys = [b"page-%d" % i for i in range(16)]
        values = [bytes([i]) * (256 << 10) for i in range(16)]
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            assert all(c.put_many(keys, values, dialog=b"d", position=0)), "acknowledged"

        # What was acknowledged went through the network filesystem: the storage host reads it there.
        local = DirectoryCard(str(share.export / "card-7"))
        local.open()
        try:
            dest = bytearray(256 << 10)
            local.read_into(full_key(b"t", keys[5]), memoryview(dest))
            assert bytes(dest) == values[5]
        finally:
            local.close()

        gw.stop()
        gw.start()
        t = time.monotonic()
        with Client.connect(gw.socket, namespace="t", engine_id="e") as c:
            assert c.lookup(keys, dialog=b"d") == len(keys)
            got = c.get_many(keys, dialog=b"d")
            assert [bytes(g) for g in got] == values, "every byte back after a restart, over the network"
        assert time.monotonic() - t < 30
        gw.stop()
    finally:
        share.stop()
        etcd.stop()
