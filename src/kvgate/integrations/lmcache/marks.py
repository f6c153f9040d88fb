"""Which dialog each LMCache chunk belongs to, and its place in its prompt: learned at lookups.

LMCache tells an L2 adapter nothing about requests, but a lookup carries
every chunk key of one request, one row per (object group, kv rank), each
row in chunk order from the prompt's first chunk (LMCache's
``GroupedObjectKeys``: ``keys[i]`` covers chunk ``i``).  A store comes later,
once the engine has computed what the lookup missed, in batches of whatever
L1 finished writing, with no order or request to go by.  So the adapter asks
the gateway for the request's ``DialogMark`` at its lookup (one call per
prompt lead, cached: ``MarkCache``) and remembers each chunk's dialog and
position here; a store places each chunk by what was remembered.  Rows of one
request share their chunk hashes, so one entry serves every kv rank and
object group, and they all land on the conversation's card.

A chunk never looked up, or looked up so long ago that it was forgotten (at
most ``SIZE`` chunks are remembered), is stored without a dialog, as by a
gateway without marks: placed by its key, evicted alone.  A mark only
decides placement and eviction order, never which bytes a key names.
Imports no LMCache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvgate.client import DialogMark

SIZE = 1 << 16  # chunks remembered between a lookup and its store (about 210 bytes each: 13 MiB in all)

#: (indices into the batch, dialog, position of the first): keys one put can carry
Run = tuple[list[int], "bytes | None", int]


class ChunkMarks:
    """Chunk key -> (dialog, position), from lookups, for the stores after them.  Thread-safe: the
    lookup thread notes, the store thread reads."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self._at: OrderedDict[bytes, tuple[bytes | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._at)

    def note(self, row: list[bytes], dm: DialogMark) -> None:
        """``row``: one request's chunk keys from its first chunk on; ``dm``: its mark."""
        entries = [(k, (dm.dialog_at(i), i)) for i, k in enumerate(row)]
        with self._lock:
            at = self._at
            for k, v in entries:
                at[k] = v
                at.move_to_end(k)
            while len(at) > self.size:
                at.popitem(last=False)

    def runs(self, keys: list[bytes]) -> list[Run]:
        """``keys`` cut into runs one put can carry: consecutive positions of one dialog, in the batch's
        order; keys with nothing remembered form runs of their own (dialog None, position -1)."""
        with self._lock:
            found = [self._at.get(k) for k in keys]
        out: list[Run] = []
        for i, f in enumerate(found):
            dialog, position = f if f is not None else (None, -1)
            if out:
                idx, d, p = out[-1]
                if d == dialog and (position == -1 == p or (p >= 0 and position == p + len(idx))):
                    idx.append(i)
                    continue
            out.append(([i], dialog, position))
        return out

    def by_dialog(self, keys: list[bytes]) -> dict[bytes | None, list[int]]:
        """Indices of ``keys`` by remembered dialog (None: nothing remembered), for calls that take no position."""
        with self._lock:
            found = [self._at.get(k) for k in keys]
        out: dict[bytes | None, list[int]] = {}
        for i, f in enumerate(found):
            out.setdefault(f[0] if f is not None else None, []).append(i)
        return out
