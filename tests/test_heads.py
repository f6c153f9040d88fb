"""Shared heads: learning which leading blocks many dialogs share, and the marks past them."""

from __future__ import annotations

import logging

import pytest

from kvgate.heads import BRANCHES, DEPTH, SharedHeads, block_id, decode_ids, encode_ids
from kvgate.keys import DialogMark


def prompt(head: int, conv: int, turn_blocks: int, system: str = "sys") -> list[bytes]:
    """Chained block keys: a shared head of ``head`` blocks, then conversation ``conv``'s own blocks."""
    keys = [f"{system}-{i}".encode() for i in range(head)]
    return keys + [f"{system}-c{conv}-{i}".encode() for i in range(turn_blocks)]


def test_a_system_prompt_becomes_a_shared_head_after_a_few_conversations() -> None:
    heads = SharedHeads()
    answers = [heads.shared_prefix(prompt(16, c, 5))[0] for c in range(BRANCHES + 2)]
    # The first conversations see no head yet; from the BRANCHES-th on the mark is past the system prompt.
    assert answers[: BRANCHES - 1] == [0] * (BRANCHES - 1)
    assert answers[BRANCHES - 1 :] == [16] * 3
    assert len(heads) == 16 and heads.learned == 16
    assert heads.shared_prefix(prompt(16, 99, 1)) == (16, [0])  # a new conversation behind it, one segment


def test_one_conversation_growing_turn_by_turn_is_never_a_head() -> None:
    heads = SharedHeads()
    for turn in range(1, 30):
        assert heads.shared_prefix(prompt(0, 7, 3 * turn)) == (0, [])
    assert len(heads) == 0


def test_heads_past_depth_are_not_learned() -> None:
    heads = SharedHeads()
    for c in range(BRANCHES):
        assert heads.shared_prefix(prompt(DEPTH + 5, c, 2))[0] == 0
    assert len(heads) == 0, "a branch past DEPTH blocks is not looked at"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def learn(heads: SharedHeads, system: str, head: int = 4) -> None:
    for c in range(BRANCHES):
        heads.shared_prefix(prompt(head, c, 2, system))


def test_a_full_set_makes_room_for_a_new_system_prompt_from_idle_heads() -> None:
    """System prompts change: a set that only grew would fill in normal use and stop learning for good."""
    clock = Clock()
    heads = SharedHeads(max_heads=12, idle_s=600, clock=clock)
    for version in range(3):  # three versions of a 4-block system prompt fill the set
        learn(heads, f"v{version}")
        clock.now += 60
    assert len(heads) == 12
    clock.now += 1000  # v0 and v1 go idle; v2 stays in use
    assert heads.shared_prefix(prompt(4, 99, 2, "v2"))[0] == 4
    learn(heads, "v3")
    assert heads.shared_prefix(prompt(4, 99, 2, "v3")) == (4, [0]), "the new version is learned"
    assert heads.shared_prefix(prompt(4, 99, 2, "v2"))[0] == 4, "the one in use stayed"
    assert heads.shared_prefix(prompt(4, 99, 2, "v0"))[0] == 0, "the least recently used one gave its place"
    assert heads.shared_prefix(prompt(4, 99, 2, "v1"))[0] == 4
    assert len(heads) == 12 and heads.replaced == 4 and heads.refused == 0
    assert block_id(b"v0-3") not in {i & ((1 << 63) - 1) for i in heads.all()}, "its branch point went with it"


def test_made_up_system_prompts_never_push_out_heads_in_use(caplog) -> None:
    """An engine sending thousands of made-up shared prefixes fills free room only; the real one keeps its mark."""
    clock = Clock()
    heads = SharedHeads(max_heads=64, idle_s=600, clock=clock)
    learn(heads, "real", head=8)
    with caplog.at_level(logging.WARNING, logger="kvgate.heads"):
        for n in range(200):  # each round: a made-up prefix of 8 blocks behind three "conversations"
            learn(heads, f"fake{n}", head=8)
            clock.now += 5
            assert heads.shared_prefix(prompt(8, 1000 + n, 2, "real"))[0] == 8, n  # real traffic keeps going
    assert len(heads) == 64
    assert heads.refused > 0 and "full of heads in use" in caplog.text
    assert caplog.text.count("full of heads in use") == 2, "logged once per idle period, not per prompt"
    # Later, the made-up heads idle, a new real system prompt finds room.
    clock.now += 601
    heads.shared_prefix(prompt(8, 1, 2, "real"))
    learn(heads, "real2", head=8)
    assert heads.shared_prefix(prompt(8, 5, 2, "real2"))[0] == 8
    assert heads.shared_prefix(prompt(8, 5, 2, "real"))[0] == 8


