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
from kvgate.tiers import peertier
from kvgate.tiers.contract import Tier
from kvgate.tiers.peertier import PeerTier, host_port
from kvgate.tiers.store import GetItem
from kvgate.types import SizeCode
from tests.helpers import free_port

KEY = full_key(encode_namespace("peer-test"), b"k")
PAYLOAD = bytes(range(256)) * 64


class LyingPeer:
    """Answers a hello with Ok, a lookup with the payload's size, and each read as ``mode`` says.

    ``held``: the keys it holds (None: every key); ``asked``: each request's op after the hello, in order."""

    def __init__(self, mode: str, held: set[bytes] | None = None) -> None:
        self.mode = mode
        self.held = held
        self.asked: list[str] = []
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
                if not isinstance(msg, w.Hello):
                    self.asked.append(type(msg).__struct_config__.tag)
                if isinstance(msg, w.Hello):
                    conn.sendall(w.frame(w.Ok({"max_object_bytes": 1 << 20})))
                elif isinstance(msg, w.ExistsMany):
                    conn.sendall(w.frame(w.Results([len(PAYLOAD) if self._holds(k) else False for k in msg.keys],
                                                   [None] * len(msg.keys))))
                elif isinstance(msg, w.ReadMany):
                    for k in msg.keys:
                        if self._holds(k):
                            self._send_object(conn, k)
                        else:
                            conn.sendall(w.frame(w.Item(w.Err("missing", "not held by this gateway"))))
                else:
                    conn.sendall(w.frame(w.Err("bad_request", "no")))
        except (OSError, w.WireError):
            conn.close()

    def _holds(self, key: bytes) -> bool:
        return self.held is None or key in self.held

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


@pytest.mark.parametrize("own", [False, True], ids=["through-scratch", "in-place"])
@pytest.mark.parametrize("mode", ["honest", "flipped", "wrong-key", "stall"])
def test_a_peer_that_lies_or_stalls_costs_a_miss_never_a_wrong_byte(tmp_path, mode: str, own: bool) -> None:
    peer = LyingPeer(mode)
    tier = tier_for(peer, tmp_path)

    async def main() -> tuple[list[int], bytearray, float]:
        assert await tier.find([KEY], b"") == [True]
        assert tier.sizes([KEY], b"") == [len(PAYLOAD)]  # the lookup told the size
        dest = bytearray(len(PAYLOAD))
        t0 = time.monotonic()
        sizes, _needed, _metas = await tier.read_into([GetItem(KEY, b"", memoryview(dest))], own=own)
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


