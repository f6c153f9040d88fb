"""Card removals that would lose data or leave no card in service are refused unless forced.

Real gateway process, real directory cards, the real ``kvgate cards`` command.
Before, ``cards remove LAST`` and ``cards drain LAST --now`` were taken (every
put then answered False), and so was removing (or draining ``--now``) the card
a running drain had just copied objects onto, whose copies on the draining
card were already deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run_kvgate, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OBJECT = 256 << 10


def _cards(gw) -> list[dict]:
    out = run_kvgate("cards", "list", "--json", "--socket", gw.socket)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["cards"]


def _card(gw, location: Path) -> dict:
    return next(c for c in _cards(gw) if c["location"] == str(location))


def _cards_cmd(gw, *args: str):
    return run_kvgate("cards", *args, "--socket", gw.socket)


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, OBJECT, dtype=np.uint8).tobytes()


def _put(gw, keys: list[bytes]) -> None:
    with gw.client() as c:
        for i in range(0, len(keys), 16):
            assert c.put_many(keys[i : i + 16], [_payload(j) for j in range(i, min(i + 16, len(keys)))]) == \
                [True] * len(keys[i : i + 16])


def test_removing_the_last_card_in_service_is_refused_unless_forced(tmp_path: Path, gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"])
    gw.wait_scanned()
    (serial,) = [c["serial"] for c in _cards(gw)]
    for args in (("remove", serial), ("drain", serial, "--now"), ("drain", serial)):
        out = _cards_cmd(gw, *args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "last card in service" in out.stderr and serial in out.stderr, (args, out.stderr)
        if args[0] == "remove" or "--now" in args:
            assert "--force" in out.stderr and "every put is refused" in out.stderr, out.stderr
    assert [c["serial"] for c in _cards(gw)] == [serial]
    with gw.client() as c:
        assert c.put_many([b"still"], [b"served"]) == [True]

    out = _cards_cmd(gw, "remove", serial, "--force")
    assert out.returncode == 0, out.stderr
    assert _cards(gw) == []
    with gw.client() as c:  # what --force was warned of: nowhere to put anything
        assert c.put_many([b"after"], [b"x"]) == [False]
    assert gw.alive()


def test_removing_the_card_a_running_drain_copies_onto_is_refused_unless_forced(tmp_path: Path,
                                                                                gateway_factory) -> None:
    cards = {n: tmp_path / n for n in ("c1", "c2", "c3")}
    for p in cards.values():
        p.mkdir()
    # The slowest mover (1 MiB/s: 4 objects a second) keeps c1's drain running while the test asks for removals.
    gw = gateway_factory(["--max-bytes", "0", "--card-move-rate", "1M", "--storage-devices",
                          *map(str, cards.values())])
    gw.wait_scanned()
    keys = [b"obj-%03d" % i for i in range(240)]
    _put(gw, keys)
    serial = {n: _card(gw, p)["serial"] for n, p in cards.items()}
    on_c1, on_c3 = _card(gw, cards["c1"])["objects"], _card(gw, cards["c3"])["objects"]
    assert on_c1 > 40 and on_c3 > 0, (on_c1, on_c3)

    assert _cards_cmd(gw, "drain", serial["c1"]).returncode == 0
    wait_until(lambda: _card(gw, cards["c3"])["objects"] > on_c3, 30, "the drain copied objects onto c3")
    assert _card(gw, cards["c1"])["state"] == "draining"

    for args in (("remove", serial["c3"]), ("drain", serial["c3"], "--now")):
        out = _cards_cmd(gw, *args)
        assert out.returncode == 1, (args, out.stdout, out.stderr, gw.log()[-3000:])
        msg = out.stderr
        assert f"card {serial['c3']} not" in msg and "moved onto it" in msg and serial["c1"] in msg, msg
        assert "objects (" in msg and "MiB)" in msg, msg  # how much would be lost
        assert "undrain" in msg and "--force" in msg, msg  # and how to go on
    out = _cards_cmd(gw, "remove", serial["c1"])  # the draining card itself, still holding some
    assert out.returncode == 1 and "not copied elsewhere yet" in out.stderr, (out.stdout, out.stderr)
    assert {c["serial"] for c in _cards(gw)} == set(serial.values())
    assert "Traceback" not in gw.log()

    moved_to_c3 = _card(gw, cards["c3"])["objects"]
    out = _cards_cmd(gw, "remove", serial["c3"], "--force")
    assert out.returncode == 0, out.stderr
    assert serial["c3"] not in {c["serial"] for c in _cards(gw)}
    # What the refusal protected: c3's objects (those moved off c1 among them) are read nowhere now.
    with gw.client() as c:
        found = sum(c.exists_many(keys))
    assert found <= len(keys) - moved_to_c3, (found, moved_to_c3)
    assert gw.alive()


def test_undrain_ends_the_drain_and_the_card_it_copied_onto_may_then_go(tmp_path: Path, gateway_factory) -> None:
    cards = {n: tmp_path / n for n in ("c1", "c2", "c3")}
    for p in cards.values():
        p.mkdir()
    gw = gateway_factory(["--max-bytes", "0", "--card-move-rate", "1M", "--storage-devices",
                          *map(str, cards.values())])
    gw.wait_scanned()
    keys = [b"obj-%03d" % i for i in range(160)]
    _put(gw, keys)
    serial = {n: _card(gw, p)["serial"] for n, p in cards.items()}
    on_c2 = _card(gw, cards["c2"])["objects"]
    assert _cards_cmd(gw, "drain", serial["c1"]).returncode == 0
    wait_until(lambda: _card(gw, cards["c2"])["objects"] > on_c2, 30, "the drain copied objects onto c2")
    assert _cards_cmd(gw, "remove", serial["c2"]).returncode == 1
    assert _cards_cmd(gw, "undrain", serial["c1"]).returncode == 0
    out = _cards_cmd(gw, "remove", serial["c2"])  # no drain runs: a plain removal, as before
    assert out.returncode == 0, out.stderr
