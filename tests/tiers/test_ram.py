"""RAM tier: data round trips, page accounting, pins, contiguity, and prefix retention."""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvgate.cards.objectformat import ObjectMeta
from kvgate.keys import dialog_digest, full_key
from kvgate.tiers.eviction import LONG, SHORT
from kvgate.tiers.ram import Entry, RamPages, copy_into, copy_out

PAGE = 4096
META = ObjectMeta()


def put(tier: RamPages, key: bytes, data: bytes | np.ndarray, meta: ObjectMeta = META, klass: int = SHORT) -> Entry | None:
    buf = memoryview(data if isinstance(data, (bytes, bytearray)) else data.tobytes())
    res = tier.reserve(key, len(buf), meta, klass)
    if res is None:
        return None
    copy_into(res.views(), buf)
    tier.commit(res)
    return res


def get(tier: RamPages, key: bytes) -> bytes | None:
    entry = tier.pin(key)
    if entry is None:
        return None
    try:
        out = bytearray(entry.size)
        assert copy_out(entry.views(), memoryview(out)) == entry.size
        return bytes(out)
    finally:
        tier.unpin(entry)


def rand_bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def check_pages(tier: RamPages, held: list[Entry] = ()) -> None:
    """Every used page belongs to exactly one live entry or reservation."""
    pages: list[int] = []
    for entry in list(tier.iter_entries()) + list(held):
        for start, n in entry.extents:
            pages.extend(range(start, start + n))
        assert entry.n_pages == -(-entry.size // tier.page_size)
    assert len(pages) == len(set(pages)), "a page is shared by two objects"
    assert all(0 <= p < tier.total_pages for p in pages)
    assert tier.used_pages <= tier.total_pages
    assert tier.free_pages + tier.used_pages == tier.total_pages


# -- data -----------------------------------------------------------------


def test_round_trip_odd_sizes():
    rng = np.random.default_rng(1)
    tier = RamPages(64 * PAGE, PAGE)
    blobs = {b"k%d" % n: rand_bytes(rng, n) for n in (1, 17, 4095, 4096, 4097, 12345, 3 * PAGE)}
    for key, data in blobs.items():
        res = tier.reserve(key, len(data), META, SHORT)
        views = res.views()
        assert sum(v.nbytes for v in views) == len(data)
        assert not tier.contains(key) and tier.pin(key) is None  # invisible until commit
        copy_into(views, data)
        tier.commit(res)
    for key, data in blobs.items():
        assert get(tier, key) == data
        assert tier.size_of(key) == len(data)
    assert tier.used_bytes == sum(map(len, blobs.values()))
    assert tier.entries == len(blobs)
    check_pages(tier)


def test_zero_size_object_takes_no_pages():
    tier = RamPages(2 * PAGE, PAGE)
    assert put(tier, b"empty", b"") is not None
    assert tier.used_pages == 0 and tier.contains(b"empty")
    assert get(tier, b"empty") == b""


def test_multi_extent_round_trip():
    rng = np.random.default_rng(2)
    tier = RamPages(8 * PAGE, PAGE)
    for i in range(4):
        put(tier, b"p%d" % i, rand_bytes(rng, PAGE))
    tier.delete(b"p0")
    tier.delete(b"p2")  # free pages now 0 and 2 on top of 4..7: not contiguous
    data = rand_bytes(rng, 3 * PAGE - 5)
    entry = put(tier, b"big", data)
    assert len(entry.extents) >= 2, entry.extents
    assert [v.nbytes for v in entry.views()][-1] == PAGE - 5
    assert get(tier, b"big") == data
    assert get(tier, b"p1") is not None and get(tier, b"p3") is not None
    check_pages(tier)


def test_copies_from_threads():
    rng = np.random.default_rng(3)
    tier = RamPages(64 * PAGE, PAGE)
    blobs = [rand_bytes(rng, 5 * PAGE + i) for i in range(8)]
    reservations = [tier.reserve(b"t%d" % i, len(b), META, SHORT) for i, b in enumerate(blobs)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda rb: copy_into(rb[0].views(), memoryview(rb[1])), zip(reservations, blobs)))
    for r in reservations:
        tier.commit(r)
    entries = [tier.pin(b"t%d" % i) for i in range(len(blobs))]
    outs = [bytearray(len(b) + 10) for b in blobs]  # destination may be longer
    with ThreadPoolExecutor(2) as pool:
        sizes = list(pool.map(lambda eo: copy_out(eo[0].views(), memoryview(eo[1])), zip(entries, outs)))
    for e in entries:
        tier.unpin(e)
    assert sizes == [len(b) for b in blobs]
    assert all(bytes(o[: len(b)]) == b for o, b in zip(outs, blobs))


