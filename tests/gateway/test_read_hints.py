"""A lookup that finds objects on a card passes their keys to the card (Card.prepare_reads),
against a real gateway: counted per card, only for what is on a card and not in RAM, and
switched off by `prepare_reads: false`."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

N = 6


def _objects() -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(3)
    return [f"hint-{i}".encode() for i in range(N)], [rng.integers(0, 256, 40_000, dtype=np.uint8) for _ in range(N)]


def _read_hints(gw) -> int:
    (card,) = gw.stats()["cards"]
    return card["read_hints"]


def test_lookups_hint_the_objects_they_found_on_the_card(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"])  # no RAM tier: whatever is found is on the card
    keys, vals = _objects()
    with gw.client(namespace="hints") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        assert _read_hints(gw) == 0
        assert c.exists_many([*keys, b"absent"]) == [True] * N + [False]
        assert _read_hints(gw) == N
        assert c.lookup([*keys[:4], b"absent", *keys[4:]]) == 4  # a prefix lookup hints its prefix
        assert _read_hints(gw) == N + 4
        got = c.get_many(keys)
        assert all(g is not None and bytes(g) == v.tobytes() for g, v in zip(got, vals))


def test_objects_in_the_ram_tier_are_not_hinted(gateway_factory) -> None:
    gw = gateway_factory()
    keys, vals = _objects()
    with gw.client(namespace="hints") as c:
        assert all(c.put_many(keys, vals, retention="long"))  # in RAM and on the card
        assert c.exists_many(keys) == [True] * N
        assert c.lookup(keys) == N
    assert _read_hints(gw) == 0


def test_prepare_reads_off_hints_nothing(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0", "--prepare-reads", "false"])
    keys, vals = _objects()
    with gw.client(namespace="hints") as c:
        assert all(c.put_many(keys, vals, retention="long"))
        assert c.exists_many(keys) == [True] * N
        assert c.lookup(keys) == N
        got = c.get_many(keys)
        assert all(g is not None for g in got)
    assert _read_hints(gw) == 0
