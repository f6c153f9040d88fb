"""The contract of ``kvgate.cards.base`` checked once, against every card kind on real parts.

Each test runs on each kind's medium: a directory card in a temporary
directory, a Redis card on a real ``redis-server`` (noeviction, no
persistence; started as ``tests/cards/test_redis.py`` starts its servers, so
``slow``), and a network card talking to a real ``CardExporter`` on a free
loopback port, serving a directory card.  What only one kind does (its
layout on the medium, direct I/O, leases, the wire, TLS) is tested in that
kind's own file.  The shared heads list is no part of that contract: each
kind's channel (``kvgate.cards.heads``) is tested in test_heads_channel.py.

A ``Medium`` hands out card objects on the same storage (a new one stands
for a restarted gateway), and reaches under the card for the raw bytes of
an object, so corruption and newer formats are made the same way for all.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvgate.cards import (
    BufferTooSmall,
    Card,
    CardInUse,
    CardUnavailable,
    DirectoryCard,
    Header,
    NetworkCard,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    ObjectTooNew,
    RedisCard,
    StoredObject,
    WriteAbandoned,
)
from kvgate.cards.network.server import CardExporter
from kvgate.cards.objectformat import CHECKSUM_PIECE, header_size
from kvgate.keys import dialog_digest, full_key, key_digest
from kvgate.memcopy import Abandon, MemoryFault, ReadAbandoned
from tests.cards.common import check_snapshot_round_trip, key, payload_for
from tests.helpers import as_newer_format
from tests.processes import REDIS_SERVER, RedisServer

P = CHECKSUM_PIECE
GUARD = 4096
GUARD_BYTE = 0xEE
MAX_OBJECT = 32 << 20  # the card server's and the network card's limit here: above the largest object written
IO_TIMEOUT_MS = 1000  # a medium taken away answers within this


class Medium:
    """One card's storage, and card objects on it; every card made is closed at teardown."""

    kind = ""

    def __init__(self) -> None:
        self.made: list[Card] = []

    def new_card(self) -> Card:
        raise NotImplementedError

    def card(self) -> Card:
        """A new card object on this medium, opened."""
        c = self.new_card()
        self.made.append(c)
        c.open()
        return c

    def raw_get(self, k: bytes) -> bytes:
        """The object of ``k`` as stored (header and payload), read under the card."""
        raise NotImplementedError

    def raw_set(self, k: bytes, value: bytes) -> None:
        """Store ``value`` as the object of ``k``, under the card (no check)."""
        raise NotImplementedError

    def take_away(self) -> None:
        """Make the medium unreachable (unmounted, server killed, card server stopped)."""
        raise NotImplementedError

    def close(self) -> None:
        for c in self.made:
            c.close()


class DirectoryMedium(Medium):
    kind = "directory"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.location = str(root / "card")
        self._paths = DirectoryCard(self.location, num_dbs=2)  # object_path only: no I/O

    def new_card(self) -> Card:
        return DirectoryCard(self.location, num_dbs=2)

    def raw_get(self, k: bytes) -> bytes:
        return Path(self._paths.object_path(k)).read_bytes()

    def raw_set(self, k: bytes, value: bytes) -> None:
        path = Path(self._paths.object_path(k))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)

    def take_away(self) -> None:
        shutil.rmtree(self.location)


class RedisMedium(Medium):
    kind = "redis"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: a Unix socket path fits in 108 bytes
        self.server = RedisServer(self.dir, "noeviction", unix_socket=True).start()
        self._keys = RedisCard(self.server.url, num_dbs=2)  # object_key only: no I/O

    def new_card(self) -> Card:
        return RedisCard(self.server.url, num_dbs=2, io_timeout_ms=IO_TIMEOUT_MS)

    def raw_get(self, k: bytes) -> bytes:
        r = self.server.raw()
        try:
            return r.get(self._keys.object_key(k))
        finally:
            r.close()

    def raw_set(self, k: bytes, value: bytes) -> None:
        r = self.server.raw()
        try:
            r.set(self._keys.object_key(k), value)
        finally:
            r.close()

    def take_away(self) -> None:
        self.server.kill()

    def close(self) -> None:
        super().close()
        self.server.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class NetworkMedium(DirectoryMedium):
    """A directory card served by a real card server; raw access is to the served directory."""

    kind = "kvgate"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.local = DirectoryCard(self.location, num_dbs=2)
        self.local.open()
        self.exporter = CardExporter([self.local], "127.0.0.1", 0, max_object_bytes=MAX_OBJECT,
                                     frame_timeout=1.0).start()
        self.url = self.exporter.urls()[self.local.serial]

    def new_card(self) -> Card:
        return NetworkCard(self.url, num_dbs=2, io_timeout_ms=IO_TIMEOUT_MS, max_object_bytes=MAX_OBJECT)

    def take_away(self) -> None:
        self.exporter.stop()

    def close(self) -> None:
        super().close()
        self.exporter.stop()
        self.local.close()


_needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (make services)")


@pytest.fixture(params=["directory", "network",
                        pytest.param("redis", marks=[pytest.mark.slow, _needs_redis])])  # slow: starts a server
def medium(request, tmp_path: Path) -> Iterator[Medium]:
    m = {"directory": lambda: DirectoryMedium(tmp_path), "network": lambda: NetworkMedium(tmp_path),
         "redis": RedisMedium}[request.param]()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def card(medium: Medium) -> Card:
    return medium.card()


def read_back(c: Card, k: bytes, size_hint: int) -> tuple[Header, np.ndarray]:
    buf = np.empty(size_hint, dtype=np.uint8)
    h = c.read_into(k, memoryview(buf))
    return h, buf[: h.payload_len]


def stored_of(c: Card, k: bytes) -> StoredObject:
    (found,) = c.stored_objects([key_digest(k)])
    assert found is not None
    return found


# ---------------------------------------------------------------- the card itself


def test_open_check_and_reopen_give_one_serial(medium: Medium, card: Card) -> None:
    assert isinstance(card, Card) and card.kind == medium.kind
    assert card.serial and card.serial in repr(card)
    assert card.open() == card.serial and card.check() == card.serial
    assert medium.card().serial == card.serial, "another card object on the same medium: the same card"
    with pytest.raises(ValueError, match="num_dbs"):
        type(card)(card.location, num_dbs=0)


def test_an_exclusive_claim_refuses_every_other_until_closed(medium: Medium, card: Card) -> None:
    card.claim(False)
    card.claim(False)  # calling again renews it
    other = medium.card()
    for shared in (False, True):
        with pytest.raises(CardInUse) as ei:
            other.claim(shared)
        assert isinstance(ei.value, CardUnavailable) and ei.value.errno == errno.EBUSY
        msg = str(ei.value)
        assert f"pid {os.getpid()}" in msg and "holding it exclusively" in msg and "shared_storage" in msg, msg
    card.close()
    claim_once_let_go(other, False)


def claim_once_let_go(card: Card, shared: bool, within: float = 5.0) -> None:
    """``card.claim(shared)`` once the holder's close reached the medium: a card server lets a claim go when
    its connection's thread has seen the close, a moment after the client closed (longer on a loaded host)."""
    deadline = time.monotonic() + within
    while True:
        try:
            card.claim(shared)
            return
        except CardInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_shared_claims_mix_only_with_shared_ones(medium: Medium) -> None:
    a, b, c = medium.card(), medium.card(), medium.card()
    a.claim(True)
    b.claim(True)
    with pytest.raises(CardInUse) as ei:
        c.claim(False)
    assert ei.value.held_shared and not ei.value.want_shared and "holding it shared" in str(ei.value)
    a.close()
    with pytest.raises(CardInUse):
        c.claim(False)  # b still holds it
    b.close()
    claim_once_let_go(c, False)


def test_the_write_probe_leaves_nothing(card: Card) -> None:
    k = key("kept")
    card.write(k, memoryview(b"x"), ObjectMeta())
    card.check_writable()
    assert [o.full_key for o in card.scan()] == [k]


