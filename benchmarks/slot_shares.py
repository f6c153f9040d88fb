"""How even the slot shares of rendezvous placement are: the fullest card's share over its fair share.

    python benchmarks/slot_shares.py [--sets 20]

Prints, per card count and slot count, the median and worst ratio over
random sets of card serials (docs/cluster.md's table of slots for many cards).
"""

from __future__ import annotations

import argparse
import statistics
import uuid

from kvgate.placement import SlotMap


def fullest_over_fair(cards: int, slots: int) -> float:
    slot_map = SlotMap([uuid.uuid4().hex for _ in range(cards)], slots)
    return max(len(slot_map.slots_of(s)) for s in slot_map.serials) / (slots / cards)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", type=int, default=20, help="random sets of serials per point")
    p.add_argument("--cards", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--slots", type=int, nargs="+", default=[1024, 4096, 16384])
    args = p.parse_args()
    print("| cards | " + " | ".join(f"{n:,} slots" for n in args.slots) + " |")
    print("| --- |" + " --- |" * len(args.slots))
    for cards in args.cards:
        cells = []
        for slots in args.slots:
            ratios = [fullest_over_fair(cards, slots) for _ in range(args.sets)]
            cells.append(f"{statistics.median(ratios):.2f} (worst {max(ratios):.2f})")
        print(f"| {cards} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
