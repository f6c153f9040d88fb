"""KV event feeds: one ``kvgate.kvevents.subscriber.Subscriber`` per publisher (an engine, a gateway),
applied to a ``KvIndex``.

Resync: the subscriber catches up a gap through the publisher's replay socket, and on joining (and after
a publisher restart) asks for a snapshot: a kvgate gateway answers with ``AllBlocksCleared`` then
everything it holds, so a restarted router rebuilds its view of each gateway in the time the snapshot
takes to stream (seconds for a million blocks); a vLLM engine has no snapshot (it answers the end
marker) and its view fills from its live events.

Threads: each subscriber polls on a daemon thread of its own (a snapshot's decode must not stall the
router's event loop).  With ``loop`` the batches are handed to that asyncio loop
(``call_soon_threadsafe``) and applied there, the loop that scores: the index is never touched from two
threads.  Without a loop, ``poll()`` reads and applies on the caller's thread (tests, tools).

Checks on every BlockStored of a source: a GPU ``block_size`` other than the router's (``block_size``
setting) means the source's hashes can never match the router's: the feed is REFUSED, loudly (an error
log naming the setting and both values), its blocks are dropped from the index and its later events
ignored; ``Feeds.refused`` (source -> reason) is what /health and /metrics show.  In CPU or STORAGE a
multiple of the router's block size is an offloaded chunk keyed by its last block's hash (a kvgate
gateway declares its keys' tokens so): the index is told the factor (``KvIndex.set_factor``); another
size is refused.  A block size of 0 is "not said" (vLLM's offloading connector sends 0: give ``add`` the
engine's ``offload_factor``) and passes.

The hash algorithm and seed (``prefix_caching_hash_algo``, PYTHONHASHSEED) are not fields of an event,
and vLLM shows its seed nowhere; but a GPU ``BlockStored`` of a prompt's first block (no parent, no extra
keys) carries the block's token ids, so with ``hasher`` (the router's ``BlockHasher``) the feed hashes
them as the router would and refuses a source whose hash differs: an engine started with another seed or
algorithm is refused, named, on the first new prompt it caches, stated or not (about 3 us a check).  The
front also checks what the engine reports or the operator states
(``kvgate.routing.endpoints.compare_settings``) and passes a refusal to ``Feeds.refuse``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.errors import InvalidArgument
from kvgate.kvevents.subscriber import Delivered, Subscriber
from kvgate.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU, BlockStored, EventBatch
from kvgate.routing.hashing import DEFAULT_NONE_HASH_SEED, BlockHasher, block_key
from kvgate.routing.index import KvIndex

__all__ = ["Feed", "Feeds"]

log = logging.getLogger(__name__)


@dataclass
class Feed:
    """One publisher's feed: ``source`` (the index source id its events are applied under), its PUB and
    replay addresses, and what it has done: batches and events applied, the last seq, ``refused``."""

    source: str
    endpoint: str
    replay_endpoint: str | None = None
    topics: tuple[str, ...] | None = None
    batches: int = 0
    events: int = 0
    last_seq: int | None = None
    refused: str | None = None
    hashes_checked: int = 0  # first blocks hashed as the router does, and found equal
    subscriber: Subscriber | None = field(default=None, repr=False)

    def stats(self) -> dict[str, object]:
        sub = self.subscriber.stats if self.subscriber is not None else {}
        return {"source": self.source, "endpoint": self.endpoint, "batches": self.batches, "events": self.events,
                "last_seq": self.last_seq, "refused": self.refused,
                "hashes_checked": self.hashes_checked, **sub}


class Feeds:
    """The router's feeds into ``index``.  ``block_size``: the router's (the hasher's); ``loop``: the
    asyncio loop that owns the index (None: apply on the thread that calls ``poll``); ``hasher``: the
    router's, to check the engines' first-block hashes (None: not checked); used on the thread that
    applies, as the router's own use of it is (it is not thread-safe)."""

    def __init__(self, index: KvIndex, block_size: int, loop: asyncio.AbstractEventLoop | None = None,
                 hasher: BlockHasher | None = None) -> None:
        if hasher is not None and hasher.block_size != block_size:
            raise InvalidArgument(f"Feeds: the hasher's block size {hasher.block_size} is not {block_size}")
        self.index = index
        self.block_size = block_size
        self.loop = loop
        self.hasher = hasher
        self.feeds: dict[str, Feed] = {}

    def add(self, source: str, endpoint: str, replay_endpoint: str | None = None,
            topics: Sequence[str] | None = None, offload_factor: int = 1, **subscriber_options: object) -> Feed:
        """Subscribe to ``endpoint`` (and its replay socket) and apply what it publishes under ``source``;
        with a loop, the subscriber's thread starts now.  ``offload_factor``: an engine's vLLM offloading
        ``block_size`` factor (GPU blocks per CPU key; its events say 0 tokens, so it must be told).
        ``subscriber_options`` go to ``Subscriber``."""
        if source in self.feeds:
            raise InvalidArgument(f"a feed for source {source!r} exists already ({self.feeds[source].endpoint})")
        feed = Feed(source, endpoint, replay_endpoint, None if topics is None else tuple(topics))
        if offload_factor != 1:
            self.index.set_factor(MEDIUM_CPU, source, offload_factor)
        feed.subscriber = Subscriber(endpoint, replay_endpoint, topics, **subscriber_options)  # type: ignore[arg-type]
        self.feeds[source] = feed
        if self.loop is not None:
            loop = self.loop
            feed.subscriber.start_thread(lambda got: loop.call_soon_threadsafe(self.apply, feed, got),
                                         name=f"kvgate-router-feed-{source}")
        return feed

    def poll(self, timeout: float = 0.1) -> int:
        """Without a loop: read every feed once (``timeout`` each) and apply; the batches applied."""
        n = 0
        for feed in list(self.feeds.values()):
            if feed.subscriber is not None:
                got = feed.subscriber.poll(timeout)
                self.apply(feed, got)
                n += len(got)
        return n

    def apply(self, feed: Feed, delivered: list[Delivered]) -> None:
        """Apply ``delivered`` batches of ``feed`` to the index (after the block-size check)."""
        for topic, seq, batch in delivered:
            feed.last_seq = seq
            if feed.refused is not None:
                continue
            reason = self._check(feed, topic, batch)
            if reason is not None:
                self.refuse(feed.source, reason)
                continue
            self.index.apply(feed.source, topic, batch)
            feed.batches += 1
            feed.events += len(batch.events)

    def _check(self, feed: Feed, topic: str, batch: EventBatch) -> str | None:
        source, forced = self.index.resolve(feed.source, topic)
        for ev in batch.events:
            if not isinstance(ev, BlockStored) or not ev.block_size:
                continue
            if ev.block_size == self.block_size:
                if forced is None and (ev.medium or MEDIUM_GPU) == MEDIUM_GPU:
                    reason = self._check_hash(feed, ev)
                    if reason is not None:
                        return reason
                continue
            medium = forced or ev.medium or MEDIUM_GPU
            if medium != MEDIUM_GPU and ev.block_size % self.block_size == 0:
                # an offloaded chunk of several blocks, keyed by its last block's hash
                self.index.set_factor(medium, source, ev.block_size // self.block_size)
                continue
            return (f"KV events of {feed.source} ({feed.endpoint}) are for {medium} blocks of {ev.block_size} "
                    f"tokens, the router hashes blocks of {self.block_size} (setting block_size): their block "
                    f"hashes can never match; run the router with block_size {ev.block_size} or the engine with "
                    f"--block-size {self.block_size}")
        return None

    def _check_hash(self, feed: Feed, ev: BlockStored) -> str | None:
        """A prompt's first block (no parent, no LoRA, no extra keys: what ``BlockHasher`` reproduces)
        hashed as the router does; a mismatch names the router's settings and what to change."""
        h = self.hasher
        if (h is None or ev.parent_block_hash is not None or not ev.block_hashes or ev.lora_id is not None
                or ev.lora_name is not None or len(ev.token_ids) < h.block_size
                or (ev.extra_keys and any(k for k in ev.extra_keys))):
            return None
        if h.keys(ev.token_ids[:h.block_size])[0] == block_key(ev.block_hashes[0]):
            feed.hashes_checked += 1
            return None
        seed = "none" if h.seed == DEFAULT_NONE_HASH_SEED else repr(h.seed)
        return (f"KV events of {feed.source} ({feed.endpoint}) hash a prompt's first block otherwise than the "
                f"router (hash_algo {h.algo}, hash_seed {seed}): the engine runs with another "
                f"--prefix-caching-hash-algo or PYTHONHASHSEED, so its blocks can never match; start it with the "
                f"router's or give the router the engine's (hash_algo, hash_seed)")

    def refuse(self, source: str, reason: str) -> None:
        """Stop counting ``source``: its blocks leave the index and its later events are ignored (a
        settings mismatch the front found, or the block-size check).  Logged as an error once."""
        feed = self.feeds.get(source)
        if feed is not None:
            if feed.refused is not None:
                return
            feed.refused = reason
        log.error("router: refused %s: %s", source, reason)
        self.index.clear(source)

    @property
    def refused(self) -> dict[str, str]:
        """Source -> why it is refused, for /health and /metrics."""
        return {s: f.refused for s, f in self.feeds.items() if f.refused is not None}

    def close(self) -> None:
        """Stop every subscriber (their threads end within about 0.1 s)."""
        for feed in self.feeds.values():
            if feed.subscriber is not None:
                feed.subscriber.close()
                feed.subscriber = None
