"""Cards: the media of the long tier, one interface for every kind."""

from kvgate.cards.base import Card, CardUnavailable, StoredObject
from kvgate.cards.directory import DirectoryCard
from kvgate.cards.objectformat import BufferTooSmall, Header, ObjectCorrupt, ObjectMeta, ObjectMissing

__all__ = [
    "BufferTooSmall",
    "Card",
    "CardUnavailable",
    "DirectoryCard",
    "Header",
    "ObjectCorrupt",
    "ObjectMeta",
    "ObjectMissing",
    "StoredObject",
]
