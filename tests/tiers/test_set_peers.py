"""``TieredStore.set_peers``: the peers change while the store serves (a cluster's registry names them).

A peer kept keeps its tier, a new one gets one, and ``tiers``/``peers`` are
new lists, so a call that took the old list goes on with it; a peer that
left is closed once no call that could hold it is in flight, and a pull
through it that was under way when it left still lands, verified.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from kvgate.config import Config
from kvgate.tiers.io import IoPool
from kvgate.tiers.peertier import PeerTier
from kvgate.tiers.store import GetItem, TieredStore
from tests.helpers import wait_until_async
from tests.tiers.test_peertier import KEY, PAYLOAD, LyingPeer


def _store(tmp_path: Path, peers: list[str]) -> TieredStore:
    (tmp_path / "card").mkdir(exist_ok=True)
    token = tmp_path / "token"
    token.write_text("t")
    cfg = Config(storage_devices=[str(tmp_path / "card")], max_bytes=8 << 20, card_capacity=64 << 20,
                 thread_pool_size=2, storage_slots=16, peers=peers, peer_token_file=str(token),
                 peer_timeout_ms=5000)
    return TieredStore(cfg, IoPool(2))


def _watch_close(tier: PeerTier, closed: list[str]) -> None:
    close = tier.close

    def recorded() -> None:
        closed.append(tier.address)
        close()

    tier.close = recorded  # type: ignore[method-assign]


def test_set_peers_keeps_creates_and_removes_tiers_and_replaces_the_lists(tmp_path: Path) -> None:
    async def main() -> None:
        store = _store(tmp_path, ["127.0.0.1:1", "127.0.0.1:2"])
        await store.start()
        try:
            tiers, peers = store.tiers, store.peers
            first, second = peers
            before = list(tiers)
            closed: list[str] = []
            _watch_close(second, closed)

            store.set_peers(["127.0.0.1:1", "127.0.0.1:3", "127.0.0.1:3"])
            assert [p.address for p in store.peers] == ["127.0.0.1:1", "127.0.0.1:3"]
            assert store.peers[0] is first, "a peer kept keeps its tier (connections, counters, backoff)"
            assert isinstance(store.peers[1], PeerTier) and store.peers[1] is not second
            assert store.tiers is not tiers and store.peers is not peers, "new lists, never changed in place"
            assert tiers == before and peers == [first, second], "the lists a call in flight holds stay as they were"
            assert store.tiers[: store.local] == before[: store.local] and store.tiers[store.local:] == store.peers
            assert closed == ["127.0.0.1:2"], "no call in flight: the peer that left is closed at once"
            assert [p["address"] for p in store.status()["peers"]] == ["127.0.0.1:1", "127.0.0.1:3"]

            same = store.tiers
            store.set_peers(["127.0.0.1:1", "127.0.0.1:3"])
            assert store.tiers is same, "the same peers: nothing changes"

            store.set_peers([])
            assert store.peers == [] and len(store.tiers) == store.local
            assert await store.exists([KEY], b"") == [False]
        finally:
            await store.stop()

    asyncio.run(main())


class SlowPeer(LyingPeer):
    """An honest peer that waits ``delay`` before each object."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        super().__init__("honest")

    def _send_object(self, conn: socket.socket, key: bytes) -> None:
        time.sleep(self.delay)
        super()._send_object(conn, key)


def test_a_peer_that_leaves_mid_pull_is_closed_only_once_the_pull_ends(tmp_path: Path) -> None:
    peer = SlowPeer(1.0)
    address = f"127.0.0.1:{peer.port}"

    async def main() -> None:
        store = _store(tmp_path, [address])
        await store.start()
        try:
            (tier,) = store.peers
            closed: list[str] = []
            _watch_close(tier, closed)
            dest = bytearray(len(PAYLOAD))
            get = asyncio.create_task(store.get([GetItem(KEY, b"", memoryview(dest))]))
            await wait_until_async(lambda: tier.io.inflight > 0, 10, "the pull from the peer under way")
            store.set_peers([])
            assert store.peers == [] and closed == [], "a pull through it is in flight: not closed yet"
            sizes, _needed = await get
            assert sizes == [len(PAYLOAD)] and bytes(dest) == PAYLOAD, "the pull under way still lands"
            assert closed == [address], "closed once the last call that held it ended"
            assert tier.counters.hits == 1
        finally:
            await store.stop()

    try:
        asyncio.run(main())
    finally:
        peer.close()
