"""The SGLang backend's transfer figures for SGLang's metrics collector (``get_stats``).

SGLang asks a storage backend, now and then, for the pages and the bandwidth of each prefetch
and backup since it last asked, as a ``StorageMetrics`` record; the backend notes them per
transfer, from the storage threads, and hands them over when asked.
"""

from __future__ import annotations

import threading
import time
from typing import Any

try:  # the metrics record SGLang's metrics collector expects from get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # pragma: no cover - another SGLang layout: report no metrics
    StorageMetrics = None  # type: ignore[assignment,misc]


class TransferStats:
    """The pages and GB/s of each prefetch (load) or backup (store) since the last ``collect``."""

    def __init__(self) -> None:
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    def prefetched(self, pages: int, t0: float, page_bytes: int) -> None:
        """A load that began at ``t0`` (``time.perf_counter``) brought ``pages`` pages."""
        self._record(False, pages, t0, page_bytes)

    def backed_up(self, pages: int, t0: float, page_bytes: int) -> None:
        """A store that began at ``t0`` (``time.perf_counter``) stored ``pages`` pages."""
        self._record(True, pages, t0, page_bytes)

    def _record(self, backup: bool, pages: int, t0: float, page_bytes: int) -> None:
        if not pages:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:  # the lists are picked under the lock: collect() swaps them
            pgs, bw = (self._backup_pgs, self._backup_bw) if backup else (self._prefetch_pgs, self._prefetch_bw)
            if len(pgs) < 10000:  # bounded when SGLang never collects (metrics off)
                pgs.append(pages)
                bw.append(pages * page_bytes / dt / 1e9 if dt > 0 else 0.0)

    def collect(self) -> Any:
        """Pages and bandwidth (GB/s) per transfer since the last call, as SGLang's ``StorageMetrics``."""
        if StorageMetrics is None:
            return None
        with self._metrics_lock:
            m = StorageMetrics(prefetch_pgs=self._prefetch_pgs, backup_pgs=self._backup_pgs,
                               prefetch_bandwidth=self._prefetch_bw, backup_bandwidth=self._backup_bw)
            self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw = [], [], [], []
        return m
