"""Which block each source holds, per medium, fed by vLLM KV events.

A SOURCE is whatever publishes events about blocks it holds:

- an engine (its own events: medium ``GPU``, or ``CPU`` for vLLM's native CPU offloading);
- a gateway, on its configured topic (``kv_events_topic``): its RAM tier, medium ``CPU``;
- a card, on the topic ``"<topic>@card:<serial>"`` of any gateway that mounts it: medium ``STORAGE``.
  One card may be mounted by several gateways; the index keeps its blocks once, under the source
  ``"card:<serial>"``, and learns from the topics each gateway publishes which cards it mounts
  (``mounts(gateway_source)``).

Keys are ``kvgate.routing.hashing.block_key`` of the hashes (the low 64 bits: what vLLM's events carry by
default), so events with int hashes and events with byte hashes meet the router's own hashes.

Memory: one dict per KV group of ``key -> bitmask`` where each (source, medium) pair that has published
is one bit of a Python int; a key is dropped when its last holder drops it.  Measured: 78 bytes a held
block for the dict itself, plus the key's and the mask's ints (about 36 bytes each where not shared):
110-150 bytes a block, so 10 M blocks held across a fleet take 1.1-1.5 GB.

Hybrid models (several KV cache groups, e.g. full attention plus sliding window or Mamba): a source
holds a block in a medium only where it holds it in EVERY group it has published for that medium
(``group_idx``; None counts as group 0).  Each source's groups are learned from its events.

Not thread-safe: the router applies events and scores on one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from kvgate.errors import InvalidArgument
from kvgate.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, \
    BlockStored, EventBatch
from kvgate.routing.hashing import block_key

__all__ = ["CARD_TOPIC_MARK", "KvIndex", "card_source", "MEDIA"]

MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
CARD_TOPIC_MARK = "@card:"


def card_source(serial: str) -> str:
    """The index's source id of the card ``serial`` (shared by every gateway that mounts it)."""
    return f"card:{serial}"


