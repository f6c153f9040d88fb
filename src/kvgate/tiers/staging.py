"""Put staging: buffers of ours for card writes of items that have no RAM-tier copy."""

from __future__ import annotations

from kvgate.tiers.io import ByteBudget


class Staging:
    """Buffers of ours that card writes of items without a RAM copy read from (see ``TieredStore.put``).

    Puts hold at most ``limit`` bytes of them at once, as inline frames do;
    puts beyond it wait their turn.  Given-back buffers are kept for reuse up
    to ``KEEP`` bytes: fresh memory fills at about 0.5 GiB/s here (a page
    fault and a zeroing per 4 KiB, see ``RamTier``), which made a fresh
    buffer per put cost more than the card write itself.
    """

    KEEP = 64 << 20

    def __init__(self, limit: int):
        self.budget = ByteBudget(limit)
        self._free: dict[int, list[memoryview]] = {}
        self._kept = 0

    async def take(self, sizes: list[int]) -> list[memoryview]:
        await self.budget.acquire(sum(sizes))
        out = []
        for n in sizes:
            free = self._free.get(n)
            if free:
                out.append(free.pop())
                self._kept -= n
            else:
                out.append(memoryview(bytearray(n)))
        return out

    async def give_back(self, buffers: list[memoryview]) -> None:
        for buf in buffers:
            n = len(buf)
            if self._kept + n <= self.KEEP:
                self._free.setdefault(n, []).append(buf)
                self._kept += n
        await self.budget.release(sum(len(b) for b in buffers))
