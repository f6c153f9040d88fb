import random

import xxhash

from kvgate.keys import NO_DIALOG, dialog_digest
from kvgate.placement import SlotMap, fingerprint, slot_of


def serials(n, seed=0):
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def test_map_does_not_depend_on_card_order():
    s = serials(5)
    a = SlotMap(s, 64)
    b = SlotMap(list(reversed(s)), 64)
    assert a.owner == b.owner
    assert fingerprint(a, 1, "dialog") == fingerprint(b, 1, "dialog")


def test_adding_a_card_moves_only_its_share():
    s = serials(4, seed=1)
    before = SlotMap(s, 1024)
    new = serials(1, seed=99)[0]
    after = SlotMap(s + [new], 1024)
    moved = [i for i in range(1024) if before.owner[i] != after.owner[i]]
    assert all(after.owner[i] == new for i in moved), "a slot moved between two old cards"
    assert 0.12 < len(moved) / 1024 < 0.28  # about 1/(N+1) = 0.2


def test_slots_spread_over_cards():
    m = SlotMap(serials(4, seed=2), 256)
    counts = [len(m.slots_of(s)) for s in m.serials]
    assert min(counts) > 256 / 4 * 0.6


def test_fingerprint_changes_with_layout():
    s = serials(3)
    base = fingerprint(SlotMap(s, 16), 1, "dialog")
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint(SlotMap(s, 17), 1, "dialog") != base
    assert fingerprint(SlotMap(s, 16), 2, "dialog") != base
    assert fingerprint(SlotMap(s, 16), 1, "stripe") != base
    assert fingerprint(SlotMap(s[:2], 16), 1, "dialog") != base


def test_dialog_placement_keeps_a_dialog_on_one_slot_and_stripe_spreads_it():
    d = dialog_digest(b"system prompt + first chunk")
    keys = [xxhash.xxh3_128_digest(f"block{i}".encode()) for i in range(64)]
    assert len({slot_of(k, d, "dialog", 16) for k in keys}) == 1
    assert len({slot_of(k, d, "stripe", 16) for k in keys}) > 8
    # without a dialog mark, dialog mode places by key
    assert len({slot_of(k, NO_DIALOG, "dialog", 16) for k in keys}) > 8


def test_duplicate_serials_refused():
    import pytest

    with pytest.raises(ValueError, match="same serial"):
        SlotMap(["a", "a"], 4)


def test_the_map_is_the_highest_weight_card_of_each_slot():
    """The kept weight columns give exactly rendezvous hashing: per slot, the card of the highest weight."""
    serials = [f"card-{i}" for i in range(12)]
    slot_map = SlotMap(serials, 512)
    weight = lambda s, slot: xxhash.xxh3_64_intdigest(f"{s}\x00{slot}".encode())  # noqa: E731
    assert slot_map.owner == tuple(max(sorted(serials), key=lambda s: weight(s, slot)) for slot in range(512))
    assert SlotMap(serials[:5], 512).owner == tuple(
        max(sorted(serials[:5]), key=lambda s: weight(s, slot)) for slot in range(512))
