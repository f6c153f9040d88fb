"""The side channel through which gateways share their shared heads (``kvgate.heads``) on a card.

It is no part of the ``Card`` interface: a card that keeps a heads list
offers a ``HeadsChannel`` as its ``heads`` attribute (``None`` on a card
that keeps none), and only the gateway's head sync
(``kvgate.gateway.headsync``) and the card server, serving a remote
gateway's ``MergeHeads`` message, use it.  Each kind's channel lives in
its own package (``kvgate.cards.directory.heads``,
``kvgate.cards.redis.heads``, ``kvgate.cards.network.heads``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection


class HeadsChannel(ABC):
    """A card's list of shared heads, the union of what every gateway on the card added.

    Contract:
    - Callers: ``HeadSync`` once a sync period (``PERIOD_S``, 2 s) and once
      before the gateway listens, on the card's I/O threads (``CardIo.run``,
      under the card's ``io_timeout_ms`` deadline), never on the event loop;
      and the card server, on the thread of the connection that asked.
    - Safe to call from several threads and processes at once, on other
      hosts too: no call loses what a concurrent one adds.  Ids go only
      past the bound below, or with a write a crash cut short.
    - It blocks on the card's medium and nothing else: a directory card's
      file I/O and a ``flock`` of its heads file (another gateway holds it
      only while it reads and writes the list; neither is bounded here), a
      Redis card's round trips and a network card's request (each bounded
      by the card's ``io_timeout_ms``).  A caller that stops waiting leaves
      the call to finish on its thread; an append lands whole or, after a
      crash, as a torn tail that later calls drop.
    - Failures are the card's ``OSError`` (a Redis or network card that
      cannot be reached: ``CardUnavailable``), never a partial answer.
    - The list is stored on the medium exactly as cards stored it before
      this channel had its name (a directory card's ``kvgate-heads`` file of
      little-endian u64s, oldest first; a Redis card's set ``kvgate:heads``
      of 8-byte little-endian members, behind the card's hash tag if it has
      one; a network card's is its served directory card's), so a card
      written by an earlier kvgate keeps its heads and the other way round.
    """

    @abstractmethod
    def merge(self, ids: Collection[int]) -> set[int]:
        """Add ``ids`` (u64s) to the card's list; the whole list after that.

        Every gateway on the card adds what it learned and reads what the
        others did, so they all compute the same dialog marks.  The list
        keeps at most ``kvgate.heads.CARD_MAX_HEADS`` ids: past that, the
        ones it has held longest (or, where it keeps no order, any) go.  With
        no ``ids`` this only reads (an empty set if there is none).
        """
