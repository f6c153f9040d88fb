"""Latency histograms (``kvgate.latency``): cumulative buckets, and what /metrics shows of requests and card I/O."""

from __future__ import annotations

from kvgate.latency import BUCKETS, Latencies
from kvgate.gateway.status import render


def test_buckets_are_cumulative_and_the_largest_goes_past_the_last_bound() -> None:
    lat = Latencies()
    for s in (0.00005, 0.0003, 0.0003, 0.004, 20.0):
        lat.observe("lookup", s)
    lat.observe("get", 0.001)  # a bound itself counts under that bound
    snap = lat.snapshot()
    assert list(snap) == ["get", "lookup"]
    lookup = dict((b, n) for b, n in snap["lookup"]["buckets"])
    assert (lookup[0.0001], lookup[0.00025], lookup[0.0005], lookup[0.005], lookup[BUCKETS[-1]]) == (1, 1, 3, 4, 4)
    assert snap["lookup"]["count"] == 5 and abs(snap["lookup"]["sum"] - 20.00465) < 1e-6
    assert dict((b, n) for b, n in snap["get"]["buckets"])[0.001] == 1


def test_metrics_render_a_histogram_per_request_type(gateway) -> None:
    with gateway.client("lat") as c:
        c.lookup([b"x"])
        c.lookup([b"y"])
    text = render(gateway.stats()).decode()
    assert 'kvgate_request_seconds_count{op="lookup"} 2.0' in text
    assert 'kvgate_request_seconds_bucket{le="+Inf",op="lookup"} 2.0' in text
    assert 'kvgate_storage_group_state{' in text and 'state="serving"} 1.0' in text
    assert 'kvgate_read_priority_info{priority="' in text


def test_card_io_calls_are_timed_under_the_card_method_s_name(gateway) -> None:
    with gateway.client("lat") as c:
        assert c.put_many([b"w"], [b"x" * 5000]) == [True]
    text = render(gateway.stats()).decode()
    calls = {line.split('call="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("kvgate_card_io_seconds_count")}
    assert {"open", "claim", "write_many"} <= calls, calls
