"""A Redis card's label, and the same card coming back from a server that restarted empty.

The serial is created once with ``SET NX`` (whoever is first wins; everybody
else reads the winner's label) and never changed.

A Redis card is mostly run without persistence, so a restart loses every
key, the label included.  The server at that address is still the same card:
the same place in every gateway's slot map.  Refusing it until an operator
relabels would turn every restart of a cache into an outage, and inventing a
new serial would move its slots.  So ``check()`` (and a later ``open()``)
puts the *old* serial back when the label is missing **and the server holds
no kvgate objects**: an empty server holds nothing that could be mistaken
for this card's data, so taking it back loses nothing and risks nothing.  A
server whose label is gone but which holds kvgate objects is refused
(``CardUnavailable``): those objects come from somewhere this card cannot
vouch for (a deleted or evicted label, another deployment's data).  A label
with another serial is returned as found; the caller sees the different
serial and does not use the card.  (The very first ``open()`` of a card
object labels a server that has no label whatever it holds, as the directory
card does: its objects carry their full keys and hashes, so adopting them is
safe.)
"""

from __future__ import annotations

import errno
import logging
import time

import redis.exceptions as rexc

from kvgate.cards.base import CardUnavailable, new_label, parse_label
from kvgate.cards.redis.conn import RedisConnections
from kvgate.cards.redis.keys import SCAN_COUNT, RedisKeys

log = logging.getLogger("kvgate.cards.redis")  # the logger of everything a Redis card says


class RedisLabel:
    """The label key of one card: read, created once, put back on a server that lost everything.

    Callers run these inside ``RedisConnections.io``: redis-py failures
    leave as they came.
    """

    def __init__(self, conns: RedisConnections, keys: RedisKeys, io_timeout_ms: int) -> None:
        self.conns = conns
        self.keys = keys
        self.io_timeout_ms = io_timeout_ms

    def read(self) -> bytes | None:
        try:
            return self.conns.r.get(self.keys.label)
        except rexc.ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise CardUnavailable(errno.EINVAL, "card label is not a string value (not a kvgate label)",
                                      self.conns.display_location) from exc
            raise

    def create(self, serial: str) -> str:
        """SET NX: the first gateway wins, every other one reads its label."""
        if self.conns.r.set(self.keys.label, new_label(serial), nx=True):
            return serial
        raw = self.read()
        if raw is None:  # created and deleted again in between: nobody owns it now
            raise CardUnavailable(errno.ENOENT, "card label vanished while being created",
                                  self.conns.display_location)
        return self.parse(raw)

    def restore(self, serial: str) -> str:
        """Put the old serial back on a server that lost everything (see the module doc)."""
        empty = self._holds_no_objects()
        if empty is None:
            raise CardUnavailable(errno.ETIMEDOUT, "card label is missing, and the server holds too many keys to "
                                  "confirm in time that none is a kvgate object", self.conns.display_location)
        if not empty:
            raise CardUnavailable(
                errno.ENOENT,
                "card label is missing but kvgate objects are present; not taking the card back "
                "(clean the server's kvgate:o:* keys, or restore the label)",
                self.conns.display_location,
            )
        found = self.create(serial)
        if found == serial:
            log.warning("redis card %s: server holds no kvgate data (restarted empty?); label re-created with "
                        "serial %s", self.conns.display_location, serial)
        return found

    def _holds_no_objects(self) -> bool | None:
        """True when the database holds no ``kvgate:o:*`` key; None when that is not known in time.

        DBSIZE answers at once for an empty server.  Otherwise SCAN walks the
        keyspace until the first match; a server full of foreign keys that
        cannot be walked within the I/O deadline gives None (the card is
        refused this time and tried again at the next check).
        """
        r = self.conns.r
        if r.dbsize() == 0:
            return True
        deadline = time.monotonic() + self.io_timeout_ms / 1000
        cursor = 0
        while True:
            cursor, keys = r.scan(cursor, match=self.keys.objects_match, count=SCAN_COUNT)
            if keys:
                return False
            if int(cursor) == 0:
                return True
            if time.monotonic() > deadline:
                return None

    def parse(self, raw: bytes) -> str:
        return parse_label(raw, self.conns.display_location)
