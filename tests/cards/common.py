"""Checks every card kind must pass the same way."""

from __future__ import annotations

from kvgate.cards import Card


def check_snapshot_round_trip(card: Card, objects: int) -> None:
    """The index snapshot is replaced whole or not at all, and is no object (``objects`` are on the card)."""
    assert card.read_snapshot() is None
    w = card.snapshot_writer()
    w.write(b"an index ")
    w.write(memoryview(b"snapshot"))
    assert card.read_snapshot() is None, "not visible before its commit"
    w.commit()
    assert card.read_snapshot() == b"an index snapshot"
    w = card.snapshot_writer()
    w.write(b"half of a second one")
    w.abort()
    assert card.read_snapshot() == b"an index snapshot"
    assert len(list(card.scan())) == objects, "the snapshot is no object"
    card.drop_snapshot()
    assert card.read_snapshot() is None
