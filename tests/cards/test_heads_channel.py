"""Each card kind's shared-heads channel (``kvgate.cards.heads``) on its real medium.

A directory in a temp dir, a real ``redis-server``, and a real card server
(``CardExporter``) over loopback serving a directory card.  What every kind
promises is tested over all three; what only one kind does (the directory
file's order and torn appends, the Redis hash tag, the server's checks of a
request) in its own tests.  The lists are also read and written here
without kvgate, by the file and key names a card has always used, so a card
written before the channel keeps its heads.
"""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from kvgate.cards import Card, DirectoryCard, NetworkCard, RedisCard
from kvgate.cards.heads import HeadsChannel
from kvgate.cards.network import wire as w
from kvgate.cards.network.server import CardExporter
from tests.processes import REDIS_SERVER, RedisServer

HEADS_FILE = "kvgate-heads"  # a directory card's list, in its directory, as every kvgate has named it
HEADS_KEY = b"kvgate:heads"  # a Redis card's set, as every kvgate has named it


def u64s(ids: list[int]) -> bytes:
    """A list as a directory card stores it: little-endian u64s, oldest first."""
    return struct.pack(f"<{len(ids)}Q", *ids)


class Medium:
    """One card's medium of one kind, and card objects opened on it (all closed at the end)."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.tmp = tmp
        self.cards: list[Card] = []
        self.server: RedisServer | None = None
        self.exporter: CardExporter | None = None
        self.dir = str(tmp / "card")
        if kind == "redis":
            self.server = RedisServer(tmp / "redis", "noeviction").start()
        elif kind == "network":
            self._serve()

    def _serve(self) -> None:
        local = DirectoryCard(self.dir, num_dbs=2)
        local.open()
        self.local = local
        self.exporter = CardExporter([local], "127.0.0.1", 0, max_object_bytes=16 << 20, frame_timeout=1.0).start()

    def open(self) -> Card:
        card: Card
        if self.kind == "directory":
            card = DirectoryCard(self.dir, num_dbs=2)
        elif self.kind == "redis":
            assert self.server is not None
            card = RedisCard(self.server.url, num_dbs=2)
        else:
            assert self.exporter is not None
            card = NetworkCard(self.exporter.urls()[self.local.serial], num_dbs=2, max_object_bytes=16 << 20)
        self.cards.append(card)
        card.open()
        return card

    def reopen(self) -> None:
        """Every card object closed; a card server stopped and started again on a new card object."""
        self.close_cards()
        if self.exporter is not None:
            self.exporter.stop()
            self.local.close()
            self._serve()

    def stored(self) -> list[int]:
        """The list as it is on the medium, read without kvgate (a directory's in its order, Redis's sorted)."""
        if self.server is not None:
            r = self.server.raw()
            try:
                members = r.smembers(HEADS_KEY)
            finally:
                r.close()
            assert all(len(m) == 8 for m in members), members
            return sorted(int.from_bytes(m, "little") for m in members)
        raw = (Path(self.dir) / HEADS_FILE).read_bytes()
        return list(struct.unpack(f"<{len(raw) // 8}Q", raw))

    def store(self, ids: list[int]) -> None:
        """Adds ``ids`` the way a kvgate from before the channel did: appends to the file, SADD to the set."""
        if self.server is not None:
            r = self.server.raw()
            try:
                r.sadd(HEADS_KEY, *[i.to_bytes(8, "little") for i in ids])
            finally:
                r.close()
        else:
            with open(Path(self.dir) / HEADS_FILE, "ab") as f:
                f.write(u64s(ids))

    def close_cards(self) -> None:
        for c in self.cards:
            c.close()
        self.cards.clear()

    def close(self) -> None:
        self.close_cards()
        if self.exporter is not None:
            self.exporter.stop()
            self.local.close()
        if self.server is not None:
            self.server.kill()


KINDS = [
    "directory",
    pytest.param("redis", marks=[pytest.mark.slow,  # starts a redis-server
                                 pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")]),
    "network",
]


@pytest.fixture(params=KINDS)
def medium(request, tmp_path: Path) -> Iterator[Medium]:
    m = Medium(request.param, tmp_path)
    yield m
    m.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Medium]:
    m = Medium("network", tmp_path)
    yield m
    m.close()


@pytest.fixture
def card(tmp_path: Path) -> DirectoryCard:
    c = DirectoryCard(str(tmp_path / "card"), num_dbs=2)
    c.open()
    return c


# ---------------------------------------------------------------- every kind


def test_a_card_offers_its_list_as_a_channel_not_as_a_card_method(medium: Medium) -> None:
    card = medium.open()
    assert isinstance(card.heads, HeadsChannel)
    assert not hasattr(Card, "merge_heads") and not hasattr(card, "merge_heads")


def test_the_list_is_the_union_of_what_every_card_object_added(medium: Medium) -> None:
    one, two = medium.open(), medium.open()
    assert one.heads is not None and two.heads is not None
    assert one.heads.merge(set()) == set()
    assert one.heads.merge({1, 2, 3}) == {1, 2, 3}
    assert two.heads.merge({3, 4, 2**64 - 1}) == {1, 2, 3, 4, 2**64 - 1}
    assert one.heads.merge(set()) == {1, 2, 3, 4, 2**64 - 1}
    assert one.clean() >= 0 and two.heads.merge(set()) == {1, 2, 3, 4, 2**64 - 1}, "clean keeps the heads"


def test_heads_the_channel_wrote_are_where_cards_always_kept_them_and_read_back_after_a_reopen(
        medium: Medium) -> None:
    card = medium.open()
    assert card.heads is not None
    assert card.heads.merge([5, 1 << 63, 7]) == {5, 7, 1 << 63}
    stored = medium.stored()
    assert sorted(stored) == [5, 7, 1 << 63], "the same file or key, the same little-endian u64s"
    if medium.kind != "redis":
        assert stored == [5, 7, 1 << 63], "a directory's list is appended in order (sorted within one append)"
    medium.reopen()
    again = medium.open()
    assert again.heads is not None and again.heads.merge(set()) == {5, 7, 1 << 63}


def test_a_list_a_card_held_before_the_channel_is_read_and_added_to(medium: Medium) -> None:
    card = medium.open()
    assert card.heads is not None
    medium.store([11, 12, 1 << 63])
    assert card.heads.merge(set()) == {11, 12, 1 << 63}
    assert card.heads.merge({12, 13}) == {11, 12, 13, 1 << 63}
    if medium.kind == "redis":
        assert medium.stored() == [11, 12, 13, 1 << 63]
    else:
        assert medium.stored() == [11, 12, 1 << 63, 13], "only what was missing is appended"


def test_the_list_keeps_at_most_card_max_heads(medium: Medium, monkeypatch) -> None:
    """Gateways that keep learning (system prompts change) never grow a card's list past its bound.

    The card server runs in this process, so the bound patched here is the one it keeps too."""
    monkeypatch.setattr("kvgate.cards.directory.heads.CARD_MAX_HEADS", 50)
    monkeypatch.setattr("kvgate.cards.redis.heads.CARD_MAX_HEADS", 50)
    card = medium.open()
    assert card.heads is not None
    for start in range(0, 400, 40):
        got = card.heads.merge(set(range(start, start + 40)))
        assert len(got) == min(50, start + 40)
    final = card.heads.merge(set())
    assert len(final) == 50 and final <= set(range(400)) and len(medium.stored()) == 50
    if medium.kind != "redis":  # a set has no order: Redis drops any
        assert final == set(range(350, 400)), "a directory's list drops its oldest ids"


# ---------------------------------------------------------------- a directory's file


@pytest.mark.slow  # starts processes
def test_a_directory_s_list_from_several_processes_is_their_union(tmp_path: Path) -> None:
    """Gateways on other hosts append to the same list: concurrent appends lose nothing, a torn tail is dropped."""
    card = DirectoryCard(str(tmp_path / "card"))
    card.open()
    assert card.heads.merge(set()) == set()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        pool.starmap(_append_heads, [(card.location, range(w * 1000, w * 1000 + 1000)) for w in range(4)])
    assert card.heads.merge(set()) == set(range(4000))
    path = tmp_path / "card" / HEADS_FILE
    assert path.stat().st_size == 4000 * 8, "no id written twice"
    with open(path, "ab") as f:
        f.write(b"\x07\x07\x07")  # a crash in the middle of an append
    assert card.heads.merge(set()) == set(range(4000))
    assert card.heads.merge({5000}) == set(range(4000)) | {5000}
    assert path.stat().st_size == 4001 * 8
    card.clean()
    assert card.heads.merge(set()) == set(range(4000)) | {5000}, "clean keeps the heads"


def _append_heads(location: str, ids) -> None:
    card = DirectoryCard(location)
    card.open()
    for start in range(0, len(ids), 100):
        card.heads.merge(set(ids[start : start + 100]))


def test_a_directory_s_list_keeps_its_newest_ids_and_writes_over_a_torn_append(card: DirectoryCard,
                                                                             monkeypatch) -> None:
    monkeypatch.setattr("kvgate.cards.directory.heads.CARD_MAX_HEADS", 50)
    path = Path(card.location) / HEADS_FILE
    assert card.heads.merge(set(range(30))) == set(range(30))
    with open(path, "ab") as f:
        f.write(b"\x07\x07")  # a torn append
    assert card.heads.merge(set(range(30, 60))) == set(range(10, 60)), "the oldest ids go first"
    assert path.stat().st_size == 50 * 8
    assert card.heads.merge(set(range(55, 70))) == set(range(20, 70))
    assert card.heads.merge(set(range(1000, 1100))) == set(range(1050, 1100)), "one append over the bound"
    assert card.heads.merge(set()) == set(range(1050, 1100)) and path.stat().st_size == 50 * 8


def test_a_directory_s_read_creates_no_file(card: DirectoryCard) -> None:
    assert card.heads.merge(set()) == set()
    assert not (Path(card.location) / HEADS_FILE).exists()


# ---------------------------------------------------------------- Redis: the hash tag


@pytest.mark.slow  # starts a redis-server
@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_a_tagged_redis_card_keeps_its_list_behind_its_tag() -> None:
    """A Redis Cluster primary's card: every key, the list's too, behind ``{tag}`` (one hash slot)."""
    d = tempfile.mkdtemp(prefix="kvh", dir="/tmp")
    server = RedisServer(d, "noeviction").start()
    card = RedisCard(f"{server.url}?kvgate_tag=kvgate-0")
    try:
        card.open()
        assert card.heads is not None and card.heads.merge({1, 2}) == {1, 2}
        r = server.raw()
        assert r.smembers(b"{kvgate-0}" + HEADS_KEY) == {(1).to_bytes(8, "little"), (2).to_bytes(8, "little")}
        assert not r.exists(HEADS_KEY)
        r.close()
    finally:
        card.close()
        server.kill()
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- the card server


def test_a_network_card_s_list_is_its_served_directory_s(served: Medium) -> None:
    card = served.open()
    assert card.heads is not None
    assert card.heads.merge([1, 2]) == {1, 2}
    served.local.heads.merge([3])
    assert card.heads.merge([2, 1 << 63]) == {1, 2, 3, 1 << 63}


def test_the_card_server_refuses_ids_that_are_no_u64s_and_keeps_the_list(served: Medium) -> None:
    card = served.open()
    assert card.heads is not None and card.heads.merge([1]) == {1}
    assert served.exporter is not None
    s = socket.create_connection(("127.0.0.1", served.exporter.port), timeout=5)
    with s:
        s.sendall(w.frame(w.Hello(served.local.serial, 2)))
        assert isinstance(_reply(s)[0], w.Ok)
        s.sendall(w.frame(w.MergeHeads([2, -1])))
        err, _ = _reply(s)
        assert isinstance(err, w.Err) and err.kind == "bad_request" and "not u64s" in err.message, err
    assert card.heads.merge(set()) == {1}


def _reply(s: socket.socket) -> tuple[w.Msg, bytes]:
    prefix = bytearray(w.PREFIX.size)
    w.recv_exact(s, memoryview(prefix))
    hlen, blen = w.parse_prefix(prefix, 1 << 20, 1 << 30)
    return w.decode_reply(w.recv_body(s, hlen)), bytes(w.recv_body(s, blen))
