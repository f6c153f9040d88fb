"""What a failure costs the SGLang backend: a line in SGLang's log, never an exception.

None of SGLang's storage threads is restarted when it dies, so the backend answers trouble
with misses and says so in the log, without flooding it: a warning at most once a minute per
topic, one line when the gateway goes away and one when it is reachable again.  A failed
gateway call also drops its connection when the connection broke (``OSError``, EOF) or the
gateway refused the session itself (``ENGINE_BUSY``, ``NOT_AUTHORIZED``, ``BAD_VERSION``), and a
later call reconnects; a spent time budget, any other refusal or a fault of the backend's own
leaves it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvgate.client import GatewayError
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.sglang.link import GatewayDown, OutOfTime

if TYPE_CHECKING:
    from kvgate.integrations.sglang.link import GatewayLink

# under "sglang." so that SGLang's logging configuration (handler, level, format) applies
logger = logging.getLogger("sglang.kvgate")


class FailureLog:
    """The backend's warnings, rate-limited per topic, and its reaction to a failed gateway call.

    ``counters`` is the backend's: every failed call counts in ``counters["errors"]``."""

    def __init__(self, target: str, counters: dict[str, int]):
        self.target = target
        self.counters = counters
        self._down_since: float | None = None
        self._warnings = RateLimitedLog(logger, every_s=60.0)
        self._lock = threading.Lock()

    def warn_once(self, topic: str, msg: str, *args: Any) -> None:
        """A warning at most once a minute per topic."""
        self._warnings.warning(topic, msg, *args)

    def went_down(self, what: str, e: BaseException) -> None:
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:
            logger.warning("kvgate backend: gateway %s unreachable (%s: %s, on %s); serving without it "
                           "(misses, no stores) and reconnecting in the background of later calls",
                           self.target, type(e).__name__, e, what)

    def came_up(self, what: str) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.warning("kvgate backend: gateway %s reachable again after %.1f s (%s)", self.target,
                           time.monotonic() - since, what)

    def failed(self, link: GatewayLink, what: str, e: BaseException) -> None:
        """A call failed: a refusal is logged (rate-limited), anything else drops the connection."""
        self.counters["errors"] += 1
        if isinstance(e, GatewayDown):
            return
        if isinstance(e, OutOfTime):
            self.warn_once(f"slow-{what}", "kvgate backend: a %s ran out of time (%s); the rest is a miss", what, e)
            return
        if isinstance(e, GatewayError):
            self.warn_once(f"refused-{what}", "kvgate backend: the gateway refused a %s: %s", what, e)
            if e.code in ("ENGINE_BUSY", "NOT_AUTHORIZED", "BAD_VERSION"):
                link.drop()
            return
        if isinstance(e, (OSError, EOFError, ConnectionError)):
            link.drop()
            self.went_down(link.name, e)
            return
        # Not the gateway's doing (a host pool that describes its pages unexpectedly, a bug): the
        # connection stays (a call cut short marks its client broken, and get() replaces it).
        self.warn_once(f"unexpected-{what}-{type(e).__name__}", "kvgate backend: %s failed (%s: %s); treated "
                       "as a miss", what, type(e).__name__, e)
