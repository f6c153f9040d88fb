"""Background work on the event loop, cut into slices that leave the loop to requests in between.

Indexing what a card's scan found, or dropping the rows a check did not see,
runs on the loop (it changes the index the loop's requests read) for
seconds in all on a large card.  ``LoopSlices`` cuts it into slices of
``SLICE_S`` and, between two, sleeps ``GAP_S`` on a timer.

Why a timer and not ``asyncio.sleep(0)``: a request's way through the
gateway takes several loop iterations (the socket's callback, the session's
task, the request's task, a pool thread's answer).  After ``sleep(0)`` the
background task is ready again at the next iteration, so it ran a slice
between every two of those steps: a request waited one slice per step.
Measured on a card of 100,000 objects during its full scan (``kvgate bench
--objects 100000``, 2 shared cores): lookups of 1,000 keys at p99 12.5 ms
with 2 ms slices and ``sleep(0)``, 7.4 ms with 1 ms slices and a timer
(6.6-6.7 ms once the scan also read the next headers while indexing).
Until the timer fires the loop runs whatever is ready, request after
request; epoll's millisecond resolution makes a gap of ``GAP_S`` about a
millisecond, so background work gets at most about half of a loop that has
requests to answer, and all of an idle one (a slice is cut by time, not by
work, and the timer costs nothing when nothing else is ready).
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

SLICE_S: Final = 0.001
GAP_S: Final = 0.0005


class LoopSlices:
    """The slices of one piece of background work (module docstring).

    Used by one task on the loop: call ``await slices.give_way()`` between
    two items of work; it returns at once while the current slice lasts.
    """

    def __init__(self, slice_s: float = SLICE_S, gap_s: float = GAP_S) -> None:
        self.slice_s = slice_s
        self.gap_s = gap_s
        self._start = time.perf_counter()
        self.gaps = 0  # how often it gave way (a test's measure that it did)

    async def give_way(self) -> None:
        if time.perf_counter() - self._start > self.slice_s:
            await asyncio.sleep(self.gap_s)
            self.gaps += 1
            self._start = time.perf_counter()

    def restart(self) -> None:
        """A new slice starts now (after the task waited on something else, e.g. a pool thread)."""
        self._start = time.perf_counter()
