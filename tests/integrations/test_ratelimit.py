"""``RateLimitedLog``: one line per topic and interval, the held-back count on the next, shared by threads."""

from __future__ import annotations

import logging
import threading

import pytest

from kvgate.integrations import ratelimit
from kvgate.integrations.ratelimit import RateLimitedLog


def test_one_line_per_topic_and_interval_and_the_count_held_back(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: now[0])
    log = RateLimitedLog(logging.getLogger("kvgate.test.ratelimit"), every_s=30.0)
    with caplog.at_level(logging.WARNING, logger="kvgate.test.ratelimit"):
        assert log.warning("down", "gateway %s down", "a")
        assert not log.warning("down", "gateway %s down", "a")
        assert not log.warning("down", "gateway %s down", "a")
        assert log.warning("other", "another topic")  # topics are apart
        now[0] += 30.0
        assert log.warning("down", "gateway %s down", "b")
    assert [r.getMessage() for r in caplog.records] == [
        "gateway a down", "another topic", "gateway b down (2 similar messages suppressed)"]


def test_threads_sharing_one_log_write_one_line_per_topic(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("kvgate.test.ratelimit.threads"), every_s=3600.0)
    go = threading.Barrier(8)
    logged: list[bool] = []

    def warn() -> None:
        go.wait()
        for i in range(500):
            logged.append(log.warning(f"t{i % 5}", "x"))

    with caplog.at_level(logging.WARNING, logger="kvgate.test.ratelimit.threads"):
        threads = [threading.Thread(target=warn) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(logged) == 5 and len(caplog.records) == 5
