"""One contract for every tier of the store: the RAM tier, the cards, and any tier added after them.

``TieredStore`` keeps its tiers in a list, fastest first (``TieredStore.tiers``),
and asks them by one rule, the same for lookup, exists, get, prewarm and
delete:

- a key is *present* when some tier holds it, and is read from the first
  tier that holds it; a read that finds it gone there (evicted meanwhile)
  falls through to the tiers after it;
- each tier first says what it knows without I/O (``known``: present,
  absent, or unknown until its medium is asked); only keys no tier knows
  present are asked of a medium (``find``, ``probe_prefix``), in tier order;
- with ``ttl``, an object older than that is a miss in every tier.

Who calls what: only the store, on the gateway's event loop.  Plain methods
(``known``, ``status``) are bookkeeping: no I/O, no copies, no waits.
Coroutines run their copies and I/O in the store's ``IoPool`` threads and
keep the loop free meanwhile.  A tier never calls another tier: what crosses
tiers (a put written through from the RAM copy, a prewarm reading a card
object into RAM) is the store's.

Changes: every tier notes what it stores and drops in the store's
``TierChanges`` (``kvgate.tiers.events``) under its own tier names (the RAM
tier ``"ram"``, each card its serial), and lists what it holds now with
``held_keys``: together, what a gateway publishes as KV events.

Holds (``kvgate.tiers.holds``) are the store's, one set for all tiers: a
tier that keeps the last copy of an object (the cards) does not evict one
that a session holds.

Lending is a capability, not part of the contract: a tier that can hand a
reply its bytes without a copy offers it (``RamTier.lend``: its pages;
``CardTier.lend_files``: open files in the page cache), and the store says
which it uses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.tiers.counters import TierCounters
from kvgate.types import Retention

# ``Known.state`` per key
PRESENT, UNKNOWN, ABSENT = 1, 0, -1

# ``Tier.medium``: as vLLM's KV events name where a block is
CPU, STORAGE = "CPU", "STORAGE"


@dataclass(slots=True)
class PutItem:
    fkey: bytes
    src: memoryview
    meta: ObjectMeta
    # src lies in a client's shared region (which it may write again once answered), not in a buffer of ours
    in_region: bool = False


@dataclass(slots=True)
class GetItem:
    fkey: bytes
    dialog: bytes
    dest: memoryview


@dataclass(slots=True)
class Known:
    """What a tier knows of a request's keys without I/O (``Tier.known``).

    ``state``: int8 per key, ``PRESENT``, ``UNKNOWN`` (only its medium can
    tell) or ``ABSENT``.  ``detail``: the tier's own notes on where each key
    is, handed back to its ``probe_prefix`` and ``prepare`` so that they do
    not look again.
    """

    state: np.ndarray
    detail: object = None


@runtime_checkable
class Tier(Protocol):
    """A tier of the store (the module's contract).

    ``name``: how status and logs call it.  ``medium``: ``CPU`` or
    ``STORAGE``, as KV events publish it.  ``keeps``: the retentions whose
    puts it stores (the RAM tier ``short`` and ``long``, the cards ``long``,
    a tier that only serves reads none).  ``probes``: whether it may hold
    keys ``known`` cannot tell of (a card's objects not indexed yet), so
    that a get reads from it every key the tiers before it lack.
    ``promote``: what it serves is copied into the front tier (a peer's
    objects: the engine's next load of them is then local).
    ``counters``: its gets, hits, misses and bytes (``TierCounters``).
    """

    name: str
    medium: str
    keeps: frozenset[Retention]
    probes: bool
    promote: bool
    counters: TierCounters

    def known(self, fkeys: list[bytes], dialog: bytes) -> Known:
        """What it knows of each key without I/O; never waits (a lookup of 1,000s of keys runs on every
        engine step)."""

    async def find(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        """Whether it holds each key, asking its medium where ``known`` cannot tell."""

    async def probe_prefix(self, fkeys: list[bytes], dialog: bytes, known: Known, start: int, end: int,
                           urgent: bool = False) -> int:
        """How many of the keys ``start:end`` in a row (all ``UNKNOWN`` in ``known``) its medium holds."""

    def prepare(self, fkeys: list[bytes], known: Known, present: np.ndarray, urgent: bool = False) -> None:
        """A lookup found the keys of mask ``present`` in this tier: ready them for the read that follows
        (a card hints its reads), or nothing."""

    async def read_into(self, items: list[GetItem], urgent: bool = False, own: bool = False, gets: bool = True,
                        ) -> tuple[list[int], list[int], list[ObjectMeta | None]]:
        """Fill each item's dest with its object: ``(sizes, needed, metas)``, per item a size or
        ``SizeCode.MISS`` (not here: the store asks the next tier) or ``SizeCode.TOO_SMALL`` with the size
        ``needed``, and the meta of each object read.  Counts what it reads in ``counters``: as gets, hits
        and misses unless ``gets`` is False (a prewarm: only the bytes read).  ``urgent``: an engine on
        this host waits on it; ``own``: every dest is the gateway's own memory."""

    async def write(self, items: list[PutItem], retention: Retention,
                    sources: dict[int, memoryview] | None = None) -> list[bool]:
        """Store items (a retention it ``keeps``); True per item stored and still held when it answers.
        ``sources``: by ``id(item)``, a copy of the item's bytes the gateway owns, to write from instead
        of the client's."""

    def sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """Each key's payload size where this tier knows it without I/O, else None."""

    async def find_sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """``sizes``, asking its medium for the keys it cannot tell of without I/O; None: not here."""

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        """Delete the keys wherever this tier could answer them from; how many objects were there."""

    async def clean(self) -> int:
        """Drop everything; how many objects it held."""

    async def clean_namespace(self, ns: bytes) -> int:
        """Drop every object of namespace ``ns`` (its encoded form), letting the loop go between batches."""

    def held_keys(self, chunk: int) -> AsyncIterator[tuple[str, list[bytes]]]:
        """What it holds now, as ``(tier name for events, full keys)`` of at most ``chunk`` keys, the loop
        let go between chunks."""

    def status(self) -> dict:
        """Its part of the gateway's status."""
