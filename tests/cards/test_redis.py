"""RedisCard against real redis-server processes (TCP and Unix socket).

Every test starts its own server (``--save "" --appendonly no``) on a free
loopback port and a Unix socket, and kills it at teardown.  Skipped only when
``redis-server`` is not installed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from kvgate.cards import (
    BufferTooSmall,
    Card,
    CardInUse,
    CardUnavailable,
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    RedisCard,
)
from kvgate.cards.redis import objects as redisobjects
from kvgate.cards.base import BOOT_ID, HOST
from kvgate.cards.objectformat import CHECKSUM_PIECE, header_size, pack_header
from kvgate.cards.redis.card import UNLIMITED_FREE_BYTES
from kvgate.cards.redis.keys import LABEL_KEY, LEASE_KEY, PROBE_KEY
from kvgate.cards.redis.lease import LEASE_TTL_MS
from kvgate.cards.redis.packer import ZERO_COPY, ArgumentParts, ZeroCopyPacker
from kvgate.keys import key_digest, payload_hash
from tests.cards.common import key, payload_for
from tests.processes import REDIS_SERVER, RedisServer

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (apt-get install -y --no-install-recommends redis-server)",
)

P = CHECKSUM_PIECE
GUARD = 4096
GUARD_BYTE = 0xEE
FAST_MS = 300  # io_timeout_ms for the failure tests


@pytest.fixture
def server_factory() -> Iterator:
    servers: list[RedisServer] = []
    dirs: list[str] = []

    def make(policy: str = "allkeys-lru", extra: tuple[str, ...] = (), start: bool = True) -> RedisServer:
        # A short directory: a Unix socket path must fit in 108 bytes.
        d = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
        dirs.append(d)
        s = RedisServer(d, policy, extra, unix_socket=True)
        servers.append(s)
        return s.start() if start else s

    yield make
    for s in servers:
        s.kill()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(server_factory) -> RedisServer:
    return server_factory()


@pytest.fixture
def cards() -> Iterator[list[RedisCard]]:
    made: list[RedisCard] = []
    yield made
    for c in made:
        c.close()


def open_card(cards: list[RedisCard], location: str, **kw) -> RedisCard:
    c = RedisCard(location, **kw)
    cards.append(c)
    c.open()
    return c


@pytest.fixture(params=["tcp", "unix"])
def card(request, server: RedisServer, cards: list[RedisCard]) -> RedisCard:
    url = server.url if request.param == "tcp" else server.unix_url
    return open_card(cards, url, num_dbs=2)


def read_back(c: RedisCard, k: bytes, size_hint: int) -> tuple[Header, np.ndarray]:
    buf = np.empty(size_hint, dtype=np.uint8)
    h = c.read_into(k, memoryview(buf))
    return h, buf[: h.payload_len]


def object_keys(srv: RedisServer) -> set[bytes]:
    r = srv.raw()
    try:
        return set(r.scan_iter(match=b"kvgate:o:*"))
    finally:
        r.close()


# ---------------------------------------------------------------- round trip


def test_a_read_hands_over_its_payload_in_few_large_copies(card: RedisCard) -> None:
    """Each guarded copy has a fixed cost (a kernel call when the destination is a client region): 1 MiB pieces."""
    from kvgate.memcopy import Abandon

    class Counting(Abandon):
        __slots__ = ("sizes",)

        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def copy(self, dst, src) -> None:
            self.sizes.append(len(memoryview(src)))
            super().copy(dst, src)

    size = (2 << 20) + 100
    k = key("pieces")
    data = payload_for(k, size)
    card.write(k, memoryview(data), ObjectMeta())
    out = np.zeros(size, np.uint8)
    guard = Counting()
    card.read_into(k, memoryview(out), guard)
    assert np.array_equal(out, data)
    assert guard.sizes == [1 << 20, 1 << 20, 100]


def test_interface_and_value_layout(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, num_dbs=3)
    assert isinstance(c, Card) and RedisCard.kind == "redis"
    assert c.serial is not None and c.serial in repr(c)
    k = key("layout")
    data = payload_for(k, 5000)
    meta = ObjectMeta(position=7, created_ns=99)
    c.write(k, memoryview(data), meta)
    d = key_digest(k)
    rkey = b"kvgate:o:%d:" % (int.from_bytes(d[:4], "little") % 3) + d.hex().encode()
    assert c.object_key(k) == rkey
    raw = server.raw()
    # Exactly the on-card object format: header + payload.
    assert raw.get(rkey) == pack_header(k, len(data), payload_hash(memoryview(data)), meta) + data.tobytes()
    raw.close()


def test_packer_sends_payload_without_copying() -> None:
    payload = memoryview(np.arange(100_000, dtype=np.uint8))
    chunks = ZeroCopyPacker().pack("SET", b"k", ArgumentParts(b"HDR", payload))
    assert any(c is payload for c in chunks)  # the caller's buffer itself goes to the socket
    joined = b"".join(bytes(c) for c in chunks)
    assert joined == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100003\r\nHDR" + payload.tobytes() + b"\r\n"
    small = ZeroCopyPacker().pack("SET", b"k", ArgumentParts(b"HDR", memoryview(b"xy")), 5)
    assert b"".join(small) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nHDRxy\r\n$1\r\n5\r\n"
    assert ZERO_COPY  # this redis-py takes our packer


# ---------------------------------------------------------------- corruption


def _mutate(value: bytes, how: str, k: bytes, other_value: bytes) -> bytes:
    hs = header_size(k)
    b = bytearray(value)
    if how == "payload-byte":
        b[hs + P + 3] ^= 0x40
    elif how == "payload-last":
        b[-1] ^= 0x40
    elif how == "header-magic":
        b[0] ^= 0x40
    elif how == "header-crc":
        b[65] ^= 0x40
    elif how == "truncate":
        del b[-1]
    elif how == "truncate-header":
        del b[hs - 5 :]
    elif how == "append":
        b += b"\0"
    elif how == "other-key":
        return other_value
    return bytes(b)


@pytest.mark.parametrize(
    "how", ["payload-byte", "payload-last", "header-magic", "header-crc", "truncate", "truncate-header", "append",
            "other-key", "wrong-type"])
def test_corruption_is_detected_and_deleted(server: RedisServer, cards: list[RedisCard], how: str) -> None:
    card = open_card(cards, server.url)
    k, other = key("victim"), key("other")
    size = 2 * P + 5
    card.write(k, memoryview(payload_for(k, size)), ObjectMeta())
    card.write(other, memoryview(payload_for(other, size)), ObjectMeta())
    raw = server.raw()
    rk = card.object_key(k)
    if how == "wrong-type":
        raw.delete(rk)
        raw.hset(rk, "a", "b")
    else:
        raw.set(rk, _mutate(raw.get(rk), how, k, raw.get(card.object_key(other))))
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, memoryview(np.zeros(size + 10, dtype=np.uint8)))
    assert not raw.exists(rk)
    assert card.exists(other)
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(np.zeros(size + 10, dtype=np.uint8)))
    raw.close()


def test_corrupt_delete_spares_a_rewrite(server: RedisServer, cards: list[RedisCard]) -> None:
    # The conditional delete only removes the value that was found bad.
    card = open_card(cards, server.url)
    k = key("rewritten")
    card.write(k, memoryview(b"good"), ObjectMeta())
    rk = card.object_key(k)
    raw = server.raw()
    bad = raw.get(rk)[:-1] + b"X"
    card.write(k, memoryview(b"newer"), ObjectMeta())  # written after the reader got `bad`
    card._objects.discard(rk, bad)
    assert read_back(card, k, 10)[1].tobytes() == b"newer"
    raw.set(rk, bad)
    card._objects.discard(rk, bad)
    assert not raw.exists(rk)
    raw.close()


# --------------------------------------------------------------------- batches


def test_batches_give_per_object_results(server: RedisServer, cards: list[RedisCard],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    card = open_card(cards, server.unix_url, num_dbs=2)
    keys = [key(i) for i in range(6)]
    datas = [payload_for(k, 1000 * (i + 1)) for i, k in enumerate(keys)]
    pipelines = []
    real_pipeline = card._r.pipeline
    monkeypatch.setattr(card._r, "pipeline", lambda *a, **kw: pipelines.append(1) or real_pipeline(*a, **kw))
    monkeypatch.setattr(card._r, "execute_command", lambda *a, **kw: pytest.fail(f"not pipelined: {a[:1]}"))

    written = card.write_many([(k, memoryview(d), ObjectMeta(position=i)) for i, (k, d) in enumerate(zip(keys, datas))])
    assert written == [header_size(k) + len(d) for k, d in zip(keys, datas)]
    assert len(pipelines) == 1
    monkeypatch.undo()

    raw = server.raw()
    corrupt, miss, small = keys[2], key("missing"), keys[4]
    v = bytearray(raw.get(card.object_key(corrupt)))
    v[-3] ^= 1
    raw.set(card.object_key(corrupt), bytes(v))

    monkeypatch.setattr(card._r, "pipeline", lambda *a, **kw: pipelines.append(1) or real_pipeline(*a, **kw))
    pipelines.clear()
    assert card.exists_many([keys[0], miss, keys[5]]) == [True, False, True]
    bufs = [np.zeros(10_000, dtype=np.uint8) for _ in range(5)]
    bufs[3] = np.zeros(10, dtype=np.uint8)  # too small for keys[4]
    order = [keys[0], miss, corrupt, small, keys[5]]
    res = card.read_many_into([(k, memoryview(b)) for k, b in zip(order, bufs)])
    assert len(pipelines) == 2  # exists_many + read_many_into (the corrupt delete is its own call)
    monkeypatch.undo()

    assert isinstance(res[0], Header) and res[0].meta.position == 0
    assert np.array_equal(bufs[0][:1000], datas[0])
    assert isinstance(res[1], ObjectMissing)
    assert isinstance(res[2], ObjectCorrupt)
    assert isinstance(res[3], BufferTooSmall) and res[3].needed == len(datas[4])
    assert isinstance(res[4], Header) and np.array_equal(bufs[4][: len(datas[5])], datas[5])
    assert not raw.exists(card.object_key(corrupt))  # the corrupt one is gone...
    assert raw.exists(card.object_key(small))  # ...the one that did not fit is kept
    assert card.write_many([]) == [] and card.read_many_into([]) == [] and card.exists_many([]) == []
    raw.close()


def test_read_many_splits_huge_batches(server: RedisServer, cards: list[RedisCard],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redisobjects, "_READ_PIPELINE_BYTES", 3000)
    card = open_card(cards, server.url)
    keys = [key(i) for i in range(5)]
    card.write_many([(k, memoryview(payload_for(k, 1000)), ObjectMeta()) for k in keys])
    bufs = [np.zeros(1000, dtype=np.uint8) for _ in keys]
    res = card.read_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
    assert all(isinstance(r, Header) for r in res)
    assert all(np.array_equal(b, payload_for(k, 1000)) for k, b in zip(keys, bufs))


def test_out_of_memory_write_is_not_card_unavailable(server_factory, cards: list[RedisCard]) -> None:
    srv = server_factory(policy="noeviction", extra=("--maxmemory", "4mb"))
    card = open_card(cards, srv.url)
    assert card.free_bytes() < 4 << 20
    blob = np.ones(1 << 20, dtype=np.uint8)
    errors = []
    for i in range(12):
        r = card.write_many([(key(i), memoryview(blob), ObjectMeta())])[0]
        if isinstance(r, BaseException):
            errors.append(r)
    assert errors, "the server never refused a write"
    assert all(isinstance(e, OSError) and not isinstance(e, CardUnavailable) for e in errors)
    assert errors[0].errno == 28
    assert card.check() == card.serial


# --------------------------------------------------------------------- label


def test_label_created_once_and_stable(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url)
    raw = server.raw()
    label = json.loads(raw.get(LABEL_KEY))
    assert label["serial"] == c.serial and label["format"] == 1 and "created" in label
    before = raw.get(LABEL_KEY)
    assert c.open() == c.serial
    assert open_card(cards, server.unix_url, num_dbs=4).serial == c.serial
    assert c.check() == c.serial
    assert raw.get(LABEL_KEY) == before
    assert raw.dbsize() == 1  # nothing but the label
    raw.close()


def test_cards_racing_to_open_agree(server_factory, cards: list[RedisCard]) -> None:
    for _ in range(3):
        srv = server_factory()
        racers = [RedisCard(srv.url if i % 2 else srv.unix_url) for i in range(6)]
        cards.extend(racers)
        for c in racers:  # connect first, so the race is between SET NXs
            c._r.ping()
        go = threading.Barrier(len(racers))
        serials: list[str] = []

        def run(c: RedisCard) -> None:
            go.wait()
            serials.append(c.open())

        threads = [threading.Thread(target=run, args=(c,)) for c in racers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(serials) == len(racers) and len(set(serials)) == 1
        raw = srv.raw()
        assert json.loads(raw.get(LABEL_KEY))["serial"] == serials[0]
        raw.close()


def test_two_servers_get_different_serials(server_factory, cards: list[RedisCard]) -> None:
    a, b = server_factory(), server_factory()
    assert open_card(cards, a.url).serial != open_card(cards, b.url).serial


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"format": 1}', b'{"serial": "ab", "format": 2}'])
def test_bad_label_is_unavailable(server: RedisServer, cards: list[RedisCard], content: bytes) -> None:
    raw = server.raw()
    raw.set(LABEL_KEY, content)
    with pytest.raises(CardUnavailable):
        open_card(cards, server.url)
    assert raw.get(LABEL_KEY) == content  # never rewritten
    raw.close()


def test_label_of_wrong_type_is_unavailable(server: RedisServer, cards: list[RedisCard]) -> None:
    raw = server.raw()
    raw.hset(LABEL_KEY, "serial", "x")
    with pytest.raises(CardUnavailable):
        open_card(cards, server.url)
    raw.close()


def test_check_before_open_needs_a_label(server: RedisServer, cards: list[RedisCard]) -> None:
    c = RedisCard(server.url)
    cards.append(c)
    with pytest.raises(CardUnavailable, match="label"):
        c.check()


# --------------------------------------------------------------------- shards


def test_num_dbs_spreads_keys_over_prefixes(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, num_dbs=4)
    keys = [key(i) for i in range(64)]
    c.write_many([(k, memoryview(payload_for(k, 50)), ObjectMeta()) for k in keys])
    expected = set()
    for k in keys:
        d = key_digest(k)
        expected.add(b"kvgate:o:%d:%s" % (int.from_bytes(d[:4], "little") % 4, d.hex().encode()))
    found = object_keys(server)
    assert found == expected
    assert {n.split(b":")[2] for n in found} == {b"0", b"1", b"2", b"3"}
    assert {o.full_key for o in c.scan()} == set(keys)


def test_scan_relocates_objects_after_num_dbs_change(server: RedisServer, cards: list[RedisCard]) -> None:
    old = open_card(cards, server.url, num_dbs=3)
    keys = [key(i) for i in range(30)]
    old.write_many([(k, memoryview(payload_for(k, 40)), ObjectMeta(position=1)) for k in keys])
    new = open_card(cards, server.url, num_dbs=2)
    # One key also written under its new name: that copy wins, the old one goes.
    dup = keys[0]
    new.write(dup, memoryview(payload_for(dup, 40)), ObjectMeta(position=2))
    found = list(new.scan())
    assert sorted({o.full_key for o in found}) == sorted(keys)
    assert len(found) == len(keys)
    for k in keys:
        assert np.array_equal(read_back(new, k, 100)[1], payload_for(k, 40))
    assert read_back(new, dup, 100)[0].meta.position == 2
    assert object_keys(server) == {new.object_key(k) for k in keys}


# ---------------------------------------------------------------------- scan


def test_scan_deletes_corrupt_and_skips_foreign(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url)
    good, bad_hdr, short, wrong_name = key("good"), key("bad"), key("short"), key("wrong")
    c.write_many([(k, memoryview(payload_for(k, 500)), ObjectMeta()) for k in (good, bad_hdr, short, wrong_name)])
    raw = server.raw()
    v = bytearray(raw.get(c.object_key(bad_hdr)))
    v[2] ^= 1
    raw.set(c.object_key(bad_hdr), bytes(v))
    raw.set(c.object_key(short), raw.get(c.object_key(short))[:300])
    misnamed = c.object_key(key("elsewhere"))
    raw.set(misnamed, raw.get(c.object_key(wrong_name)))
    typed = c.object_key(key("typed"))
    raw.hset(typed, "x", "y")
    foreign = [b"kvgate:o:not-ours", b"kvgate:o:0:xyz", b"user:x"]
    for f in foreign:
        raw.set(f, b"not ours")
    assert c.scan_corrupt == 0
    assert sorted(o.full_key for o in c.scan()) == sorted([good, wrong_name])
    assert c.scan_corrupt == 3  # the bad header, the short value and the misnamed one
    for gone in (c.object_key(bad_hdr), c.object_key(short), misnamed, typed):
        assert not raw.exists(gone)
    assert all(raw.exists(f) for f in foreign)
    raw.close()


# ---------------------------------------------------------------------- clean


def test_clean_keeps_label_and_foreign_keys(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, num_dbs=3)
    keys = [key(i) for i in range(1200)]  # more than one UNLINK batch
    c.write_many([(k, memoryview(b"payload"), ObjectMeta()) for k in keys])
    raw = server.raw()
    raw.set(b"user:x", b"keep me")
    raw.set(b"kvgate:other", b"keep me too")
    assert c.clean() == len(keys)
    assert list(c.scan()) == [] and object_keys(server) == set()
    assert raw.get(b"user:x") == b"keep me" and raw.get(b"kvgate:other") == b"keep me too"
    assert c.check() == c.serial
    assert open_card(cards, server.url).serial == c.serial
    c.write(keys[0], memoryview(b"again"), ObjectMeta())
    assert c.clean() == 1
    raw.close()


# ------------------------------------------------------------ server settings


@pytest.mark.parametrize("policy, warned", [("noeviction", False), ("allkeys-lru", True), ("volatile-lru", True)])
def test_eviction_policy_warning(server_factory, cards: list[RedisCard], caplog: pytest.LogCaptureFixture,
                                 policy: str, warned: bool) -> None:
    srv = server_factory(policy=policy)
    with caplog.at_level(logging.WARNING, logger="kvgate.cards.redis"):
        c = open_card(cards, srv.url)
    assert c.maxmemory_policy == policy
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvgate.cards.redis"]
    expected = f"redis card {srv.url}: maxmemory-policy is {policy}: the server may drop objects the gateway"
    assert any(m.startswith(expected) and "set maxmemory-policy noeviction" in m for m in msgs) is warned
    if not warned:
        assert msgs == []


def test_config_command_forbidden_is_tolerated(server_factory, cards: list[RedisCard]) -> None:
    srv = server_factory(extra=("--rename-command", "CONFIG", ""))
    c = open_card(cards, srv.url)
    assert c.maxmemory_policy is None
    c.write(key(1), memoryview(b"x"), ObjectMeta())
    assert read_back(c, key(1), 10)[1].tobytes() == b"x"


def test_free_bytes(server_factory, cards: list[RedisCard]) -> None:
    assert open_card(cards, server_factory().url).free_bytes() == UNLIMITED_FREE_BYTES
    limited = open_card(cards, server_factory(extra=("--maxmemory", "64mb")).url)
    before = limited.free_bytes()
    assert 0 < before < 64 << 20
    limited.write(key(1), memoryview(np.ones(4 << 20, dtype=np.uint8)), ObjectMeta())
    assert limited.free_bytes() < before - (3 << 20)


def test_password_and_db_index(server_factory, cards: list[RedisCard]) -> None:
    srv = server_factory(extra=("--requirepass", "s3cret"))
    c = open_card(cards, f"redis://:s3cret@127.0.0.1:{srv.port}/2")
    c.write(key(1), memoryview(b"x"), ObjectMeta())
    raw = srv.raw(password="s3cret", db=2)
    assert raw.exists(c.object_key(key(1))) and raw.exists(LABEL_KEY)
    assert srv.raw(password="s3cret", db=0).dbsize() == 0
    assert "s3cret" not in repr(c) and "***" in repr(c)
    wrong = RedisCard(f"redis://:nope@127.0.0.1:{srv.port}", io_timeout_ms=FAST_MS)
    cards.append(wrong)
    with pytest.raises(CardUnavailable) as info:
        wrong.open()
    assert "nope" not in str(info.value)
    raw.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RedisCard("localhost:6379")
    with pytest.raises(ValueError):
        RedisCard("redis://127.0.0.1:1", num_dbs=0)


# ------------------------------------------------------------------- failures


def _assert_all_unavailable(c: RedisCard, k: bytes) -> None:
    buf = memoryview(bytearray(100))
    for call in (c.check, lambda: c.read_into(k, buf), lambda: c.write(k, memoryview(b"d"), ObjectMeta()),
                 lambda: c.exists(k), lambda: c.delete(k), c.free_bytes, c.clean, lambda: list(c.scan())):
        t0 = time.monotonic()
        with pytest.raises(CardUnavailable):
            call()
        assert time.monotonic() - t0 < 2.0
    for res in (c.read_many_into([(k, buf), (key("x"), buf)]), c.exists_many([k, key("x")]),
                c.write_many([(k, memoryview(b"d"), ObjectMeta()), (key("x"), memoryview(b"d"), ObjectMeta())])):
        assert len(res) == 2 and all(isinstance(r, CardUnavailable) for r in res)
        assert res[0] is not res[1]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_killed_server_is_unavailable_quickly(server: RedisServer, cards: list[RedisCard], transport: str) -> None:
    c = open_card(cards, server.url if transport == "tcp" else server.unix_url, io_timeout_ms=FAST_MS)
    k = key("k")
    c.write(k, memoryview(b"data"), ObjectMeta())
    server.kill()
    t0 = time.monotonic()
    _assert_all_unavailable(c, k)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(CardUnavailable):
        c.open()


def test_hung_server_times_out_then_recovers(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, io_timeout_ms=FAST_MS)
    k = key("k")
    data = payload_for(k, 1000)
    c.write(k, memoryview(data), ObjectMeta())
    server.pause()
    try:
        for call in (lambda: c.read_into(k, memoryview(bytearray(2000))), c.check):
            t0 = time.monotonic()
            # a hang is a timeout (a strike for the card's health), not "card gone"
            with pytest.raises(TimeoutError) as info:
                call()
            elapsed = time.monotonic() - t0
            assert FAST_MS / 1000 * 0.8 < elapsed < 2.0
            assert not isinstance(info.value, CardUnavailable) and info.value.errno == errno.ETIMEDOUT
        t0 = time.monotonic()
        res = c.read_many_into([(k, memoryview(bytearray(2000))), (key("y"), memoryview(bytearray(10)))])
        assert all(isinstance(r, TimeoutError) for r in res) and time.monotonic() - t0 < 2.0
    finally:
        server.resume()
    assert c.check() == c.serial
    assert np.array_equal(read_back(c, k, 2000)[1], data)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_server_restarted_empty_is_the_same_card(server: RedisServer, cards: list[RedisCard],
                                                 transport: str, caplog: pytest.LogCaptureFixture) -> None:
    c = open_card(cards, server.url if transport == "tcp" else server.unix_url, io_timeout_ms=FAST_MS)
    serial = c.serial
    k = key("k")
    c.write(k, memoryview(b"data"), ObjectMeta())
    server.restart_empty()
    with caplog.at_level(logging.WARNING, logger="kvgate.cards.redis"):
        assert c.check() == serial
    assert any("label re-created" in r.getMessage() for r in caplog.records)
    raw = server.raw()
    assert json.loads(raw.get(LABEL_KEY))["serial"] == serial
    with pytest.raises(ObjectMissing):
        c.read_into(k, memoryview(bytearray(10)))
    assert c.check() == serial
    c.write(k, memoryview(b"new"), ObjectMeta())
    assert read_back(c, k, 10)[1].tobytes() == b"new"
    # A second gateway started later sees the same serial too.
    assert open_card(cards, server.url).serial == serial
    raw.close()


def test_open_again_after_empty_restart_keeps_serial(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, io_timeout_ms=FAST_MS)
    serial = c.serial
    server.restart_empty()
    assert c.open() == serial


def test_write_to_restarted_server_before_check_is_undone(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, io_timeout_ms=FAST_MS)
    serial = c.serial
    server.restart_empty()
    # The health check has not run yet: the write lands on a server without a label.
    res = c.write_many([(key(1), memoryview(b"a"), ObjectMeta()), (key(2), memoryview(b"b"), ObjectMeta())])
    assert all(isinstance(r, CardUnavailable) for r in res)
    with pytest.raises(CardUnavailable, match="label"):
        c.write(key(3), memoryview(b"c"), ObjectMeta())
    raw = server.raw()
    assert raw.dbsize() == 0  # undone: nothing unlabelled is left behind...
    assert c.check() == serial  # ...so the card can be taken back
    assert c.write(key(1), memoryview(b"a"), ObjectMeta()) > 0
    raw.close()


def test_label_missing_with_objects_present_is_refused(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, io_timeout_ms=FAST_MS)
    serial = c.serial
    c.write(key(1), memoryview(b"a"), ObjectMeta())
    raw = server.raw()
    raw.set(b"user:x", b"foreign")  # the server is not empty, but of kvgate data it holds only objects
    raw.delete(LABEL_KEY)
    with pytest.raises(CardUnavailable, match="objects are present"):
        c.check()
    assert not raw.exists(LABEL_KEY)
    raw.delete(c.object_key(key(1)))
    assert c.check() == serial  # foreign keys alone do not stop it
    raw.close()


def test_other_server_at_same_address_has_another_serial(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url, io_timeout_ms=FAST_MS)
    server.kill()
    server.start()
    other = open_card(cards, server.unix_url)  # another card's label is there first
    assert other.serial != c.serial
    assert c.check() == other.serial
    raw = server.raw()
    assert json.loads(raw.get(LABEL_KEY))["serial"] == other.serial  # not overwritten
    raw.close()


# ---------------------------------------------------------------- a replica


def test_a_replica_refuses_writes_as_read_only_and_still_serves_reads(server: RedisServer, cards) -> None:
    """A server turned into a replica answers READONLY: EROFS, which the gateway keeps serving reads from."""
    c = open_card(cards, server.url)
    c.claim(False)
    payload = np.random.default_rng(7).integers(0, 256, 10_000, dtype=np.uint8)
    c.write(key(1), memoryview(payload), ObjectMeta())
    c.check_writable()
    r = server.raw()
    r.execute_command("CONFIG", "SET", "repl-diskless-load", "disabled")
    r.execute_command("REPLICAOF", "127.0.0.1", "1")  # nothing listens there: it stays a replica with its data
    try:
        with pytest.raises(CardUnavailable) as e:
            c.write(key(2), memoryview(payload), ObjectMeta())
        assert e.value.errno == errno.EROFS
        with pytest.raises(CardUnavailable) as e:
            c.check_writable()
        assert e.value.errno == errno.EROFS
        _h, got = read_back(c, key(1), 20_000)
        assert np.array_equal(got, payload)
        # its lease cannot be renewed there, and need not be: the health check passes, reads go on
        assert c.check() == c.serial
        c.claim(False)
    finally:
        r.execute_command("REPLICAOF", "NO", "ONE")
    c.check_writable()
    assert len(object_keys(server)) == 1 and not r.exists(PROBE_KEY)  # the probe leaves nothing behind


# ---- the lease -----------------------------------------------------------------------------


def lease_doc(host: str, pid: int, mode: str = "exclusive", expires_in_ms: int = 60_000, boot: str = "b") -> bytes:
    return json.dumps({"host": host, "boot": boot, "pid": pid, "mode": mode,
                       "expires": int(time.time() * 1000) + expires_in_ms}).encode()


def test_lease_alone_refuses_others_until_closed(server: RedisServer, cards: list[RedisCard]) -> None:
    first = open_card(cards, server.url)
    first.claim(False)
    second = open_card(cards, server.url)
    for shared in (False, True):
        with pytest.raises(CardInUse) as ei:
            second.claim(shared)
        assert f"pid {os.getpid()}" in str(ei.value) and server.url in str(ei.value)
    first.close()  # gives the lease back at once
    second.claim(False)
    assert len(server.raw().hgetall(LEASE_KEY)) == 1


def test_shared_leases_mix_only_with_shared_ones(server: RedisServer, cards: list[RedisCard]) -> None:
    a, b, c = (open_card(cards, server.url) for _ in range(3))
    a.claim(True)
    b.claim(True)
    with pytest.raises(CardInUse) as ei:
        c.claim(False)
    assert ei.value.held_shared
    assert len(server.raw().hgetall(LEASE_KEY)) == 2


def test_lease_of_a_dead_or_expired_holder_is_taken_over(server: RedisServer, cards: list[RedisCard]) -> None:
    r = server.raw()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    r.hset(LEASE_KEY, b"killed-here", lease_doc(HOST, dead.pid, boot=BOOT_ID))  # this host, pid gone
    r.hset(LEASE_KEY, b"earlier-boot", lease_doc(HOST, os.getpid(), boot="another boot"))
    r.hset(LEASE_KEY, b"ran-out", lease_doc("elsewhere", 1, expires_in_ms=-1))
    c = open_card(cards, server.url)
    c.claim(False)
    assert set(r.hgetall(LEASE_KEY)) == {c._lease.field}
    # a live holder on another host is waited out (its lease has not run out)
    c.close()
    r.hset(LEASE_KEY, b"live-elsewhere", lease_doc("elsewhere", 1))
    with pytest.raises(CardInUse, match="pid 1 on host elsewhere"):
        open_card(cards, server.url).claim(True)


def test_check_renews_the_lease_and_says_when_it_is_lost(server: RedisServer, cards: list[RedisCard]) -> None:
    c = open_card(cards, server.url)
    c.claim(False)
    r = server.raw()
    before = json.loads(r.hget(LEASE_KEY, c._lease.field))["expires"]
    time.sleep(0.05)  # the point: the clock moves on, so a renewed lease expires later
    c.check()
    assert json.loads(r.hget(LEASE_KEY, c._lease.field))["expires"] > before
    assert 0 < r.pttl(LEASE_KEY) <= LEASE_TTL_MS
    # Lost (as after a stall longer than the lease) and taken by another gateway: the card is not ours now.
    r.delete(LEASE_KEY)
    r.hset(LEASE_KEY, b"usurper", lease_doc("elsewhere", 7))
    with pytest.raises(CardInUse):
        c.check()
    # A server restarted empty loses the lease with everything else; the next check takes it again.
    server.restart_empty()
    assert c.check() == c.serial and r.hexists(LEASE_KEY, c._lease.field)
