"""What a card may hold, with real gateways, real filesystems and a real Redis.

A card sized by its free space counts what it already holds, at start as
later: a restart never evicts from a card that is not over its capacity.  A
long put is acknowledged only when the object is on its card and stays
there; a card that can hold nothing says so and takes no puts.  A Redis
card is sized from its maxmemory, not from ``card_reserve``.
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.helpers import DEFAULT_FLAGS, GatewayProcess, free_port, object_files, wait_until
from tests.processes import REDIS_SERVER, RedisServer

MiB = 1 << 20

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def free_space_flags(*extra: str) -> list[str]:
    """The test defaults without ``--card-capacity``: cards are sized by their free space."""
    flags = [x for f, v in DEFAULT_FLAGS.items() if f != "--card-capacity" for x in (f, *v)]
    return flags + list(extra)


def payload(i: int, size: int = MiB) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def wait_log(gw: GatewayProcess, pattern: str, timeout: float = 30.0) -> re.Match:
    return wait_until(lambda: re.search(pattern, gw.log()), timeout,
                      lambda: f"no log line matching {pattern!r}:\n{gw.log()}")


def restart(gw: GatewayProcess) -> None:
    """Stop, start again with the same flags, and wait for the card's start-up scan to finish."""
    gw.stop()
    gw.log_path.write_text("")
    gw.start()
    gw.wait_scanned()


