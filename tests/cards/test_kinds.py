"""Which card kind a storage_devices entry names, and the locations a glob names now."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.cards import DirectoryCard, RedisCard, expand, is_redis, make_card
from kvgate.config import DEFAULT_CARD, Config
from kvgate.keys import full_key


@pytest.mark.parametrize("location", ["redis://127.0.0.1:6379", "rediss://h:6380/2", "unix:///run/redis.sock"])
def test_redis_locations_make_redis_cards(location: str) -> None:
    assert is_redis(location)
    card = make_card(location, Config(num_dbs=3, io_timeout_ms=1500, ttl=60.0))
    assert isinstance(card, RedisCard)
    assert (card.num_dbs, card.io_timeout_ms, card.ttl_ns) == (3, 1500, 60 * 10**9)
    assert expand(location) == [location]


def test_other_locations_make_directory_cards_created_only_when_asked(tmp_path: Path) -> None:
    loc = str(tmp_path / "card")
    assert not is_redis(loc)
    card = make_card(loc, Config(num_dbs=2, sync_writes=True, direct_reads=False))
    assert isinstance(card, DirectoryCard)
    assert (card.num_dbs, card.sync_writes, card.direct_reads, card.create_missing) == (2, True, False, False)
    assert make_card(loc, Config(create_card_dirs=True)).create_missing
    assert make_card(DEFAULT_CARD, Config()).create_missing


def test_expand_lists_the_directories_a_glob_matches_now(tmp_path: Path) -> None:
    for name in ("b", "a", "c"):
        (tmp_path / f"card-{name}").mkdir()
    (tmp_path / "card-file").write_text("not a directory")
    assert expand(str(tmp_path / "card-*")) == [str(tmp_path / f"card-{n}") for n in "abc"]
    assert expand(str(tmp_path / "none-*")) == []
    assert expand(str(tmp_path / "missing")) == [str(tmp_path / "missing")]


def test_every_kind_puts_a_key_in_the_same_shard(tmp_path: Path) -> None:
    directory = DirectoryCard(str(tmp_path / "card"), num_dbs=4)
    redis = RedisCard("redis://127.0.0.1:1", num_dbs=4)
    for i in range(32):
        k = full_key(b"ns", b"key-%d" % i)
        db, name = directory.object_place(k)
        assert directory.object_path(k) == str(tmp_path / "card" / f"db{db:02d}" / name[:2] / name)
        assert redis.object_key(k) == b"kvgate:o:%d:%s" % (db, name.encode())
