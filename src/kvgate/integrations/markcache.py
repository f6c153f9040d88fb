"""The gateway's dialog marks, cached per prompt lead, for integrations that see a request several times.

An engine's calls for one request (SGLang's lookup, get and set; LMCache's lookups of every kv rank and
object group) would each ask the gateway for the same mark.  The cache names a mark by the last key of
the lead it was computed from (block keys chain, so that key names the whole lead), never by the
prompt's first key: every conversation behind one system prompt shares that one, and a mark cached
under it would answer them all without asking, so the gateway would never see the conversations
branch and never learn the system prompt as a shared head.  A mark is asked again after ``ttl_s``: the
gateway keeps learning heads.  Imports no engine.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kvgate.client import DialogMark

TTL_S = 30.0
SIZE = 4096


class MarkCache:
    """Dialog marks by the last key of their lead, for ``ttl_s``; at most ``size``.  Thread-safe."""

    def __init__(self, ttl_s: float = TTL_S, size: int = SIZE) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._marks: OrderedDict[bytes, tuple[DialogMark, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, lead_last: bytes) -> DialogMark | None:
        with self._lock:
            hit = self._marks.get(lead_last)
        if hit is None or time.monotonic() - hit[1] >= self.ttl_s:
            return None
        return hit[0]

    def put(self, lead_last: bytes, dm: DialogMark) -> None:
        with self._lock:
            self._marks[lead_last] = (dm, time.monotonic())
            self._marks.move_to_end(lead_last)
            while len(self._marks) > self.size:
                self._marks.popitem(last=False)
