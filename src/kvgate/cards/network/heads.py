"""A network card's heads list: its served directory card's, reached by one ``MergeHeads`` request (``HeadsChannel``)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from kvgate.cards.heads import HeadsChannel
from kvgate.cards.network import wire as w


class NetworkHeads(HeadsChannel):
    """``merge`` as one request on the calling thread's connection of the card (``call``: ``NetworkCard._call``).

    The server merges into the directory card it serves
    (``DirectoryHeads``, the same ``kvgate-heads`` file a gateway on that
    host would use) and answers with the whole list; it refuses a request
    of more than ``wire.MAX_HEADS`` ids.
    """

    def __init__(self, call: Callable[..., tuple[Any, bytes]]) -> None:
        self._call = call

    def merge(self, ids: Collection[int]) -> set[int]:
        return set(self._call(w.MergeHeads(list(ids)), max_body=0)[0])
