"""``SampledPolicy``: PrefixPolicy's rules kept in index columns, its victims chosen by ranked sampling.

With no more rows than one sample, the ranking sees every row: the policy
must then name exactly the victim the brute-force model of
tests/tiers/test_eviction.py names (the same state machine, long objects
only, as on a card).  Its order must also survive a snapshot (``restore``),
and on the public trace it stays within a point of ``PrefixPolicy``
(tests/tiers/test_trace_replay.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import rule

from kvgate.keys import NO_DIALOG
from kvgate.tiers.eviction import LONG, SHORT, Segment
from kvgate.tiers.rows import DigestRows
from kvgate.tiers.sampled import SampledPolicy
from kvgate.tiers.sampled_ids import SampledEvictionPolicy, make_sampled_policy
from tests.tiers.test_eviction import DIALOGS, IDENTS, PolicyMachine, dlg


def sampled(kind: str = "prefix") -> SampledEvictionPolicy:
    pol = SampledEvictionPolicy(kind)
    pol.policy.young_adds = 0
    return pol


class SampledMachine(PolicyMachine):
    """The model of PrefixPolicy, against the sampled policy (every row in each sample)."""

    policy_name = "prefix"

    def __init__(self) -> None:
        super().__init__()
        self.policy = sampled("lru" if self.policy_name == "lru" else "prefix")

    @rule(ident=st.sampled_from(IDENTS), dialog=st.sampled_from(DIALOGS), position=st.integers(-1, 3),
          tail=st.booleans())
    def add(self, ident, dialog, position, tail=False):
        super().add(ident, dialog, position, LONG, tail)

    @rule(ident=st.sampled_from(IDENTS), dialog=st.sampled_from(DIALOGS[1:3]), position=st.integers(0, 3))
    def add_block(self, ident, dialog, position):
        self.add(ident, dialog, position)


class SampledLruMachine(SampledMachine):
    policy_name = "lru"


# As in test_eviction: sized so a broken order is found every time; LRU needs fewer examples.
TestSampledMachine, TestSampledLruMachine = SampledMachine.TestCase, SampledLruMachine.TestCase
for case, examples in ((TestSampledMachine, 100), (TestSampledLruMachine, 40)):
    case.settings = settings(max_examples=examples, stateful_step_count=50, deadline=None)


def drain(pol, skip=None) -> list:
    out = []
    while (victim := pol.choose_victim(skip)) is not None:
        out.append(victim)
        pol.remove(victim)
    return out


def test_dialogs_are_cut_from_the_tail_and_reused_blocks_outlive_one_off_ones() -> None:
    pol = sampled()
    for p in range(4):
        pol.add(f"A{p}", 1, dlg(0), p, LONG)
    for p in range(3):
        pol.add(f"B{p}", 1, dlg(1), p, LONG, tail=p == 2)
    pol.add("L", 1, NO_DIALOG, 0, LONG)
    for p in (0, 1):
        pol.touch(f"A{p}")  # A's head is read again: REUSED
    assert pol.segment_of("B2") is Segment.TAIL and pol.segment_of("A0") is Segment.REUSED
    # TAIL first (B's last block), then the NEW groups coldest first (A's, B's, the lone L), REUSED last;
    # each dialog from its tail.
    assert drain(pol) == ["B2", "A3", "A2", "B1", "B0", "L", "A1", "A0"]


def test_a_held_block_shields_the_blocks_below_it() -> None:
    pol = sampled()
    for p in range(3):
        pol.add(f"A{p}", 1, dlg(0), p, LONG)
    pol.add("B0", 1, dlg(1), 0, LONG)
    pol.touch("B0")
    held = {"A1"}
    # A2 may go; A1 is held and shields A0, so B0 (REUSED) goes before A0; then A0 as the last resort.
    assert drain(pol, held.__contains__) == ["A2", "B0", "A0"]
    assert len(pol) == 1 and "A1" in pol


def test_short_objects_are_refused() -> None:
    with pytest.raises(ValueError, match="long objects only"):
        SampledEvictionPolicy().add("x", 1, NO_DIALOG, 0, SHORT)
    with pytest.raises(ValueError, match="unknown sampled policy"):
        make_sampled_policy("sampled-fifo")


@pytest.mark.parametrize("kind", ["prefix", "lru"])
def test_the_order_survives_a_snapshot(kind: str) -> None:
    """``restore`` of what a snapshot keeps (dialog, position, segment, group tick) gives the same victims.

    (Blocks sharing a position in a dialog may come back in another order
    among themselves: any of them is a right victim.  Here positions are
    distinct, so the whole order is fixed.)
    """
    rng = random.Random(3)
    pol = SampledEvictionPolicy(kind)
    for _ in range(400):
        ident = rng.randrange(60)
        what = rng.random()
        if what < 0.6:
            lone = ident % 10 == 0
            pol.add(ident, 1, NO_DIALOG if lone else dlg(ident % 6), -1 if ident % 10 == 5 else ident // 6, LONG,
                    tail=rng.random() < 0.2)
        elif what < 0.9:
            pol.touch(ident)
        elif ident in pol:
            pol.remove(ident)
    pol.policy.young_adds = 0
    src = pol.policy
    n = src.rows.n
    sel = np.arange(n)
    copy = SampledEvictionPolicy(kind)
    copy.policy.young_adds = 0
    copy._numbers, copy._idents = dict(pol._numbers), list(pol._idents)
    rows = copy._rows.add_many(src.rows.lo[:n].copy(), src.rows.hi[:n].copy())
    copy.policy.restore(rows, src.dialog_digests(sel), src.rows.pos[:n].copy(), src.rows.seg[:n].copy(),
                        src.group_ticks(sel))
    assert copy.hottest_first() == pol.hottest_first()
    assert drain(copy) == drain(pol)


def test_a_sample_finds_the_coldest_groups_of_a_large_card() -> None:
    """100,000 one-block dialogs in age order: each victim is among the oldest few percent."""
    pol = SampledEvictionPolicy("prefix", seed=1)
    n = 100_000
    for i in range(n):
        pol.add(i, 1, NO_DIALOG, 0, LONG)
    victims = [pol.choose_victim() for _ in range(200)]
    for v in victims:
        pol.remove(v)
    assert sorted(victims)[-1] < 0.1 * n and np.median(victims) < 0.02 * n


def test_rows_of_a_dialog_without_a_position_keep_their_dialog() -> None:
    """Eviction takes them as blocks of their own, but their dialog is known (a card's mover places by it)."""
    rows = DigestRows(SampledPolicy.ROW_COLUMNS)
    pol = SampledPolicy(rows)
    r = rows.add1(5, 6)
    pol.add(r, dlg(2), -1)
    assert rows.pos[r] == -1 and pol.dialog_digests(np.array([r])).tobytes() == dlg(2)
    pol.removing(r)
    rows.remove(r)
    assert len(pol.dialogs) == 0, "a dialog no row names is let go"
