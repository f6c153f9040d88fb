"""What each namespace holds and reads: objects and bytes per tier, reads, hits and writes.

Several engines share one cache through their namespaces (a vLLM, an SGLang
and an LMCache deployment on the same cards each have their own); an
operator wants to see which of them holds the space and which gets the
hits.  ``NamespaceUsage`` keeps those figures for ``kvgate stat``, the
``stats`` op and ``/metrics``.

Bounded: namespaces are whatever clients send, so at most ``MAX_ROWS`` get a
row of their own, in the order they are first seen; later ones share the
row ``OTHER``.  A namespace keeps its row for the life of the gateway (a row
freed and given to another namespace would take over objects the first one
still holds), so the figures of every row always add up.

Loop only, like the tiers that call it: no locks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Final

MAX_ROWS: Final = 256
OTHER: Final = "(other namespaces)"


@dataclass(slots=True)
class NamespaceRow:
    ram_objects: int = 0
    ram_bytes: int = 0  # payload bytes in the RAM tier
    card_objects: int = 0
    card_bytes: int = 0  # bytes on cards, headers included (as the cards count them)
    gets: int = 0  # objects asked for by get
    hits: int = 0  # objects get returned
    bytes_read: int = 0
    sets: int = 0  # objects stored by put
    bytes_written: int = 0


def namespace_of(full_key: bytes) -> bytes:
    """The namespace part of a full key (``keys.full_key``: a length byte, the namespace, the key)."""
    return full_key[1 : 1 + full_key[0]]


class NamespaceUsage:
    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self._rows: dict[bytes, NamespaceRow] = {}
        self._other = NamespaceRow()

    def row(self, full_key: bytes) -> NamespaceRow:
        return self.namespace_row(namespace_of(full_key))

    def namespace_row(self, ns: bytes) -> NamespaceRow:
        r = self._rows.get(ns)
        if r is None:
            if len(self._rows) >= self.max_rows:
                return self._other
            r = self._rows[ns] = NamespaceRow()
        return r

    def ram(self, full_key: bytes, nbytes: int, objects: int) -> None:
        """An object entered (objects=1) or left (objects=-1, nbytes negative) the RAM tier."""
        r = self.row(full_key)
        r.ram_objects += objects
        r.ram_bytes += nbytes

    def card(self, full_key: bytes, nbytes: int, objects: int) -> None:
        """An object entered or left a card's index."""
        self.card_namespace(namespace_of(full_key), nbytes, objects)

    def card_namespace(self, ns: bytes, nbytes: int, objects: int) -> None:
        """Objects of namespace ``ns`` entered or left a card's index (a card index keeps namespaces, not keys)."""
        r = self.namespace_row(ns)
        r.card_objects += objects
        r.card_bytes += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per namespace (decoded for display), its figures; ``OTHER`` once some namespaces have no row."""
        out = {ns.decode("utf-8", "backslashreplace"): asdict(r) for ns, r in self._rows.items()}
        if len(self._rows) >= self.max_rows:
            out[OTHER] = asdict(self._other)
        return out