@pytest.fixture
def tmpfs(tmp_path: Path):
    """``mount(size) -> Path``: a fresh tmpfs of that size, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@needs_root
@pytest.mark.parametrize("reserve", ["0", "20M", None])
def test_restart_keeps_what_a_fairly_full_card_holds(tmp_path: Path, tmpfs, gateway_factory,
                                                     reserve: str | None) -> None:
    """40 acknowledged 1 MiB objects on a 64 MiB card are all there after a restart (``None``: the default
    reserve, a tenth of the card)."""
    card = tmpfs("64m") / "card"
    gw = gateway_factory(free_space_flags(*(("--card-reserve", reserve) if reserve else ())), card=card,
                         defaults=False)
    if reserve is None:
        cap = int(wait_log(gw, r"bytes indexed, capacity (\d+) bytes").group(1))
        assert 0.88 * 64 * MiB < cap < 0.91 * 64 * MiB, cap
    keys = [b"obj-%02d" % i for i in range(40)]
    with gw.client() as c:
        assert c.put_many(keys, [payload(i) for i in range(40)]) == [True] * 40
    restart(gw)
    assert "evicted" not in gw.log()
    with gw.client() as c:
        assert c.lookup(keys) == 40
        got = c.get_many(keys)
    assert [bytes(g) if g is not None else None for g in got] == [payload(i) for i in range(40)]
    assert len(object_files(card)) == 40


@needs_root
def test_batches_larger_than_a_small_cards_room_keep_their_head_and_the_next_batches_too(
        tmp_path: Path, tmpfs, gateway_factory) -> None:
    """A 64 MiB tmpfs card, RAM tier off: three puts of 48 objects of 2 MiB (96 MiB each, past the 60 MiB room).

    Each batch keeps its leading objects, as many as the card holds, every
    one acknowledged reads back whole, and the next batch takes the room of
    the last.  (A batch started whole used to meet ENOSPC halfway with
    nothing of it indexed, and the card was lowered to a capacity of 0.)
    """
    card = tmpfs("64m") / "card"
    mport = free_port()
    gw = gateway_factory(free_space_flags("--card-reserve", "4M", "--max-bytes", "0", "--shared-memory-size", "128M",
                                          "--metrics-port", str(mport)), card=card, defaults=False)
    gw.wait_scanned()
    refused = 0
    for batch in range(3):
        keys = [b"b%d-%02d" % (batch, i) for i in range(48)]
        values = [payload(batch * 100 + i, 2 * MiB) for i in range(48)]
        with gw.client() as c:
            ok = c.put_many(keys, values)
            kept = ok.count(True)
            refused += 48 - kept
            assert ok == [True] * kept + [False] * (48 - kept), "a batch keeps its head: a restore needs a prefix"
            assert 25 <= kept <= 30, f"60 MiB hold 29 objects of 2 MiB and a header; {kept} kept"
            got = c.get_many(keys[:kept])
            assert all(g is not None and bytes(g) == v for g, v in zip(got, values)), batch
            assert c.lookup(keys) == kept
    assert "capacity lowered" not in gw.log() and "can hold nothing" not in gw.log(), gw.log()
    row = gw.stats()["cards"][0]
    assert (row["refused"], row["writing_bytes"], row["errors"]) == (refused, 0, 0), row
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert f'kvgate_storage_group_refused_total{{group="{row["serial"]}"}} {refused}.0' in metrics
    wait_until(lambda: len(object_files(card)) == kept, 10, lambda: f"{len(object_files(card))} objects on the card")
    restart(gw)
    with gw.client() as c:
        assert c.lookup(keys) == kept, "what was acknowledged is on the card after a restart"


@needs_root
def test_puts_in_flight_together_take_room_one_after_another(tmp_path: Path, tmpfs, gateway_factory) -> None:
    """Two engines put 40 MiB batches at once to a 64 MiB card: each batch fits alone, two do not.

    Room is taken before a batch starts, counting the other's bytes in
    flight: the medium never runs out (no ENOSPC, no lowered capacity), and
    what each put acknowledged is stored whole until a later batch evicts it.
    """
    from concurrent.futures import ThreadPoolExecutor

    card = tmpfs("64m") / "card"
    gw = gateway_factory(free_space_flags("--card-reserve", "4M", "--max-bytes", "0", "--shared-memory-size", "64M"),
                         card=card, defaults=False)
    gw.wait_scanned()

    def engine(e: int) -> list[tuple[bytes, bytes]]:
        acked = []
        with gw.client(namespace="test-ns") as c:
            for batch in range(4):
                keys = [b"e%d-b%d-%02d" % (e, batch, i) for i in range(20)]
                values = [payload(e * 1000 + batch * 100 + i, 2 * MiB) for i in range(20)]
                acked += [(k, v) for k, v, ok in zip(keys, values, c.put_many(keys, values)) if ok]
        return acked

    with ThreadPoolExecutor(2) as pool:
        acked = [kv for part in pool.map(engine, range(2)) for kv in part]
    assert len(acked) >= 80, f"{len(acked)} of 160 acknowledged"
    card_row = gw.stats()["cards"][0]
    assert card_row["errors"] == 0 and "capacity lowered" not in gw.log(), gw.log()
    with gw.client() as c:
        got = c.get_many([k for k, _v in acked])
    assert all(g is None or bytes(g) == v for g, (_k, v) in zip(got, acked))
    assert sum(g is not None for g in got) >= 25, "the card holds what fits: 29 objects of 2 MiB"


@needs_root
def test_a_card_filled_by_another_writer_is_lowered_to_what_fits_not_to_nothing(
        tmp_path: Path, tmpfs, gateway_factory) -> None:
    """Another writer takes 50 of the card's 64 MiB after the gateway sized it; a batch then meets ENOSPC.

    The card is lowered to what it holds plus what is free less the
    reserve (read again from the medium), not to a share of what was
    indexed when the write failed (nothing yet: that made it 0).
    """
    mnt = tmpfs("64m")
    card = mnt / "card"
    gw = gateway_factory(free_space_flags("--card-reserve", "4M", "--max-bytes", "0", "--shared-memory-size", "64M"),
                         card=card, defaults=False)
    gw.wait_scanned()
    with open(mnt / "other-writer", "wb") as f:
        f.write(b"x" * (50 * MiB))
    keys = [b"k%d" % i for i in range(8)]
    values = [payload(i, 2 * MiB) for i in range(8)]
    with gw.client() as c:
        ok = c.put_many(keys, values)
        assert 3 <= ok.count(True) < 8, ok
        lowered = int(wait_log(gw, r"capacity lowered to (\d+) bytes").group(1))
        assert 4 * MiB <= lowered <= 14 * MiB, lowered
        assert "can hold nothing" not in gw.log()
        # What was indexed is evicted down to the lowered capacity (four of 2 MiB and a header in 10 MiB),
        # and the card goes on taking what fits beside them.
        assert c.put_many([b"after"], [payload(99)]) == [True], "the card still takes puts"
        got = c.get_many(keys + [b"after"])
    stored = [g for g in got if g is not None]
    assert all(bytes(g) == v for g, v in zip(got, values + [payload(99)]) if g is not None)
    assert 2 <= len(stored) and sum(len(g) for g in stored) <= lowered


def test_card_over_its_capacity_at_start_evicts_and_says_how_many(tmp_path: Path, gateway_factory) -> None:
    gw = gateway_factory(["--card-capacity", "1G"])
    keys = [b"obj-%02d" % i for i in range(10)]
    with gw.client() as c:
        assert c.put_many(keys, [payload(i) for i in range(10)]) == [True] * 10
    gw.stop()
    gw.argv[gw.argv.index("--card-capacity") + 1] = "5M"
    gw.log_path.write_text("")
    gw.start()
    m = wait_log(gw, r"held more than its capacity of (\d+) bytes at start: (\d+) objects \((\d+) bytes\) evicted")
    assert int(m.group(1)) == 5 * MiB
    evicted = int(m.group(2))
    with gw.client() as c:
        kept = sum(g is not None for g in c.get_many(keys))
    assert 0 < evicted < 10 and kept == 10 - evicted
    assert kept == 4, "5 MiB holds four objects of 1 MiB and a header"


@needs_root
def test_card_below_its_reserve_takes_no_puts_and_says_so(tmp_path: Path, tmpfs, gateway_factory) -> None:
    card = tmpfs("16m") / "card"
    gw = gateway_factory(free_space_flags("--card-reserve", "32M"), card=card, defaults=False)
    line = wait_log(gw, r"WARNING.*card \S+ \(\w+\) can hold nothing: .*card_reserve.*long puts to it fail").group(0)
    assert "lower card_reserve" in line
    keys = [b"a", b"b"]
    with gw.client() as c:
        assert c.put_many(keys, [payload(1), payload(2, 4096)]) == [False, False]
    # an object written and evicted at once is deleted in the background
    wait_until(lambda: object_files(card) == [], 10, lambda: f"objects left on the card: {object_files(card)}")
    restart(gw)
    with gw.client() as c:
        assert c.get_many(keys) == [None, None]
        assert c.lookup(keys) == 0


def test_object_larger_than_the_card_is_not_acknowledged(tmp_path: Path, gateway_factory) -> None:
    gw = gateway_factory(["--card-capacity", "3M", "--max-bytes", "0"])
    with gw.client() as c:
        small, big = payload(1), payload(2, 4 * MiB)
        assert c.put_many([b"small", b"big"], [small, big]) == [True, False]
        # Four more objects of 1 MiB and a header on a 3 MiB card, which holds two:
        # the batch evicts some of its own objects.
        keys = [b"x%d" % i for i in range(4)]
        ok = c.put_many(keys, [payload(10 + i) for i in range(4)])
        assert c.exists_many(keys) == ok, "a put answers True exactly for the objects that stayed"
        assert [g is not None for g in c.get_many(keys)] == ok
        assert 1 <= ok.count(True) <= 2
        assert c.get_many([b"big"]) == [None]
    # what the batch evicted is deleted in the background
    wait_until(lambda: len(object_files(Path(gw.card))) == 2, 10,
               lambda: f"not the two objects the card holds: {object_files(Path(gw.card))}")


# ------------------------------------------------------------------ Redis cards


@pytest.fixture
def redis_server():
    """``start(*extra) -> RedisServer`` with maxmemory-policy noeviction; all killed at teardown."""
    if not REDIS_SERVER:
        pytest.skip("redis-server is not installed")
    servers: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        import tempfile

        s = RedisServer(tempfile.mkdtemp(prefix="kvr", dir="/tmp"), "noeviction", extra, unix_socket=True)
        servers.append(s)
        return s.start()

    yield start
    for s in servers:
        s.kill()


def test_redis_card_with_256mb_holds_and_keeps_objects(tmp_path: Path, redis_server, gateway_factory) -> None:
    srv = redis_server("--maxmemory", "256mb")
    # card_reserve (default 1 GiB) is a filesystem's: it must not apply here.
    gw = gateway_factory(free_space_flags("--card-reserve", "1G"), card=srv.url, defaults=False)
    keys = [b"obj-%03d" % i for i in range(64)]
    with gw.client() as c:
        assert c.put_many(keys, [payload(i) for i in range(64)]) == [True] * 64
    restart(gw)
    with gw.client() as c:
        got = c.get_many(keys)
    assert [bytes(g) if g is not None else None for g in got] == [payload(i) for i in range(64)]
    cap = int(wait_log(gw, r"objects, \d+ bytes indexed, capacity (\d+) bytes").group(1))
    assert 150 * MiB < cap < 256 * MiB, cap
    assert "maxmemory-policy" not in gw.log(), "noeviction is what a card should run with"


def test_redis_card_within_its_capacity_never_runs_out_of_memory(tmp_path: Path, redis_server,
                                                               gateway_factory) -> None:
    """More than maxmemory put through a 256 MiB server: the gateway evicts before Redis refuses a write."""
    srv = redis_server("--maxmemory", "256mb")
    gw = gateway_factory(free_space_flags("--max-bytes", "0"), card=srv.url, defaults=False)
    wait_log(gw, r"bytes indexed")
    with gw.client() as c:
        for start in range(0, 320, 32):
            keys = [b"obj-%03d" % i for i in range(start, start + 32)]
            assert c.put_many(keys, [payload(i) for i in range(start, start + 32)]) == [True] * 32
    card = gw.stats()["cards"][0]
    assert card["errors"] == 0 and card["evictions"] > 0
    assert card["objects"] > 150, "the card holds what fits, about 180 objects of 1 MiB"
    used = int(redis.Redis(unix_socket_path=srv.sock).info("memory")["used_memory"])
    assert used < 256 * MiB


def test_one_batch_larger_than_a_redis_card_keeps_its_head_and_never_runs_the_server_out_of_memory(
        tmp_path: Path, redis_server, gateway_factory) -> None:
    """300 objects of 1 MiB in one put to a 256 MiB server: the batch is cut to what the card holds."""
    srv = redis_server("--maxmemory", "256mb")
    gw = gateway_factory(free_space_flags("--max-bytes", "0", "--shared-memory-size", "512M"), card=srv.url,
                         defaults=False)
    wait_log(gw, r"bytes indexed")
    keys = [b"obj-%03d" % i for i in range(300)]
    values = [payload(i) for i in range(300)]
    with gw.client() as c:
        ok = c.put_many(keys, values)
        kept = ok.count(True)
        assert ok == [True] * kept + [False] * (300 - kept) and kept > 150, kept
        got = c.get_many(keys[:kept])
    assert all(g is not None and bytes(g) == v for g, v in zip(got, values))
    card = gw.stats()["cards"][0]
    assert card["errors"] == 0 and card["refused"] == 300 - kept, (card, gw.log())
    assert int(redis.Redis(unix_socket_path=srv.sock).info("memory")["used_memory"]) < 256 * MiB


def test_redis_card_that_can_hold_nothing_warns_and_refuses_puts(tmp_path: Path, redis_server,
                                                                 gateway_factory) -> None:
    srv = redis_server("--maxmemory", "8mb")
    raw = redis.Redis(unix_socket_path=srv.sock)
    i = 0
    with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
        while i < 10_000:  # someone else's keys fill the server
            raw.set(b"other:%d" % i, b"x" * 65536)
            i += 1
    raw.close()
    gw = gateway_factory(free_space_flags(), card=srv.url, defaults=False)
    line = wait_log(gw, r"WARNING.*card \S+ \(\w+\) can hold nothing: .*maxmemory.*long puts to it fail").group(0)
    assert "raise maxmemory" in line
    with gw.client() as c:
        assert c.put_many([b"k"], [payload(1)]) == [False]
    raw = redis.Redis(unix_socket_path=srv.sock)
    assert raw.keys(b"kvgate:o:*") == []
    raw.close()
