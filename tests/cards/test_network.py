"""NetworkCard against a real card server over loopback TCP: round trips, corruption, deadlines, hostile peers."""

from __future__ import annotations

import errno
import re
import gc
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvgate.cards import (
    CardInUse,
    CardUnavailable,
    DirectoryCard,
    NetworkCard,
    ObjectCorrupt,
    ObjectMeta,
    WriteAbandoned,
    expand,
    make_card,
)
from kvgate.cards.network import wire as w
from kvgate.cards.objectformat import CHECKSUM_PIECE, header_size, pack_header, padded_size
from kvgate.cards.network.server import CardExporter
from kvgate.config import Config
from kvgate.keys import dialog_digest, payload_hash
from kvgate.memcopy import Abandon, ReadAbandoned
from tests.cards.common import check_snapshot_round_trip, key, payload_for
from tests.helpers import freeze, run_threads, wait_until

P = CHECKSUM_PIECE
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def served(tmp_path: Path):
    local = DirectoryCard(str(tmp_path / "card"), num_dbs=2)
    local.open()
    ex = CardExporter([local], "127.0.0.1", 0, max_object_bytes=16 << 20, frame_timeout=1.0).start()
    yield ex, local
    ex.stop()


@pytest.fixture
def card(served) -> NetworkCard:
    ex, local = served
    c = NetworkCard(ex.urls()[local.serial], num_dbs=2, io_timeout_ms=2000, max_object_bytes=16 << 20)
    assert c.open() == local.serial
    yield c
    c.close()


def read_back(c: NetworkCard, k: bytes, size: int) -> np.ndarray:
    buf = np.zeros(size + 7, dtype=np.uint8)
    h = c.read_into(k, memoryview(buf)[3:])
    return buf[3 : 3 + h.payload_len]


