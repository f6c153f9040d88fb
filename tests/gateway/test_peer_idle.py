"""A peer's idle connection closed by the holder costs the peer nothing: its next lookup reconnects.

In process, so ``PEER_IDLE_S`` can be made short: a real ``PeerServer`` (over a store that holds one key)
and a real ``PeerTier`` reading it.  The gateways in subprocesses are tests/gateway/test_peers.py.
"""

from __future__ import annotations

import asyncio

from kvgate.config import Config
from kvgate.gateway import peerserve
from kvgate.gateway.peerserve import PeerServer
from kvgate.keys import encode_namespace, full_key
from kvgate.tiers.peertier import PeerTier

KEY = full_key(encode_namespace("idle-test"), b"held")


class OneKeyStore:
    """What the peer listener asks of a store for a lookup: this one holds ``KEY`` (1,000 bytes)."""

    async def exists(self, keys: list[bytes], dialog: bytes, local: bool = False) -> list[bool]:
        assert local  # a peer is served this gateway's own tiers only
        return [k == KEY for k in keys]

    def size_hints(self, keys: list[bytes], dialog: bytes) -> list[int | None]:
        return [1000 if k == KEY else None for k in keys]


def test_the_next_lookup_after_an_idle_close_reconnects_and_is_a_hit(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(peerserve, "PEER_IDLE_S", 0.3)
    token = tmp_path / "peer.token"
    token.write_text("secret\n")
    cfg = Config(storage_devices=[str(tmp_path)], peer_listen="127.0.0.1:0", peer_token_file=str(token),
                 peer_timeout_ms=2000)
    server = PeerServer(cfg, OneKeyStore())  # type: ignore[arg-type]

    async def main() -> None:
        await server.start()
        tier = PeerTier(cfg, f"127.0.0.1:{server.port}")
        try:
            assert await tier.find([KEY], b"") == [True]
            assert server.status()["connections"] == 1
            for _ in range(100):  # the holder closes the idle connection
                await asyncio.sleep(0.05)
                if server.status()["idle_closed"]:
                    break
            st = server.status()
            assert st["idle_closed"] == 1 and st["connections"] == 0, st
            # the tier's thread finds its connection closed and makes a new one before it asks: a hit
            for _ in range(3):
                assert await tier.find([KEY], b"") == [True]
            assert tier.failures == 0 and tier.skipped == 0
            # each of the tier's threads (PEER_THREADS) keeps a connection of its own: the finds may use either
            assert 1 <= server.status()["connections"] <= 2 and server.status()["refused"] == 0
        finally:
            tier.close()
            await server.close()

    asyncio.run(main())
