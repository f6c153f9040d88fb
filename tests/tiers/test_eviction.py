"""Eviction policies: exact orders on small cases, and a model-checked state machine."""

from __future__ import annotations

from typing import Hashable

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvgate.keys import NO_DIALOG
from kvgate.tiers.eviction import (
    LONG,
    SHORT,
    EvictionPolicy,
    LruPolicy,
    PrefixPolicy,
    Retention,
    make_policy,
)


def dlg(n: int) -> bytes:
    return bytes([n + 1]) * 16


def drain(policy: EvictionPolicy, skip=None) -> list:
    """Evict until nothing can be chosen; the order of victims."""
    out = []
    while (victim := policy.choose_victim(skip)) is not None:
        out.append(victim)
        policy.remove(victim)
    return out


def add_dialog(policy: EvictionPolicy, name: str, n_blocks: int, klass: int = SHORT, start: int = 0) -> None:
    for p in range(start, start + n_blocks):
        policy.add(f"{name}{p}", 1, dlg(ord(name[0])), p, klass)


# -- prefix policy: exact orders ------------------------------------------


def test_prefix_evicts_tail_before_head():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 4)
    assert drain(pol) == ["A3", "A2", "A1", "A0"]
    assert len(pol) == 0


def test_prefix_evicts_whole_coldest_dialog_first():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 3)
    add_dialog(pol, "B", 2)
    assert drain(pol) == ["A2", "A1", "A0", "B1", "B0"]


def test_prefix_interleaved_writes_order_by_last_add():
    pol = PrefixPolicy()
    for p in range(2):
        pol.add(f"A{p}", 1, dlg(0), p, SHORT)
        pol.add(f"B{p}", 1, dlg(1), p, SHORT)
    # B got the last add, so A is colder as a whole.
    assert drain(pol) == ["A1", "A0", "B1", "B0"]


def test_prefix_add_to_older_dialog_warms_it():
    pol = PrefixPolicy()
    pol.add("A0", 1, dlg(0), 0, SHORT)
    pol.add("B0", 1, dlg(1), 0, SHORT)
    pol.add("A1", 1, dlg(0), 1, SHORT)  # A is being written: now B is the colder one
    assert drain(pol) == ["B0", "A1", "A0"]


def test_prefix_touch_warms_whole_dialog():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 3)
    add_dialog(pol, "B", 3)
    pol.touch("A0")  # reading the head of A makes all of A hot, tail included
    assert drain(pol) == ["B2", "B1", "B0", "A2", "A1", "A0"]


def test_prefix_out_of_order_positions_still_tail_first():
    pol = PrefixPolicy()
    for p in (2, 0, 3, 1):
        pol.add(f"A{p}", 1, dlg(0), p, SHORT)
    assert drain(pol) == ["A3", "A2", "A1", "A0"]


def test_prefix_remove_from_middle_keeps_order():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 4)
    pol.remove("A1")
    pol.remove("nonexistent")  # tolerated
    assert "A1" not in pol and len(pol) == 3
    assert drain(pol) == ["A3", "A2", "A0"]


def test_prefix_short_before_long():
    pol = PrefixPolicy()
    add_dialog(pol, "L", 2, klass=LONG)
    add_dialog(pol, "S", 2, klass=SHORT)
    pol.touch("S0")
    add_dialog(pol, "T", 1, klass=SHORT)
    pol.touch("L0")  # warm long dialog still goes after every short one
    assert drain(pol) == ["S1", "S0", "T0", "L1", "L0"]


def test_prefix_shared_positions_go_together_tail_first():
    pol = PrefixPolicy()
    for p in range(2):
        for rank in range(2):
            pol.add(f"A{p}r{rank}", 1, dlg(0), p, SHORT)
    assert drain(pol) == ["A1r0", "A1r1", "A0r0", "A0r1"]


