"""Which gateways hold a Redis card: the lease, so that two gateways never use one card unknowingly.

A gateway holds the card through a lease, one field per gateway in the
hash ``kvgate:card-lease`` naming its host, boot id, pid, mode (exclusive,
or shared for ``shared_storage``) and when it runs out by the server's
clock.  ``claim`` adds the field in a WATCH/MULTI transaction after checking
the others, so two gateways racing for the card cannot both win; the health
check renews it every second (``check``), and a gateway that did not renew
for ``LEASE_TTL_MS`` has lost it.  A field of this host and boot whose pid
is dead, or of an earlier boot, is the leftover of a killed gateway: it is
dropped at once instead of waited out.
"""

from __future__ import annotations

import errno
import json
import logging
import uuid

import redis.exceptions as rexc

from kvgate.cards.base import CardInUse, describe_holder, holder_dead, holder_doc
from kvgate.cards.redis.conn import RedisConnections

log = logging.getLogger("kvgate.cards.redis")  # the logger of everything a Redis card says

# Renewed every second by the health check: 15 missed renewals (a gateway
# killed on another host, or cut off from the server) free the card.  A
# gateway on this host that was killed frees it at once (its pid is dead).
LEASE_TTL_MS = 15_000


class RedisLease:
    """One card object's field in the lease hash at ``key``: taken, renewed, given up.

    ``field`` names this card object among the card's holders.
    """

    def __init__(self, conns: RedisConnections, key: bytes) -> None:
        self.conns = conns
        self.key = key
        self.field = uuid.uuid4().hex.encode()  # this card object's claim among the card's holders

    def renew(self, shared: bool, claiming: bool) -> None:
        """``take``, except on a read-only server (a replica) or one out of memory.

        A replica serves reads and no gateway can write or clean it through
        that server, so it is used without a lease.  A server at its
        ``maxmemory`` (filled by others) refuses even the lease's few bytes;
        the holders were checked before that write, so no gateway it would
        conflict with holds it now: it is used without a lease (it holds
        nothing new anyway) and the next health check takes the lease once
        there is room.  ``claiming``: the card is not claimed yet, so going
        without a lease is logged.
        """
        try:
            with self.conns.io():
                self.take(shared)
        except OSError as exc:  # CardUnavailable(EROFS) for a replica, a plain OSError(ENOSPC) when out of memory
            if exc.errno not in (errno.EROFS, errno.ENOSPC) or isinstance(exc, CardInUse):
                raise
            if claiming:
                why = "read-only" if exc.errno == errno.EROFS else "out of memory (at its maxmemory)"
                log.warning("redis card %s is %s: used without a lease until it takes one",
                            self.conns.display_location, why)

    def take(self, shared: bool) -> None:
        """Add or renew this card object's field in the lease, unless a live holder does not mix with ``shared``."""
        with self.conns.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    sec, usec = pipe.time()
                    now_ms = int(sec) * 1000 + int(usec) // 1000
                    gone = []
                    for field, raw in pipe.hgetall(self.key).items():
                        if field == self.field:
                            continue
                        try:
                            doc = json.loads(raw)
                        except ValueError:
                            doc = None
                        if (not isinstance(doc, dict) or not isinstance(doc.get("expires"), int)
                                or doc["expires"] < now_ms or holder_dead(doc)):
                            gone.append(field)
                            continue
                        held_shared = doc.get("mode") == "shared"
                        if not (shared and held_shared):
                            raise CardInUse(self.conns.display_location, describe_holder(doc), held_shared, shared)
                    mine = {**holder_doc(shared), "expires": now_ms + LEASE_TTL_MS}
                    pipe.multi()
                    if gone:
                        pipe.hdel(self.key, *gone)
                    pipe.hset(self.key, self.field, json.dumps(mine))
                    pipe.pexpire(self.key, LEASE_TTL_MS)
                    pipe.execute()
                    return
                except rexc.WatchError:
                    continue  # another holder changed the lease meanwhile: look again

    def give_up(self) -> None:
        """Drop this card object's field, best effort: a field left behind runs out by itself."""
        try:
            self.conns.r.hdel(self.key, self.field)
        except (rexc.RedisError, OSError):
            pass  # it runs out by itself
