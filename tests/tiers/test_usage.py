"""NamespaceUsage: figures per namespace, bounded however many namespaces clients invent."""

from __future__ import annotations

from kvgate.keys import encode_namespace, full_key
from kvgate.tiers.ram import RamPages
from kvgate.cards.objectformat import ObjectMeta
from kvgate.tiers.usage import OTHER, NamespaceUsage, namespace_of


def fk(ns: str, key: bytes) -> bytes:
    return full_key(encode_namespace(ns), key)


def test_rows_follow_objects_in_and_out() -> None:
    u = NamespaceUsage()
    u.ram(fk("a", b"1"), 100, 1)
    u.ram(fk("a", b"2"), 50, 1)
    u.card(fk("b", b"1"), 4096, 1)
    u.ram(fk("a", b"1"), -100, -1)
    snap = u.snapshot()
    assert snap["a"]["ram_objects"] == 1 and snap["a"]["ram_bytes"] == 50
    assert snap["b"]["card_objects"] == 1 and snap["b"]["card_bytes"] == 4096
    assert OTHER not in snap
    assert namespace_of(fk("model|tp1", b"k")) == b"model|tp1"


def test_namespaces_past_the_cap_share_one_row_and_every_row_adds_up() -> None:
    u = NamespaceUsage(max_rows=3)
    for i in range(10):
        u.card(fk(f"ns{i}", b"k"), 10, 1)
    snap = u.snapshot()
    assert len(snap) == 4 and snap[OTHER]["card_objects"] == 7
    for i in range(10):  # whatever row an object went to, it leaves the same row
        u.card(fk(f"ns{i}", b"k"), -10, -1)
    snap = u.snapshot()
    assert all(r["card_objects"] == 0 and r["card_bytes"] == 0 for r in snap.values())
    u.card(fk("ns9", b"k"), 10, 1)  # a namespace that got no row keeps none, even with rows at zero
    assert u.snapshot()[OTHER]["card_objects"] == 1


def test_undecodable_namespaces_keep_apart() -> None:
    u = NamespaceUsage()
    u.ram(full_key(b"\xff", b"k"), 1, 1)
    u.ram(full_key(b"\xfe", b"k"), 2, 1)
    assert len(u.snapshot()) == 2


def test_ram_tier_rows_match_its_totals_through_replace_and_eviction() -> None:
    u = NamespaceUsage()
    ram = RamPages(64 << 10, page_size=4096, usage=u)
    for i in range(40):  # 40 x 4 KiB into 64 KiB: most are evicted
        for ns in ("a", "b"):
            res = ram.reserve(fk(ns, b"%d" % (i % 25)), 4096, ObjectMeta(), 1)
            if res is not None:
                ram.commit(res)
    snap = u.snapshot()
    assert sum(r["ram_bytes"] for r in snap.values()) == ram.used_bytes
    assert sum(r["ram_objects"] for r in snap.values()) == ram.entries
