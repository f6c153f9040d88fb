"""What one card holds, as far as this gateway knows: full key -> size and age.

Owned by one ``ManagedCard``, used on the event loop only (no locks); it
does no I/O.  It answers lookups without touching the card; the object's own
header is what a read trusts, never an entry here.  Entries come from this
gateway's writes and from the card's scan at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvgate.tiers.usage import NamespaceUsage


@dataclass(slots=True)
class IndexEntry:
    stored_bytes: int
    payload_len: int
    created_ns: int
    dialog: bytes  # the object's dialog mark: where placement puts it, should the card set change
    expiring: bool = False  # past the ttl: a miss, its delete is under way


class CardIndex:
    """Entries by full key and the bytes they take on the card (``used``).

    Every entry added or removed is counted in ``usage`` (per namespace), so
    the namespaces' card figures always add up to what the indexes hold.
    ``get`` is the dict's own: lookups call it for 1,000s of keys a step.
    """

    def __init__(self, usage: NamespaceUsage) -> None:
        self._entries: dict[bytes, IndexEntry] = {}
        self.usage = usage
        self.used = 0
        self.get = self._entries.get

    def put(self, fkey: bytes, entry: IndexEntry) -> IndexEntry | None:
        """Index ``entry`` under ``fkey``; returns the entry it replaced."""
        old = self.pop(fkey)
        self._entries[fkey] = entry
        self.used += entry.stored_bytes
        self.usage.card(fkey, entry.stored_bytes, 1)
        return old

    def pop(self, fkey: bytes) -> IndexEntry | None:
        entry = self._entries.pop(fkey, None)
        if entry is not None:
            self.used -= entry.stored_bytes
            self.usage.card(fkey, -entry.stored_bytes, -1)
        return entry

    def clear(self) -> None:
        for fkey, entry in self._entries.items():
            self.usage.card(fkey, -entry.stored_bytes, -1)
        self._entries.clear()
        self.used = 0

    def __contains__(self, fkey: object) -> bool:
        return fkey in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[bytes, IndexEntry]]:
        return iter(self._entries.items())
