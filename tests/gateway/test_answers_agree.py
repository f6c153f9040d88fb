"""lookup, exists_many, get_many and prewarm give one answer, with real gateways.

One rule decides where a key is (``TieredStore``, ``LongTier.find``): the
RAM tier, any card's index whatever the dialog, else a probe of the key's
placement card for the request's dialog.  An engine restores what its
lookup found, so a lookup that says less than get loses hits, and one that
says more makes the engine load misses.  With a ttl, an object past it is a
miss in all of them, from RAM, from the index and after a restart.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.gateway.test_card_capacity import redis_server, wait_log  # noqa: F401 (a fixture)
from tests.helpers import GatewayProcess, object_files, wait_until

DIALOGS = (None, b"dialog-a", b"dialog-b")


def blob(key: bytes) -> bytes:
    return key * (4096 // len(key))


def answers(gw: GatewayProcess, keys: list[bytes], dialog: bytes | None) -> tuple[int, list[bool], list[bool]]:
    """(lookup, exists_many, which get_many found) for ``keys``; checks that what get returns is right."""
    with gw.client() as c:
        n = c.lookup(keys, dialog=dialog)
        present = c.exists_many(keys, dialog=dialog)
        got = c.get_many(keys, dialog=dialog)
    for k, g in zip(keys, got):
        assert g is None or bytes(g) == blob(k)
    return n, present, [g is not None for g in got]


def leading(flags: list[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


def restart(gw: GatewayProcess) -> None:
    gw.stop()
    gw.start()
    gw.wait_scanned()


@pytest.mark.parametrize("n_cards", [1, 3])
def test_lookup_exists_get_prewarm_agree(tmp_path: Path, gateway_factory, n_cards: int) -> None:
    cards = [tmp_path / f"card{i}" for i in range(n_cards)]
    for c in cards:
        c.mkdir()
    gw = gateway_factory(["--storage-devices", *map(str, cards), "--storage-slots", str(16 * n_cards)])
    # Keys put under each dialog (and none), then a gap (never put), then more.
    put_sets = {d: [b"%s-%02d" % (d or b"none", i) for i in range(12)] for d in DIALOGS}
    with gw.client() as c:
        for d, keys in put_sets.items():
            assert c.put_many(keys, [blob(k) for k in keys], dialog=d) == [True] * len(keys)
    everything = [k for keys in put_sets.values() for k in keys]
    with_gap = everything[:20] + [b"never-put"] + everything[20:]

    def check(when: str) -> None:
        for read_dialog in DIALOGS:
            for keys in (everything, with_gap):
                n, present, found = answers(gw, keys, read_dialog)
                where = f"{when}, read with dialog {read_dialog}, {len(keys)} keys"
                assert present == found, where
                assert n == leading(found), where
                assert found == [k != b"never-put" for k in keys], where

    check("before a restart")
    restart(gw)
    check("after a restart")
    for read_dialog in DIALOGS:  # prewarm pulls exactly the leading run lookup counts
        restart(gw)
        with gw.client() as c:
            assert c.prewarm(with_gap, dialog=read_dialog) == 20
            assert c.lookup(with_gap, dialog=read_dialog) == 20
        assert gw.stats()["tiers"]["ram"]["objects"] == 20


def test_deleted_without_dialog_is_gone_everywhere(tmp_path: Path, gateway_factory) -> None:
    cards = [tmp_path / f"card{i}" for i in range(3)]
    for c in cards:
        c.mkdir()
    gw = gateway_factory(["--storage-devices", *map(str, cards), "--storage-slots", "48"])
    keys = [b"k%02d" % i for i in range(12)]
    with gw.client() as c:
        assert all(c.put_many(keys, [blob(k) for k in keys], dialog=b"dialog-a"))
    restart(gw)
    with gw.client() as c:
        assert c.delete_many(keys) == 12
    for d in DIALOGS:
        assert answers(gw, keys, d) == (0, [False] * 12, [False] * 12)
    assert sum(len(object_files(c)) for c in cards) == 0


def test_expired_objects_are_misses_everywhere(tmp_path: Path, gateway_factory) -> None:
    # A ttl long enough that a restart on a loaded machine ends well inside it.
    ttl = 5.0
    gw = gateway_factory(["--ttl", f"{ttl:.0f}s"])
    indexed = [b"indexed-%d" % i for i in range(8)]  # found by the start-up scan, then expire
    in_ram = [b"in-ram-%d" % i for i in range(8)]  # in RAM and indexed when they expire
    with gw.client() as c:
        assert all(c.put_many(indexed, [blob(k) for k in indexed]))
    restart(gw)
    with gw.client() as c:
        assert all(c.put_many(in_ram, [blob(k) for k in in_ram]))
        last_put = time.monotonic()
        assert c.lookup(indexed) == 8 and c.lookup(in_ram) == 8
    time.sleep(max(0.0, last_put + ttl + 1 - time.monotonic()))  # 1 s past the ttl of the last of them
    for keys in (indexed, in_ram):
        assert answers(gw, keys, None) == (0, [False] * 8, [False] * 8)
        with gw.client() as c:
            assert c.prewarm(keys) == 0

    stale = [b"stale-%d" % i for i in range(8)]  # expire while no gateway runs
    with gw.client() as c:
        assert all(c.put_many(stale, [blob(k) for k in stale]))
        last_put = time.monotonic()
    gw.stop()
    time.sleep(max(0.0, last_put + ttl + 1 - time.monotonic()))  # the point: they expire while it is down
    gw.start()
    assert int(wait_log(gw, r"; (\d+) objects past the ttl deleted").group(1)) >= 8
    assert answers(gw, stale, None) == (0, [False] * 8, [False] * 8)
    with gw.client() as c:
        assert c.prewarm(stale) == 0
    wait_until(lambda: object_files(Path(gw.card)) == [], 10,
               lambda: f"expired objects left on the card: {object_files(Path(gw.card))}")
    assert gw.stats()["expired_objects"] >= 8


def _objects_another_gateway_wrote(gateway_factory, card: str, ttl: str) -> tuple[GatewayProcess, list[bytes]]:
    """Two gateways sharing ``card``; the second started first, so it has not indexed what the first writes."""
    args = ["--storage-devices", card, "--shared-storage", "true", "--ttl", ttl, "--max-bytes", "0"]
    reader = gateway_factory(args, name="reader")
    reader.wait_scanned()
    writer = gateway_factory(args, name="writer")
    keys = [b"shared-%02d" % i for i in range(6)]
    with writer.client() as c:
        assert c.put_many(keys, [blob(k) for k in keys]) == [True] * len(keys)
    return reader, keys


def test_an_unindexed_object_past_the_ttl_is_a_miss_for_every_question(tmp_path: Path, gateway_factory) -> None:
    card = tmp_path / "card"
    card.mkdir()
    reader, keys = _objects_another_gateway_wrote(gateway_factory, str(card), "2s")
    assert answers(reader, keys, None) == (6, [True] * 6, [True] * 6), "found on the card, unindexed, in time"
    time.sleep(2.5)  # the point: past the 2 s ttl
    assert answers(reader, keys, None) == (0, [False] * 6, [False] * 6)


def test_an_unindexed_object_past_the_ttl_is_a_miss_on_a_redis_card(gateway_factory, redis_server) -> None:
    srv = redis_server()
    reader, keys = _objects_another_gateway_wrote(gateway_factory, srv.url, "2s")
    assert answers(reader, keys, None) == (6, [True] * 6, [True] * 6)
    time.sleep(2.5)  # the point: past the 2 s ttl
    assert answers(reader, keys, None) == (0, [False] * 6, [False] * 6)
