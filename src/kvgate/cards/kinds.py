"""Which card kind a ``storage_devices`` entry names, and the cards it names now.

Used by the long tier and by ``kvgate fingerprint``, which must find the very
cards a gateway would.  ``make_card`` does no I/O (a card touches its medium
only once opened), so the long tier calls it on its event loop; ``expand``
lists directories, so it runs on an I/O pool.
"""

from __future__ import annotations

import glob
import os

from kvgate.cards.base import Card
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.network.card import NetworkCard, is_network
from kvgate.cards.redis.card import RedisCard
from kvgate.config import DEFAULT_CARD, Config

REDIS_PREFIXES = ("redis://", "rediss://", "unix://")


def is_redis(location: str) -> bool:
    return location.startswith(REDIS_PREFIXES)


def kind_of(location: str) -> str:
    """The ``Card.kind`` a location names: "kvgate", "redis" or "directory"."""
    return NetworkCard.kind if is_network(location) else RedisCard.kind if is_redis(location) else DirectoryCard.kind


def make_card(location: str, cfg: Config) -> Card:
    if is_network(location):  # a card server's: no object on the wire is larger than a client's largest frame
        return NetworkCard(location, num_dbs=cfg.num_dbs, io_timeout_ms=cfg.io_timeout_ms,
                           max_object_bytes=cfg.max_frame_bytes, token_file=cfg.card_token_file,
                           tls_ca_file=cfg.card_tls_ca_file)
    if is_redis(location):
        return RedisCard(location, num_dbs=cfg.num_dbs, io_timeout_ms=cfg.io_timeout_ms, ttl_s=cfg.ttl)
    return DirectoryCard(location, num_dbs=cfg.num_dbs, sync_writes=cfg.sync_writes, direct_reads=cfg.direct_reads,
                         create_missing=cfg.create_card_dirs or location == DEFAULT_CARD)


def expand(pattern: str) -> list[str]:
    """Locations an entry names now: itself, or the directories its glob matches."""
    if is_redis(pattern) or is_network(pattern) or not glob.has_magic(pattern):
        return [pattern]
    return sorted(p for p in glob.glob(pattern) if os.path.isdir(p))
