"""hold / release against a real gateway: a held object stays on its full card while others are
evicted around it, until released or its session ends; a session cannot hold without bound."""

from __future__ import annotations

import pytest

from kvgate.tiers.holds import MAX_PER_SESSION
from tests.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NS = "holds"
BLOCK = b"h" * (64 << 10)


def fill(c, prefix: str, n: int) -> None:
    for i in range(n):  # one put at a time: the card evicts after each
        assert c.put_many([f"{prefix}{i}".encode()], [BLOCK]) == [True]


def test_held_objects_outlive_eviction_until_released(gateway_factory) -> None:
    gw = gateway_factory(["--card-capacity", "2M", "--max-bytes", "0"])
    held = [f"held{i}".encode() for i in range(8)]
    with gw.client(NS) as lmcache, gw.client(NS) as writer:
        assert lmcache.put_many(held, [BLOCK] * len(held)) == [True] * len(held)
        assert lmcache.hold_many(held + [b"never-stored"]) == [True] * len(held) + [False]
        assert gw.stats()["holds"]["objects"] == len(held)
        fill(writer, "w", 80)  # 5 MiB through a 2 MiB card
        assert writer.exists_many(held) == [True] * len(held)
        assert sum(writer.exists_many([f"w{i}".encode() for i in range(80)])) < 40  # the rest was evicted
        got = writer.get_many(held)
        assert all(g is not None and bytes(g) == BLOCK for g in got)

        assert lmcache.release_many(held) == len(held)
        assert lmcache.release_many(held) == 0
        fill(writer, "x", 80)
        assert sum(writer.exists_many(held)) < len(held)


def test_a_sessions_holds_end_with_it_and_are_bounded(gateway_factory) -> None:
    gw = gateway_factory(["--card-capacity", "64M"])
    keys = [f"k{i}".encode() for i in range(MAX_PER_SESSION + 10)]
    with gw.client(NS) as c:
        for i in range(0, len(keys), 1024):
            assert all(c.put_many(keys[i : i + 1024], [b"v"] * len(keys[i : i + 1024])))
        got = []
        for i in range(0, len(keys), 1024):
            got += c.hold_many(keys[i : i + 1024])
        assert got == [True] * MAX_PER_SESSION + [False] * 10
        snap = gw.stats()["holds"]
        assert snap == {"objects": MAX_PER_SESSION, "refused": 10}
    # the first session is gone, and its holds with it
    wait_until(lambda: gw.stats()["holds"]["objects"] == 0, 10, lambda: f"holds left: {gw.stats()['holds']}")
    with gw.client(NS) as other:
        assert other.hold_many(keys[:3]) == [True] * 3
