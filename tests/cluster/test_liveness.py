"""Liveness: which cards a gateway holds out because no agent reports them (pure bookkeeping, no etcd)."""

from __future__ import annotations

import logging

import pytest

from kvgate.cluster.liveness import Liveness


def test_a_card_is_held_out_after_sick_polls_in_a_row_and_released_at_once() -> None:
    live = Liveness(sick_polls=3)
    cards = ["a", "b", "c"]
    assert live.observe(cards, {"a", "b", "c"}) == (set(), set())
    assert live.observe(cards, {"b", "c"}) == (set(), set())
    assert live.observe(cards, {"a", "b", "c"}) == (set(), set()), "a late report resets the count"
    for _ in range(2):
        assert live.observe(cards, {"b", "c"}) == (set(), set())
    assert live.observe(cards, {"b", "c"}) == ({"a"}, set())
    live.hold({"a"})  # its own check failed too
    assert live.observe(cards, {"b", "c"}) == (set(), set()) and live.held == {"a"}
    assert live.observe(cards, {"a", "b", "c"}) == (set(), {"a"}) and live.held == set()


def test_an_unreported_card_that_answers_is_not_held_and_is_asked_again_each_poll() -> None:
    live = Liveness(sick_polls=2)
    cards = ["a", "b"]
    live.observe(cards, {"a", "b"})
    live.observe(cards, {"b"})
    assert live.observe(cards, {"b"}) == ({"a"}, set())
    live.hold(set())  # it answered this gateway: its agent is down, not the card
    assert live.held == set()
    assert live.observe(cards, {"b"}) == ({"a"}, set()), "asked again while it goes unreported"
    live.hold({"a"})
    assert live.held == {"a"} and live.observe(cards, {"b"}) == (set(), set())
    assert live.observe(cards, {"a", "b"}) == (set(), {"a"})


def test_a_card_no_agent_ever_reported_is_never_held_out() -> None:
    live = Liveness(sick_polls=1)
    for _ in range(5):
        assert live.observe(["a", "manual"], {"a"}) == (set(), set())


def test_never_every_card_at_once(caplog) -> None:
    caplog.set_level(logging.ERROR, "kvgate.cluster")
    live = Liveness(sick_polls=1)
    live.observe(["a", "b", "c"], {"a", "b", "c"})
    assert live.observe(["a", "b", "c"], {"b", "c"}) == ({"a"}, set())
    live.hold({"a"})
    # Now b and c go quiet too: that would be every card, so this gateway is the one cut off.
    for _ in range(3):
        assert live.observe(["a", "b", "c"], set()) == (set(), set())
    assert live.held == {"a"} and caplog.text.count("every card looks dead") == 1
    assert live.observe(["a", "b", "c"], {"a", "b", "c"}) == (set(), {"a"})


def test_cards_that_left_the_set_are_forgotten() -> None:
    live = Liveness(sick_polls=1)
    live.observe(["a", "b"], {"a", "b"})
    assert live.observe(["a", "b"], {"b"}) == ({"a"}, set())
    live.observe(["b"], {"b"})
    assert live.held == set() and "a" not in live.missed


def test_sick_polls_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sick_polls"):
        Liveness(0)
