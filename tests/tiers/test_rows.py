"""``DigestRows``: rows found by digest, one at a time and in batches, through growth and removals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from kvgate.tiers import rows as rows_module
from kvgate.tiers.rows import DigestRows, digest_array, split_digest, unique_digests


@pytest.fixture(params=["compiled", "numpy"], autouse=True)
def probe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case on both batch probes: the compiled one (``kvgate/_probe.c``, built by ``make install``)
    and the numpy one it replaces where it is built."""
    if request.param == "numpy":
        monkeypatch.setattr(rows_module, "_probe_many", None)
    elif rows_module._probe_many is None:
        pytest.skip("the compiled probe is not built here (make install builds it)")
    return request.param


def digests(n: int, salt: bytes = b"") -> list[bytes]:
    return [xxhash.xxh3_128_digest(salt + b"%d" % i) for i in range(n)]


@pytest.mark.parametrize("stable", [False, True])
def test_random_adds_and_removes_agree_with_a_dict(stable: bool) -> None:
    moves: list[tuple[int, int]] = []
    rows = DigestRows({"v": np.int64}, on_move=lambda s, d: moves.append((s, d)), stable=stable)
    ref: dict[bytes, int] = {}
    rng = random.Random(7)
    keys = digests(3000)
    for step in range(12000):
        k = rng.choice(keys)
        r = rows.find1(*split_digest(k))
        if k in ref:
            assert r >= 0 and rows.v[r] == ref[k]
            if rng.random() < 0.5:
                n0 = rows.n
                moved = rows.remove(r)
                del ref[k]
                if stable:
                    assert moved == -1 and rows.n == n0, "a stable table leaves a hole"
                elif moved >= 0:
                    assert moves[-1] == (moved, r) and moved == n0 - 1, "the last row filled the hole"
        else:
            assert r == -1
            r = rows.add1(*split_digest(k))
            rows.v[r] = step
            ref[k] = step
        if step % 3000 == 0:
            found = rows.find(*digest_array(keys).T)
            assert [int(x) >= 0 for x in found] == [k in ref for k in keys]
            assert all(rows.v[int(x)] == ref[k] for k, x in zip(keys, found) if x >= 0)
            assert len(rows) == len(ref)
            if not stable:
                assert rows.n == len(ref), "dense: every row below n is live"
    assert len(rows) == len(ref)


def test_bulk_add_then_find_many_and_digests_back() -> None:
    rows = DigestRows({})
    keys = digests(50_000)
    arr = digest_array(keys)
    got = rows.add_many(arr[:, 0], arr[:, 1])
    assert list(got) == list(range(50_000))
    probe = digests(50_000)[::7] + digests(1000, b"absent")
    found = rows.find(*digest_array(probe).T)
    assert (found[: len(keys[::7])] == np.arange(0, 50_000, 7)).all()
    assert (found[len(keys[::7]):] == -1).all()
    assert rows.digests(np.array([0, 49_999])) == [keys[0], keys[49_999]]
    assert rows.slots.size >= 2 * rows.n, "at most half the slots in use"


def test_removal_keeps_every_probe_run_whole() -> None:
    """Keys sharing a home slot, and keys their run pushed along: removing any one leaves the rest findable
    (the run is shifted back, no tombstones)."""
    rows = DigestRows({}, capacity=16)
    mask = rows.mask
    colliding = [(3 + (i << 40), i) for i in range(4)]  # all at home in slot 3
    pushed = [(4, 100), (5, 101), (mask, 102), (mask + 1, 103)]  # homes 4 and 5, then a run that wraps
    live = colliding + pushed
    for lo, hi in live:
        rows.add1(lo, hi)
    assert rows.mask == mask, "no growth in between"
    for victim in [colliding[1], pushed[0], colliding[0], pushed[2], colliding[3]]:
        rows.remove(rows.find1(*victim))
        live.remove(victim)
        for lo, hi in colliding + pushed:
            assert (rows.find1(lo, hi) >= 0) == ((lo, hi) in live), (victim, (lo, hi))
    assert len(rows) == len(live)


