"""The tiered store's counters: what ``kvgate stat``, the status page and ``/metrics`` report.

Written on the event loop only (by ``TieredStore`` and the gateway's operations), read there by the
status snapshot: plain fields, no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierCounters:
    sets: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


GET_PATHS = ("lent", "session_region", "registered_region", "inline")


@dataclass
class StoreCounters:
    ram: TierCounters = field(default_factory=TierCounters)
    long: TierCounters = field(default_factory=TierCounters)
    lookups: int = 0
    corrupt: int = 0
    # card objects a client read itself out of a file we lent it open (``TieredStore.lend_files``)
    files_lent: int = 0
    expired: int = 0
    # get requests by the way their bytes travel: read out of our memory by the client (``lent``),
    # through the session region, in place in a registered region, or in the frames (``inline``)
    get_paths: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GET_PATHS, 0))
