"""A card's ``SampledPolicy`` behind the ``EvictionPolicy`` interface, by identity.

The trace replay (``kvgate.bench.trace``) drives every policy by identity,
the way the RAM tier does; a card's policy works on index rows.  This
adapter gives each identity a row of its own, so the replay and the tests
run the very code a card runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Final

from kvgate.tiers.eviction import LONG, EvictionPolicy, Segment
from kvgate.tiers.referee import Referee
from kvgate.tiers.rows import DigestRows
from kvgate.tiers.sampled import SampledPolicy


class SampledEvictionPolicy(EvictionPolicy):
    """``SampledPolicy`` by identity, for the trace replay (``kvgate.bench.trace.simulate``) and tests.

    Any hashable identity (each gets a number of its own); long objects
    only, as on a card.
    """

    def __init__(self, kind: str = "prefix", seed: int | None = 0, referee: Referee | None = None,
                 numbers: tuple[dict[Hashable, int], list[Hashable]] | None = None) -> None:
        """``referee`` and ``numbers`` (identity -> number, number -> identity) shared by the policies of one
        card set: a card's digests are unique across cards, and the referee tells blocks apart by them."""
        self.name = f"sampled-{kind}"
        self._rows = DigestRows(SampledPolicy.ROW_COLUMNS)
        self.policy = SampledPolicy(self._rows, kind, seed, referee)
        self._numbers, self._idents = numbers if numbers is not None else ({}, [])

    def _digest(self, ident: Hashable, make: bool = False) -> tuple[int, int] | None:
        i = self._numbers.get(ident)
        if i is None:
            if not make:
                return None
            i = self._numbers[ident] = len(self._idents)
            self._idents.append(ident)
        # The filter and the table hash by the low half: a mix of the number (splitmix64's finalizer).
        h = (i + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
        return h ^ (h >> 31), i

    def _row(self, ident: Hashable) -> int:
        key = self._digest(ident)
        return -1 if key is None else self._rows.find1(*key)

    def _ident(self, row: int) -> Hashable:
        return self._idents[self._rows.hi.item(row)]

    def add(self, ident: Hashable, size: int, dialog: bytes, position: int, klass: int, tail: bool = False) -> None:
        if klass != LONG or isinstance(klass, bool):
            raise ValueError(f"cards hold long objects only (retention class {LONG}), got {klass!r}")
        key = self._digest(ident, make=True)
        assert key is not None
        row = self._rows.find1(*key)
        again = row >= 0
        if again:
            self.policy.removing(row)
            self._rows.remove(row)
        row = self._rows.add1(*key)
        self.policy.add(row, dialog, position, tail, again)

    def touch(self, ident: Hashable) -> None:
        row = self._row(ident)
        if row >= 0:
            self.policy.touch(row)

    def remove(self, ident: Hashable) -> None:
        row = self._row(ident)
        if row >= 0:
            self.policy.removing(row)
            self._rows.remove(row)

    def choose_victim(self, skip: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        row = self.policy.choose_victim(None if skip is None else (lambda r: skip(self._ident(r))))
        return None if row < 0 else self._ident(row)

    def hottest_first(self) -> list[Hashable]:
        return [self._ident(r) for r in self.policy.hottest_first().tolist()]

    def evictions_by_order(self) -> dict[str, int]:
        return dict(self.policy.tally.counts) if self.policy.referee is not None else {}

    def segment_of(self, ident: Hashable) -> Segment | None:
        row = self._row(ident)
        return None if row < 0 else self.policy.segment_of(row)

    def __len__(self) -> int:
        return self._rows.n

    def __contains__(self, ident: object) -> bool:
        return isinstance(ident, Hashable) and self._row(ident) >= 0


SAMPLED_POLICIES: Final = tuple(f"sampled-{kind}" for kind in SampledPolicy.KINDS)


def make_sampled_policy(name: str) -> SampledEvictionPolicy:
    """``sampled-adaptive``, ``sampled-prefix`` or ``sampled-lru`` by identity (the trace replay's names for the
    cards' policies)."""
    return make_sampled_policies(name, 1)[0]


def make_sampled_policies(name: str, cards: int) -> list[SampledEvictionPolicy]:
    """One policy per card, as a gateway's card set runs them: under "adaptive", one referee for them all
    (``CardSet.referee``)."""
    kind = name.removeprefix("sampled-")
    if name not in SAMPLED_POLICIES:
        raise ValueError(f"unknown sampled policy {name!r}; choose one of {', '.join(SAMPLED_POLICIES)}")
    policies: list[SampledEvictionPolicy] = []
    referee = Referee(lambda: sum(len(p) for p in policies)) if kind == "adaptive" else None
    numbers: tuple[dict[Hashable, int], list[Hashable]] = ({}, [])
    policies.extend(SampledEvictionPolicy(kind, referee=referee, numbers=numbers) for _ in range(cards))
    return policies


def card_policy(eviction_policy: str) -> str:
    """The name the trace replay knows a card's policy by, for the ``eviction_policy`` a gateway was given."""
    return f"sampled-{eviction_policy}"