class KvIndex:
    """Block holdings of every source, per medium, with ``apply`` for each event batch.

    Each (source, medium) pair that has published is one bit (``bit(medium, source)``), and one dict per
    KV group maps a block key to the mask of the pairs holding it: the scorer looks each prompt block up
    ONCE for every tier (measured: a dict lookup is ~35-65 ns here, the conversion of a mask the same)."""

    def __init__(self) -> None:
        self._bits: dict[tuple[str, str], int] = {}  # (medium, source id) -> bit number
        self._pairs: list[tuple[str, str]] = []
        self._sources: set[str] = set()
        self._held: dict[int, dict[int, int]] = {}  # KV group -> block key -> mask of holding pairs
        self._seen: dict[int, int] = {}  # KV group -> mask of the pairs that have published that group
        self._mounts: dict[str, set[str]] = {}  # gateway source -> card serials it publishes
        self.block_sizes: dict[str, int] = {}  # source -> the block_size of its first BlockStored (0: unknown)
        self.events_applied = 0
        self.layout_version = 0  # bumped when a pair gets a bit or a gateway a mount: the scorer's cache key
        self._factors: dict[tuple[str, str], int] = {}  # (medium, source) -> GPU blocks per published key

    # ---- sources ----------------------------------------------------------------------

    def bit(self, medium: str, source_id: str) -> int:
        """The bit of ``source_id`` in ``medium`` (assigned on first use, kept for the index's life)."""
        b = self._bits.get((medium, source_id))
        if b is None:
            b = self._bits[(medium, source_id)] = len(self._pairs)
            self._pairs.append((medium, source_id))
            self._sources.add(source_id)
            self.layout_version += 1
        return b

    def bit_of(self, medium: str, source_id: str | None) -> int | None:
        """The bit of ``source_id`` in ``medium``, or None if it never published there."""
        return None if source_id is None else self._bits.get((medium, source_id))

    @property
    def width(self) -> int:
        """How many (source, medium) pairs have a bit: masks fit in this many bits."""
        return len(self._pairs)

    def known(self, source_id: str) -> bool:
        return source_id in self._sources

    @property
    def sources(self) -> list[str]:
        """Every source id that has published, sorted."""
        return sorted(self._sources)

    def mounts(self, gateway_source: str) -> frozenset[str]:
        """Serials of the cards ``gateway_source`` publishes events for (the cards it mounts)."""
        return frozenset(self._mounts.get(gateway_source, ()))

    def set_factor(self, medium: str, source_id: str, factor: int) -> None:
        """``source_id`` publishes one key per chunk of ``factor`` blocks in ``medium``: vLLM's offloading
        (``blocks_per_chunk``) and a kvgate gateway serving it key a chunk by its LAST block's hash
        (``kvgate.routing.hashing.offload_keys``), so a held key at block ``c*factor + factor - 1`` means
        blocks ``c*factor`` .. that one are held.  The scorer reads it that way; 1 (the default) is per block."""
        if factor < 1:
            raise InvalidArgument(f"factor is the blocks per published key, at least 1, got {factor}")
        if self._factors.get((medium, source_id), 1) != factor:
            self._factors[(medium, source_id)] = factor
            self.layout_version += 1

    def factor(self, medium: str, source_id: str) -> int:
        return self._factors.get((medium, source_id), 1)

    def factor_masks(self) -> dict[int, int]:
        """factor -> mask of the (source, medium) pairs publishing chunks of that many blocks (factor > 1)."""
        out: dict[int, int] = {}
        for pair, f in self._factors.items():
            b = self._bits.get(pair)
            if f > 1 and b is not None:
                out[f] = out.get(f, 0) | 1 << b
        return out

    # ---- events -----------------------------------------------------------------------

    @staticmethod
    def resolve(source_id: str, topic: str) -> tuple[str, str | None]:
        """(the source a batch on ``topic`` from ``source_id`` is about, the medium it forces or None);
        changes nothing (``source_of`` also records the mount)."""
        mark = topic.find(CARD_TOPIC_MARK)
        if mark < 0:
            return source_id, None
        return card_source(topic[mark + len(CARD_TOPIC_MARK):]), MEDIUM_STORAGE

    def source_of(self, source_id: str, topic: str) -> tuple[str, str | None]:
        """``resolve``, recording that ``source_id`` mounts the card a card topic names."""
        mark = topic.find(CARD_TOPIC_MARK)
        if mark < 0:
            return source_id, None
        serial = topic[mark + len(CARD_TOPIC_MARK):]
        mounted = self._mounts.setdefault(source_id, set())
        if serial not in mounted:
            mounted.add(serial)
            self.layout_version += 1
        return card_source(serial), MEDIUM_STORAGE

    def apply(self, source_id: str, topic: str, batch: EventBatch) -> None:
        """Apply one batch published by ``source_id`` on ``topic``: BlockStored adds the blocks, BlockRemoved
        drops them (in their medium and group), AllBlocksCleared drops all the source holds.

        A batch on ``"<topic>@card:<serial>"`` is about the card (medium STORAGE whatever the event says) and
        records that ``source_id`` mounts it.  An event without a medium counts as GPU (vLLM's default)."""
        src, forced = self.source_of(source_id, topic)
        self._sources.add(src)
        for ev in batch.events:
            self.events_applied += 1
            if isinstance(ev, BlockStored):
                if src not in self.block_sizes and ev.block_size:
                    self.block_sizes[src] = ev.block_size
                medium = forced or ev.medium or MEDIUM_GPU
                self._store(1 << self.bit(medium, src), ev.group_idx or 0, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                b = self.bit_of(forced or ev.medium or MEDIUM_GPU, src)
                if b is not None:
                    self._remove(1 << b, ev.group_idx or 0, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(src)

    @staticmethod
    def _keys(hashes: Sequence[bytes | int]) -> Iterable[int]:
        # vLLM sends ints by default (already the low 64 bits, unsigned in msgpack): kept as they are
        return [h if type(h) is int else block_key(h) for h in hashes]

    def _store(self, mask: int, group: int, hashes: Sequence[bytes | int]) -> None:
        self._seen[group] = self._seen.get(group, 0) | mask
        held = self._held.setdefault(group, {})
        get = held.get
        for k in self._keys(hashes):
            held[k] = get(k, 0) | mask

    def _remove(self, mask: int, group: int, hashes: Sequence[bytes | int]) -> None:
        held = self._held.get(group)
        if held is None:
            return
        keep = ~mask
        for k in self._keys(hashes):
            m = held.get(k)
            if m is None:
                continue
            m &= keep
            if m:
                held[k] = m
            else:
                del held[k]

    def clear(self, source_id: str) -> None:
        """Drop every block ``source_id`` holds, in every medium (AllBlocksCleared; before a resync).

        A scan of every held block: O(blocks held), for a rare event."""
        mask = 0
        for (_medium, src), b in self._bits.items():
            if src == source_id:
                mask |= 1 << b
        if not mask:
            return
        keep = ~mask
        for held in self._held.values():
            dead = []
            for k, m in held.items():
                if m & mask:
                    m &= keep
                    if m:
                        held[k] = m
                    else:
                        dead.append(k)
            for k in dead:
                del held[k]
        for g in self._seen:
            self._seen[g] &= keep

    # ---- queries ----------------------------------------------------------------------

    def holders(self, key: int) -> int:
        """Mask of the (source, medium) pairs holding block ``key``, in every KV group each has published."""
        if len(self._held) <= 1:
            for held in self._held.values():
                return held.get(key, 0)
            return 0
        out = -1
        anyone = 0
        for g, held in self._held.items():
            m = held.get(key, 0)
            anyone |= m
            out &= m | ~self._seen[g]  # a pair that never published group g is not held back by it
        return out & anyone

    def holder_masks(self, keys: Sequence[int]) -> list[int]:
        """``holders(k)`` for each of ``keys`` (one dict lookup each when there is one KV group)."""
        if not self._held:
            return [0] * len(keys)
        if len(self._held) == 1:
            (held,) = self._held.values()
            return list(map(held.get, keys, repeat(0)))
        # several groups (a hybrid model): one lookup pass per group, then the rule of ``holders``
        out = [-1] * len(keys)
        anyone = [0] * len(keys)
        for g, held in self._held.items():
            unseen = ~self._seen[g]
            got = list(map(held.get, keys, repeat(0)))
            out = [o & (m | unseen) for o, m in zip(out, got)]
            anyone = [a | m for a, m in zip(anyone, got)]
        return [o & a for o, a in zip(out, anyone)]

    def holds(self, source_id: str, medium: str, block_hash: bytes | int) -> bool:
        """Whether ``source_id`` holds the block in ``medium``."""
        b = self.bit_of(medium, source_id)
        return b is not None and bool(self.holders(block_key(block_hash)) >> b & 1)

    def count(self, source_id: str, medium: str) -> int:
        """Blocks ``source_id`` holds in ``medium`` (a scan: for tests, /metrics, not the request path)."""
        b = self.bit_of(medium, source_id)
        if b is None:
            return 0
        keys: set[int] = set()
        for held in self._held.values():
            keys.update(k for k, m in held.items() if m >> b & 1)
        return sum(1 for k in keys if self.holders(k) >> b & 1)

    def __len__(self) -> int:
        """Held (block, KV group) entries: the index's size."""
        return sum(len(h) for h in self._held.values())