def test_copy_size_mismatch_raises():
    tier = RamPages(4 * PAGE, PAGE)
    res = tier.reserve(b"k", 100, META, SHORT)
    with pytest.raises(ValueError):
        copy_into(res.views(), bytes(99))
    copy_into(res.views(), bytes(100))
    tier.commit(res)
    entry = tier.pin(b"k")
    with pytest.raises(ValueError):
        copy_out(entry.views(), bytearray(99))
    tier.unpin(entry)


# -- capacity and eviction --------------------------------------------------


def test_eviction_when_full_and_capacity_respected():
    tier = RamPages(4 * PAGE, PAGE, policy="lru")
    for i in range(6):
        assert put(tier, b"k%d" % i, bytes([i]) * PAGE) is not None
        assert tier.used_pages <= tier.total_pages
    assert tier.entries == 4
    assert tier.evictions == 2 and tier.evicted_bytes == 2 * PAGE
    assert not tier.contains(b"k0") and not tier.contains(b"k1")
    assert get(tier, b"k5") == bytes([5]) * PAGE
    check_pages(tier)


def test_random_workload_keeps_accounting():
    rng = random.Random(4)
    tier = RamPages(40 * PAGE + 123, PAGE)  # a partial page is not usable
    assert tier.capacity == 40 * PAGE
    pinned: list[Entry] = []
    held: list[Entry] = []
    for step in range(1500):
        op = rng.random()
        key = b"k%d" % rng.randrange(60)
        if op < 0.45:
            res = tier.reserve(key, rng.randrange(0, 6 * PAGE), ObjectMeta(dialog_digest(b"d%d" % rng.randrange(5)), rng.randrange(8)), rng.choice([SHORT, LONG]))
            if res is not None:
                if rng.random() < 0.1:
                    held.append(res)  # filled slowly, committed later
                else:
                    tier.commit(res)
        elif op < 0.6:
            entry = tier.pin(key)
            if entry is not None:
                pinned.append(entry)
        elif op < 0.75 and pinned:
            tier.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.85 and held:
            r = held.pop(rng.randrange(len(held)))
            tier.abort(r) if rng.random() < 0.5 else tier.commit(r)
        elif op < 0.95:
            tier.delete(key)
        elif op < 0.96:
            tier.clear()
        assert tier.used_bytes == sum(e.size for e in tier.iter_entries())
        dropped = [e for e in {id(e): e for e in pinned}.values() if not e.visible]
        check_pages(tier, held + dropped)
    for e in pinned:
        tier.unpin(e)
    for r in held:
        tier.abort(r)
    check_pages(tier)
    assert tier.used_pages == sum(e.n_pages for e in tier.iter_entries())
    assert tier.evictions > 0


def test_reserve_larger_than_capacity_and_disabled_tier():
    tier = RamPages(4 * PAGE, PAGE)
    assert tier.reserve(b"k", 4 * PAGE + 1, META, SHORT) is None
    assert tier.reserve(b"k", 4 * PAGE, META, SHORT) is not None
    for off in (RamPages(0, PAGE), RamPages(PAGE - 1, PAGE)):
        assert off.capacity == 0
        assert off.reserve(b"k", 0, META, SHORT) is None
        assert off.reserve(b"k", 10, META, SHORT) is None
        assert off.pin(b"k") is None and not off.contains(b"k")


