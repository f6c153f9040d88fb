"""Where an object lives: slots, the slot -> card map, and the layout fingerprint.

Slots are assigned to cards by rendezvous (highest-random-weight) hashing of
the card *serials*, never their paths or their order in the config: every
gateway that sees the same cards computes the same map, and adding a card
moves only the slots it wins (about 1/(N+1) of them).

Placement chooses the slot of an object:
- ``dialog``: from the dialog mark, so every block of a conversation lands on
  one card and a failed card costs only its own dialogs;
- ``stripe``: from the object's own key, so one long restore reads from all
  cards at once.
A request without a dialog mark is placed by its keys in either mode.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Sequence

import numpy as np
import xxhash

from kvgate.keys import NO_DIALOG

PLACEMENTS = ("dialog", "stripe")


def _weight(serial: str, slot: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{serial}\x00{slot}".encode())


# A card's weights for every slot: a card set that changes (a cluster of 64
# cards, 16,384 slots) re-maps by hashing only the cards that are new to it.
# 64 x 16,384 weights took 0.67 s to hash, which a join would spend on the
# event loop; one new card's column takes ~10 ms.  256 columns of 16,384
# slots are 32 MiB at most.
@lru_cache(maxsize=256)
def _weights(serial: str, slots: int) -> np.ndarray:
    return np.fromiter((_weight(serial, slot) for slot in range(slots)), dtype=np.uint64, count=slots)


class SlotMap:
    """Immutable slot -> card serial assignment."""

    def __init__(self, serials: Sequence[str], slots: int):
        if slots < 1:
            raise ValueError("storage_slots must be at least 1")
        unique = sorted(set(serials))
        if len(unique) != len(serials):
            raise ValueError("two cards carry the same serial (the same card listed twice?)")
        self.serials = tuple(unique)
        self.slots = slots
        if unique:
            # argmax takes the first of equal weights, as max() over the sorted serials did
            winners = np.vstack([_weights(s, slots) for s in unique]).argmax(axis=0)
            self.owner: tuple[str | None, ...] = tuple(unique[i] for i in winners.tolist())
        else:
            self.owner = (None,) * slots

    def serial_of_slot(self, slot: int) -> str | None:
        return self.owner[slot]

    def slots_of(self, serial: str) -> list[int]:
        return [i for i, s in enumerate(self.owner) if s == serial]


def slot_of(key_digest: bytes, dialog: bytes, placement: str, slots: int) -> int:
    """Slot of one object; ``dialog`` is a 16-byte digest (NO_DIALOG for none)."""
    source = dialog if placement == "dialog" and dialog != NO_DIALOG else key_digest
    return int.from_bytes(source[8:16], "little") % slots


def fingerprint(slot_map: SlotMap, num_dbs: int, placement: str) -> str:
    """16 hex digits that change whenever a key could land somewhere else."""
    h = hashlib.sha256()
    h.update(f"kvgate-layout-1|slots={slot_map.slots}|dbs={num_dbs}|placement={placement}|".encode())
    for owner in slot_map.owner:
        h.update((owner or "-").encode() + b"|")
    return h.hexdigest()[:16]
