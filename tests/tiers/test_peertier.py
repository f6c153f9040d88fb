"""``PeerTier`` against peers that lie or stall (a small server speaking the network card's wire, in a thread).

The real gateways' side is tests/gateway/test_peers.py; here the peer is made to misbehave on purpose: a
payload that does not match its hash, a header for another key, a peer that stops sending mid-object.  Each
is a miss, within ``peer_timeout_ms``, and nothing is written into the destination once the tier gave up.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from kvgate.cards.network import wire as w
from kvgate.cards.objectformat import ObjectMeta, pack_header
from kvgate.config import Config
from kvgate.keys import encode_namespace, full_key, payload_hash
from kvgate.tiers.contract import Tier
from kvgate.tiers.peertier import PeerTier
from kvgate.tiers.store import GetItem
from kvgate.types import SizeCode

KEY = full_key(encode_namespace("peer-test"), b"k")
PAYLOAD = bytes(range(256)) * 64


class LyingPeer:
    """Answers a hello with Ok, a lookup with the payload's size, and each read as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _request(self, conn: socket.socket) -> w.Msg:
        prefix = bytearray(w.PREFIX.size)
        w.recv_exact(conn, memoryview(prefix))
        hlen, _ = w.parse_prefix(prefix, w.MAX_REQUEST_HEADER, 0)
        return w.decode_request(w.recv_body(conn, hlen))

    def _conn(self, conn: socket.socket) -> None:
        try:
            while True:
                msg = self._request(conn)
                if isinstance(msg, w.Hello):
                    conn.sendall(w.frame(w.Ok({"max_object_bytes": 1 << 20})))
                elif isinstance(msg, w.ExistsMany):
                    conn.sendall(w.frame(w.Results([len(PAYLOAD)] * len(msg.keys), [None] * len(msg.keys))))
                elif isinstance(msg, w.ReadMany):
                    for k in msg.keys:
                        self._send_object(conn, k)
                else:
                    conn.sendall(w.frame(w.Err("bad_request", "no")))
        except (OSError, w.WireError):
            conn.close()

    def _send_object(self, conn: socket.socket, key: bytes) -> None:
        payload = bytearray(PAYLOAD)
        named = key
        if self.mode == "wrong-key":
            named = full_key(encode_namespace("peer-test"), b"another")
        header = pack_header(named, len(payload), payload_hash(bytes(payload)), ObjectMeta())
        if self.mode == "flipped":
            payload[100] ^= 1  # the hash in the header is of the true payload
        conn.sendall(w.frame(w.Item(), len(header) + len(payload)) + header)
        if self.mode == "stall":
            conn.sendall(payload[:1000])
            time.sleep(3)
        conn.sendall(payload)


def tier_for(peer: LyingPeer, tmp_path, timeout_ms: int = 500) -> PeerTier:
    token = tmp_path / "token"
    token.write_text("t")
    cfg = Config(storage_devices=[str(tmp_path)], peers=[f"127.0.0.1:{peer.port}"], peer_token_file=str(token),
                 peer_timeout_ms=timeout_ms)
    return PeerTier(cfg, f"127.0.0.1:{peer.port}")


def test_a_peer_tier_speaks_the_contract(tmp_path) -> None:
    peer = LyingPeer("honest")
    try:
        assert isinstance(tier_for(peer, tmp_path), Tier)
    finally:
        peer.close()


@pytest.mark.parametrize("mode", ["honest", "flipped", "wrong-key", "stall"])
def test_a_peer_that_lies_or_stalls_costs_a_miss_never_a_wrong_byte(tmp_path, mode: str) -> None:
    peer = LyingPeer(mode)
    tier = tier_for(peer, tmp_path)

    async def main() -> tuple[list[int], bytearray, float]:
        assert await tier.find([KEY], b"") == [True]
        assert tier.sizes([KEY], b"") == [len(PAYLOAD)]  # the lookup told the size
        dest = bytearray(len(PAYLOAD))
        t0 = time.monotonic()
        sizes, _needed, _metas = await tier.read_into([GetItem(KEY, b"", memoryview(dest))])
        return sizes, dest, time.monotonic() - t0

    try:
        sizes, dest, took = asyncio.run(main())
        if mode == "honest":
            assert sizes == [len(PAYLOAD)] and bytes(dest) == PAYLOAD
            return
        assert sizes == [SizeCode.MISS], mode
        assert took < 2.0, f"{mode}: the read took {took:.2f} s, past peer_timeout_ms"
        if mode == "stall":
            time.sleep(3.5)  # the peer sends the rest after the tier gave up: it must not land
            assert bytes(dest[1000:]) == bytes(len(PAYLOAD) - 1000)
        assert tier.counters.hits == 0 and tier.counters.misses == 1
    finally:
        tier.close()
        peer.close()
