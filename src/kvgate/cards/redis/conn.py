"""A Redis card's connections to its server, and the OSError each redis-py failure stands for.

The gateway's health logic knows cards by ``OSError``: ``CardUnavailable``
takes a card out, a timeout is a strike, ``ENOSPC`` lowers its capacity.
Every call a Redis card makes goes through one bounded pool whose sockets
are all bounded by ``io_timeout_ms`` and never retried, and every failure of
such a call comes out of ``RedisConnections.io`` (or ``map_error``, for the
replies of a pipeline) as one of those, so a Redis card fails exactly like
a directory.
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from typing import Any, Iterator

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvgate.cards.base import CardUnavailable
from kvgate.cards.objectformat import BufferTooSmall, ObjectCorrupt, ObjectMissing
from kvgate.cards.redis.packer import ZERO_COPY, ZeroCopyPacker


def _error_classes(*names: str) -> tuple[type[BaseException], ...]:
    """redis-py's specific ResponseError subclasses that this version has."""
    return tuple(getattr(rexc, n) for n in names if isinstance(getattr(rexc, n, None), type))


# redis-py strips the error code (``OOM``, ``READONLY``...) from the message
# of the errors it has a class for, so both the class and the text are tested.
_OOM = _error_classes("OutOfMemoryError")
_READONLY = _error_classes("ReadOnlyError")
_NOPERM = _error_classes("NoPermissionError", "MasterDownError")
_CLUSTER = _error_classes("MovedError", "AskError", "ClusterDownError", "ClusterCrossSlotError", "TryAgainError")


class RedisConnections:
    """The bounded connection pool of one card's server, whose failures leave as OSErrors.

    ``r`` is the one redis-py client every part of the card uses; it checks
    a connection out of the pool for each call, so the gateway's I/O threads
    use it at once.  ``display_location`` names the card in every error.
    """

    def __init__(self, url: str, display_location: str, io_timeout_ms: int, max_connections: int) -> None:
        self.display_location = display_location
        timeout = io_timeout_ms / 1000
        extra: dict[str, Any] = {"command_packer": ZeroCopyPacker()} if ZERO_COPY else {}
        try:
            self.pool = redis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout,  # waiting for a free connection
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),  # the gateway counts failures; never wait out retries here
                health_check_interval=0,
                socket_read_size=256 << 10,  # fewer reads for big values (redis-py default: 64 KiB)
                **extra,
            )
        except ValueError as exc:
            raise ValueError(f"not a redis card location: {display_location}: {exc}") from None
        self.r = redis.Redis(connection_pool=self.pool)

    def map_error(self, exc: BaseException) -> OSError:
        """The OSError that a redis-py failure stands for."""
        where = self.display_location
        if isinstance(exc, CardUnavailable):
            return exc
        if isinstance(exc, rexc.TimeoutError):
            # slow, not gone: a strike for the card's health, not an instant take-out
            return TimeoutError(errno.ETIMEDOUT, f"redis card timed out: {exc}", where)
        if isinstance(exc, rexc.AuthenticationError):
            return CardUnavailable(errno.EACCES, f"redis card refused authentication: {exc}", where)
        if isinstance(exc, rexc.ConnectionError):  # incl. BusyLoadingError, pool exhausted
            return CardUnavailable(errno.ENOTCONN, f"redis card is not reachable: {exc}", where)
        if isinstance(exc, rexc.ResponseError):
            msg = str(exc)
            if isinstance(exc, _OOM) or msg.startswith("OOM"):
                # One write refused; the card itself is fine (and should evict).
                return OSError(errno.ENOSPC, f"redis card is out of memory: {msg}", where)
            if isinstance(exc, _READONLY) or msg.startswith("READONLY"):
                return CardUnavailable(errno.EROFS, f"redis card is read-only: {msg}", where)
            if isinstance(exc, _NOPERM) or msg.startswith(("NOPERM", "NOAUTH", "MISCONF", "MASTERDOWN")):
                return CardUnavailable(errno.EACCES, f"redis card refused: {msg}", where)
            if isinstance(exc, _CLUSTER) or msg.startswith(("MOVED", "ASK", "CLUSTERDOWN", "CROSSSLOT")):
                return CardUnavailable(errno.EINVAL, f"redis card is a node of a Redis Cluster and this key is not "
                                       f"on it: register the cluster by one seed address (`kvgate cluster "
                                       f"register redis://SEED`: one card per primary), or use a proxy: {msg}",
                                       where)
            return OSError(errno.EIO, f"redis card error: {msg}", where)
        if isinstance(exc, rexc.RedisError):
            return OSError(errno.EIO, f"redis card error: {exc}", where)
        if isinstance(exc, OSError):  # a socket error redis-py did not wrap
            return CardUnavailable(exc.errno or errno.EIO, f"redis card is not reachable: {exc}", where)
        return OSError(errno.EIO, f"redis card error: {exc!r}", where)

    @contextmanager
    def io(self) -> Iterator[None]:
        """Turn redis-py failures into OSErrors; lets the card's own errors through."""
        try:
            yield
        except (CardUnavailable, ObjectMissing, ObjectCorrupt, BufferTooSmall):
            raise
        except (rexc.RedisError, OSError) as exc:
            raise self.map_error(exc) from exc

    @staticmethod
    def same_error(exc: OSError) -> OSError:
        """A fresh exception like ``exc`` for each item of a batch (never share one instance)."""
        cls = CardUnavailable if isinstance(exc, CardUnavailable) else OSError
        new = cls(exc.errno, exc.strerror, exc.filename)
        new.__cause__ = exc.__cause__
        return new

    def disconnect(self) -> None:
        """Close every connection; the pool reconnects if it is used again."""
        try:
            self.pool.disconnect()
        except (rexc.RedisError, OSError):
            pass
