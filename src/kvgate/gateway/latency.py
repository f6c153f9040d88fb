"""How long the gateway takes to answer each kind of request: one histogram per request type.

``Operations.dispatch`` observes, for every request, the seconds from the
moment its handler starts to the moment its reply has gone out (the
gateway's own share of an engine's wait: the store, the cards' I/O, the
copy, the send), under the request's type (``lookup``, ``get``, ``put``
...).  The types are the protocol's messages, a fixed set, so the series
cannot grow with what clients send.  ``/metrics`` renders it as
``kvgate_request_seconds{op}`` (``kvgate.gateway.status``).

Loop only: observed and read on the gateway's event loop.
"""

from __future__ import annotations

import bisect
from typing import Any, Final

# Upper bounds, seconds: a RAM-tier lookup takes tens of microseconds, a cold
# read of many MiB from a loaded card can take seconds.
BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)


class RequestLatency:
    """Per request type: how many requests fell under each bound, their count and their total seconds."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}  # per op: one count per bound, then one for above the last
        self._sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        counts = self._counts.get(op)
        if counts is None:
            counts = self._counts[op] = [0] * (len(BUCKETS) + 1)
            self._sums[op] = 0.0
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[op] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per op: ``buckets`` as [bound, requests at or under it] pairs (cumulative), ``count``, ``sum``."""
        out = {}
        for op, counts in sorted(self._counts.items()):
            running, cumulative = 0, []
            for bound, n in zip(BUCKETS, counts):
                running += n
                cumulative.append([bound, running])
            out[op] = {"buckets": cumulative, "count": running + counts[-1], "sum": round(self._sums[op], 6)}
        return out
