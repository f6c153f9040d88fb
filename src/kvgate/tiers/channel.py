"""A card's bulk I/O channel: reads, writes and file opens of many objects, cut into chunks that run on the
card's I/O threads at once, each with a deadline, each chunk's outcome one success or one strike.

Who calls it: its ``ManagedCard``, on the event loop, after the card's catalog decided what to read or
write (the room taken, the key order's turn held).  What it never does: wait on the loop (the chunks run
on the card's ``CardIo`` threads), touch the index, or let a byte land in a destination after the call
returned or raised (each chunk's ``Abandon`` guard is abandoned before ``CardIo.run`` gives up on it).

Health: a chunk is one I/O to the card, however many objects it carried: its first error (a memory fault
in a client's region excepted: the client's doing, not the card's) or its success goes to ``note_result``
once, so a slow chunk of 16 objects is one strike, not 16.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from kvgate.cards import Card, ObjectMeta
from kvgate.cards.base import CachedObjectFile, close_files
from kvgate.memcopy import MemoryFault
from kvgate.tiers.io import Abandon, CardIo, split_calls
from kvgate.tiers.reads import CardRead

OPEN_CALL_OBJECTS = 256  # objects one open_cached call opens at most


@dataclass(frozen=True)
class _ChunkFailed:
    """A chunk call that failed whole: its error stands for each of its ``n_items`` objects, and
    counts as one strike against the card's health."""

    error: OSError
    n_items: int


class CardChannel:
    """Bulk calls to one card (module docstring).  ``card``: the card as it is now (a reopened card is
    another object); ``note_result``: the card's health, fed once per chunk."""

    def __init__(self, card: Callable[[], Card], io: CardIo,
                 note_result: Callable[[BaseException | None], None]) -> None:
        self._card = card
        self.io = io
        self.note_result = note_result

    async def read(self, items: list[tuple[bytes, memoryview]], urgent: bool = False,
                   own: bool = False) -> list[CardRead]:
        """Read ``(full key, dest)`` pairs, in parallel chunks, each with a deadline.

        ``urgent``: an engine waits on it (``IoPool.run``).  Once this returns
        or raises, no byte of the read lands in any ``dest`` (each chunk's
        guard is abandoned first), however long the card takes.  Raises
        ``MemoryFault`` when a ``dest`` is memory that is gone (a client's
        region shrunk under its mapping): the client's doing, not the card's.
        ``own``: every ``dest`` is the gateway's own memory (``Abandon.own``).
        """
        chunks = split_calls(items, self.io.threads, [len(dest) for _k, dest in items])
        out = await self._chunked([self._read_chunk(chunk, urgent, own) for chunk in chunks])
        fault = next((r for r in out if isinstance(r, MemoryFault)), None)
        if fault is not None:
            raise fault
        return [CardRead.of(r) for r in out]

    async def open_cached(self, fkeys: list[bytes], urgent: bool = False) -> list[CachedObjectFile | None]:
        """Each object's file, open for a client to read itself, where the card lends files and the page
        cache holds the object whole (``Card.open_cached_many``); None for the rest.  Files a call opens
        after its caller stopped waiting are closed as it ends; the caller closes every other."""
        if not self._card().lends_files:
            return [None] * len(fkeys)
        # Opening is a few syscalls and mostly Python: two threads at it fight for the GIL (32 files,
        # benchmarks/card_paths.py "card open": 0.74 ms median on one thread, 1.36 split over two); very
        # large gets still take turns.
        chunks = [fkeys[i : i + OPEN_CALL_OBJECTS] for i in range(0, len(fkeys), OPEN_CALL_OBJECTS)]
        res = await self._chunked([self._open_chunk(chunk, urgent) for chunk in chunks])
        return [r if isinstance(r, CachedObjectFile) else None for r in res]

    async def write(self, items: list[tuple[bytes, memoryview, ObjectMeta]]) -> list[int | BaseException]:
        """Write ``(full key, payload, meta)`` items in parallel chunks: bytes stored, or the error, per item.
        The room on the card is the caller's to have made."""
        chunks = split_calls(items, self.io.threads, [len(payload) for _k, payload, _m in items])
        return await self._chunked([self._write_chunk(chunk) for chunk in chunks])

    async def _chunked(self, chunk_calls: list) -> list:
        """Run the chunk calls at once and feed each one's outcome to the card's health (module docstring)."""
        out = []
        for res in await asyncio.gather(*chunk_calls):
            if isinstance(res, _ChunkFailed):
                self.note_result(res.error)
                out += [res.error] * res.n_items
                continue
            failed = next((r for r in res if isinstance(r, OSError) and not isinstance(r, MemoryFault)), None)
            self.note_result(failed)
            out += res
        return out

    async def _read_chunk(self, chunk: list, urgent: bool, own: bool) -> list | _ChunkFailed:
        # The card reads into its own memory and delivers through the guard,
        # which CardIo.run abandons before it gives up on the call: a read
        # that ends after its deadline writes nothing into the destinations.
        guard = Abandon(own=own)
        try:
            return await self.io.run(self._card().read_many_into, chunk, guard, abandon=guard, urgent=urgent)
        except OSError as e:
            return _ChunkFailed(e, len(chunk))

    async def _open_chunk(self, fkeys: list[bytes], urgent: bool) -> list | _ChunkFailed:
        guard = Abandon(own=True)
        try:
            return await self.io.run(self._card().open_cached_many, fkeys, guard, abandon=guard, urgent=urgent,
                                     late=close_files)
        except OSError as e:
            return _ChunkFailed(e, len(fkeys))

    async def _write_chunk(self, chunk: list) -> list | _ChunkFailed:
        abandon = Abandon()
        try:
            return await self.io.run(self._card().write_many, chunk, abandon, abandon=abandon)
        except OSError as e:
            return _ChunkFailed(e, len(chunk))