def test_capacity_free_bytes_reserve_and_the_used_bytes_of_objects(card: Card) -> None:
    free = card.free_bytes()
    assert isinstance(free, int) and free > 0
    reserve = card.reserve_bytes(1 << 30)
    assert isinstance(reserve, int) and reserve >= 0
    why = card.why_empty(0, 0, 1 << 30)
    assert isinstance(why, str) and why
    sizes = {key(i): 1000 * i + 7 for i in range(5)}
    stored = {k: card.write(k, memoryview(payload_for(k, n)), ObjectMeta()) for k, n in sizes.items()}
    for k, n in sizes.items():
        assert stored[k] >= header_size(k) + n, "an object takes at least its header and payload"
        assert stored_of(card, k).stored_bytes == stored[k], "what write said it takes is what scan says"
    assert sum(o.stored_bytes for o in card.scan()) == sum(stored.values())


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("size", [0, 1, P - 1, P, P + 1, (3 << 20) + 7])
def test_round_trip_is_byte_exact_and_touches_nothing_past_the_payload(card: Card, size: int) -> None:
    k = key(size)
    data = payload_for(k, size)
    meta = ObjectMeta(dialog=dialog_digest(b"d"), position=size, created_ns=123)
    card.write(k, memoryview(data), meta)
    slack = 1000  # a destination bigger than the payload, inside a bigger buffer
    big = np.full(GUARD + size + slack + GUARD, GUARD_BYTE, dtype=np.uint8)
    h = card.read_into(k, memoryview(big)[GUARD: GUARD + size + slack])
    assert (h.payload_len, h.full_key, h.meta) == (size, k, meta)
    assert np.array_equal(big[GUARD: GUARD + size], data)
    assert (big[:GUARD] == GUARD_BYTE).all() and (big[GUARD + size:] == GUARD_BYTE).all()
    exact = np.zeros(size, dtype=np.uint8)  # and a destination of exactly its size
    assert card.read_into(k, memoryview(exact)).payload_len == size and np.array_equal(exact, data)


def test_an_object_larger_than_one_write_of_any_medium(card: Card) -> None:
    """Many checksum pieces, many socket writes and guarded copies, beyond one Redis bulk buffer."""
    k = key("large")
    size = (20 << 20) + 5
    data = payload_for(k, size)
    card.write(k, memoryview(data), ObjectMeta(position=9))
    h, got = read_back(card, k, size)
    assert h.payload_len == size and h.meta.position == 9 and np.array_equal(got, data)
    assert stored_of(card, k).payload_len == size


def test_typed_buffers_are_handled_as_bytes(card: Card) -> None:
    k = key("f16")
    src = np.arange(P, dtype=np.float16)  # 2*P bytes, while the memoryview counts P elements
    card.write(k, memoryview(src), ObjectMeta())
    out = np.zeros(P + 10, dtype=np.float16)
    assert card.read_into(k, memoryview(out)).payload_len == src.nbytes
    assert np.array_equal(out[:P], src)


def test_an_overwrite_replaces_the_whole_object(card: Card) -> None:
    k = key("ow")
    card.write(k, memoryview(payload_for(k, 3 * P)), ObjectMeta(position=1))
    small = payload_for(k, 10)
    card.write(k, memoryview(small), ObjectMeta(position=2))
    h, got = read_back(card, k, 4 * P)
    assert h.meta.position == 2 and np.array_equal(got, small)
    assert [(o.full_key, o.payload_len) for o in card.scan()] == [(k, 10)]


# ---------------------------------------------------------------- present, absent, deleted


def test_a_missing_object_is_a_miss_everywhere(card: Card) -> None:
    k = key("nothing")
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(bytearray(10)))
    assert not card.exists(k) and card.delete(k) is False
    assert card.stored_objects([key_digest(k)]) == [None] and card.delete_named(key_digest(k)) is False


def test_exists_and_delete(card: Card) -> None:
    k = key("del")
    card.write(k, memoryview(b"abc"), ObjectMeta())
    assert card.exists(k)
    assert card.delete(k) is True
    assert not card.exists(k) and card.delete(k) is False
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(bytearray(10)))


def test_exists_counts_an_object_written_before_not_before_as_absent(medium: Medium, card: Card) -> None:
    if medium.kind == RedisCard.kind:
        pytest.skip("RedisCard.exists leaves not_before_ns to the server, which expires objects at the ttl (ttl_s)")
    k = key("old")
    card.write(k, memoryview(b"x" * 10), ObjectMeta(created_ns=time.time_ns()))
    assert card.exists(k, time.time_ns() - 10**9) and not card.exists(k, time.time_ns() + 10**9)
    assert card.exists_many([k, key("absent")], time.time_ns() + 10**9) == [False, False]


def test_a_too_small_buffer_is_refused_and_the_object_kept(card: Card) -> None:
    k = key("big")
    data = payload_for(k, P + 100)
    card.write(k, memoryview(data), ObjectMeta())
    for short in (0, 1, P, P + 99):
        with pytest.raises(BufferTooSmall) as info:
            card.read_into(k, memoryview(bytearray(short)))
        assert info.value.needed == P + 100
    assert card.exists(k)
    assert np.array_equal(read_back(card, k, P + 100)[1], data)


# ---------------------------------------------------------------- listing the card


