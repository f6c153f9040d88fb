"""A card set that follows the cluster's view in a real etcd: joins, drains, leaves, and an etcd outage."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import pytest
from etcd3aio import Etcd3Client

from kvgate.cluster.follower import ViewFollower
from kvgate.cluster.registry import CardRecord, CardState, GatewayReport, Registry, RegistryUnavailable, View
from kvgate.config import Config
from tests.cluster.common import ETCD, EtcdServer, labelled_card
from tests.helpers import wait_until_async
from tests.tiers.common import card_set

needs_etcd = pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")
SLOTS = 64


@pytest.mark.slow
@needs_etcd
def test_a_card_set_follows_the_view_and_keeps_the_last_one_through_an_outage(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "kvgate.cluster")
    etcd = EtcdServer(tmp_path / "etcd").start()
    a, b, c = (labelled_card(tmp_path / n) for n in ("a", "b", "c"))
    foreign = CardRecord(serial="not-its-serial", kind="directory", address=str(tmp_path / "c"))

    async def main() -> None:
        cfg = Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20)
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "t", call_timeout_s=5)  # a loaded test machine: etcd fsyncs
            cards = card_set(cfg)
            await cards.start()
            follower = ViewFollower(reg, cards, tmp_path / "view.json")
            try:
                await follower.start()  # nothing kept yet
                assert await follower.poll() and cards.cards == [] and follower.epoch == 0

                await reg.publish(View.of(1, [a], SLOTS))
                assert await follower.poll()
                assert [mc.serial for mc in cards.cards] == [a.serial]
                await reg.publish(View.of(2, [a, b, foreign], SLOTS))
                assert await follower.poll()
                assert sorted(mc.serial for mc in cards.cards) == sorted([a.serial, b.serial])
                assert "carries serial" in caplog.text and "not-its-serial" in caplog.text
                # Both gateways' slot maps agree with the leader's view.
                assert cards.layout.slot_map.owner == View.of(2, [a, b], SLOTS).owners
                draining = View.of(3, [a, msgspec.structs.replace(b, state=CardState.DRAINING)], SLOTS)
                await reg.publish(draining)
                assert await follower.poll()
                # Out of the slot map at once; it holds nothing to copy, so it has left or is about to.
                assert cards.layout.slot_map.owner == draining.owners and set(draining.owners) == {a.serial}
                assert all(cards.is_draining(mc) for mc in cards.cards if mc.serial == b.serial)

                etcd.pause()
                follower.registry = Registry(client, "t", call_timeout_s=0.3)
                assert not await follower.poll(), "etcd does not answer: nothing changes"
                assert follower.epoch == 3 and a.serial in [mc.serial for mc in cards.cards]
                assert "cluster registry unreachable" in caplog.text
            finally:
                await cards.stop()

            # A gateway started during the outage serves the view kept on disk.
            again = card_set(cfg)
            await again.start()
            try:
                restarted = ViewFollower(Registry(client, "t", call_timeout_s=0.3), again, tmp_path / "view.json")
                await restarted.start()
                assert restarted.epoch == 3 and a.serial in [mc.serial for mc in again.cards]
                assert again.layout.slot_map.owner == draining.owners
            finally:
                await again.stop()
                etcd.resume()

    try:
        asyncio.run(main())
    finally:
        etcd.stop()


def test_a_view_of_many_new_cards_is_one_change_of_the_card_set(tmp_path: Path) -> None:
    """A gateway that starts on a view of many cards re-maps its slots once, not once per card."""
    records = [labelled_card(tmp_path / f"c{i}") for i in range(8)]

    async def main() -> None:
        cards = card_set(Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20))
        await cards.start()
        try:
            unconnected = Registry(Etcd3Client(["127.0.0.1:1"]), "t")  # apply makes no etcd call
            follower = ViewFollower(unconnected, cards, tmp_path / "view.json")
            generation = cards.generation
            await follower.apply(View.of(1, records, SLOTS))
            assert len(cards.cards) == 8 and cards.generation == generation + 1
            assert cards.layout.slot_map.owner == View.of(1, records, SLOTS).owners
        finally:
            await cards.stop()

    asyncio.run(main())


def test_a_card_the_view_drops_leaves_even_the_last_one(tmp_path: Path) -> None:
    """The view decides: the refusals of a `kvgate cards remove` by hand (the last card in service, objects a
    drain moved) do not apply to a card that left the cluster's view."""
    a = labelled_card(tmp_path / "a")

    async def main() -> None:
        cards = card_set(Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20))
        await cards.start()
        try:
            follower = ViewFollower(Registry(Etcd3Client(["127.0.0.1:1"]), "t"), cards, tmp_path / "view.json")
            await follower.apply(View.of(1, [a], SLOTS))
            assert [mc.serial for mc in cards.cards] == [a.serial]
            await follower.apply(View.of(2, [], SLOTS))  # retired: no card left in the view
            assert cards.cards == [] and follower.epoch == 2
        finally:
            await cards.stop()

    asyncio.run(main())


