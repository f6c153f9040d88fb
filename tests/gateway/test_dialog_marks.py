"""Dialog marks past a shared system prompt, on real gateway processes and real directory cards.

Every conversation behind one system prompt must get a mark of its own (so
conversations spread over the cards), two gateways on the same cards must
give the same marks, and so must a gateway after a restart.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kvgate.heads import BRANCHES
from kvgate.keys import DialogMark, dialog_digest
from kvgate.placement import SlotMap, slot_of
from tests.helpers import wait_until

HEAD = 8  # blocks of the shared system prompt


def conversation(c: int, blocks: int = 2) -> list[bytes]:
    return [b"sys-%d" % i for i in range(HEAD)] + [b"conv-%d-%d" % (c, i) for i in range(blocks)]


def block(key: bytes) -> bytes:
    return np.frombuffer(key.ljust(64, b".") * 64, np.uint8).tobytes()


def store(client, keys: list[bytes], dm: DialogMark) -> None:
    for start, end, dialog in dm.spans(0, len(keys)):
        assert all(client.put_many(keys[start:end], [block(k) for k in keys[start:end]], dialog=dialog,
                                   position=start))


def restore(client, keys: list[bytes], dm: DialogMark) -> int:
    """Leading blocks restored with the right bytes, as an engine restores a prefix."""
    n = 0
    for start, end, dialog in dm.spans(0, len(keys)):
        for k, got in zip(keys[start:end], client.get_many(keys[start:end], dialog=dialog)):
            if got is None:
                return n
            assert bytes(got) == block(k), f"wrong bytes for {k!r}"
            n += 1
    return n


def test_marks_agree_across_gateways_and_restarts_and_conversations_spread(gateway_factory, tmp_path) -> None:
    cards = [str(tmp_path / f"card{i}") for i in range(4)]
    flags = ["--storage-devices", *cards, "--shared-storage", "true", "--card-capacity", "256M"]
    a = gateway_factory(flags, name="a")
    b = gateway_factory(flags, name="b")
    with a.client() as ca:
        first = [ca.dialog_mark(conversation(c)) for c in range(BRANCHES + 1)]
        assert [m.shared for m in first] == [0] * (BRANCHES - 1) + [HEAD] * 2, first
        assert first[-1].mark == b"conv-%d-0" % BRANCHES

    with b.client() as cb:  # b saw none of these prompts: it learns the head from the cards
        wait_until(lambda: cb.stats()["shared_heads"]["blocks"] >= HEAD, 10,
                   lambda: f"gateway b never got the shared heads: {cb.stats()['shared_heads']}", interval=0.2)
        with a.client() as ca:
            for c in range(100, 120):
                keys = conversation(c)
                assert ca.dialog_mark(keys) == cb.dialog_mark(keys) == DialogMark(keys[HEAD], HEAD, [(0, keys[0])])

        # Conversations stored through b restore in full through a, each from its own card.
        marks = {c: cb.dialog_mark(conversation(c)) for c in range(200, 600)}
        for c, dm in marks.items():
            store(cb, conversation(c), dm)
    with a.client() as ca:
        for c, dm in list(marks.items())[:50]:
            assert restore(ca, conversation(c), dm) == HEAD + 2
        stats = ca.stats()
        serials = [card["serial"] for card in stats["cards"]]
        slots = stats["gateway"]["storage_slots"]

    # Spread: the card of each conversation, by the placement every gateway computes.
    slot_map = SlotMap(serials, slots)
    per_card = collections.Counter(
        slot_map.serial_of_slot(slot_of(b"", dialog_digest(dm.mark), "dialog", slots)) for dm in marks.values())
    fair = len(marks) / len(serials)
    assert len(per_card) == 4 and max(per_card.values()) <= 1.5 * fair, per_card
    objects = [card["objects"] for card in stats["cards"]]  # and what the cards really hold
    assert max(objects) <= 1.5 * sum(objects) / 4, objects

    # A restarted gateway gives the same marks from its first request on.
    a.stop()
    a.start()
    with a.client() as ca:
        assert ca.dialog_mark(conversation(999)) == DialogMark(b"conv-999-0", HEAD, [(0, b"sys-0")])
        for c, dm in list(marks.items())[:20]:
            assert ca.dialog_mark(conversation(c)) == dm
            assert restore(ca, conversation(c), dm) == HEAD + 2


def test_long_prompts_and_bad_keys(gateway) -> None:
    from kvgate.keys import MARK_KEYS

    with gateway.client() as c:
        long_prompt = [b"long-%d" % i for i in range(3 * MARK_KEYS)]
        assert c.dialog_mark(long_prompt) == DialogMark(b"long-0", 0)
        assert c.dialog_mark([]) == DialogMark(None, 0)
        with pytest.raises(TypeError, match="keys"):
            c.dialog_mark(b"one-key")
        assert c.dialog_mark([b"after-errors"]).mark == b"after-errors"


def test_an_engine_flooding_made_up_system_prompts_cannot_displace_the_real_one(gateway_factory, tmp_path) -> None:
    """Made-up shared prefixes fill the shared-head set and the card's list to their bounds, no further; the
    system prompt real traffic runs on keeps its mark, here and after a restart, and its conversations restore."""
    from kvgate.heads import CARD_MAX_HEADS, MAX_HEADS
    from kvgate.keys import MARK_KEYS

    card = tmp_path / "card"
    gw = gateway_factory(["--storage-devices", str(card), "--card-capacity", "256M"], name="flooded")
    with gw.client() as c:
        for conv in range(BRANCHES):
            c.dialog_mark(conversation(conv))
        real = {conv: c.dialog_mark(conversation(conv)) for conv in range(50, 60)}
        assert all(dm.shared == HEAD for dm in real.values())
        for conv, dm in real.items():
            store(c, conversation(conv), dm)
        rounds = MAX_HEADS // (MARK_KEYS - 1) + 20  # enough to fill the set, then some
        for n in range(rounds):
            fake = [b"fake-%d-%d" % (n, i) for i in range(MARK_KEYS - 1)]
            for conv in range(BRANCHES):
                c.dialog_mark(fake + [b"fake-%d-conv-%d" % (n, conv)])
        heads = c.stats()["shared_heads"]
        assert heads["blocks"] <= MAX_HEADS and heads["refused"] > 0, heads
        for conv, dm in real.items():
            assert c.dialog_mark(conversation(conv)) == dm
            assert restore(c, conversation(conv), dm) == HEAD + 2
        wait_until(lambda: c.stats()["shared_heads"]["sync_rounds"] >= 2, 10, "no head sync rounds", interval=0.2)
    size = (card / "kvgate-heads").stat().st_size
    assert 0 < size <= CARD_MAX_HEADS * 8, size
    gw.stop()
    gw.start()
    with gw.client() as c:
        for conv, dm in real.items():
            assert c.dialog_mark(conversation(conv)) == dm, "the real system prompt's heads came back from the card"
            assert restore(c, conversation(conv), dm) == HEAD + 2


def test_a_card_full_of_old_heads_does_not_stop_a_new_system_prompt_being_learned(gateway_factory, tmp_path) -> None:
    """Cards that served many system prompt versions hold more heads than a gateway keeps: a restarted gateway
    fills its set from them, and still learns the system prompt of today."""
    from kvgate.heads import CARD_MAX_HEADS, MAX_HEADS, encode_ids

    card = tmp_path / "card"
    gw = gateway_factory(["--storage-devices", str(card), "--card-capacity", "256M"], name="old-heads")
    gw.stop()
    old = np.random.default_rng(7).integers(1, 1 << 62, CARD_MAX_HEADS, dtype=np.uint64).tolist()
    (card / "kvgate-heads").write_bytes(encode_ids(old))
    gw.start()
    with gw.client() as c:
        assert c.stats()["shared_heads"]["blocks"] == MAX_HEADS, "the set was filled from the card"
        marks = [c.dialog_mark(conversation(conv)) for conv in range(BRANCHES + 2)]
        assert [m.shared for m in marks[BRANCHES - 1 :]] == [HEAD] * 3, marks
        assert c.stats()["shared_heads"]["replaced"] == HEAD
