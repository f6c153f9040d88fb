"""Holds: what sessions keep on their cards, bounded per session and in all, lapsing when not renewed."""

from __future__ import annotations

from kvgate.tiers.holds import Holds


def test_a_key_stays_held_while_any_session_holds_it() -> None:
    h = Holds()
    assert h.hold(1, [b"a", b"b"], now=0) == [True, True]
    assert h.hold(2, [b"a"], now=0) == [True]
    assert h.release(1, [b"a", b"zzz"]) == 1
    assert b"a" in h and b"b" in h
    assert h.release_all(2) == 1
    assert b"a" not in h and b"b" in h
    assert h.release_all(1) == 1 and len(h) == 0
    assert h.release(7, [b"b"]) == 0 and h.release_all(7) == 0


def test_holds_lapse_unless_renewed() -> None:
    h = Holds(hold_s=10)
    h.hold(1, [b"a", b"b"], now=0)
    h.hold(1, [b"a"], now=8)  # renewed: lapses at 18
    assert h.expire(now=11) == 1
    assert b"a" in h and b"b" not in h
    assert h.expire(now=18) == 1 and len(h) == 0


def test_caps_per_session_and_in_all() -> None:
    h = Holds(max_per_session=3, max_total=5)
    assert h.hold(1, [b"1", b"2", b"3", b"4"], now=0) == [True, True, True, False]
    assert h.hold(1, [b"1"], now=0) == [True]  # renewing a held key needs no room
    assert h.hold(2, [b"x", b"y", b"z"], now=0) == [True, True, False]
    assert h.refused == 2
    h.release_all(1)
    assert h.hold(2, [b"z"], now=0) == [True]
