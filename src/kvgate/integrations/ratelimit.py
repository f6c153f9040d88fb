"""A warning at most once per topic and interval: what every integration logs trouble through.

An engine's tier is called on every scheduling step; a gateway that is down or refuses would
otherwise write a line per step.  Shared by the engine's threads (vLLM's scheduler and worker
threads, LMCache's and SGLang's storage threads): thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedLog:
    """``warning(topic, msg, *args)`` logs through ``logger`` at most once every ``every_s`` per topic;
    the next line that goes out says how many were held back since."""

    def __init__(self, logger: logging.Logger, every_s: float = 30.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, topic: str, msg: str, *args: Any) -> bool:
        """Log it unless ``topic`` was logged less than ``every_s`` ago; whether it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self.every_s:
                self._suppressed[topic] = self._suppressed.get(topic, 0) + 1
                return False
            n = self._suppressed.pop(topic, 0)
            self._last[topic] = now
        self.logger.warning(msg + (f" ({n} similar messages suppressed)" if n else ""), *args)
        return True