async def _alive(client: Etcd3Client, reg: Registry, serials: list[str], ttl: int = 30) -> int:
    """Report ``serials`` alive as an agent does (under one lease); the lease id."""
    lease = await reg.grant(ttl)
    for serial in serials:
        await client.kv.put(reg.prefix + b"alive/" + serial.encode(), b"{}", lease=lease)  # type: ignore[union-attr]
    return lease


@pytest.mark.slow
@needs_etcd
def test_liveness_holds_a_card_out_reports_the_gateway_and_refuses_a_view_that_does_not_fit(
        tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "kvgate.cluster")
    etcd = EtcdServer(tmp_path / "etcd").start()
    a, b, c = (labelled_card(tmp_path / n) for n in ("a", "b", "c"))

    async def main() -> None:
        cfg = Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20)
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "t", call_timeout_s=5)
            cards = card_set(cfg)
            await cards.start()
            follower = ViewFollower(reg, cards, tmp_path / "view.json", sick_polls=2, gateway_id="g1")
            by_serial = lambda: {mc.serial: mc for mc in cards.cards}  # noqa: E731
            try:
                await reg.publish(View.of(1, [a, b, c], SLOTS))
                lease_a = await _alive(client, reg, [a.serial])
                lease_b = await _alive(client, reg, [b.serial])
                assert await follower.poll() and len(cards.cards) == 3
                # The gateway reports itself under its lease: epoch and layout.
                seen = await reg.observe()
                assert seen.gateways["g1"].epoch == 1 and seen.gateways["g1"].fingerprint == cards.fingerprint
                assert seen.alive == {a.serial, b.serial}

                await reg.revoke(lease_a)  # a's agent is gone, and so is a (its mount, its server)
                (tmp_path / "a").rename(tmp_path / "a.away")
                await reg.revoke(lease_b)  # b's agent is gone, but b is there
                assert await follower.poll() and by_serial()[a.serial].active, "one poll without a report: kept"
                assert await follower.poll()
                assert not by_serial()[a.serial].active and follower.liveness.held == {a.serial}
                assert by_serial()[b.serial].active, "unreported, but it answers this gateway: kept"
                assert follower.answering == {b.serial} and "but it answers this gateway" in caplog.text
                assert by_serial()[c.serial].active, "never reported by an agent: never held out"
                assert cards.layout.slot_map.owner == View.of(1, [a, b, c], SLOTS).owners, "liveness never changes slots"
                assert await follower.poll() and by_serial()[b.serial].active
                assert caplog.text.count("but it answers this gateway") == 1, "said once"

                (tmp_path / "a.away").rename(tmp_path / "a")
                lease_a = await _alive(client, reg, [a.serial])
                await _alive(client, reg, [b.serial])
                assert await follower.poll() and follower.liveness.held == set() and follower.answering == set()
                await by_serial()[a.serial].life.check()  # its next health check (the card set runs one a second)
                assert by_serial()[a.serial].active, "back as soon as it is reported again"

                # A drain: the card leaves this gateway once copied (it holds nothing), and the report says so.
                await reg.publish(View.of(2, [a, msgspec.structs.replace(b, state=CardState.DRAINING), c], SLOTS))
                assert await follower.poll()
                for _ in range(100):
                    if b.serial not in by_serial():
                        break
                    await asyncio.sleep(0.05)
                assert b.serial not in by_serial()
                assert await follower.poll() and b.serial not in by_serial(), "a card drained here is not taken again"
                assert (await reg.observe()).gateways["g1"].drained == (b.serial,)

                # A view for another slot count is refused, loudly; the gateway keeps the one it has.
                await reg.publish(View.of(3, [a, c], SLOTS * 2))
                assert await follower.poll() and follower.epoch == 2
                assert "set storage_slots: 128" in caplog.text

                # Another gateway on the same epoch with another layout: said loudly.
                await reg.report_gateway(await reg.grant(30), "g2", GatewayReport(epoch=2, fingerprint="0000"))
                assert await follower.poll() and follower.mismatch == ["g2"]
                assert "look for keys on different cards" in caplog.text

                await follower.stop()
                assert "g1" not in (await reg.observe()).gateways, "a gateway that stops stops counting at once"
            finally:
                await cards.stop()

    try:
        asyncio.run(main())
    finally:
        etcd.stop()


