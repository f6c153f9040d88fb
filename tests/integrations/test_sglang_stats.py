"""The SGLang backend's transfer figures: recorded from storage threads, collected from another."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from kvgate.integrations.sglang import stats


@dataclass
class FakeStorageMetrics:  # SGLang's record has these four fields
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


def test_no_figure_is_lost_or_counted_twice_while_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "StorageMetrics", FakeStorageMetrics)
    ts = stats.TransferStats()
    per_thread, threads = 2000, 4
    done = threading.Event()
    got = {"prefetch": 0, "backup": 0, "records": 0}

    def record(backup: bool) -> None:
        t0 = time.perf_counter()
        for _ in range(per_thread):
            (ts.backed_up if backup else ts.prefetched)(1, t0, 4096)

    def collect() -> None:
        while True:
            last = done.is_set()
            m = ts.collect()
            got["prefetch"] += sum(m.prefetch_pgs)
            got["backup"] += sum(m.backup_pgs)
            got["records"] += len(m.prefetch_bandwidth) + len(m.backup_bandwidth)
            if last:
                return

    collector = threading.Thread(target=collect)
    collector.start()
    workers = [threading.Thread(target=record, args=(i % 2 == 1,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    collector.join()
    assert got == {"prefetch": per_thread * threads // 2, "backup": per_thread * threads // 2,
                   "records": per_thread * threads}


def test_figures_are_bounded_when_nobody_collects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "StorageMetrics", FakeStorageMetrics)
    ts = stats.TransferStats()
    for _ in range(20000):
        ts.prefetched(1, time.perf_counter(), 4096)
    assert len(ts.collect().prefetch_pgs) == 10000


def test_no_metrics_without_sglang_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "StorageMetrics", None)
    ts = stats.TransferStats()
    ts.prefetched(3, time.perf_counter(), 4096)
    assert ts.collect() is None
