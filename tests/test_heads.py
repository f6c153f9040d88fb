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


def test_heads_past_depth_are_not_learned_and_the_set_stops_when_full(caplog) -> None:
    heads = SharedHeads()
    for c in range(BRANCHES):
        assert heads.shared_prefix(prompt(DEPTH + 5, c, 2))[0] == 0
    assert len(heads) == 0, "a branch past DEPTH blocks is not looked at"
    small = SharedHeads(max_heads=10)
    with caplog.at_level(logging.WARNING, logger="kvgate.heads"):
        for c in range(BRANCHES + 1):
            small.shared_prefix(prompt(16, c, 2))
    assert len(small) == 0 and "shared-head set is full" in caplog.text


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
