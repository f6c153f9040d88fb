"""Latency histograms, one per name from a fixed set: how long requests and card I/O take.

Two owners: ``Operations.dispatch`` observes, for every request, the seconds
from the moment its handler starts to the moment its reply has gone out (the
gateway's own share of an engine's wait), under the request's type
(``lookup``, ``get``, ``put`` ...); each card's ``CardIo`` observes every
call it runs on a card thread, from its start on that thread to its end,
under the card method's name (``read_many_into``, ``write_many`` ...).  Both
sets of names are fixed by the code, so the series cannot grow with what
clients send.  ``/metrics`` renders them as ``kvgate_request_seconds{op}``
and ``kvgate_card_io_seconds{call}`` (``kvgate.gateway.status``).

Loop only: observed and read on the gateway's event loop.
"""

from __future__ import annotations

import bisect
from typing import Any, Final

# Upper bounds, seconds: a RAM-tier lookup takes tens of microseconds, a cold
# read of many MiB from a loaded card can take seconds.
BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)


class Latencies:
    """Per name: how many observations fell under each bound, their count and their total seconds."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}  # per op: one count per bound, then one for above the last
        self._sums: dict[str, float] = {}

    def observe(self, name: str, seconds: float) -> None:
        counts = self._counts.get(name)
        if counts is None:
            counts = self._counts[name] = [0] * (len(BUCKETS) + 1)
            self._sums[name] = 0.0
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[name] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per name: ``buckets`` as [bound, observations at or under it] pairs (cumulative), ``count``, ``sum``."""
        out = {}
        for op, counts in sorted(self._counts.items()):
            running, cumulative = 0, []
            for bound, n in zip(BUCKETS, counts):
                running += n
                cumulative.append([bound, running])
            out[op] = {"buckets": cumulative, "count": running + counts[-1], "sum": round(self._sums[op], 6)}
        return out
