"""The I/O thread pool, with the bookkeeping status needs.

Card reads and writes and bulk copies run here, never on the event loop.
Each call is tracked while in flight so the gateway can export the age of
the oldest one (a stuck card shows as a growing age long before anything
else notices).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class IoPool:
    def __init__(self, threads: int):
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgate-io")
        self._inflight: dict[int, float] = {}
        self._ids = itertools.count()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` in the pool; the loop stays free meanwhile."""
        ticket = next(self._ids)
        self._inflight[ticket] = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            del self._inflight[ticket]

    async def map_chunks(self, fn: Callable[[list], T], items: list, min_chunk: int = 1) -> list[T]:
        """Split ``items`` into at most ``threads`` contiguous chunks, run ``fn`` on each at once."""
        if not items:
            return []
        n = max(1, min(self.threads, len(items) // max(1, min_chunk)))
        size = -(-len(items) // n)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if len(chunks) == 1:
            return [await self.run(fn, chunks[0])]
        return list(await asyncio.gather(*(self.run(fn, c) for c in chunks)))

    def oldest_age(self) -> float:
        """Seconds the oldest in-flight call has been running (0 when idle)."""
        if not self._inflight:
            return 0.0
        return time.monotonic() - min(self._inflight.values())

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