def test_names_stored_objects_and_delete_named(card: Card) -> None:
    keys = [key(f"n{i}") for i in range(40)]
    for i, k in enumerate(keys):
        card.write(k, memoryview(payload_for(k, 100 + i)), ObjectMeta(position=i))
    assert sorted({d for b in card.names() for d in b}) == sorted(key_digest(k) for k in keys)
    found = card.stored_objects([key_digest(keys[5]), key_digest(key("never written"))])
    assert found[0] is not None and (found[0].full_key, found[0].payload_len, found[0].meta.position) == (
        keys[5], 105, 5)
    assert found[1] is None
    assert card.delete_named(key_digest(keys[5])) and not card.delete_named(key_digest(keys[5]))
    assert card.stored_objects([key_digest(keys[5])]) == [None] and not card.exists(keys[5])
    assert sorted(o.full_key for o in card.scan()) == sorted(keys[:5] + keys[6:])


def test_scan_reports_every_object_with_its_meta(card: Card) -> None:
    expected, items = {}, []
    for i in range(20):
        k = key(i, ns=b"ns%d" % (i % 3))
        meta = ObjectMeta(dialog=dialog_digest(b"dialog-%d" % (i % 4)), position=i, created_ns=1000 + i)
        items.append((k, memoryview(payload_for(k, i * 1000)), meta))
    for (k, payload, meta), stored in zip(items, card.write_many(items)):
        assert isinstance(stored, int)
        expected[k] = StoredObject(k, len(payload), stored, meta)
    found = list(card.scan())
    assert len(found) == len(expected) and {o.full_key: o for o in found} == expected


def test_scan_reads_the_longest_keys(card: Card) -> None:
    k = full_key(b"n" * 255, b"k" * 1024)  # a header longer than a scan's first read
    card.write(k, memoryview(b"xyz"), ObjectMeta(position=5))
    assert [(o.full_key, o.payload_len, o.meta.position) for o in card.scan()] == [(k, 3, 5)]


def test_clean_deletes_every_object_and_keeps_the_card(medium: Medium, card: Card) -> None:
    keys = [key(i) for i in range(15)]
    for k in keys:
        card.write(k, memoryview(b"payload"), ObjectMeta())
    assert card.clean() == 15
    assert list(card.scan()) == [] and not any(card.exists(k) for k in keys)
    assert card.check() == card.serial and medium.card().serial == card.serial
    card.write(keys[0], memoryview(b"again"), ObjectMeta())
    assert card.clean() == 1


def test_the_index_snapshot_is_replaced_whole_or_not_at_all(card: Card) -> None:
    k = key("an object")
    card.write(k, memoryview(b"x"), ObjectMeta())
    check_snapshot_round_trip(card, 1)
    w = card.snapshot_writer()
    w.write(b"kept")
    w.commit()
    card.clean()
    assert card.read_snapshot() == b"kept", "clean leaves the snapshot: drop_snapshot removes it"
    card.drop_snapshot()
    assert card.read_snapshot() is None


# ---------------------------------------------------------------- durability


def test_acknowledged_objects_outlive_the_card_object_that_wrote_them(medium: Medium, card: Card) -> None:
    """A gateway restarted (a new card object, the medium as it was) finds every object written before."""
    card.claim(False)
    keys = [key(f"d{i}") for i in range(10)]
    datas = {k: payload_for(k, 5000 * (i + 1)) for i, k in enumerate(keys)}
    for i, k in enumerate(keys):
        card.write(k, memoryview(datas[k]), ObjectMeta(position=i))
    card.delete(keys[0])
    serial = card.serial
    card.close()
    again = medium.card()
    again.claim(False)  # the closed card's claim is gone with it
    assert again.serial == serial
    assert sorted(o.full_key for o in again.scan()) == sorted(keys[1:])
    for i, k in enumerate(keys[1:], 1):
        h, got = read_back(again, k, len(datas[k]))
        assert h.meta.position == i and np.array_equal(got, datas[k])
    assert not again.exists(keys[0])
    # and the closed card object may be used again, as the contract's close allows
    assert card.check() == serial and np.array_equal(read_back(card, keys[1], 20_000)[1], datas[keys[1]])


# ---------------------------------------------------------------- bad objects


def test_a_corrupt_object_is_reported_and_deleted(medium: Medium, card: Card) -> None:
    k, other = key("victim"), key("other")
    size = 2 * P + 5
    for x in (k, other):
        card.write(x, memoryview(payload_for(x, size)), ObjectMeta())
    raw = bytearray(medium.raw_get(k))
    raw[-(size // 2)] ^= 0x40  # a payload byte
    medium.raw_set(k, bytes(raw))
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, memoryview(np.zeros(size + 10, dtype=np.uint8)))
    assert not card.exists(k) and card.exists(other)
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(np.zeros(size + 10, dtype=np.uint8)))
    assert np.array_equal(read_back(card, other, size)[1], payload_for(other, size))