def test_a_table_that_doubles_moves_over_while_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MIGRATE_FROM slots the table doubles by migration: every digest stays findable, one by one and in
    batches, through adds and removals while both tables are in use."""
    monkeypatch.setattr(rows_module, "MIGRATE_FROM", 64)
    monkeypatch.setattr(rows_module, "MIGRATE_PER_ADD", 3)
    monkeypatch.setattr(rows_module, "MIGRATE_PER_FIND", 16)
    monkeypatch.setattr(rows_module, "RESERVE_FROM", 256)
    rows = DigestRows({"v": np.int64})
    ref: dict[bytes, int] = {}
    rng = random.Random(11)
    keys = digests(5000)
    migrating = 0
    for step in range(20000):
        k = rng.choice(keys)
        r = rows.find1(*split_digest(k))
        assert (r >= 0) == (k in ref)
        if r >= 0:
            assert rows.v[r] == ref[k]
            if rng.random() < 0.3:
                rows.remove(r)
                del ref[k]
        else:
            r = rows.add1(*split_digest(k))
            rows.v[r] = step
            ref[k] = step
        migrating += rows._old is not None
        if step % 500 == 0:
            found = rows.find(*digest_array(keys).T)
            assert [int(x) >= 0 for x in found] == [k in ref for k in keys]
            assert all(rows.v[int(x)] == ref[k] for k, x in zip(keys, found) if x >= 0)
    assert migrating > 100, "the steps ran while the table was doubling"
    assert rows.cap >= rows_module.RESERVE_ROWS or rows.cap >= len(ref), "columns grew"


def test_dialogs_told_apart_by_both_halves_of_their_digest() -> None:
    """Dialogs are grouped by the high half of their digest first: two that share it stay two."""
    d = np.array([[1, 7], [2, 7], [1, 7], [3, 9]], np.uint64)
    uniq, inv = unique_digests(d)
    assert len(uniq) == 3 and (uniq[inv] == d).all()
    uniq, inv = unique_digests(d[[0, 2, 3]])
    assert len(uniq) == 2 and (uniq[inv] == d[[0, 2, 3]]).all()


@pytest.mark.parametrize("n", [40, 1000, 3000, 20_000])
def test_a_batch_find_agrees_with_one_by_one_probes_on_every_run_length(n: int) -> None:
    """The batched probe (a round, then a window of slots, then one by one past it) finds what ``find1``
    finds, for keys on runs of every length up to the longest at the table's fullest (adds up to its
    resize, removals leaving runs that must stay whole, a table part moved over)."""
    rows = DigestRows({})
    keys = digests(n, b"run")
    arr = digest_array(keys)
    rows.add_many(arr[:, 0], arr[:, 1])
    rng = random.Random(n)
    for k in rng.sample(keys, n // 5):
        rows.remove(rows.find1(*split_digest(k)))
    asked = keys + digests(n, b"absent")
    want = [rows.find1(*split_digest(k)) for k in asked]
    got = rows.find(*digest_array(asked).T)
    assert got.tolist() == want
    assert sum(w >= 0 for w in want) == n - n // 5


def test_a_batch_of_separate_or_strided_halves_is_found_alike() -> None:
    """The halves as the columns of one ``(n, 2)`` array (a card index's lookup), as arrays of their own,
    reversed, or not uint64 at all: the same rows."""
    rows = DigestRows({})
    keys = digests(500)
    arr = digest_array(keys)
    rows.add_many(arr[:, 0], arr[:, 1])
    asked = digest_array(keys[::3] + digests(100, b"absent"))
    want = [rows.find1(*split_digest(k)) for k in keys[::3] + digests(100, b"absent")]
    assert rows.find(asked[:, 0], asked[:, 1]).tolist() == want
    assert rows.find(asked[:, 0].copy(), asked[:, 1].copy()).tolist() == want
    assert rows.find(asked[::-1, 0], asked[::-1, 1]).tolist() == want[::-1]
    assert rows.find(asked[:, 0].astype(object), asked[:, 1].astype(object)).tolist() == want


def test_the_compiled_probe_is_built_where_a_compiler_is() -> None:
    """``make install`` builds it (setup.py, optional): a lookup without it costs 100-200 us more."""
    import shutil
    import sysconfig

    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc")):
        pytest.skip("no C compiler here: the numpy probe serves")
    from kvgate import native

    assert native.load("_probe") is not None, "make install should have built kvgate/_probe*.so"
