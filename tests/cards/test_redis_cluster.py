"""A Redis Cluster as cards: registered by one seed address, one card per primary, each keeping its keys on it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
from redis.crc import key_slot

from kvgate.cards import CardUnavailable, ObjectMeta, RedisCard
from kvgate.cards.redis.keys import LABEL_KEY, cluster_cards, split_tag
from kvgate.keys import full_key
from tests.cards.common import check_snapshot_round_trip, start_redis_cluster
from tests.processes import REDIS_SERVER, RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")]


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory) -> Iterator[list[RedisServer]]:
    nodes = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def test_a_cluster_seed_is_one_card_per_primary_and_each_card_keeps_its_keys_on_its_primary(
        redis_cluster: list[RedisServer]) -> None:
    seed = redis_cluster[1].url
    urls = cluster_cards(seed)
    assert sorted(int(split_tag(u)[0].rsplit(":", 1)[1]) for u in urls) == sorted(n.port for n in redis_cluster)
    assert cluster_cards(redis_cluster[0].url) == urls, "the same cards whichever node is the seed"
    payload = bytes(range(256)) * 1024
    serials = set()
    for url in urls:
        card = RedisCard(url)
        serials.add(card.open())
        card.claim(False)
        try:
            keys = [full_key(b"ns", b"%s-%d" % (url.encode(), i)) for i in range(20)]
            for k in keys:
                card.write(k, memoryview(payload), ObjectMeta(created_ns=time.time_ns()))
            dest = bytearray(len(payload))
            for k in keys:
                card.read_into(k, memoryview(dest))
                assert dest == payload
            assert len(list(card.scan())) == 20
            assert card.heads is not None and card.heads.merge({1, 2}) == {1, 2}
            check_snapshot_round_trip(card, 20)
            # Every key of the card is on its own primary (its tag's slot), none elsewhere.
            node = redis.Redis.from_url(split_tag(url)[0])
            tag = split_tag(url)[1]
            mine = [k for k in node.scan_iter(match=b"{%s}*" % tag.encode(), count=1000)]
            assert len(mine) >= 21 and all(key_slot(k) == key_slot(tag.encode()) for k in mine)
            node.close()
            assert card.clean() == 20
        finally:
            card.close()
    assert len(serials) == 3, "three cards, three serials"


def test_a_primary_named_without_its_tag_is_refused_with_the_fix(redis_cluster: list[RedisServer]) -> None:
    slot = key_slot(LABEL_KEY)
    for n in redis_cluster:
        ranges = redis.Redis(port=n.port).execute_command("CLUSTER SLOTS")
        owner = {int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1])}
        if n.port not in owner:
            break
    card = RedisCard(n.url)
    with pytest.raises(CardUnavailable, match="register the cluster by one seed address"):
        card.open()
    card.close()


def test_a_server_that_is_not_a_cluster_node_is_one_card(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, policy="noeviction").start()
    try:
        assert cluster_cards(server.url) == [server.url]
    finally:
        server.kill()
    with pytest.raises(CardUnavailable, match="seed did not answer"):
        cluster_cards(server.url, io_timeout_ms=200)