def test_another_key_s_object_under_a_name_is_corrupt(medium: Medium, card: Card) -> None:
    k, other = key("victim"), key("other-length-key")
    for x in (k, other):
        card.write(x, memoryview(payload_for(x, 100)), ObjectMeta())
    medium.raw_set(k, medium.raw_get(other))
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, memoryview(bytearray(1000)))
    assert not card.exists(k) and card.exists(other)


def test_scan_deletes_broken_objects_and_counts_them(medium: Medium, card: Card) -> None:
    keys = [key(i) for i in range(3)]
    for k in keys:
        card.write(k, memoryview(payload_for(k, 5000)), ObjectMeta())
    medium.raw_set(keys[0], medium.raw_get(keys[0])[:100])  # truncated
    medium.raw_set(keys[1], b"not an object at all")
    assert [o.full_key for o in card.scan()] == [keys[2]]
    assert not card.exists(keys[0]) and not card.exists(keys[1])
    if medium.kind != NetworkCard.kind:  # a served card's scan deletes them on the server, which counts them
        assert card.scan_corrupt == 2


def test_an_object_a_newer_kvgate_wrote_is_a_miss_and_stays(medium: Medium, card: Card) -> None:
    k, ok = key("newer"), key("current")
    for x in (k, ok):
        card.write(x, memoryview(payload_for(x, 9000)), ObjectMeta())
    newer = as_newer_format(medium.raw_get(k), k)
    medium.raw_set(k, newer)
    with pytest.raises(ObjectTooNew):
        card.read_into(k, memoryview(np.zeros(9000, dtype=np.uint8)))
    (res,) = card.read_many_into([(k, memoryview(np.zeros(9000, dtype=np.uint8)))])
    assert isinstance(res, ObjectTooNew)
    assert [o.full_key for o in card.scan()] == [ok]
    assert medium.raw_get(k) == newer, "left for the kvgate that reads it"


# ---------------------------------------------------------------- batches and guards


def test_a_batch_reports_each_object_on_its_own(card: Card) -> None:
    keys = [key(i) for i in range(4)]
    datas = [payload_for(k, 1000 * (i + 1)) for i, k in enumerate(keys)]
    written = card.write_many([(k, memoryview(d), ObjectMeta(position=i)) for i, (k, d) in enumerate(zip(keys,
                                                                                                           datas))])
    assert all(isinstance(n, int) and n >= header_size(k) + len(d) for n, k, d in zip(written, keys, datas))
    assert card.exists_many([keys[0], key("missing"), keys[3]]) == [True, False, True]
    bufs = [np.zeros(10_000, dtype=np.uint8) for _ in range(4)]
    bufs[2] = np.zeros(10, dtype=np.uint8)  # too small for keys[2]
    res = card.read_many_into([(k, memoryview(b)) for k, b in zip([keys[0], key("missing"), keys[2], keys[3]],
                                                                   bufs)])
    assert isinstance(res[0], Header) and res[0].meta.position == 0 and np.array_equal(bufs[0][:1000], datas[0])
    assert isinstance(res[1], ObjectMissing)
    assert isinstance(res[2], BufferTooSmall) and res[2].needed == len(datas[2])
    assert isinstance(res[3], Header) and np.array_equal(bufs[3][: len(datas[3])], datas[3])
    assert card.exists(keys[2]), "too small a buffer keeps the object"
    assert card.write_many([]) == [] and card.read_many_into([]) == [] and card.exists_many([]) == []


def test_a_write_the_caller_gave_up_on_publishes_nothing(card: Card) -> None:
    k = key("late")
    card.write(k, memoryview(b"before"), ObjectMeta())
    gone = Abandon()
    gone.abandon()
    with pytest.raises(WriteAbandoned):
        card.write(k, memoryview(payload_for(k, 3 * P)), ObjectMeta(), gone)
    assert read_back(card, k, 10)[1].tobytes() == b"before"
    (res,) = card.write_many([(key("late too"), memoryview(b"x"), ObjectMeta())], gone)
    assert isinstance(res, WriteAbandoned) and not card.exists(key("late too"))