@pytest.mark.slow
@needs_etcd
def test_a_watch_applies_a_new_view_long_before_the_next_poll(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    a, b = labelled_card(tmp_path / "a"), labelled_card(tmp_path / "b")

    async def main() -> None:
        cfg = Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20)
        async with Etcd3Client([etcd.endpoint]) as client:
            reg = Registry(client, "t", call_timeout_s=5)
            cards = card_set(cfg)
            await cards.start()
            follower = ViewFollower(reg, cards, tmp_path / "view.json", poll_s=30)  # polls far apart
            await reg.publish(View.of(1, [a], SLOTS))
            task = asyncio.create_task(follower.run())
            try:
                await wait_until_async(lambda: follower.epoch == 1, 5, "the first poll")
                await asyncio.sleep(0.5)  # the watch is set up
                t = time.monotonic()
                await reg.publish(View.of(2, [a, b], SLOTS))
                await wait_until_async(lambda: follower.epoch == 2, 5, "view 2 applied by the watch")
                assert time.monotonic() - t < 5, "long before the next poll (30 s)"
                assert len(cards.cards) == 2
            finally:
                task.cancel()
                await cards.stop()

    try:
        asyncio.run(main())
    finally:
        etcd.stop()


@pytest.mark.slow
@needs_etcd
def test_an_etcd_outage_leaves_no_watch_task_behind_and_views_after_it_are_applied(
        tmp_path: Path, caplog) -> None:
    """Each watch stream an outage breaks is closed with its gRPC request task (etcd3aio's own watch left that
    task waiting forever, collected later as "Task was destroyed but it is pending!"), the outage is said by
    the follower alone, and views published after it are applied."""
    import gc

    from kvgate.cluster.registry import etcd_client

    caplog.set_level(logging.WARNING)
    etcd = EtcdServer(tmp_path / "etcd").start()
    a, b = labelled_card(tmp_path / "a"), labelled_card(tmp_path / "b")
    pending: list[str] = []

    async def main() -> None:
        client = etcd_client([etcd.endpoint])
        await client.connect()
        reg = Registry(client, "t", call_timeout_s=0.5)
        await reg.publish(View.of(1, [a], SLOTS))
        cards = card_set(Config(storage_devices=[], storage_slots=SLOTS, card_capacity=64 << 20))
        await cards.start()
        follower = ViewFollower(reg, cards, tmp_path / "view.json", poll_s=0.2)
        task = asyncio.create_task(follower.run())
        try:
            await wait_until_async(lambda: follower.epoch == 1, 10, "view 1 applied")
            await asyncio.sleep(0.5)  # the watches are made
            etcd.stop()
            await wait_until_async(lambda: follower.unreachable, 10, "the outage seen")
            await asyncio.sleep(2)  # watches made again and broken again
            etcd.start()
            # the client's channel reconnects on its own backoff after the refused connects: an operator's
            # publish right after the restart may be refused once, as here; it retries, as one would
            deadline = time.monotonic() + 15
            while True:
                try:
                    await reg.publish(View.of(2, [a, b], SLOTS))
                    break
                except RegistryUnavailable:
                    assert time.monotonic() < deadline, "etcd back, but view 2 could not be published in 15 s"
                    await asyncio.sleep(0.2)
            await wait_until_async(lambda: follower.epoch == 2, 10, "view 2 applied after the outage")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await cards.stop()
        gc.collect()

        def left() -> list[asyncio.Task]:
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

        # A call the channel's close cancelled ends its gRPC status task on a later turn of the loop (seen once
        # in about ten runs, 10 ms after the close): a task that ends is not the one this test looks for
        deadline = time.monotonic() + 2
        while left() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        pending.extend(f"{t.get_name()}: {t.get_coro()!r}" for t in left())

    try:
        asyncio.run(main())
    finally:
        etcd.stop()
    assert pending == [], pending
    said = [r.getMessage() for r in caplog.records]
    assert not any("Task was destroyed" in m for m in said), said
    assert not any(r.name == "etcd3aio.watch" for r in caplog.records), "the outage is said once, by the follower"