def hello(port: int, serial: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(w.frame(w.Hello(serial, 2)))
    assert isinstance(reply(s)[0], w.Ok)
    return s


def reply(s: socket.socket) -> tuple[w.Msg, bytes]:
    prefix = bytearray(w.PREFIX.size)
    w.recv_exact(s, memoryview(prefix))
    hlen, blen = w.parse_prefix(prefix, 1 << 20, 1 << 30)
    return w.decode_reply(w.recv_body(s, hlen)), bytes(w.recv_body(s, blen))


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("size", [0, 1, P - 1, P + 1, (1 << 20) + 5, 3 << 20])
def test_round_trip_is_byte_exact_and_the_same_object_format(card: NetworkCard, served, size: int) -> None:
    _, local = served
    k = key(size)
    data = payload_for(k, size)
    meta = ObjectMeta(dialog_digest(b"d"), 7, 123456789)
    stored = card.write(k, memoryview(data), meta)
    assert stored == padded_size(header_size(k)) + size
    assert np.array_equal(read_back(card, k, size), data)
    buf = np.zeros(size, dtype=np.uint8)
    h = local.read_into(k, memoryview(buf))  # the server's directory holds the very object a local card writes
    assert np.array_equal(buf, data) and (h.meta.position, h.meta.created_ns, h.meta.dialog) == (7, 123456789,
                                                                                                    meta.dialog)


def test_many_objects_in_batches_of_one_request_each(card: NetworkCard, served) -> None:
    ex, _ = served
    keys = [key(f"many-{i}") for i in range(300)]
    datas = [payload_for(k, 1000 + 37 * i) for i, k in enumerate(keys)]
    before = dict(ex.requests)
    results = card.write_many([(k, memoryview(d), ObjectMeta(position=i)) for i, (k, d) in enumerate(zip(keys,
                                                                                                          datas))])
    assert all(isinstance(r, int) for r in results)
    assert ex.requests["WriteMany"] == before.get("WriteMany", 0) + 1
    dests = [np.zeros(len(d) + 3, dtype=np.uint8) for d in datas]
    got = card.read_many_into([(k, memoryview(b)) for k, b in zip(keys, dests)])
    assert ex.requests["ReadMany"] == before.get("ReadMany", 0) + 1, "one request for the whole batch"
    for d, b, h in zip(datas, dests, got):
        assert not isinstance(h, BaseException) and np.array_equal(b[: h.payload_len], d)
    assert card.exists_many(keys + [key("absent")]) == [True] * 300 + [False]
    assert ex.requests["ExistsMany"] == before.get("ExistsMany", 0) + 1


def _abandoned() -> Abandon:
    guard = Abandon()
    guard.abandon()
    return guard


class _GivesUpLater(Abandon):
    """A guard abandoned as ``wanted`` says, one answer per look."""

    def __init__(self, wanted) -> None:
        super().__init__()
        self._wanted = wanted

    @property  # type: ignore[override]
    def abandoned(self) -> bool:
        return not next(self._wanted)

    @abandoned.setter
    def abandoned(self, value: bool) -> None:
        pass


def test_a_write_the_caller_gave_up_on_publishes_nothing(card: NetworkCard) -> None:
    k = key("late")
    with pytest.raises(WriteAbandoned):
        card.write(k, memoryview(payload_for(k, 1000)), ObjectMeta(), guard=_abandoned())
    calls = iter([True, False])  # wanted when asked before sending, not any more once it was sent
    with pytest.raises(WriteAbandoned):
        card.write(k, memoryview(payload_for(k, 1000)), ObjectMeta(), guard=_GivesUpLater(calls))
    assert not card.exists(k)


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("own", [False, True], ids=["through-scratch", "in-place"])
@pytest.mark.parametrize("how", ["payload", "header-key", "truncate", "append", "empty"])
def test_a_corrupt_object_on_the_server_is_reported_and_deleted(card: NetworkCard, served, how: str,
                                                                 own: bool) -> None:
    _, local = served
    k = key("victim")
    size = 2 * P + 5
    card.write(k, memoryview(payload_for(k, size)), ObjectMeta())
    path = local.object_path(k)
    poff = padded_size(header_size(k))
    with open(path, "r+b") as f:
        if how == "payload":
            f.seek(poff + size // 2)
            b = f.read(1)
            f.seek(poff + size // 2)
            f.write(bytes([b[0] ^ 1]))
        elif how == "header-key":
            f.seek(header_size(k) - 1)
            f.write(b"\xff")
        elif how == "truncate":
            f.truncate(poff + size - 1)
        elif how == "append":
            f.seek(0, os.SEEK_END)
            f.write(b"\0")
        else:
            f.truncate(0)
    with pytest.raises(ObjectCorrupt) as ei:
        card.read_into(k, memoryview(bytearray(size)), Abandon(own))
    assert "deleted corrupt object" in "".join(ei.value.__notes__)
    assert not os.path.exists(path) and not card.exists(k)
    other = key("after")  # the connection is still in step
    card.write(other, memoryview(payload_for(other, 10)), ObjectMeta())
    assert np.array_equal(read_back(card, other, 10), payload_for(other, 10))


class _CountsReceives(Abandon):
    """An ``own`` guard that counts the receives straight into the destination, and is abandoned after
    ``abandon_after`` of them (None: never)."""

    def __init__(self, abandon_after: int | None = None) -> None:
        super().__init__(own=True)
        self.receives = 0
        self.abandon_after = abandon_after

    def recv_nowait(self, fd, dst, hasher):
        if self.abandon_after is not None and self.receives >= self.abandon_after:
            self.abandon()
        n = super().recv_nowait(fd, dst, hasher)
        self.receives += n is not None
        return n


def test_gateway_memory_is_received_into_in_place_and_client_memory_never(card: NetworkCard, monkeypatch) -> None:
    from kvgate import memcopy

    k = key("in-place")
    size = 3 * (1 << 20) + 5
    card.write(k, memoryview(payload_for(k, size)), ObjectMeta())
    buf = np.zeros(size + 1, dtype=np.uint8)
    guard = _CountsReceives()
    assert card.read_into(k, memoryview(buf), guard).payload_len == size
    assert guard.receives > 0 and np.array_equal(buf[:size], payload_for(k, size)) and buf[size] == 0
    # the same buffer named client memory: through the scratch, whatever the caller says it owns
    base = buf.__array_interface__["data"][0]
    monkeypatch.setattr(memcopy._client, "spans", ((base, base + buf.size),))
    buf[:] = 0
    guard = _CountsReceives()
    assert card.read_into(k, memoryview(buf), guard).payload_len == size
    assert guard.receives == 0 and np.array_equal(buf[:size], payload_for(k, size))


def test_a_read_in_place_abandoned_midway_writes_nothing_more(card: NetworkCard) -> None:
    k = key("abandoned-in-place")
    size = 4 << 20
    card.write(k, memoryview(payload_for(k, size)), ObjectMeta())
    buf = np.zeros(size, dtype=np.uint8)
    guard = _CountsReceives(abandon_after=1)
    with pytest.raises(ReadAbandoned):
        card.read_into(k, memoryview(buf), guard)
    assert guard.receives == 1
    landed = int(np.flatnonzero(buf != 0).max()) + 1 if buf.any() else 0
    assert landed <= 256 << 10 and not buf[landed:].any()
    assert np.array_equal(read_back(card, k, size), payload_for(k, size))  # a new connection, in step


def test_a_corrupt_object_replaced_meanwhile_is_kept(card: NetworkCard, served) -> None:
    _, local = served
    k = key("replaced")
    card.write(k, memoryview(payload_for(k, 100)), ObjectMeta())
    bad = open(local.object_path(k), "rb").read()
    card.write(k, memoryview(payload_for(k, 100)), ObjectMeta())  # a new object: another creation time
    assert not card._conn().call(w.Discard(k, bad[:72], len(bad)))[0]
    assert card.exists(k)


# ---------------------------------------------------------------- whole card


def test_snapshot(card: NetworkCard, served) -> None:
    _, local = served
    check_snapshot_round_trip(card, 0)
    big = os.urandom(3 * w.SNAPSHOT_PIECE + 5)  # several pieces
    wr = card.snapshot_writer()
    wr.write(big)
    wr.commit()
    assert card.read_snapshot() == big == local.read_snapshot()


def test_make_card_and_expand_know_kvgate_urls() -> None:
    loc = "kvgate://storage-1:7001/0123abcd"
    c = make_card(loc, Config(num_dbs=3, io_timeout_ms=1500, max_frame_bytes=64 << 20))
    assert isinstance(c, NetworkCard) and c.kind == "kvgate"
    assert (c.host, c.port, c.url_serial, c.num_dbs, c.timeout, c.max_object_bytes) == (
        "storage-1", 7001, "0123abcd", 3, 1.5, 64 << 20)
    assert expand(loc) == [loc]
    for bad in ("kvgate://h/serial", "kvgate://h:1/", "kvgate://:1/s", "kvgate://h:1/a/b"):
        with pytest.raises(ValueError, match="kvgate://HOST:PORT/SERIAL"):
            NetworkCard(bad)


# ---------------------------------------------------------------- refusals


def test_a_wrong_serial_is_refused_naming_what_is_served(served) -> None:
    ex, local = served
    c = NetworkCard(f"kvgate://127.0.0.1:{ex.port}/not-this-one")
    with pytest.raises(CardUnavailable) as ei:
        c.open()
    msg = str(ei.value)
    assert "serves no card not-this-one" in msg and local.serial in msg and "check the kvgate:// URL" in msg
    assert ei.value.filename == c.location


def test_nothing_listening_or_not_a_card_server_is_unavailable(served) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(CardUnavailable, match="nothing listens"):
        NetworkCard(f"kvgate://127.0.0.1:{port}/x").check()
    other = socket.create_server(("127.0.0.1", 0))  # answers like a web server
    def answer() -> None:
        s, _ = other.accept()
        s.recv(100)
        s.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        s.close()
    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(CardUnavailable, match="broke the protocol"):
        NetworkCard(f"kvgate://127.0.0.1:{other.getsockname()[1]}/x").check()
    other.close()


def test_a_server_announcing_a_huge_object_is_cut_off_without_allocating_it(served) -> None:
    liar = socket.create_server(("127.0.0.1", 0))
    def serve() -> None:
        s, _ = liar.accept()
        reply_len = w.PREFIX.size
        s.recv(1 << 16)
        s.sendall(w.frame(w.Ok({"serial": "x"})))
        s.recv(1 << 16)
        s.sendall(w.frame(w.Item(), 1 << 40))  # a terabyte, announced
        time.sleep(1)
        s.close()
        del reply_len
    threading.Thread(target=serve, daemon=True).start()
    c = NetworkCard(f"kvgate://127.0.0.1:{liar.getsockname()[1]}/x", max_object_bytes=1 << 20)
    with pytest.raises(CardUnavailable, match="over the limit"):
        c.read_into(key(1), memoryview(bytearray(10)))
    liar.close()


# ---------------------------------------------------------------- hostile peers


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n",
    struct.pack("<4sIQ", w.MAGIC, 0xFFFFFFFF, 0),  # a 4 GiB header announced
    struct.pack("<4sIQ", w.MAGIC, 10, 1 << 62),  # an absurd body
    struct.pack("<4sIQ", w.MAGIC, 4, 0) + b"\xc1\xc1\xc1\xc1",  # not msgpack
    w.frame(w.Check(), 5) + b"hello",  # a body where none belongs
    w.frame(w.ReadMany([b"k"] * (w.MAX_BATCH + 1))),
])
def test_garbage_gets_an_error_and_a_disconnect_and_good_clients_go_on(card: NetworkCard, served,
                                                                      garbage: bytes) -> None:
    ex, local = served
    k = key("survivor")
    card.write(k, memoryview(payload_for(k, 5000)), ObjectMeta())
    s = hello(ex.port, local.serial)
    s.sendall(garbage)
    err, _ = reply(s)
    assert isinstance(err, w.Err) and err.kind == "bad_request" and err.message, err
    assert closed(s)
    assert np.array_equal(read_back(card, k, 5000), payload_for(k, 5000))


def test_garbage_before_hello_and_a_huge_hello_are_refused(served) -> None:
    ex, _ = served
    for garbage in (b"\0" * 16, w.frame(w.Check()), struct.pack("<4sIQ", w.MAGIC, 1 << 30, 0)):
        s = socket.create_connection(("127.0.0.1", ex.port), timeout=5)
        s.sendall(garbage)
        err, _ = reply(s)
        assert isinstance(err, w.Err) and err.kind == "bad_request"
        assert closed(s)


def test_a_slow_loris_is_cut_off_and_others_are_served_meanwhile(card: NetworkCard, served) -> None:
    ex, local = served  # frame_timeout 1 s
    s = hello(ex.port, local.serial)
    s.sendall(w.frame(w.Check())[:7])  # half a prefix, then nothing
    k = key("meanwhile")
    t0 = time.monotonic()
    card.write(k, memoryview(payload_for(k, 100)), ObjectMeta())
    assert card.exists(k) and time.monotonic() - t0 < 0.5
    s.settimeout(5)
    assert closed(s)
    assert 0.9 < time.monotonic() - t0 < 4


def test_a_payload_damaged_in_transit_is_not_written(served) -> None:
    ex, local = served
    s = hello(ex.port, local.serial)
    k = key("damaged")
    data = bytes(payload_for(k, 1000))
    item = w.WriteItem(k, len(data), 12345, dialog_digest(None), -1, time.time_ns())
    s.sendall(w.frame(w.WriteMany([item]), len(data) + 1) + data + b"\1")
    res, _ = reply(s)
    assert isinstance(res, w.Results) and res.values == [None] and "damaged in transit" in res.errors[0].message
    assert not local.exists(k)


# ---------------------------------------------------------------- claims


def test_claims_mix_as_a_directory_s_do_and_go_with_the_connection(served) -> None:
    ex, local = served
    url = ex.urls()[local.serial]
    a, b = NetworkCard(url, num_dbs=2), NetworkCard(url, num_dbs=2)
    a.open(), b.open()
    a.claim(False)
    with pytest.raises(CardInUse) as ei:
        b.claim(True)
    assert f"pid {os.getpid()}" in str(ei.value) and "exclusively" in str(ei.value)
    on_host = DirectoryCard(local.location, num_dbs=2)
    with pytest.raises(CardInUse):
        on_host.claim(True)  # a gateway on the storage host is refused too
    a.claim(False)  # renewing is fine
    assert a.check() == local.serial
    a.close()
    b.claim(True)
    a.open()
    a.claim(True)  # shared with shared
    with pytest.raises(CardInUse):
        on_host.claim(False)
    on_host.claim(True)
    a.close(), b.close(), on_host.close()


@pytest.mark.slow
def test_a_killed_gateway_releases_its_claim(served) -> None:
    ex, local = served
    url = ex.urls()[local.serial]
    code = ("import sys, time; from kvgate.cards import NetworkCard; c = NetworkCard(sys.argv[1], num_dbs=2); "
            "c.open(); c.claim(False); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    mine = NetworkCard(url, num_dbs=2)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(CardInUse, match=f"pid {proc.pid} "):
            mine.claim(False)
    finally:
        proc.kill()
        proc.wait(10)
    wait_until(lambda: _claims(mine), 5, "the claim of a killed gateway released")
    mine.close()


def _claims(c: NetworkCard) -> bool:
    try:
        c.claim(False)
    except CardInUse:
        return False
    return True


# ---------------------------------------------------------------- a server process


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _start_server(card_dir: str, port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "export", "--cards", card_dir, "--listen",
                             f"127.0.0.1:{port}", "--num-dbs", "2"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    line = proc.stdout.readline().split()
    assert line and line[1] == card_dir, line
    return proc, line[0]


@pytest.mark.slow
def test_a_killed_server_is_unavailable_within_the_deadline_and_works_after_a_restart(tmp_path: Path) -> None:
    loc = str(tmp_path / "card")
    DirectoryCard(loc).open()
    port = _free_port()
    proc, url = _start_server(loc, port)
    c = NetworkCard(url, num_dbs=2, io_timeout_ms=1000)
    try:
        c.open()
        c.claim(False)
        k = key("kept")
        c.write(k, memoryview(payload_for(k, 3 << 20)), ObjectMeta())
        freeze(proc.pid)  # hung: the deadline answers
        t0 = time.monotonic()
        with pytest.raises(CardUnavailable) as ei:
            c.read_into(k, memoryview(bytearray(3 << 20)))
        took = time.monotonic() - t0
        assert ei.value.errno == errno.ETIMEDOUT and "io_timeout_ms" in str(ei.value), ei.value
        assert took < 2.5, f"a hung server answered after {took:.2f} s, io_timeout_ms is 1000"
        proc.kill()  # SIGKILL while stopped, the card in use
        proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(CardUnavailable):
            c.read_into(k, memoryview(bytearray(3 << 20)))
        took = time.monotonic() - t0
        assert took < 2.5, f"a killed server answered after {took:.2f} s, io_timeout_ms is 1000"
        proc, _ = _start_server(loc, port)
        assert np.array_equal(read_back(c, k, 3 << 20), payload_for(k, 3 << 20))
        assert c.check() == c.serial  # the claim is taken again over a new connection
        with pytest.raises(CardInUse):
            NetworkCard(url, num_dbs=2).claim(True)
    finally:
        c.close()
        proc.kill()
        proc.wait(10)


def test_wire_messages_decode_only_as_what_they_are() -> None:
    with pytest.raises(w.WireError, match="does not decode"):
        w.decode_request(msgspec.msgpack.encode({"op": "nonsense"}))
    with pytest.raises(w.WireError, match="magic"):
        w.parse_prefix(b"XXXX" + bytes(12), 10, 10)


def test_an_object_over_the_server_s_limit_is_refused_alone(served, card: NetworkCard) -> None:
    ex, _ = served  # max_object_bytes 16 MiB
    big, small = key("big"), key("small")
    assert card.server_max_object_bytes == 16 << 20
    out = card.write_many([(big, memoryview(bytearray(16 << 20)), ObjectMeta()),
                           (small, memoryview(b"x" * 10), ObjectMeta())])
    assert isinstance(out[0], OSError) and out[0].errno == errno.EFBIG and "--max-object-bytes" in str(out[0])
    assert isinstance(out[1], int) and card.exists(small) and not card.exists(big)


def test_threads_share_a_card_each_on_a_connection_of_its_own(card: NetworkCard) -> None:
    used = []

    def work(t: int) -> None:
        for i in range(20):
            k = key(f"t{t}-{i}")
            data = payload_for(k, 1000 * i + t)
            card.write(k, memoryview(data), ObjectMeta())
            assert np.array_equal(read_back(card, k, len(data)), data)
        used.append(card._local.conn)

    run_threads(work, 6)
    assert len({id(c) for c in used}) == 6
    used.clear()
    gc.collect()
    assert len(card._conns) == 1, "a thread's connection goes (closed) with the thread; the main thread's stays"


def test_connections_over_the_limit_are_refused_with_the_reason(tmp_path: Path) -> None:
    local = DirectoryCard(str(tmp_path / "card"))
    local.open()
    with CardExporter([local], max_connections=1) as ex:
        first = NetworkCard(ex.urls()[local.serial])
        first.open()
        with pytest.raises(CardUnavailable, match="max_connections"):
            NetworkCard(ex.urls()[local.serial]).open()
        first.close()
        wait_until(lambda: not ex._conns, 5, "the first connection ended")
        NetworkCard(ex.urls()[local.serial]).open()


@pytest.mark.slow
def test_a_gateway_stores_on_and_restores_from_a_served_card(gateway_factory, served) -> None:
    ex, local = served
    url = ex.urls()[local.serial]
    gw = gateway_factory(["--storage-devices", url, "--max-bytes", "0"], create_cards=False)
    wait_until(lambda: [c for c in gw.stats()["cards"] if c["active"]], 20, lambda: gw.log())
    keys = [b"block-%d" % i for i in range(8)]
    blocks = [os.urandom(100_000 + i) for i in range(8)]
    with gw.client("ns") as c:
        assert c.put_many(keys, blocks, retention="long") == [True] * 8
        assert c.get_many(keys) == blocks
    st = gw.stats()["cards"][0]
    assert (st["location"], st["serial"], st["objects"]) == (url, local.serial, 8)
    on_host = DirectoryCard(local.location)  # the gateway's num_dbs (1)
    assert len(list(on_host.scan())) == 8, "the objects are files of the served directory"
    with pytest.raises(CardInUse, match=f"pid {gw.proc.pid} "):
        on_host.claim(True)  # the gateway holds it exclusively, through the server
    assert ex.requests["Claim"] >= 1


@pytest.mark.parametrize("size", [0, 5, 5000, P + 3])
def test_an_unpadded_object_is_still_read(card: NetworkCard, served, size: int) -> None:
    """Its first payload bytes arrive with the header block: they are hashed and delivered too."""
    _, local = served
    k = key(f"old-{size}")
    data = payload_for(k, size)
    path = local.object_path(k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pack_header(k, size, payload_hash(memoryview(data)), ObjectMeta(position=4)))
        f.write(data.tobytes())
    buf = np.zeros(size + 1, dtype=np.uint8)
    h = card.read_into(k, memoryview(buf))
    assert h.payload_offset == header_size(k) and h.meta.position == 4
    assert np.array_equal(buf[:size], data) and buf[size] == 0


def test_a_server_with_a_token_serves_only_those_who_present_it(tmp_path: Path, caplog) -> None:
    local = DirectoryCard(str(tmp_path / "card"))
    local.open()
    token = tmp_path / "token"
    token.write_text("s3cret-card-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    with CardExporter([local], token="s3cret-card-token") as ex:
        url = ex.urls()[local.serial]
        for c in (NetworkCard(url), NetworkCard(url, token_file=str(wrong))):
            with pytest.raises(CardUnavailable, match="needs a valid token: set card_token_file") as ei:
                c.open()
            assert ei.value.errno == errno.EACCES
            c.close()
        missing = NetworkCard(url, token_file=str(tmp_path / "absent"))
        with pytest.raises(CardUnavailable, match="card_token_file'.*cannot read"):
            missing.open()
        s = socket.create_connection(("127.0.0.1", ex.port), timeout=5)  # a stranger's hello, no token
        s.sendall(w.frame(w.Hello(local.serial, 1)))
        msg, _ = reply(s)  # an error, then the door closes
        assert isinstance(msg, w.Err) and "valid token" in msg.message
        assert closed(s)
        assert ex.requests["refused_token"] == 3, "the two cards' opens and the stranger"
        rotated = NetworkCard(url, token_file=str(wrong))  # the file is read at each connect, not once
        with pytest.raises(CardUnavailable, match="needs a valid token"):
            rotated.open()
        wrong.write_text("s3cret-card-token")
        assert rotated.open() == local.serial, "the file's new token is used without a new card"
        rotated.close()
        good = NetworkCard(url, token_file=str(token))
        assert good.open() == local.serial
        k = key("kept")
        good.write(k, memoryview(payload_for(k, 5000)), ObjectMeta())
        assert np.array_equal(read_back(good, k, 5000), payload_for(k, 5000))
        good.close()
    assert caplog.text.count("token: refused") <= 1, "refusals are logged at most every 10 s"


@pytest.mark.slow
def test_a_server_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    local = DirectoryCard(str(tmp_path / "card"))
    with pytest.raises(ValueError, match="0.0.0.0 is not loopback: give a token file"):
        CardExporter([local], "0.0.0.0", 0)
    r = subprocess.run([sys.executable, "-m", "kvgate", "export", "--cards", str(tmp_path / "card"), "--listen",
                        "0.0.0.0:0"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC},
                       timeout=60)
    assert r.returncode == 2 and "give a token file (--token-file)" in r.stderr


def test_a_gateway_presents_its_card_token_file_and_one_without_it_is_refused(gateway_factory, tmp_path) -> None:
    local = DirectoryCard(str(tmp_path / "tokened"))
    local.open()
    token = tmp_path / "card-token"
    token.write_text("a-long-card-token")
    with CardExporter([local], token="a-long-card-token") as ex:
        url = ex.urls()[local.serial]
        without = gateway_factory(["--storage-devices", url, "--max-bytes", "0"], create_cards=False,
                                  name="without")
        wait_until(lambda: "needs a valid token: set card_token_file" in without.log(), 20, without.log)
        assert not [c for c in without.stats()["cards"] if c["active"]]
        without.stop()
        gw = gateway_factory(["--storage-devices", url, "--max-bytes", "0", "--card-token-file", str(token)],
                             create_cards=False, name="with")
        wait_until(lambda: [c for c in gw.stats()["cards"] if c["active"]], 20, gw.log)
        keys = [b"block-%d" % i for i in range(4)]
        blocks = [os.urandom(50_000 + i) for i in range(4)]
        with gw.client("ns") as c:
            assert c.put_many(keys, blocks, retention="long") == [True] * 4
            assert c.get_many(keys) == blocks


@pytest.mark.slow
def test_a_gateway_says_once_that_it_claims_a_card_again_while_the_server_is_down_and_when_it_is_back(
        tmp_path: Path, gateway_factory) -> None:
    """Its health check asks every second: the log says the loss once and the return once, not a line a
    second (a summary every CLAIM_RETRY_SAY_S while it lasts)."""
    loc = str(tmp_path / "card")
    DirectoryCard(loc).open()
    port = _free_port()
    proc, url = _start_server(loc, port)
    try:
        gw = gateway_factory(["--storage-devices", url, "--num-dbs", "2", "--io-timeout-ms", "500",
                              "--card-capacity", "1G"], create_cards=False)
        assert [c["active"] for c in gw.stats()["cards"]] == [True]
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not gw.stats()["cards"][0]["active"], 15, gw.log)
        time.sleep(5)  # five health checks, each trying the claim again
        assert gw.log().count("claiming again") == 1, gw.log()
        proc, _ = _start_server(loc, port)
        wait_until(lambda: "claim taken again after" in gw.log(), 15, gw.log)
        wait_until(lambda: gw.stats()["cards"][0]["active"], 30, gw.log)
        assert gw.log().count("claiming again") == 1 and gw.log().count("claim taken again") == 1, gw.log()
        assert re.search(r"claim taken again after \d+\.\d s \([1-9]\d* attempts failed\)", gw.log()), gw.log()
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_a_claim_not_taken_again_is_summed_up_every_interval(tmp_path: Path, monkeypatch, caplog) -> None:
    from kvgate.cards.network import card as network
    monkeypatch.setattr(network, "CLAIM_RETRY_SAY_S", 0.5)
    loc = str(tmp_path / "card")
    DirectoryCard(loc).open()
    port = _free_port()
    proc, url = _start_server(loc, port)
    c = NetworkCard(url, num_dbs=2, io_timeout_ms=500)
    try:
        c.open()
        c.claim(False)
        proc.kill()
        proc.wait(10)
        caplog.set_level("WARNING", logger="kvgate.cards.network.card")
        deadline = time.monotonic() + 1.6
        tries = 0
        while time.monotonic() < deadline:
            with pytest.raises(CardUnavailable):
                c.check()
            tries += 1
            time.sleep(0.1)
        said = [r.getMessage() for r in caplog.records]
        assert sum("claiming again" in m for m in said) == 1, said
        summaries = [m for m in said if "claim not taken again for" in m]
        assert 2 <= len(summaries) <= 4 and tries > len(summaries) + 2, (tries, said)
        assert re.search(r"\(\d+ attempts; the last: nothing listens at 127\.0\.0\.1:\d+", summaries[-1]), summaries
        proc, _ = _start_server(loc, port)
        assert c.check() == c.serial
        assert "claim taken again after" in caplog.records[-1].getMessage()
    finally:
        c.close()
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_a_claim_another_gateway_took_meanwhile_is_asked_for_until_it_is_free(tmp_path: Path) -> None:
    """A gateway whose claim connection was lost (the server restarted) and whose claim another gateway
    took meanwhile keeps finding the card unavailable, and takes its claim once the other lets go: it
    never goes on using the card unclaimed beside an exclusive holder."""
    loc = str(tmp_path / "card")
    DirectoryCard(loc).open()
    port = _free_port()
    proc, url = _start_server(loc, port)
    mine, other = NetworkCard(url, num_dbs=2, io_timeout_ms=1000), NetworkCard(url, num_dbs=2, io_timeout_ms=1000)
    try:
        mine.open()
        mine.claim(True)  # shared
        proc.kill()
        proc.wait(10)
        proc, _ = _start_server(loc, port)
        other.open()
        other.claim(False)  # exclusive, while mine had none
        for _ in range(3):  # every check asks again, and is refused while the other holds it
            with pytest.raises(CardInUse):
                mine.check()
        assert mine.claimed is True
        other.close()
        wait_until(lambda: _checks(mine), 5, "the claim taken again once the other let go")
        with pytest.raises(CardInUse):
            NetworkCard(url, num_dbs=2).claim(False)  # mine holds it (shared) again
    finally:
        mine.close(), other.close()
        proc.kill()
        proc.wait(10)


def _checks(c: NetworkCard) -> bool:
    try:
        return c.check() == c.serial
    except CardInUse:
        return False
