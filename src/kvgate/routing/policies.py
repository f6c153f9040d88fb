"""Which endpoint a request goes to: ``round-robin``, ``least-loaded`` or ``cache-aware`` (the default).

A policy orders the routable endpoints (``order``): the first is the choice, the next is where a request
that cannot connect to the first is retried.  ``needs_tokens`` says whether it wants the prompt's block
hashes (only cache-aware does: getting them costs a ``/tokenize`` round trip, see ``kvgate.routing.front``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.routing.endpoints import EndpointState
from kvgate.routing.index import KvIndex
from kvgate.routing.score import Endpoint, Score, Scorer, best

__all__ = ["Decision", "RoundRobin", "LeastLoaded", "CacheAware", "make_policy"]


@dataclass
class Decision:
    """A policy's answer: endpoints in the order to try them, the scores when it scored (cache-aware),
    and ``fallback`` True when cache-aware found nothing to go on and ordered by load."""

    order: list[EndpointState]
    scores: list[Score] | None = None
    fallback: bool = False


class RoundRobin:
    name = "round-robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._next = 0

    def order(self, candidates: Sequence[EndpointState], hashes: Sequence[bytes] | None = None) -> Decision:
        if not candidates:
            return Decision([])
        i = self._next % len(candidates)
        self._next += 1
        return Decision(list(candidates[i:]) + list(candidates[:i]))


class LeastLoaded:
    """Fewest running + waiting + router-in-flight requests first; ties keep the configured order."""

    name = "least-loaded"
    needs_tokens = False

    def order(self, candidates: Sequence[EndpointState], hashes: Sequence[bytes] | None = None) -> Decision:
        return Decision(sorted(candidates, key=lambda e: e.load))


class CacheAware:
    """The scorer's choice (``kvgate.routing.score``: cost of prefill left, restores and load), the rest by
    cost.  Falls back to least-loaded when no prompt hashes are known (tokenizing failed) or no endpoint
    matches a single block: then the scores say nothing but load, and least-loaded counts the router's own
    in-flight requests, which the scorer does not."""

    name = "cache-aware"
    needs_tokens = True

    def __init__(self, index: KvIndex | None = None, scorer: Scorer | None = None,
                 sources: dict[str, Endpoint] | None = None) -> None:
        self.index = index if index is not None else KvIndex()
        self.scorer = scorer if scorer is not None else Scorer(self.index)
        # endpoint URL -> its score.Endpoint (the index source ids of its engine and gateway events)
        self.sources = sources if sources is not None else {}
        self._least = LeastLoaded()

    def endpoint(self, ep: EndpointState) -> Endpoint:
        base = self.sources.get(ep.url)  # absent: an endpoint known only by its URL (tests, tools)
        return Endpoint(name=ep.url, engine=base.engine if base else ep.url,
                        gateway=base.gateway if base else None, cards=base.cards if base else (),
                        peers=base.peers if base else (),
                        running=ep.running + ep.inflight, waiting=ep.waiting, prefill_ahead=ep.prefilling)

    def score(self, candidates: Sequence[EndpointState], hashes: Sequence[bytes]) -> list[Score]:
        return self.scorer.score(hashes, [self.endpoint(e) for e in candidates])

    def order(self, candidates: Sequence[EndpointState], hashes: Sequence[bytes] | None = None) -> Decision:
        if not candidates:
            return Decision([])
        if not hashes:
            return Decision(self._least.order(candidates).order, None, fallback=True)
        scores = self.score(candidates, hashes)
        if not any(s.matched for s in scores):
            return Decision(self._least.order(candidates).order, scores, fallback=True)
        first = best(scores)
        rank = sorted(range(len(candidates)), key=lambda i: (scores[i] is not first, scores[i].cost,
                                                              -scores[i].matched, i))
        return Decision([candidates[i] for i in rank], [scores[i] for i in rank])


def make_policy(name: str, index: KvIndex | None = None,
                scorer: Scorer | None = None) -> RoundRobin | LeastLoaded | CacheAware:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "cache-aware":
        return CacheAware(index, scorer)
    raise ValueError(f"unknown policy {name!r}")
