"""``CardIndex``: rows by key digest, their sizes and namespaces, and the figures they feed."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.cards import ObjectMeta
from kvgate.keys import NO_DIALOG, dialog_digest, full_key, key_digest
from kvgate.tiers.index import CardIndex, IndexEntry
from kvgate.tiers.rows import key_digest_array
from kvgate.tiers.usage import NamespaceUsage


def test_rows_sizes_and_namespace_figures_add_up() -> None:
    usage = NamespaceUsage()
    index = CardIndex(usage)
    d = dialog_digest(b"conversation")
    keys = [full_key(b"ns%d" % (i % 3), b"k%d" % i) for i in range(300)]
    for i, k in enumerate(keys):
        index.put(k, 4096 + i, i, ObjectMeta(d, i, 1000 + i), 1000 + i)
    assert len(index) == 300 and index.used == sum(4096 + i for i in range(300))
    assert index.get(keys[7]) == IndexEntry(4096 + 7, 7, 1007, d)
    index.put(keys[7], 9000, 100, ObjectMeta(), 5)  # written again: replaces the row
    assert index.get(keys[7]) == IndexEntry(9000, 100, 5, NO_DIALOG) and len(index) == 300
    for k in keys[:100]:
        assert index.pop(key_digest(k))
    assert keys[0] not in index and keys[100] in index
    snap = usage.snapshot()
    assert sum(r["card_objects"] for r in snap.values()) == 200
    assert sum(r["card_bytes"] for r in snap.values()) == index.used
    index.clear()
    assert not index and all(r["card_objects"] == 0 and r["card_bytes"] == 0 for r in usage.snapshot().values())


def test_find_answers_a_batch_as_get_answers_each() -> None:
    index = CardIndex(NamespaceUsage())
    keys = [full_key(b"ns", b"k%d" % i) for i in range(2000)]
    for k in keys[::2]:
        index.put(k, 8192, 4096, ObjectMeta(), 1)
    rows = index.find_keys(keys)
    assert [r >= 0 for r in rows.tolist()] == [k in index for k in keys] == [i % 2 == 0 for i in range(2000)]
    assert (index.stored_of(rows[rows >= 0]) == 8192).all()


def test_sizes_beyond_the_columns_are_kept_exactly() -> None:
    """A payload of 4 GiB or more does not fit the payload column: its sizes are kept aside, exactly."""
    usage = NamespaceUsage()
    index = CardIndex(usage)
    big, small = full_key(b"ns", b"big"), full_key(b"ns", b"small")
    index.put(big, (5 << 30) + 4096, 5 << 30, ObjectMeta(), 1)
    index.put(small, 4096 + 10, 10, ObjectMeta(), 1)
    assert index.get(big).payload_len == 5 << 30 and index.get(big).stored_bytes == (5 << 30) + 4096
    assert index.used == (5 << 30) + 4096 + 4106
    assert list(index.stored_of(np.arange(2))) == [(5 << 30) + 4096, 4106]
    index.pop(key_digest(big))
    assert index.used == 4106 and usage.snapshot()["ns"]["card_bytes"] == 4106


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.sampled_from([10, 4096, (5 << 30)]),
                          st.integers(-1, 5), st.booleans()), min_size=1, max_size=30),
       st.integers(0, 20), st.sampled_from(["prefix", "lru"]), st.booleans(), st.booleans())
def test_a_batch_put_leaves_the_index_a_put_of_each_leaves(batch, before, policy, keys, large) -> None:
    """``put_many`` (a card write's batch) and one ``put`` per object end in the same index: entries, bytes,
    namespace figures, keys and eviction order, whether the batch replaces rows, follows removals that moved
    rows, or is ``large`` enough for the rows' batched insert (``DigestRows.add_many``)."""
    if large:
        batch = batch + [(k, 0, 4096, -1, False) for k in range(100, 100 + 150)]
    batch = list({k: (k, ns, size, pos, tail) for k, ns, size, pos, tail in batch}.values())  # distinct keys

    def key(k: int, ns: int) -> bytes:
        return full_key(b"ns%d" % ns, b"k%d" % k)

    def filled() -> tuple[CardIndex, NamespaceUsage]:
        usage = NamespaceUsage()
        index = CardIndex(usage, policy, keys=keys)
        for k in range(before):  # rows the batch replaces, and removals that move the last row
            index.put(key(k, k % 3), 4096 + 64, 64, ObjectMeta(dialog_digest(b"old"), k, 7), 7)
        for k in range(0, before, 4):
            index.pop(key_digest(key(k, k % 3)))
        return index, usage

    d = dialog_digest(b"conversation")
    fkeys = [key(k, ns) for k, ns, _s, _p, _t in batch]
    stored = [size + 4096 for _k, _n, size, _p, _t in batch]
    payloads = [size for _k, _n, size, _p, _t in batch]
    metas = [ObjectMeta(d if pos >= 0 else NO_DIALOG, pos, 0 if pos == 3 else 100 + pos, tail)
             for _k, _n, _s, pos, tail in batch]
    one, one_usage = filled()
    for k, s, p, m in zip(fkeys, stored, payloads, metas):
        one.put(k, s, p, m, m.created_ns or 55, tail=m.tail)
    many, many_usage = filled()
    many.put_many(fkeys, key_digest_array(fkeys), stored, payloads, metas, 55)
    assert len(many) == len(one) and many.used == one.used and many.changes == one.changes
    assert many_usage.snapshot() == one_usage.snapshot()
    every = [key(k, k % 3) for k in range(before)] + fkeys
    assert [many.get(k) for k in every] == [one.get(k) for k in every]

    def segments(idx: CardIndex) -> list:
        return [idx.policy.segment_of(idx.row(key_digest(k))) if k in idx else None for k in every]

    assert segments(many) == segments(one)  # (a replaced key enters the prefix order as reused)
    if keys:
        assert sorted(filter(None, map(many.key_of, range(many.rows.n)))) == \
            sorted(filter(None, map(one.key_of, range(one.rows.n))))
    if policy == "lru":  # (the prefix order samples rows: its victims depend on row numbers, not only order)
        victims = []
        for idx in (one, many):
            order = []
            while idx:
                r = idx.policy.choose_victim()
                order.append(idx.digest(r))
                idx.pop_row(r)
            victims.append(order)
        assert victims[0] == victims[1]