def test_abort_frees_pages():
    tier = RamPages(4 * PAGE, PAGE)
    res = tier.reserve(b"k", 3 * PAGE, META, SHORT)
    assert tier.used_pages == 3
    tier.abort(res)
    assert tier.used_pages == 0 and not tier.contains(b"k")
    with pytest.raises(ValueError):
        tier.commit(res)
    res = tier.reserve(b"k", 10, META, SHORT)
    tier.commit(res)
    with pytest.raises(ValueError):
        tier.commit(res)
    with pytest.raises(ValueError):
        tier.unpin(res)


def test_reservation_is_never_evicted():
    tier = RamPages(2 * PAGE, PAGE)
    res = tier.reserve(b"slow", PAGE, META, SHORT)
    put(tier, b"a", b"a" * PAGE)
    put(tier, b"b", b"b" * PAGE)  # evicts a, not the reservation
    assert tier.reserve(b"c", 2 * PAGE, META, SHORT) is None
    copy_into(res.views(), b"s" * PAGE)
    tier.commit(res)
    assert get(tier, b"slow") == b"s" * PAGE


# -- pins ------------------------------------------------------------------


def test_pinned_entries_are_never_evicted():
    tier = RamPages(4 * PAGE, PAGE, policy="lru")
    for i in range(4):
        put(tier, b"k%d" % i, bytes([i]) * PAGE)
    pinned = tier.pin(b"k0")  # the LRU victim, were it not pinned
    for i in range(4, 12):
        assert put(tier, b"k%d" % i, bytes([i]) * PAGE) is not None
        assert tier.contains(b"k0")
    out = bytearray(PAGE)
    copy_out(pinned.views(), memoryview(out))
    assert out == bytes([0]) * PAGE
    tier.unpin(pinned)
    check_pages(tier)


def test_nothing_evicted_in_vain_when_all_pinned():
    tier = RamPages(3 * PAGE, PAGE)
    entries = []
    for i in range(3):
        put(tier, b"k%d" % i, bytes([i]) * PAGE)
        entries.append(tier.pin(b"k%d" % i))
    tier.unpin(entries.pop())  # one page could be freed, two are asked for
    assert tier.reserve(b"x", 2 * PAGE, META, SHORT) is None
    assert tier.evictions == 0 and tier.entries == 3
    assert tier.reserve(b"x", PAGE, META, SHORT) is not None
    assert tier.evictions == 1


@pytest.mark.parametrize("how", ["replace", "delete", "clear"])
def test_dropped_pinned_entry_keeps_its_pages_until_unpin(how):
    tier = RamPages(3 * PAGE, PAGE)
    old = b"o" * PAGE
    put(tier, b"k", old)
    entry = tier.pin(b"k")
    if how == "replace":
        put(tier, b"k", b"n" * PAGE)
        assert get(tier, b"k") == b"n" * PAGE
    elif how == "delete":
        assert tier.delete(b"k") and not tier.delete(b"k")
        assert not tier.contains(b"k") and tier.pin(b"k") is None
    else:
        tier.clear()
        assert tier.entries == 0 and tier.used_bytes == 0
    # Churn through every page that is free: none may be the pinned one's.
    for i in range(10):
        assert put(tier, b"f%d" % i, bytes([i]) * PAGE) is not None
    assert tier.reserve(b"x", 3 * PAGE, META, SHORT) is None  # its page is still held
    out = bytearray(PAGE)
    copy_out(entry.views(), memoryview(out))
    assert out == old
    free_before = tier.free_pages
    tier.unpin(entry)
    assert tier.free_pages == free_before + 1
    check_pages(tier)
    assert tier.reserve(b"x", 3 * PAGE, META, SHORT) is not None


def test_double_pin_frees_at_last_unpin():
    tier = RamPages(2 * PAGE, PAGE)
    put(tier, b"k", b"k" * PAGE)
    a, b = tier.pin(b"k"), tier.pin(b"k")
    assert a is b and a.pins == 2
    tier.delete(b"k")
    tier.unpin(a)
    assert tier.free_pages == 1
    tier.unpin(b)
    assert tier.free_pages == 2


