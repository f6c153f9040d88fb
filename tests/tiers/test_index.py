"""``CardIndex``: rows by key digest, their sizes and namespaces, and the figures they feed."""

from __future__ import annotations

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.keys import NO_DIALOG, dialog_digest, full_key, key_digest
from kvgate.tiers.index import CardIndex, IndexEntry
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
