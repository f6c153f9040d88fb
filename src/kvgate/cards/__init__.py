"""Cards: the media of the long tier, one interface for every kind."""

from kvgate.cards.base import (Card, CardInUse, CardUnavailable, NotACardLocation, SnapshotWriter, StoredObject,
                               WriteAbandoned)
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.kinds import REDIS_PREFIXES, expand, is_redis, kind_of, make_card
from kvgate.cards.objectformat import BufferTooSmall, Header, ObjectCorrupt, ObjectMeta, ObjectMissing, ObjectTooNew
from kvgate.cards.network.card import NetworkCard, is_network
from kvgate.cards.redis.card import RedisCard

__all__ = [
    "BufferTooSmall",
    "Card",
    "CardInUse",
    "CardUnavailable",
    "DirectoryCard",
    "Header",
    "ObjectCorrupt",
    "ObjectMeta",
    "ObjectMissing",
    "ObjectTooNew",
    "NetworkCard",
    "NotACardLocation",
    "REDIS_PREFIXES",
    "RedisCard",
    "SnapshotWriter",
    "StoredObject",
    "WriteAbandoned",
    "expand",
    "is_network",
    "is_redis",
    "kind_of",
    "make_card",
]
