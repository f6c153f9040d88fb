"""A Redis card's heads list: the set ``kvgate:heads`` (behind the card's hash tag) of 8-byte ids (``HeadsChannel``)."""

from __future__ import annotations

from collections.abc import Collection

from kvgate.cards.heads import HeadsChannel
from kvgate.cards.redis.conn import RedisConnections
from kvgate.heads import CARD_MAX_HEADS

_SADD_ARGS = 4096  # ids per SADD command; a round with more sends several in one pipeline


class RedisHeads(HeadsChannel):
    """The list as a Redis set of little-endian u64 members, on the card's own connections.

    A set has no order, so past ``CARD_MAX_HEADS`` random ids go (``SPOP``):
    a gateway re-learns any it still needs.  Every failure leaves as the
    card's ``OSError`` (``RedisConnections.io``).
    """

    def __init__(self, conns: RedisConnections, key: bytes) -> None:
        self._conns = conns
        self.key = key

    def merge(self, ids: Collection[int]) -> set[int]:
        r = self._conns.r
        with self._conns.io():
            if ids:
                members = [i.to_bytes(8, "little") for i in ids]
                with r.pipeline(transaction=False) as pipe:
                    for start in range(0, len(members), _SADD_ARGS):
                        pipe.sadd(self.key, *members[start : start + _SADD_ARGS])
                    pipe.scard(self.key)
                    over = pipe.execute()[-1] - CARD_MAX_HEADS
                if over > 0:
                    r.spop(self.key, over)
            raw = r.smembers(self.key)
        return {int.from_bytes(m, "little") for m in raw if len(m) == 8}

    def __repr__(self) -> str:
        return f"RedisHeads({self._conns.display_location!r}, {self.key!r})"
