"""Buffers of ours that the store reuses: put staging, and the card part of replies sent or lent.

Fresh memory fills at about 0.5 GiB/s here (a page fault and a zeroing per
4 KiB, see ``RamPages``): a fresh buffer per put cost more than the card write
itself, and a fresh buffer per lent get held the card part of it to 1.1 GiB/s
against 11 for the read (``kvgate bench``, 2 MiB objects).  Both run on the
event loop only; no locks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.tiers.io import ByteBudget


class BufferCache:
    """Given-back buffers kept by size for the next taker, up to ``keep`` bytes in all.

    A buffer is given back only once nothing can still write into it or read
    out of it (its card reads have returned, its reply was sent or its loan
    given back); the next taker may overwrite it at once.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: dict[int, list[memoryview]] = {}
        self.kept = 0

    def take(self, sizes: list[int]) -> list[memoryview]:
        out = []
        for n in sizes:
            free = self._free.get(n)
            if free:
                out.append(free.pop())
                self.kept -= n
            else:
                out.append(memoryview(bytearray(n)))
        return out

    def give(self, buffers: Sequence[memoryview]) -> None:
        for buf in buffers:
            n = len(buf)
            if n and self.kept + n <= self.keep:
                self._free.setdefault(n, []).append(buf)
                self.kept += n


class Staging:
    """Buffers of ours that card writes of items without a RAM copy read from (see ``TieredStore.put``).

    Puts hold at most ``limit`` bytes of them at once, as inline frames do;
    puts beyond it wait their turn.  Given-back buffers are kept for reuse up
    to ``KEEP`` bytes.
    """

    KEEP = 64 << 20

    def __init__(self, limit: int):
        self.budget = ByteBudget(limit)
        self.cache = BufferCache(self.KEEP)

    async def take(self, sizes: list[int]) -> list[memoryview]:
        await self.budget.acquire(sum(sizes))
        return self.cache.take(sizes)

    async def give_back(self, buffers: list[memoryview]) -> None:
        self.cache.give(buffers)
        await self.budget.release(sum(len(b) for b in buffers))
