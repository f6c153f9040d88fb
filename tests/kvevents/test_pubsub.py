"""EventPublisher and Subscriber over real ZMQ sockets (ipc in a temporary directory): order, catch-up by
replay, snapshots for late joiners and holes, refusals of malformed requests, bounded answers."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from kvgate.errors import ConfigError
from kvgate.kvevents.publisher import EventPublisher
from kvgate.kvevents.subscriber import Subscriber
from kvgate.kvevents.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, seq_bytes


def stored(*hashes: bytes, medium: str = "CPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=0)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(2)
    lp.close()


@pytest.fixture
def addrs(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def held_provider(held: dict[str, list[bytes]], chunk: int = 100):
    async def snapshot():
        for topic, keys in held.items():
            for i in range(0, len(keys), chunk):
                yield topic, [stored(*keys[i:i + chunk])]
                await asyncio.sleep(0)
    return snapshot


def collect(sub: Subscriber, n: int, timeout: float = 20.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += sub.poll(0.05)
    return got


def settle(pub: EventPublisher, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pub.stats["published"] < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pub.stats["published"] >= n


def joined(sub: Subscriber, pub: EventPublisher) -> None:
    """Publish until the slow-joining SUB has received one (ZMQ drops what a not yet connected SUB misses)."""
    for _ in range(200):
        pub.publish("warm", [])
        sub.poll(0.02)
        if sub.last_seq is not None:
            return
    raise AssertionError("subscriber never joined")


def test_batches_arrive_in_order_under_their_topics(addrs):
    pub = EventPublisher(*addrs)
    pub.start()
    sub = Subscriber(addrs[0], addrs[1], snapshot_on_join=False)
    try:
        joined(sub, pub)
        for i in range(50):
            pub.publish("kvgate" if i % 2 else "kvgate@card:x", [stored(bytes([i]))])
        got = collect(sub, 50)
        seqs = [s for _, s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + 50))
        assert [t for t, _, _ in got][:2] == ["kvgate@card:x", "kvgate"]
        assert [b.events[0].block_hashes for _, _, b in got] == [[bytes([i])] for i in range(50)]
    finally:
        sub.close()
        pub.close()


def test_topic_filter_still_sees_gaps_across_topics(addrs):
    pub = EventPublisher(*addrs)
    pub.start()
    sub = Subscriber(addrs[0], addrs[1], topics=["a"], snapshot_on_join=False)
    try:
        joined(sub, pub)
        for i in range(20):
            pub.publish("a" if i % 2 else "b", [stored(bytes([i]))])
        got = collect(sub, 10)
        assert [t for t, _, _ in got] == ["a"] * 10
        assert sub.stats["gaps"] == 0
    finally:
        sub.close()
        pub.close()


def test_a_subscriber_that_missed_1000_batches_catches_up_by_replay(addrs):
    pub = EventPublisher(*addrs, buffer_batches=5000)
    pub.start()
    sub = Subscriber(addrs[0], addrs[1], snapshot_on_join=False)
    try:
        joined(sub, pub)
        sub._sub.disconnect(addrs[0])  # it misses what comes now
        for i in range(1000):
            pub.publish("t", [stored(i.to_bytes(4, "big"))])
        settle(pub, 1000)
        sub._sub.connect(addrs[0])
        time.sleep(0.3)
        pub.publish("t", [stored(b"last")])
        got = collect(sub, 1001)
        assert [b.events[0].block_hashes[0] for _, _, b in got] == [i.to_bytes(4, "big") for i in range(1000)] + [
            b"last"]
        seqs = [s for _, s, _ in got]
        assert seqs == sorted(set(seqs))
        assert sub.stats["gaps"] == 1 and sub.stats["replays"] == 1 and sub.stats["gaps_unrecovered"] == 0
        assert pub.stats["snapshots"] == 0
    finally:
        sub.close()
        pub.close()


def test_a_late_joiner_gets_a_snapshot_then_the_stream(addrs, loop):
    held = {"kvgate": [b"k%d" % i for i in range(250)], "kvgate@card:c1": [b"c%d" % i for i in range(30)]}
    pub = EventPublisher(*addrs, buffer_batches=100, snapshot=held_provider(held), loop=loop)
    pub.start()
    try:
        for i in range(500):  # the ring (100) rolls over
            pub.publish("kvgate", [stored(b"old%d" % i)])
        settle(pub, 500)
        sub = Subscriber(addrs[0], addrs[1])
        try:
            got = sub.poll(0.05)
            topics = {}
            for t, s, b in got:
                topics.setdefault(t, []).extend(b.events)
            for t, keys in held.items():
                evs = topics[t]
                assert isinstance(evs[0], AllBlocksCleared)
                assert [h for e in evs[1:] for h in e.block_hashes] == keys
            assert pub.stats["snapshots"] == 1
            assert {s for _, s, _ in got} == {500}
            joined(sub, pub)
            pub.publish("kvgate", [stored(b"new")])
            assert [b.events[0].block_hashes for _, _, b in collect(sub, 1)] == [[b"new"]]
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_gap_older_than_the_ring_is_answered_with_a_snapshot(addrs, loop):
    held = {"kvgate": [b"h%d" % i for i in range(10)]}
    pub = EventPublisher(*addrs, buffer_batches=50, snapshot=held_provider(held), loop=loop)
    pub.start()
    sub = Subscriber(addrs[0], addrs[1], snapshot_on_join=False)
    try:
        joined(sub, pub)
        sub._sub.disconnect(addrs[0])
        for i in range(200):
            pub.publish("kvgate", [stored(b"x")])
        settle(pub, 200)
        sub._sub.connect(addrs[0])
        time.sleep(0.3)
        pub.publish("kvgate", [BlockRemoved([b"x"], "CPU")])  # the gap shows here
        got = collect(sub, 3)
        # the snapshot (taken after that batch) is the state: a clear per topic, then what is held
        assert [(t, type(b.events[0]).__name__) for t, _, b in got] == [
            ("warm", "AllBlocksCleared"), ("kvgate", "AllBlocksCleared"), ("kvgate", "BlockStored")]
        assert got[-1][2].events[0].block_hashes == held["kvgate"]
        assert pub.stats["snapshots"] == 1 and sub.stats["gaps_unrecovered"] == 0
        pub.publish("kvgate", [BlockRemoved([b"h0"], "CPU")])
        assert [b.events for _, _, b in collect(sub, 1)] == [[BlockRemoved([b"h0"], "CPU")]]
    finally:
        sub.close()
        pub.close()


def test_a_dropped_batch_leaves_a_hole_that_a_snapshot_fills(addrs, loop):
    pub = EventPublisher(*addrs, queue_batches=5, snapshot=held_provider({"t": [b"a"]}), loop=loop)
    # not started: the queue fills, the rest is dropped
    assert all(pub.publish("t", [stored(b"%d" % i)]) for i in range(5))
    assert not pub.publish("t", [stored(b"dropped")])
    assert pub.stats["dropped"] == 1
    pub.start()
    try:
        settle(pub, 5)
        assert pub.stats["holes"] == 1 and pub.last_seq == 6  # the hole took seq 1
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(addrs[1])
        dealer.send_multipart([b"", seq_bytes(1)])
        frames = []
        while True:
            assert dealer.poll(5000)
            f = dealer.recv_multipart()
            frames.append(f)
            if f[2] == END_SEQ:
                break
        dealer.close(0)
        assert pub.stats["snapshots"] == 1  # the ring cannot replay a hole
        assert msgspec.msgpack.decode(frames[0][3])[1] == [{"type": "AllBlocksCleared"}]
    finally:
        pub.close()


def test_malformed_requests_are_counted_and_ignored(addrs):
    pub = EventPublisher(*addrs)
    pub.start()
    try:
        pub.publish("t", [stored(b"a")])
        settle(pub, 1)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(addrs[1])
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"nope"])
        dealer.send_multipart([b"", seq_bytes(1), b"extra"])
        dealer.send_multipart([b"", seq_bytes(1)])
        assert dealer.poll(5000)
        f = dealer.recv_multipart()
        assert f[1:3] == [b"t", seq_bytes(1)]
        assert dealer.recv_multipart()[2] == END_SEQ
        dealer.close(0)
        assert pub.stats["malformed_requests"] == 3
    finally:
        pub.close()


def test_a_subscriber_that_leaves_mid_answer_does_not_stop_the_publisher(addrs):
    pub = EventPublisher(*addrs, buffer_batches=20_000, queue_batches=30_000)
    pub.start()
    try:
        for i in range(20_000):
            pub.publish("t", [stored(b"x" * 32)])
        settle(pub, 20_000)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 10)
        dealer.connect(addrs[1])
        dealer.send_multipart([b"", seq_bytes(1)])
        time.sleep(0.2)
        dealer.close(0)
        pub.publish("t", [stored(b"after")])
        settle(pub, 20_001)
    finally:
        pub.close()


def test_a_bind_failure_names_the_key(addrs):
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="kv_events_replay_endpoint.*cannot bind"):
            EventPublisher(addrs[0], f"tcp://127.0.0.1:{port}").start()
        with pytest.raises(ConfigError, match="kv_events_endpoint.*cannot bind"):
            EventPublisher(f"tcp://127.0.0.1:{port}").start()
        EventPublisher(addrs[0], addrs[1]).close()  # a publisher never started closes
    finally:
        taken.close(0)


def test_a_restarted_publisher_is_joined_again(addrs, loop):
    held = {"t": [b"a", b"b"]}
    pub = EventPublisher(*addrs, snapshot=held_provider(held), loop=loop)
    pub.start()
    sub = Subscriber(addrs[0], addrs[1])
    try:
        joined(sub, pub)
        for _ in range(5):
            pub.publish("t", [stored(b"x")])
        collect(sub, 5)
        pub.close()
        pub = EventPublisher(*addrs, snapshot=held_provider({"t": [b"c"]}), loop=loop)
        pub.start()
        for _ in range(100):  # until the SUB has reconnected
            pub.publish("t", [stored(b"new")])
            time.sleep(0.02)
            got = sub.poll(0.02)
            if got:
                break
        got += collect(sub, 3, timeout=2)
        assert sub.stats["restarts"] == 1
        kinds = [(t, type(b.events[0]).__name__) for t, _, b in got]
        assert kinds[:2] == [("t", "AllBlocksCleared"), ("t", "BlockStored")]
        assert got[1][2].events[0].block_hashes == [b"c"]
    finally:
        sub.close()
        pub.close()


def test_closing_during_a_snapshot_stops_its_provider(addrs, loop):
    produced = []

    async def endless():
        i = 0
        while True:
            produced.append(i)
            yield "t", [stored(b"%d" % i)]
            i += 1
            await asyncio.sleep(0)

    pub = EventPublisher(*addrs, snapshot=endless, loop=loop)
    pub.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 5)
    dealer.connect(addrs[1])
    dealer.send_multipart([b"", END_SEQ])
    deadline = time.monotonic() + 5
    while pub.stats["snapshot_batches"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.close()
    dealer.close(0)
    time.sleep(0.2)
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n, "the provider kept running after close"
    assert not [t for t in asyncio.all_tasks(loop) if not t.done()]
