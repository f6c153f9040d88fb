"""How a Redis card stores a new index snapshot: whole or not at all.

A snapshot is written in pieces while the gateway serves; a reader must
never see half of one, and a gateway killed while writing must leave the
old one in place.  So the pieces go to a temp key of the writer's own and
one RENAME, atomic in the server, puts it over the snapshot.
"""

from __future__ import annotations

import uuid

import redis.exceptions as rexc

from kvgate.cards.base import SnapshotWriter
from kvgate.cards.redis.conn import RedisConnections
from kvgate.cards.redis.keys import RedisKeys


class RedisSnapshotWriter(SnapshotWriter):
    """APPENDs to a temp key of its own, RENAMEd over the snapshot on commit (atomic in the server)."""

    def __init__(self, conns: RedisConnections, keys: RedisKeys) -> None:
        self.conns = conns
        self.snapshot = keys.snapshot
        self.key = keys.snapshot_temp + uuid.uuid4().hex.encode()

    def write(self, data: bytes | memoryview) -> None:
        with self.conns.io():
            self.conns.r.append(self.key, bytes(data))

    def commit(self) -> None:
        with self.conns.io():
            self.conns.r.rename(self.key, self.snapshot)

    def abort(self) -> None:
        try:
            self.conns.r.unlink(self.key)
        except (rexc.RedisError, OSError):
            pass
