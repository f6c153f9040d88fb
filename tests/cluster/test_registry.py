"""The card registry against a real etcd: registrations, states, views, and bounded calls."""

from __future__ import annotations

import asyncio
import time

import pytest
from etcd3aio import Etcd3Client

from kvgate.cluster.registry import (CardRecord, CardState, Registry, RegistryConflict, RegistryUnavailable,
                                     View)
from tests.cluster.common import ETCD, EtcdServer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")]


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


def _record(serial: str, **kw) -> CardRecord:
    kw.setdefault("address", f"/cards/{serial}")
    return CardRecord(serial=serial, kind="directory", **kw)


def test_cards_register_once_and_change_state_only_as_allowed(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "c1", call_timeout_s=5)  # a loaded test machine: etcd fsyncs
            assert await reg.register(_record("a", state=CardState.ACTIVE))
            assert not await reg.register(_record("a", address="/elsewhere")), "registered once"
            (a,) = await reg.cards()
            assert a.state is CardState.JOINING and a.address == "/cards/a"
            assert (await reg.set_state("a", CardState.ACTIVE)).state is CardState.ACTIVE
            with pytest.raises(RegistryConflict, match="is active: it cannot become retired"):
                await reg.set_state("a", CardState.RETIRED)
            with pytest.raises(RegistryConflict, match="no card with serial 'b'"):
                await reg.set_state("b", CardState.ACTIVE)
            assert await Registry(client, "c2", call_timeout_s=5).cards() == [], "clusters apart"

    asyncio.run(main())


def test_a_view_places_keys_by_the_set_of_cards_not_their_order(etcd: EtcdServer) -> None:
    records = [_record(s, state=CardState.ACTIVE) for s in ("x", "y", "z")]
    one = View.of(1, records, 64)
    other = View.of(1, list(reversed(records)), 64)
    assert one == other and set(one.owners) == {"x", "y", "z"}
    drained = View.of(2, [records[0], records[1], _record("z", state=CardState.DRAINING)], 64)
    assert "z" not in drained.owners and [c.serial for c in drained.cards] == ["x", "y", "z"], "still read"

    async def main() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "c1", call_timeout_s=5)  # a loaded test machine: etcd fsyncs
            assert await reg.view() is None
            await reg.publish(one)
            with pytest.raises(RegistryConflict, match="epoch 1 does not follow the published epoch 1"):
                await reg.publish(one)
            await reg.publish(drained)
            assert await reg.view() == drained

    asyncio.run(main())


def test_every_call_is_bounded_when_etcd_does_not_answer(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            await Registry(client, "c1", call_timeout_s=5).register(_record("a"))
            reg = Registry(client, "c1", call_timeout_s=0.5)
            etcd.pause()
            try:
                for call in (reg.cards(), reg.view(), reg.set_state("a", CardState.ACTIVE)):
                    t = time.monotonic()
                    with pytest.raises(RegistryUnavailable, match=r"bound 0.5 s"):
                        await call
                    assert time.monotonic() - t < 2.0, "bounded (without the bound a paused etcd is waited on for ever)"
            finally:
                etcd.resume()
            again = Registry(client, "c1", call_timeout_s=5)
            assert [c.serial for c in await again.cards()] == ["a"], "answers again once etcd does"

    asyncio.run(main())


def test_a_card_is_relocated_with_its_serial_and_state_and_a_retired_one_is_not(etcd: EtcdServer) -> None:
    async def main() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "c1", call_timeout_s=5)
            assert await reg.register(_record("a"))
            await reg.set_state("a", CardState.ACTIVE)
            moved = await reg.set_address("a", "kvgate://10.0.0.9:7001/a")
            assert (moved.serial, moved.state, moved.kind) == ("a", CardState.ACTIVE, "kvgate")
            assert await reg.card("a") == moved
            assert await reg.set_address("a", "kvgate://10.0.0.9:7001/a") == moved, "the same address: no change"
            with pytest.raises(RegistryConflict, match="no card with serial 'b'"):
                await reg.set_address("b", "/x")
            await reg.set_state("a", CardState.DRAINING)
            await reg.set_state("a", CardState.DRAINED)
            await reg.set_state("a", CardState.RETIRED)
            with pytest.raises(RegistryConflict, match="is retired: register it again"):
                await reg.set_address("a", "/x")

    asyncio.run(main())
