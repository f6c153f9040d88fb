"""Feeds: a real EventPublisher's batches reach the KvIndex through a Subscriber; a source whose block
size differs from the router's is refused, named, and kept out of the index."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

from kvgate.errors import InvalidArgument
from kvgate.kvevents.publisher import EventPublisher
from kvgate.kvevents.wire import BlockStored
from kvgate.routing.feeds import Feeds
from kvgate.routing.hashing import BlockHasher
from kvgate.routing.index import KvIndex, card_source

HASHES = BlockHasher("sha256", 16, seed="0").hashes(list(range(16 * 10)))


def stored(hashes, medium="GPU", block_size=16) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)


def _until(cond, feeds: Feeds | None = None, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        if feeds is not None:
            feeds.poll(0.05)
        else:
            time.sleep(0.02)


def test_a_gateways_ram_and_card_topics_reach_the_index(tmp_path) -> None:
    pub = EventPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    pub.start()
    idx = KvIndex()
    feeds = Feeds(idx, 16)
    try:
        feed = feeds.add("gw-1", pub.endpoint, pub.replay_endpoint)
        feeds.poll(0.2)  # joined (the subscriber asks a snapshot first)
        time.sleep(0.3)  # SUB's subscription reaches the PUB socket
        pub.publish("kvgate", [stored(HASHES[:4], "CPU")])
        pub.publish("kvgate@card:S9", [stored(HASHES[:7], "STORAGE")])
        pub.publish("kvgate@card:S10", [stored(HASHES[3:10:4], "STORAGE", block_size=64)])  # chunks of 4
        _until(lambda: idx.count(card_source("S10"), "STORAGE") == 2, feeds)
        assert idx.count(card_source("S9"), "STORAGE") == 7 and idx.factor("STORAGE", card_source("S10")) == 4
        assert idx.count("gw-1", "CPU") == 4 and idx.mounts("gw-1") == {"S9", "S10"}
        assert feed.batches == 3 and feed.refused is None and feeds.refused == {}
        with pytest.raises(InvalidArgument, match="exists already"):
            feeds.add("gw-1", pub.endpoint)
    finally:
        feeds.close()
        pub.close()


def test_a_source_of_another_block_size_is_refused_loudly(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    pub = EventPublisher(f"ipc://{tmp_path}/pub", None)
    pub.start()
    idx = KvIndex()

    async def main() -> None:
        feeds = Feeds(idx, 16, loop=asyncio.get_running_loop())
        try:
            feeds.add("engine-7", pub.endpoint)
            await asyncio.sleep(0.4)
            pub.publish("", [stored(HASHES[:3], block_size=0)])  # 0: not said (offloading events) passes
            pub.publish("", [stored(HASHES[:5], block_size=32)])
            pub.publish("", [stored(HASHES[:8])])  # ignored once refused
            end = time.monotonic() + 10
            while "engine-7" not in feeds.refused or feeds.feeds["engine-7"].last_seq != 3:
                assert time.monotonic() < end, "timed out"
                await asyncio.sleep(0.02)
            reason = feeds.refused["engine-7"]
            assert "GPU blocks of 32 tokens" in reason and "blocks of 16" in reason and "block_size" in reason
            assert idx.count("engine-7", "GPU") == 0  # what it had sent before left the index
        finally:
            feeds.close()

    with caplog.at_level(logging.ERROR, logger="kvgate.routing.feeds"):
        asyncio.run(main())
    pub.close()
    assert any("refused engine-7" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_restarted_router_rebuilds_its_view_of_a_real_gateway_within_10_s(gateway_factory) -> None:
    """The issue's bar: a router restarted with a gateway full of blocks routes as well as before within
    10 s. The gateway's RAM tier and its card hold 20,000 vLLM-form keys (4 prompts of 5,000 blocks); a
    first router view and a second one joined from nothing (a new Feeds, as after a restart) score every
    prompt the same, the second within 10 s of joining."""
    from kvgate.bench.processes import free_port
    from kvgate.routing.score import Endpoint, Scorer

    pub, rep = free_port(), free_port()
    gw = gateway_factory(["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                          "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}", "--card-capacity", "1G"])
    prompts = [BlockHasher("sha256", 16, seed=str(p)).hashes(list(range(16 * 5000))) for p in range(4)]
    with gw.client("v", block_keys="vllm", block_size=16) as c:
        for hs in prompts:
            for i in range(0, len(hs), 1000):
                keys = [h + (0).to_bytes(4, "big") for h in hs[i:i + 1000]]
                c.put_many(keys, [b"kv"] * len(keys))
    in_ram = gw.stats()["tiers"]["ram"]["objects"]  # the RAM tier keeps the latest (a page each)
    endpoint = [Endpoint("e1", gateway="gw-1")]
    partial = BlockHasher("sha256", 16, seed="9").hashes(list(range(16 * 30)))  # held by no one

    def view() -> tuple[KvIndex, Feeds, float]:
        idx = KvIndex()
        feeds = Feeds(idx, 16)
        t0 = time.monotonic()
        feeds.add("gw-1", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
        card = lambda: sum(idx.count(card_source(s), "STORAGE") for s in idx.mounts("gw-1"))  # noqa: E731
        _until(lambda: (idx.count("gw-1", "CPU"), card()) == (in_ram, 20_000), feeds, timeout=30)
        feeds.poll(0.3)
        return idx, feeds, time.monotonic() - t0

    first, feeds1, _ = view()
    before = [Scorer(first).score(hs, endpoint)[0] for hs in prompts + [partial]]
    feeds1.close()  # the router goes away; a new one joins the same gateway
    second, feeds2, took = view()
    try:
        after = [Scorer(second).score(hs, endpoint)[0] for hs in prompts + [partial]]
    finally:
        feeds2.close()
    print(f"\nrestarted router's view of {in_ram} + 20,000 blocks: {took:.2f} s", file=sys.stderr)
    assert took < 10, f"the restarted router's view took {took:.1f} s"
    assert [(s.cpu, s.storage, s.prefill) for s in after] == [(s.cpu, s.storage, s.prefill) for s in before]
    assert all(s.matched == 5000 for s in after[:4]) and after[4].matched == 0


def test_an_engine_hashing_with_another_seed_or_algorithm_is_refused_on_its_first_block() -> None:
    """vLLM shows its PYTHONHASHSEED nowhere, but a prompt's first block comes with its tokens: the feed
    hashes them as the router does (``Feeds.apply`` straight, no sockets: the check is the subject)."""
    from kvgate.kvevents.wire import EventBatch

    router = BlockHasher("sha256", 16)  # no seed, as an engine started without PYTHONHASHSEED
    tokens = list(range(100, 148))

    def first_block(engine: BlockHasher, **kw) -> EventBatch:
        h = engine.hashes(tokens)
        ev = BlockStored(block_hashes=[int.from_bytes(x[-8:], "big") for x in h], parent_block_hash=None,
                         token_ids=tokens, block_size=16, lora_id=None, medium="GPU", lora_name=None, **kw)
        return EventBatch(0.0, [ev])

    idx = KvIndex()
    feeds = Feeds(idx, 16, hasher=router)
    for name in ("same", "seeded", "xxhash", "salted"):
        feeds.feeds[name] = feeds_feed(name)
    feeds.apply(feeds.feeds["same"], [("", 1, first_block(BlockHasher("sha256", 16)))])
    assert idx.count("same", "GPU") == 3 and feeds.refused == {} and feeds.feeds["same"].hashes_checked == 1
    feeds.apply(feeds.feeds["seeded"], [("", 1, first_block(BlockHasher("sha256", 16, seed="7")))])
    reason = feeds.refused["seeded"]
    assert "hash_algo sha256, hash_seed none" in reason and "PYTHONHASHSEED" in reason, reason
    assert idx.count("seeded", "GPU") == 0
    feeds.apply(feeds.feeds["xxhash"], [("", 1, first_block(BlockHasher("xxhash", 16, seed="1")))])
    assert "xxhash" in feeds.refused
    # a block whose hash has extra keys (a cache salt, LoRA, images) is not one the router reproduces: no verdict
    feeds.apply(feeds.feeds["salted"], [("", 1, first_block(BlockHasher("sha256", 16, seed="7"),
                                                            extra_keys=[("salt",), None, None]))])
    assert "salted" not in feeds.refused and idx.count("salted", "GPU") == 3
    with pytest.raises(InvalidArgument, match="block size 32 is not 16"):
        Feeds(idx, 16, hasher=BlockHasher("sha256", 32))


def feeds_feed(name: str):
    from kvgate.routing.feeds import Feed

    return Feed(name, f"tcp://{name}:1")