def test_what_a_peer_lacks_is_not_asked_again_for_a_moment(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(peertier, "NEGATIVE_S", 0.5)
    others = [full_key(encode_namespace("peer-test"), f"o{i}".encode()) for i in range(3)]
    peer = LyingPeer("honest", held=set())
    tier = tier_for(peer, tmp_path)

    async def main() -> None:
        keys = [KEY, *others]
        assert await tier.find(keys, b"") == [False] * 4
        assert peer.asked == ["exists_many"]
        # the lookups a new prompt repeats: answered here, the peer not asked, until NEGATIVE_S has passed
        for _ in range(3):
            assert await tier.find(keys, b"") == [False] * 4
            assert await tier.probe_prefix(keys, b"", tier.known(keys, b""), 0, 4) == 0
        dest = bytearray(len(PAYLOAD))
        sizes, _needed, _metas = await tier.read_into([GetItem(KEY, b"", memoryview(dest))])
        assert sizes == [SizeCode.MISS]
        assert peer.asked == ["exists_many"], "keys the peer lacks were asked again within NEGATIVE_S"
        assert tier.negative_hits == 6 * 4 + 1 and tier.status()["negative_hits"] == tier.negative_hits
        assert tier.counters.gets == 1 and tier.counters.misses == 1
        # the peer stores one meanwhile: found once the answer lapses, the others asked again with it
        peer.held.add(KEY)
        await asyncio.sleep(0.6)
        assert await tier.find(keys, b"") == [True, False, False, False]
        assert peer.asked == ["exists_many", "exists_many"]
        sizes, _needed, _metas = await tier.read_into([GetItem(KEY, b"", memoryview(dest))])
        assert sizes == [len(PAYLOAD)] and bytes(dest) == PAYLOAD
        # a pull of a key the peer lacks teaches the same: neither a read nor a lookup of it asks again
        asked = len(peer.asked)
        gone = full_key(encode_namespace("peer-test"), b"gone")
        for _ in range(2):
            sizes, _needed, _metas = await tier.read_into([GetItem(gone, b"", memoryview(dest))])
            assert sizes == [SizeCode.MISS]
        assert await tier.find([gone], b"") == [False]
        assert peer.asked[asked:] == ["read_many"]

    try:
        asyncio.run(main())
    finally:
        tier.close()
        peer.close()


def test_the_absent_keys_are_bounded_and_a_failed_call_teaches_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(peertier, "NEGATIVE_KEPT", 3)
    keys = [full_key(encode_namespace("peer-test"), f"b{i}".encode()) for i in range(5)]
    peer = LyingPeer("honest", held=set())
    tier = tier_for(peer, tmp_path)
    dead = PeerTier(Config(storage_devices=[str(tmp_path)], peer_token_file=str(tmp_path / "token")),
                    f"127.0.0.1:{free_port()}")  # nobody listens there: every call fails

    async def main() -> None:
        assert await tier.find(keys, b"") == [False] * 5
        assert tier.status()["absent_kept"] == 3  # the two oldest were dropped
        assert await tier.find(keys, b"") == [False] * 5
        assert peer.asked == ["exists_many"] * 2 and tier.negative_hits == 3  # those two were asked again
        # no answer, nothing learnt: the keys are misses through the backoff, then asked again
        assert await dead.find(keys, b"") == [False] * 5
        assert dead.failures == 1 and dead.status()["absent_kept"] == 0 and dead.negative_hits == 0

    try:
        asyncio.run(main())
    finally:
        tier.close()
        dead.close()
        peer.close()


def test_what_a_peer_says_of_its_namespaces_is_bounded_and_judged_once_per_answer(tmp_path) -> None:
    """A peer that answers the namespaces exchange with 10,000 of them: 256 are kept, and a lookup pays one
    dict lookup for its verdict, not a pass over them; the peer is never dialled for the refused keys."""
    from kvgate.keys import NAMESPACES_KEPT, NamespaceBook

    book = NamespaceBook()
    book.declare("vllm|m|mine", {"model": "m", "dtype": "float16"})
    tier = PeerTier(Config(storage_devices=[str(tmp_path)], peer_token_file=str(tmp_path / "token")),
                    f"127.0.0.1:{free_port()}", book)  # nobody listens: only the exchange is answered (below)
    theirs = {"vllm|m|other": {"model": "m", "dtype": "bfloat16"}}
    theirs.update({f"vllm|x{i}|d": {"model": f"x{i}"} for i in range(10_000)})
    told = []
    tier.card.ask = lambda msg: told.append(msg.namespaces) or theirs  # type: ignore[method-assign]
    judged = []
    foreign = book.foreign
    book.foreign = lambda ns, other: judged.append(ns) or foreign(ns, other)  # type: ignore[method-assign]
    keys = [full_key(encode_namespace("vllm|m|mine"), f"k{i}".encode()) for i in range(4)]

    async def main() -> None:
        tier._refused(keys[0], 4)  # starts the exchange
        while tier._telling is not None:
            await asyncio.sleep(0.01)
        assert told == [{"vllm|m|mine": {"model": "m", "dtype": "float16"}}]
        assert len(tier._theirs) == NAMESPACES_KEPT
        for _ in range(3):
            assert await tier.find(keys, b"") == [False] * 4
        assert judged == ["vllm|m|mine"] and tier.namespace_refused == 12 and tier.failures == 0
        assert 'dtype ("float16" here, "bfloat16" there)' in tier.status()["namespace_difference"]

    try:
        asyncio.run(main())
    finally:
        tier.close()


@pytest.mark.parametrize("address,expected", [
    ("10.0.0.1:5600", ("10.0.0.1", 5600)), ("10.0.0.1", ("10.0.0.1", None)), ("[::1]:5600", ("::1", 5600)),
    ("::1", ("::1", None)), ("[::ffff:10.0.0.1]:8000", ("10.0.0.1", 8000)), ("GW-A.example.:9", ("gw-a.example", 9)),
    ("[fe80::0001]", ("fe80::1", None)), ("host:port", ("host", None)),
])
def test_host_port(address: str, expected: tuple) -> None:
    assert host_port(address) == expected