def test_prefix_objects_without_dialog_are_lru():
    pol = PrefixPolicy()
    pol.add("x", 1, NO_DIALOG, 0, SHORT)
    pol.add("y", 1, dlg(0), -1, SHORT)  # unknown position: a dialog of its own
    pol.add("z", 1, dlg(0), -1, SHORT)
    pol.add("w", 1, b"", 3, SHORT)
    pol.touch("x")
    assert drain(pol) == ["y", "z", "w", "x"]


def test_prefix_readd_replaces():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 3)
    add_dialog(pol, "B", 1)
    pol.add("A0", 1, dlg(5), 0, LONG)  # moves A0 into another dialog and class
    assert len(pol) == 4
    assert drain(pol) == ["A2", "A1", "B0", "A0"]


def test_prefix_skip_pinned_tail_moves_to_next_dialog():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 3)
    add_dialog(pol, "B", 2)
    pinned = {"A2"}
    # A's tail is pinned: evicting A1 would orphan it, so B goes first.
    assert pol.choose_victim(pinned.__contains__) == "B1"
    assert drain(pol, pinned.__contains__) == ["B1", "B0", "A1", "A0"]
    assert pol.choose_victim(lambda i: True) is None
    assert "A2" in pol


def test_prefix_skip_pinned_middle_evicts_above_it_only():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 4)
    add_dialog(pol, "B", 1)
    pinned = {"A1"}
    order = []
    for _ in range(3):
        v = pol.choose_victim(pinned.__contains__)
        order.append(v)
        pol.remove(v)
    assert order == ["A3", "A2", "B0"]
    # Only A0 is left unpinned: the second pass takes it rather than fail.
    assert pol.choose_victim(pinned.__contains__) == "A0"


def test_prefix_all_pinned_gives_none():
    pol = PrefixPolicy()
    add_dialog(pol, "A", 2)
    assert pol.choose_victim(lambda i: True) is None
    assert PrefixPolicy().choose_victim() is None


# -- LRU -------------------------------------------------------------------


def test_lru_order_touch_classes_and_skip():
    pol = LruPolicy()
    pol.add("L", 1, NO_DIALOG, -1, LONG)
    add_dialog(pol, "A", 3)
    pol.touch("A0")
    pol.touch("L")
    assert pol.choose_victim() == "A1"
    assert pol.choose_victim({"A1"}.__contains__) == "A2"
    # LRU knows no dialogs: the head goes while the tail stays.
    assert drain(pol) == ["A1", "A2", "A0", "L"]
    assert pol.choose_victim() is None