# -- contiguity -------------------------------------------------------------


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_uniform_objects_stay_one_extent(policy):
    rng = random.Random(5)
    size = 3 * PAGE - 100
    tier = RamPages(31 * PAGE, PAGE, policy)  # 31 = 10 objects + 1 leftover page
    pinned: list[Entry] = []
    for step in range(600):
        key = b"k%d" % rng.randrange(40)
        r = rng.random()
        if r < 0.6:
            res = tier.reserve(key, size, ObjectMeta(dialog_digest(b"d%d" % rng.randrange(4)), rng.randrange(6)), SHORT)
            if res is not None:
                assert len(res.extents) == 1, res.extents
                tier.commit(res)
        elif r < 0.75:
            e = tier.pin(key)
            if e is not None:
                pinned.append(e)
        elif r < 0.9 and pinned:
            tier.unpin(pinned.pop(0))
        else:
            tier.delete(key)
    assert tier.evictions > 50
    assert all(len(e.extents) == 1 for e in tier.iter_entries())


def test_prefix_tier_evicts_dialog_tails():
    tier = RamPages(4 * PAGE, PAGE, policy="prefix")
    d = dialog_digest(b"dialog")
    for p in range(4):
        put(tier, b"d%d" % p, b"x" * PAGE, ObjectMeta(d, p))
    put(tier, b"other", b"y" * PAGE)
    put(tier, b"other2", b"y" * PAGE)
    assert [tier.contains(b"d%d" % p) for p in range(4)] == [True, True, False, False]


# -- the headline: prefix eviction keeps more restorable prefix --------------


def simulate(policy: str, *, seed: int = 2024, hold_pins: bool = False, concurrency: int = 32) -> dict[str, int]:
    """An engine-like workload through a real ``RamPages``; what is left restorable.

    200 dialogs of 1-16 one-page blocks; the tier holds ~30% of all blocks.
    Requests run ``concurrency`` at a time, round-robin, one block per tick,
    as an engine's batch interleaves the blocks of many prompts.  A request for a known dialog
    first reads its prefix from block 0 up to the first miss (skewed, Zipf
    popularity), then recomputes and stores the rest block by block; a new
    dialog stores all its blocks.  With ``hold_pins`` a request keeps the
    blocks it read pinned until it finishes (slow copies in flight).
    """
    rng = random.Random(seed)
    n_dialogs = 200
    lengths = [rng.randint(1, 16) for _ in range(n_dialogs)]
    tier = RamPages(int(sum(lengths) * 0.3) * PAGE, PAGE, policy)
    digests = [dialog_digest(b"dialog-%d" % d) for d in range(n_dialogs)]
    keys = [[full_key(b"ns", b"%d:%d" % (d, p)) for p in range(lengths[d])] for d in range(n_dialogs)]
    rank = list(range(n_dialogs))
    rng.shuffle(rank)
    weight = [1.0 / (rank[d] + 1) ** 1.1 for d in range(n_dialogs)]

    arrived: list[int] = []
    next_new = 0
    hits = 0
    active: deque[list] = deque()  # [dialog, next position to store, pinned entries]
    started = 0
    holes_seen = 0
    samples: list[int] = []
    tick = 0
    while started < 800 or active:
        while len(active) < concurrency and started < 800:
            started += 1
            if next_new < n_dialogs and (not arrived or rng.random() < 0.3):
                d = next_new
                next_new += 1
                arrived.append(d)
                p, pins = 0, []
            else:
                d = rng.choices(arrived, [weight[x] for x in arrived])[0]
                p, pins = 0, []
                while p < lengths[d]:
                    entry = tier.pin(keys[d][p])
                    if entry is None:
                        break
                    if hold_pins:
                        pins.append(entry)
                    else:
                        tier.unpin(entry)
                    p += 1
                hits += p
            active.append([d, p, pins])
        req = active.popleft()
        d, p, pins = req
        if p < lengths[d]:
            res = tier.reserve(keys[d][p], PAGE, ObjectMeta(digests[d], p), SHORT)
            assert res is not None
            tier.commit(res)
            req[1] += 1
        if req[1] >= lengths[d]:
            for e in pins:
                tier.unpin(e)
        else:
            active.append(req)
        tick += 1
        if tick % 97 == 0 and next_new == n_dialogs:  # sample once every dialog exists
            samples.append(restorable_blocks(tier, keys))
            holes_seen = max(holes_seen, count_holes(tier, keys))

    return {"restorable": restorable_blocks(tier, keys), "mean_restorable": round(sum(samples) / len(samples)),
            "holes": count_holes(tier, keys), "holes_seen": holes_seen,
            "hit_blocks": hits, "resident": tier.entries, "evictions": tier.evictions}


