"""The Redis card: objects in a Redis-protocol server (Redis, Valkey, KeyDB, ...).

``card`` is the ``Card`` (cards/base.py's contract); the rest are its parts: ``conn`` (connections, timeouts),
``keys`` (the server's key names), ``objects`` (reading and writing objects), ``packer`` (many small
objects per round trip), ``lease`` (one gateway per card), ``label`` (the card's serial), ``snapshot``
(its index kept across restarts).
"""

from kvgate.cards.redis.card import RedisCard

__all__ = ["RedisCard"]
