"""A card shared with a newer kvgate (an upgrade in progress), against a real gateway: objects in a
newer format are misses here, are not counted as corrupt, and stay on the card."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from kvgate.cards import DirectoryCard
from tests.helpers import as_newer_format

pytestmark = pytest.mark.timeout(60)


def test_objects_of_a_newer_format_are_misses_and_stay(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"])
    keys = [b"old-a", b"new-b", b"old-c"]
    with gw.client(namespace="upgrade") as c:
        assert all(c.put_many(keys, [k * 1000 for k in keys], retention="long"))
    assert gw.stop() == 0
    # Without an index snapshot the scan reads every header (with one, the first read finds the newer
    # object: tests/tiers/test_restart.py).
    os.unlink(os.path.join(gw.card, "kvgate-index"))
    (path,) = [p for p in glob.glob(os.path.join(gw.card, "db*", "*", "*"))
               if b"new-b" in Path(p).read_bytes()[:200]]
    full = next(o.full_key for o in DirectoryCard(str(gw.card)).scan() if o.full_key.endswith(b"new-b"))
    Path(path).write_bytes(as_newer_format(Path(path).read_bytes(), full))

    gw.start()
    stats = gw.wait_scanned()
    assert os.path.exists(path)
    assert stats["cards"][0]["objects"] == 2  # the newer one is not indexed
    with gw.client(namespace="upgrade") as c:
        got = c.get_many(keys)
        assert [None if g is None else bytes(g) for g in got] == [b"old-a" * 1000, None, b"old-c" * 1000]
        assert as_newer_format(Path(path).read_bytes(), full) == Path(path).read_bytes()  # untouched
        # Once a read has found it unreadable here, lookups stop offering it (an engine
        # would otherwise be promised a hit its load can never get).
        assert c.exists_many(keys) == [True, False, True]
        assert c.lookup(keys) == 1
        # Written again by this gateway: readable here again.
        assert all(c.put_many([b"new-b"], [b"again" * 100], retention="long"))
        assert c.lookup(keys) == 3
    assert gw.stats()["corrupt_objects"] == 0
    assert Path(path).read_bytes()[4] == 1  # rewritten in this build's format (version 1)
    assert "newer kvgate" in gw.log()