def restorable_blocks(tier: RamPages, keys: list[list[bytes]]) -> int:
    """Sum over dialogs of the leading run of present blocks: what engines can restore."""
    total = 0
    for chain in keys:
        for k in chain:
            if not tier.contains(k):
                break
            total += 1
    return total


def count_holes(tier: RamPages, keys: list[list[bytes]]) -> int:
    """Present blocks that follow a missing one in their dialog: worthless."""
    holes = 0
    for chain in keys:
        present = [tier.contains(k) for k in chain]
        if False in present:
            holes += sum(present[present.index(False):])
    return holes


@pytest.mark.parametrize("hold_pins", [False, True])
def test_prefix_policy_keeps_more_restorable_prefix_than_lru(hold_pins):
    prefix = simulate("prefix", hold_pins=hold_pins)
    lru = simulate("lru", hold_pins=hold_pins)
    print(f"\nhold_pins={hold_pins}\n  prefix: {prefix}\n  lru:    {lru}")
    assert prefix["evictions"] > 1000 and lru["evictions"] > 1000  # the cache really was too small
    assert prefix["restorable"] > lru["restorable"]
    assert prefix["mean_restorable"] >= 1.2 * lru["mean_restorable"], (prefix, lru)
    # Prefix eviction leaves whole prefixes only: no block after a missing one,
    # even with reads holding pins (the policy never orphans a pinned block).
    assert prefix["holes"] == 0 and prefix["holes_seen"] == 0
    assert lru["holes"] > 0  # what LRU wastes: tails whose heads are gone


def test_the_end_of_a_write_reaches_the_policy_as_a_tail() -> None:
    from kvgate.tiers.eviction import Segment

    tier = RamPages(4 * PAGE, PAGE)
    for i, tail in enumerate((False, True)):
        res = tier.reserve(b"k%d" % i, PAGE, ObjectMeta(dialog_digest(b"d"), i, tail=tail), LONG)
        assert res is not None
        tier.commit(res)
    assert tier.policy.segment_of(b"k0") is Segment.NEW and tier.policy.segment_of(b"k1") is Segment.TAIL


def test_presence_of_many_keys_at_once_is_presence_of_each_and_drops_what_outlived_the_ttl() -> None:
    import time

    expired: list[int] = []
    tier = RamPages(64 * PAGE, PAGE, ttl=60.0, on_expired=expired.append)
    now = time.time_ns()
    put(tier, b"fresh", b"x" * 10, ObjectMeta(created_ns=now))
    put(tier, b"old", b"y" * 10, ObjectMeta(created_ns=now - 61 * 10**9))
    asked = [b"fresh", b"nowhere", b"old", b"fresh"]
    got = tier.contains_many(asked)
    assert got.dtype == np.bool_ and got.tolist() == [True, False, False, True]
    assert expired == [1] and not tier.contains(b"old")  # dropped, as a single contains would
    assert tier.contains_many([]).tolist() == []
    plain = RamPages(64 * PAGE, PAGE)
    put(plain, b"a", b"z")
    assert plain.contains_many([b"a", b"b"]).tolist() == [plain.contains(b"a"), plain.contains(b"b")]
