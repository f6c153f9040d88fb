"""``LoopSlices``: background work on the loop leaves it to a request's chain of steps, not one step at a time."""

from __future__ import annotations

import asyncio
import time

from kvgate.tiers.slices import LoopSlices

SLICE_S = 0.005
HOPS = 8  # a request's loop iterations: socket callback, session task, request task, a pool thread's answer...


async def _request(hops: int) -> float:
    """Seconds a chain of ``hops`` loop iterations takes."""
    t = time.perf_counter()
    for _ in range(hops):
        await asyncio.sleep(0)
    return time.perf_counter() - t


async def _background(slices: LoopSlices, stop: asyncio.Event) -> int:
    """Busy work on the loop, in slices, until stopped; the items it did."""
    items = 0
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0001:  # one item: 100 us of loop time
            pass
        items += 1
        await slices.give_way()
    return items


def test_a_request_waits_at_most_about_one_slice_not_one_per_step() -> None:
    async def main() -> tuple[list[float], int, int]:
        stop = asyncio.Event()
        slices = LoopSlices(slice_s=SLICE_S)
        work = asyncio.create_task(_background(slices, stop))
        waits = []
        for _ in range(20):
            await asyncio.sleep(0.003)
            waits.append(await _request(HOPS))
        stop.set()
        return waits, await work, slices.gaps

    waits, items, gaps = asyncio.run(main())
    # Giving way with sleep(0) put a slice between every two steps: HOPS x 5 ms = 40 ms a request.
    assert sorted(waits)[len(waits) // 2] < 2 * SLICE_S, waits
    assert max(waits) < HOPS * SLICE_S / 2, waits
    assert items > 100 and gaps > 5  # the background work went on, in slices


def test_an_idle_loop_leaves_the_background_work_most_of_it() -> None:
    async def main() -> int:
        stop = asyncio.Event()
        slices = LoopSlices(slice_s=SLICE_S)
        work = asyncio.create_task(_background(slices, stop))
        await asyncio.sleep(0.3)
        stop.set()
        return await work

    # 100 us items: 3,000 in 0.3 s of a loop of its own; the gaps (about a millisecond after every 5 ms
    # slice) leave well over half of that.
    assert asyncio.run(main()) > 1000