def test_make_policy_and_retention():
    assert isinstance(make_policy("prefix"), PrefixPolicy)
    assert isinstance(make_policy("lru"), LruPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")
    assert Retention.parse("short") == SHORT == 0
    assert Retention.parse("LONG") == LONG == 1
    assert Retention.parse(1) is LONG
    with pytest.raises(ValueError):
        Retention.parse("medium")
    with pytest.raises(ValueError):
        PrefixPolicy().add("x", 1, NO_DIALOG, 0, 2)
    with pytest.raises(ValueError):
        LruPolicy().add("x", 1, NO_DIALOG, 0, -1)


# -- model-checked state machine -------------------------------------------

IDENTS = [f"k{i}" for i in range(8)]
DIALOGS = [NO_DIALOG, dlg(0), dlg(1), dlg(2)]


class PolicyMachine(RuleBasedStateMachine):
    """Random add/touch/remove against a brute-force model of each policy.

    The model recomputes the whole order from timestamps at every question,
    so it is obviously right; the policy must name a victim of exactly the
    (class, dialog, position) the model expects.
    """

    policy_name = "prefix"

    def __init__(self) -> None:
        super().__init__()
        self.policy = make_policy(self.policy_name)
        self.clock = 0
        # ident -> (klass, dialog key, position)
        self.live: dict[str, tuple[int, Hashable, int]] = {}
        self.stamp: dict[Hashable, int] = {}  # prefix: (klass, dkey); lru: ident

    def _group(self, ident: str) -> Hashable:
        klass, dkey, _ = self.live[ident]
        return (klass, dkey) if self.policy_name == "prefix" else ident

    def _use(self, ident: str) -> None:
        self.clock += 1
        self.stamp[self._group(ident)] = self.clock

    @rule(ident=st.sampled_from(IDENTS), dialog=st.sampled_from(DIALOGS),
          position=st.integers(-1, 3), klass=st.sampled_from([SHORT, LONG]))
    def add(self, ident, dialog, position, klass):
        self.policy.add(ident, 1, dialog, position, klass)
        solo = dialog == NO_DIALOG or position < 0
        self.live[ident] = (klass, ("solo", ident) if solo else dialog, 0 if solo else position)
        self._use(ident)

    @rule(ident=st.sampled_from(IDENTS), dialog=st.sampled_from(DIALOGS[1:3]), position=st.integers(0, 3))
    def add_block(self, ident, dialog, position):
        """The common case, made likelier: short blocks of a couple of real dialogs."""
        self.add(ident, dialog, position, SHORT)

    @rule(ident=st.sampled_from(IDENTS))
    def touch(self, ident):
        self.policy.touch(ident)
        if ident in self.live:
            self._use(ident)

    @rule(ident=st.sampled_from(IDENTS))
    def remove(self, ident):
        self.policy.remove(ident)
        self.live.pop(ident, None)

    def expected(self, pinned: set[str]) -> set[str]:
        """Idents the policy may name (those sharing the right slot); empty = None."""
        def order(i: str):
            klass, _dkey, pos = self.live[i]
            return (klass, self.stamp[self._group(i)], -pos)

        ranked = sorted(self.live, key=order)
        if self.policy_name == "prefix":
            # Pass 1: per dialog from the tail, stop below a pinned block.
            blocked: set[Hashable] = set()
            slot = None
            for i in ranked:
                klass, dkey, pos = self.live[i]
                if (klass, dkey) in blocked:
                    continue
                if slot is not None and slot != (klass, dkey, pos):
                    break
                if i in pinned:
                    # Unpinned peers at the same position are still fine.
                    peers = {j for j in self.live if self.live[j] == (klass, dkey, pos) and j not in pinned}
                    if peers:
                        return peers
                    blocked.add((klass, dkey))
                    continue
                slot = (klass, dkey, pos)
                break
            if slot is not None:
                return {j for j in self.live if self.live[j] == slot and j not in pinned}
        for i in ranked:  # LRU, and the prefix policy's second pass
            if i not in pinned:
                slot = self.live[i]
                return {j for j in self.live if self.live[j] == slot and j not in pinned}
        return set()

    @rule(pinned=st.sets(st.sampled_from(IDENTS), max_size=2))
    def choose(self, pinned):
        victim = self.policy.choose_victim(pinned.__contains__ if pinned else None)
        allowed = self.expected(pinned)
        if not allowed:
            assert victim is None
        else:
            assert victim in self.live and victim not in pinned
            assert victim in allowed, (victim, allowed)

    @rule(pinned=st.sets(st.sampled_from(IDENTS), max_size=2))
    def evict(self, pinned):
        victim = self.policy.choose_victim(pinned.__contains__)
        if victim is not None:
            assert victim in self.expected(pinned)
            self.policy.remove(victim)
            del self.live[victim]

    @invariant()
    def consistent(self):
        assert len(self.policy) == len(self.live)
        for i in IDENTS:
            assert (i in self.policy) == (i in self.live)


class LruMachine(PolicyMachine):
    policy_name = "lru"


# Sized so a broken order is found every time (checked by breaking it) yet the
# file stays a few seconds; LRU is simpler and needs fewer examples.
TestPrefixMachine = PolicyMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestLruMachine = LruMachine.TestCase
TestLruMachine.settings = settings(max_examples=50, stateful_step_count=50, deadline=None)