def test_a_destination_that_faults_fails_alone_and_an_abandoned_read_delivers_nothing(card: Card) -> None:
    keys = [key(f"g{i}") for i in range(3)]
    for k in keys:
        card.write(k, memoryview(payload_for(k, 3 * P)), ObjectMeta())
    dests = [np.zeros(3 * P, dtype=np.uint8) for _ in keys]

    class Faulty(Abandon):
        """The destination of the second item is gone (its region shrunk) when its bytes are handed over."""

        def read_cached(self, fd, dst, offset):
            return None  # "not cached": every read hands its bytes over through copy

        def copy(self, dst, src) -> None:
            if np.shares_memory(np.frombuffer(dst, np.uint8), dests[1]):
                raise MemoryFault(errno.EFAULT, "region shrunk")
            super().copy(dst, src)

    out = card.read_many_into([(k, memoryview(d)) for k, d in zip(keys, dests)], Faulty())
    assert isinstance(out[1], MemoryFault)
    for i in (0, 2):
        assert out[i].payload_len == 3 * P and np.array_equal(dests[i], payload_for(keys[i], 3 * P))
    gone = Abandon()
    gone.abandon()
    fresh = [np.zeros(3 * P, dtype=np.uint8) for _ in keys]
    out = card.read_many_into([(k, memoryview(d)) for k, d in zip(keys, fresh)], gone)
    assert all(isinstance(r, ReadAbandoned) for r in out) and not any(d.any() for d in fresh)
    with pytest.raises(ReadAbandoned):
        card.read_into(keys[0], memoryview(fresh[0]), gone)
    assert not fresh[0].any() and all(card.exists(k) for k in keys), "nothing delivered, nothing deleted"


def test_prepare_reads_never_raises_and_changes_nothing(card: Card) -> None:
    k = key("soon")
    card.write(k, memoryview(b"abc"), ObjectMeta())
    card.prepare_reads([k, key("absent")])
    assert [o.full_key for o in card.scan()] == [k] and read_back(card, k, 10)[1].tobytes() == b"abc"
    assert set(card.read_rates()) == {"cached_copy_bytes_per_second", "direct_read_bytes_per_second"}


# ---------------------------------------------------------------- concurrency, unavailability


def test_concurrent_writers_and_readers_never_see_torn_objects(card: Card) -> None:
    k = key("hot")
    # Writer w writes byte w+1, with its own size: both must match on read.
    sizes = {w: P + 50_000 * (w + 1) for w in range(3)}
    payloads = {w: np.full(sizes[w], w + 1, dtype=np.uint8) for w in sizes}
    by_size = {sizes[w]: w + 1 for w in sizes}
    writes_done = threading.Event()
    errors: list[str] = []
    reads_ok = [0]

    def writer(w: int) -> None:
        try:
            for _ in range(20):
                card.write(k, memoryview(payloads[w]), ObjectMeta(position=w))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(f"writer {w}: {exc!r}")

    def reader() -> None:
        buf = np.empty(max(sizes.values()), dtype=np.uint8)
        while not writes_done.is_set():
            try:
                h = card.read_into(k, memoryview(buf))
            except ObjectMissing:
                continue
            except BaseException as exc:
                errors.append(f"reader: {exc!r}")
                return
            fill = by_size.get(h.payload_len)
            if fill is None or h.meta.position != fill - 1 or not (buf[: h.payload_len] == fill).all():
                errors.append(f"torn read: {h.payload_len} bytes, position {h.meta.position}")
                return
            reads_ok[0] += 1

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in sizes]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(60)
    writes_done.set()
    for t in readers:
        t.join(60)
    assert errors == []
    assert reads_ok[0] > 0
    assert [o.full_key for o in card.scan()] == [k]


def test_a_medium_taken_away_is_unavailable_soon(medium: Medium, card: Card) -> None:
    k = key("k")
    card.write(k, memoryview(b"data"), ObjectMeta())
    medium.take_away()
    buf = memoryview(bytearray(100))
    for call in (card.check, lambda: card.read_into(k, buf), lambda: card.write(k, memoryview(b"d"), ObjectMeta()),
                 lambda: card.exists(k), lambda: card.delete(k), lambda: list(card.scan()), card.clean,
                 card.free_bytes):
        t0 = time.monotonic()
        with pytest.raises(CardUnavailable):
            call()
        assert time.monotonic() - t0 < 2 * IO_TIMEOUT_MS / 1000, call
    for res in (card.read_many_into([(k, buf), (key("x"), buf)]), card.exists_many([k, key("x")])):
        assert len(res) == 2 and all(isinstance(r, CardUnavailable) for r in res), res
