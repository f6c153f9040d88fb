"""KvIndex applied from KV event batches: stored, removed, cleared; a card shared by gateways; hybrid
groups; both event encodings through kvgate.kvevents.wire."""

from __future__ import annotations

import pytest

from kvgate.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvgate.routing.hashing import BlockHasher, block_key
from kvgate.routing.index import KvIndex, card_source


def stored(hashes, medium="GPU", group=None, block_size=16) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def removed(hashes, medium="GPU", group=None) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def batch(*events) -> EventBatch:
    return EventBatch(1.0, list(events))


HASHES = BlockHasher("sha256", 16, seed="0").hashes(list(range(16 * 8)))
KEYS = [block_key(h) for h in HASHES]


@pytest.mark.parametrize("positional", [False, True], ids=["map-tagged", "positional"])
@pytest.mark.parametrize("as_int", [False, True], ids=["bytes-hashes", "int-hashes"])
def test_stored_removed_cleared_through_the_wire(positional: bool, as_int: bool) -> None:
    hs = KEYS if as_int else HASHES
    idx = KvIndex()

    def send(*events) -> None:
        idx.apply("engine-a", "", decode_batch(encode_batch(batch(*events), positional=positional)))

    send(stored(hs[:6]), stored(hs[:3], medium="CPU"))
    assert idx.count("engine-a", "GPU") == 6 and idx.count("engine-a", "CPU") == 3
    assert idx.holds("engine-a", "GPU", HASHES[5]) and idx.holds("engine-a", "GPU", KEYS[5])
    send(removed(hs[4:6]))
    assert idx.count("engine-a", "GPU") == 4 and not idx.holds("engine-a", "GPU", HASHES[5])
    assert idx.count("engine-a", "CPU") == 3  # another medium's copy stays
    assert idx.block_sizes["engine-a"] == 16
    send(AllBlocksCleared())
    assert idx.count("engine-a", "GPU") == 0 and idx.count("engine-a", "CPU") == 0 and len(idx) == 0


def test_sources_are_kept_apart_and_removal_of_one_leaves_the_other() -> None:
    idx = KvIndex()
    idx.apply("a", "", batch(stored(HASHES[:4])))
    idx.apply("b", "", batch(stored(HASHES[:2])))
    idx.apply("a", "", batch(removed(HASHES[:4])))
    assert idx.count("a", "GPU") == 0 and idx.count("b", "GPU") == 2 and len(idx) == 2
    idx.apply("b", "", batch(AllBlocksCleared()))
    assert len(idx) == 0


def test_a_card_mounted_by_two_gateways_is_kept_once_and_known_to_both() -> None:
    idx = KvIndex()
    idx.apply("gw-1", "kvgate", batch(stored(HASHES[:2], medium="CPU")))
    idx.apply("gw-1", "kvgate@card:SER1", batch(stored(HASHES[:5], medium="CPU")))  # a card topic is STORAGE
    idx.apply("gw-2", "kvgate@card:SER1", batch(stored(HASHES[:5], medium="STORAGE")))
    assert idx.mounts("gw-1") == {"SER1"} and idx.mounts("gw-2") == {"SER1"} and idx.mounts("gw-3") == set()
    assert idx.count(card_source("SER1"), "STORAGE") == 5
    assert idx.count("gw-1", "CPU") == 2 and idx.count("gw-2", "CPU") == 0
    assert len(idx) == 5  # the card's blocks once, the gateway's RAM blocks among them
    idx.apply("gw-2", "kvgate@card:SER1", batch(removed(HASHES[4:5], medium="STORAGE")))
    assert idx.count(card_source("SER1"), "STORAGE") == 4


def test_hybrid_model_holds_a_block_only_where_every_group_does() -> None:
    idx = KvIndex()
    idx.apply("hyb", "", batch(stored(HASHES[:6], group=0), stored(HASHES[:3], group=1)))
    idx.apply("plain", "", batch(stored(HASHES[:6])))  # publishes group 0 only
    assert [idx.holds("hyb", "GPU", h) for h in HASHES[:6]] == [True] * 3 + [False] * 3
    assert all(idx.holds("plain", "GPU", h) for h in HASHES[:6])  # not held back by group 1
    idx.apply("hyb", "", batch(removed(HASHES[:1], group=1)))
    assert not idx.holds("hyb", "GPU", HASHES[0]) and idx.holds("plain", "GPU", HASHES[0])
    assert idx.count("hyb", "GPU") == 2


def test_unknown_removals_and_sources_are_harmless() -> None:
    idx = KvIndex()
    idx.apply("a", "", batch(removed(HASHES[:3]), AllBlocksCleared()))
    idx.clear("never")
    assert len(idx) == 0 and not idx.holds("never", "GPU", HASHES[0])
    assert idx.events_applied == 2


def test_holder_masks_agree_with_holders_for_hybrid_groups() -> None:
    idx = KvIndex()
    idx.apply("hyb", "", batch(stored(HASHES[:6], group=0), stored(HASHES[2:8], group=1)))
    idx.apply("plain", "", batch(stored(HASHES[1:5])))
    idx.apply("gw", "t", batch(stored(HASHES[:8], "CPU", group=1)))
    assert idx.holder_masks(KEYS) == [idx.holders(k) for k in KEYS]
    hyb = 1 << idx.bit_of("GPU", "hyb")
    assert [bool(m & hyb) for m in idx.holder_masks(KEYS)] == [False, False, True, True, True, True, False, False]