def test_heads_from_cards_fill_free_room_only_and_come_in_idle() -> None:
    clock = Clock()
    other = SharedHeads(clock=clock)
    for s in range(5):
        learn(other, f"other{s}")
    mine = SharedHeads(max_heads=12, idle_s=600, clock=clock)
    learn(mine, "mine")
    assert mine.merge(other.all()) == 8, "only the free room is filled"
    assert len(mine) == 12 and mine.shared_prefix(prompt(4, 9, 2, "mine"))[0] == 4
    learn(mine, "new")  # the merged heads are idle: the new prompt takes the place of four of them
    assert mine.shared_prefix(prompt(4, 9, 2, "new"))[0] == 4
    assert mine.shared_prefix(prompt(4, 9, 2, "mine"))[0] == 4
    assert mine.merge(other.all()) == 0, "a full set of heads in use takes nothing from a card"
    assert len(mine) == 12


def test_merge_take_new_and_the_card_encoding() -> None:
    a, b = SharedHeads(), SharedHeads()
    for c in range(BRANCHES):
        a.shared_prefix(prompt(4, c, 2))
    new = a.take_new()
    assert len(new) == 5 and a.take_new() == set(), "4 heads and the branch point"
    assert b.merge(decode_ids(encode_ids(new))) == 4
    assert b.shared_prefix(prompt(4, 50, 2)) == (4, [0]), "a gateway that merged the heads marks the same way"
    raw = encode_ids(new) + b"\x01\x02\x03"  # a torn append
    assert decode_ids(raw) == new
    assert block_id(b"x") != block_id(b"y")


def test_a_document_behind_the_system_prompt_is_a_segment_of_its_own() -> None:
    heads = SharedHeads()
    doc = [b"doc-%d" % i for i in range(3)]
    for c in range(BRANCHES):  # conversations behind the system prompt alone
        heads.shared_prefix(prompt(4, c, 2))
    for q in range(BRANCHES):  # questions about one document behind it
        heads.shared_prefix(prompt(4, 0, 0) + doc + [b"question-%d" % q])
    assert heads.shared_prefix(prompt(4, 0, 0) + doc + [b"question-9"]) == (7, [0, 4])
    other = SharedHeads()
    other.merge(heads.all())
    assert other.shared_prefix(prompt(4, 0, 0) + doc + [b"q"]) == (7, [0, 4]), "branch points travel with the heads"


def test_dialog_mark_spans() -> None:
    dm = DialogMark(b"m", 4, [(0, b"sys"), (2, b"doc")])
    assert dm.spans(0, 6) == [(0, 2, b"sys"), (2, 4, b"doc"), (4, 6, b"m")]
    assert dm.spans(2, 2) == [(0, 2, b"doc")]
    assert dm.spans(1, 2) == [(0, 1, b"sys"), (1, 2, b"doc")]
    assert dm.spans(4, 3) == [(0, 3, b"m")]
    assert dm.spans(-1, 3) == [(0, 3, b"m")]
    assert dm.spans(0, 0) == []
    assert [dm.dialog_at(p) for p in (0, 1, 2, 3, 4, -1)] == [b"sys", b"sys", b"doc", b"doc", b"m", b"m"]
    assert DialogMark(None, 0).spans(0, 2) == [(0, 2, None)]
    assert DialogMark(b"m", 4, [(0, b"sys"), (2, b"doc")]) == dm and hash(DialogMark(b"m", 4, [(0, b"sys"), (2, b"doc")])) == hash(dm)
    for bad in ((b"m", -1), (b"m", 2), (b"m", 2, [(1, b"x")]), (b"m", 2, [(0, b"x"), (2, b"y")])):
        with pytest.raises(ValueError):
            DialogMark(*bad)


def test_memory_is_bounded_whatever_the_prompts() -> None:
    heads = SharedHeads(max_parents=100)
    for c in range(50):  # 50 long conversations that share nothing: thousands of parents seen
        heads.shared_prefix([b"conv-%d-%d" % (c, i) for i in range(40)])
    assert len(heads._children) <= 100 and len(heads) == 0
