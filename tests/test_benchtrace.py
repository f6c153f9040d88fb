"""`kvgate bench --trace`: the offline figures exactly, the verifier, the flags, and one short real replay.

The replay against real gateways is checked against the in-process replay
of the same policy: the gateway's figure must equal the model of its own
cards (the policy per card, with the marks the gateway gave and its card
map) and come close to one pool of the whole capacity.  Why the two can
differ at all: the capacity is split over the cards and each card evicts on
its own (the conversations do not spread evenly), and the gateway evicts
after each write where the simulation evicts after each request.  The marks
are the same: the replay computes them with the gateway's ``SharedHeads``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvgate.bench import BenchError
from kvgate.bench.replay import Capacity
from kvgate.bench.trace import (
    TraceError,
    TraceRequest,
    expected_payload,
    infinite_cache,
    load_trace,
    replay_policies,
    simulate,
    trace_marks,
    unique_blocks,
    verify_blocks,
    with_shared_head,
)
from kvgate.cli import main
from kvgate.keys import DialogMark

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "benchmarks" / "data" / "mooncake-synthetic-trace.jsonl"


def _write_trace(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


# ---- the trace and the offline figures ------------------------------------------------


def test_shipped_trace_is_the_public_one() -> None:
    reqs = load_trace(str(TRACE))
    assert len(reqs) == 3993 and unique_blocks(reqs) == 43924
    assert reqs[0].timestamp_ms == 0 and reqs[0].ids[:3] == (0, 1, 2)


def test_infinite_cache_on_a_hand_made_trace() -> None:
    reqs = [
        [1, 2, 3],        # all new: 0
        [1, 2, 3, 4],     # 1, 2, 3 seen: 3
        [1, 5, 3],        # 1 seen, 5 not (3 after it does not count): 1
        [6, 1, 2],        # 6 new first: 0
        [1, 2, 3, 4, 5],  # 1-4 seen, and 5 too (request 3): 5
        [7],              # 0
    ]
    assert infinite_cache(reqs) == (9, 19)
    assert infinite_cache([TraceRequest(tuple(r)) for r in reqs]) == (9, 19)
    # a shared head of 2 adds 2 restorable blocks to every request but the first
    headed = with_shared_head([TraceRequest(tuple(r)) for r in reqs], 2)
    assert headed[0].ids == (8, 9, 1, 2, 3) and all(r.ids[:2] == (8, 9) for r in headed)
    assert infinite_cache(headed) == (9 + 2 * 5, 19 + 2 * 6)


def test_replay_policies_bounds_and_shared_head() -> None:
    reqs = [[1, 2, 3], [1, 2, 3, 4], [1, 5, 3], [6, 1, 2], [1, 2, 3, 4, 5], [7]]
    hits, total = infinite_cache(reqs)
    # a cache that holds everything restores what the infinite one does, whatever the policy
    assert replay_policies(reqs, 100, ["prefix", "lru"]) == {"prefix": hits / total, "lru": hits / total}
    # one block: only request 2's head can still be there... lru keeps the newest block (3), so nothing restores
    assert replay_policies(reqs, 1, ["lru"]) == {"lru": 0.0}
    # prefix keeps a whole dialog's head: request 1's tail goes first, block 1 stays for request 2
    assert replay_policies(reqs, 1, ["prefix"])["prefix"] > 0
    # the policies over a trace with a shared head (learnt by the marks after 3 conversations)
    head = with_shared_head([TraceRequest(tuple(r)) for r in reqs], 3)
    hits, total = infinite_cache(head)
    shares = {p: [replay_policies(head, cap, [p])[p] for cap in (3, 4, 5, 6, 8, 100)] for p in ("prefix", "lru")}
    for policy, figures in shares.items():
        assert figures == sorted(figures) and figures[-1] == hits / total  # more room never restored less, here
    # room for the head alone: lru keeps each request's last blocks and restores nothing; prefix cuts every
    # dialog from its tail, so the head (one conversation's start while it is not known as shared) stays
    assert shares["lru"][0] == 0.0 and shares["prefix"][0] == 3 * 5 / total


def test_marks_learn_a_shared_head_as_the_gateway_does() -> None:
    reqs = with_shared_head([TraceRequest(r) for r in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 10, 11))], 3)
    assert reqs[0].ids == (12, 13, 14, 1, 2)
    # the head is one conversation's until a third one branches off it; then the mark is past it, and the
    # head is a segment marked by its first key
    head = ((0, b"blk-12"),)
    assert trace_marks(reqs) == [DialogMark(b"blk-12", 0), DialogMark(b"blk-12", 0), DialogMark(b"blk-5", 3, head),
                                 DialogMark(b"blk-7", 3, head), DialogMark(b"blk-9", 3, head)]
    placed: list = []
    simulate(reqs, trace_marks(reqs), "lru", [100], card_of=lambda b, m: placed.append((b, m)) or 0)
    assert placed == [(12, b"blk-12"), (13, b"blk-12"), (14, b"blk-12"), (1, b"blk-12"), (2, b"blk-12"),
                      (3, b"blk-12"), (4, b"blk-12"), (5, b"blk-5"), (6, b"blk-5"), (7, b"blk-7"), (8, b"blk-7"),
                      (9, b"blk-9"), (10, b"blk-9"), (11, b"blk-9")]


def test_simulate_places_blocks_on_cards_and_counts_residents() -> None:
    reqs = [[1, 2, 3], [4, 5], [1, 2, 3, 9]]
    marks = trace_marks(reqs)
    assert marks[0] == DialogMark(b"blk-1", 0)
    sim = simulate(reqs, marks, "lru", [10, 10], card_of=lambda b, m: 0 if m == b"blk-1" else 1)
    assert (sim.restored, sim.total, sim.resident) == (3, 9, [4, 2])


def test_load_trace_names_the_bad_line(tmp_path: Path) -> None:
    ok = {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}
    cases = {
        "not JSON": ["{"],
        "hash_ids must be a non-empty list": [{"hash_ids": []}],
        "integers >= 0, found -3": [{"hash_ids": [1, -3]}],
        "integers >= 0, found 'x'": [{"hash_ids": ["x"]}],
        "timestamp must be a number": [{"hash_ids": [1], "timestamp": "soon"}],
        "expected a JSON object": [[1, 2]],
    }
    for why, bad in cases.items():
        path = _write_trace(tmp_path / "t.jsonl", [ok, *bad])
        with pytest.raises(TraceError, match=why) as e:
            load_trace(path)
        assert "line 2" in str(e.value)
    path = _write_trace(tmp_path / "t.jsonl", [ok, "", {"hash_ids": [3]}, ok])
    reqs = load_trace(path)
    assert [r.ids for r in reqs] == [(1, 2), (3,), (1, 2)] and reqs[1].timestamp_ms is None
    assert len(load_trace(path, limit=2)) == 2
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write_trace(tmp_path / "empty.jsonl", [""]))


# ---- payloads and the verifier ----------------------------------------------------------


@pytest.mark.parametrize("block_size", [4096, 1000, 7])
def test_verifier_catches_one_wrong_byte(block_size: int) -> None:
    ids = [5, 17, 3]
    want = expected_payload(ids, block_size)
    assert want.size == 3 * block_size
    assert np.array_equal(expected_payload([17], block_size), want[block_size : 2 * block_size])
    got = want.copy()
    verify_blocks(got, ids, block_size)
    got[block_size + block_size // 2] ^= 0x01
    with pytest.raises(BenchError, match=rf"block 17 \(blk-17, position 1\) came back wrong: byte {block_size // 2}"):
        verify_blocks(got, ids, block_size)
    # another block's bytes in the right place are wrong too
    swapped = np.concatenate([want[block_size : 2 * block_size], want[:block_size], want[2 * block_size :]])
    with pytest.raises(BenchError, match="block 5 "):
        verify_blocks(swapped, ids, block_size)
    with pytest.raises(BenchError, match="restored"):
        verify_blocks(want[:-1], ids, block_size)


def test_capacity_specs() -> None:
    assert Capacity.parse("5%").total_bytes(1000, 100) == 5000
    assert Capacity.parse("64M").total_bytes(1000, 100) == 64 << 20
    for bad, why in (("5x", "neither a share"), ("0%", "above 0"), ("abc%", "not a percentage"), ("0", "at least")):
        with pytest.raises(ValueError, match=why):
            Capacity.parse(bad)


# ---- the command line -----------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--capacity", "5x"], "argument --capacity: '5x' is neither a share"),
    (["--capacity", "5%,5%"], "names a capacity twice"),
    (["--policies", "lru,fifo"], "unknown eviction policy 'fifo' in 'lru,fifo'"),
    (["--block-size", "0"], "argument --block-size: must be at least 1 byte, got '0'"),
    (["--block-size", "1G"], "argument --block-size: '1G' is more than"),
    (["--requests", "0"], "argument --requests: must be 1 or more, got '0'"),
    (["--shared-head", "-1"], "argument --shared-head: must be 0 or more, got '-1'"),
    (["--speedup", "0"], "argument --speedup: must be a number above 0, got '0'"),
    (["--speedup", "fast"], "argument --speedup: expected a number, got 'fast'"),
    (["--ram", "lots"], "argument --ram: 'lots'"),
    (["--plot", "hits.jpg"], "argument --plot: 'hits.jpg': the plot is an SVG or PNG file"),
])
def test_bad_flag_values(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--trace", str(TRACE), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--shared-head", "2"], "--shared-head needs --trace FILE"),
    (["--in-process"], "--in-process needs --trace FILE"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace /nonexistent/trace.jsonl: No such file"),
    (["--trace", str(TRACE), "--quick"], "--quick is for the throughput figures"),
    (["--trace", str(TRACE), "--placement", "stripe"], "--placement is for --cards without --trace"),
    (["--trace", str(TRACE), "--in-process", "--ram", "1G"], "--in-process runs no gateway"),
    (["--trace", str(TRACE), "--capacity", "1K", "--requests", "5"], "--capacity 1K: 1 KiB over 4 cards is less "
                                                                       "than one block of 16 KiB per card"),
])
def test_flags_that_do_not_go_together(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "--trace", str(TRACE), "--in-process", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'kvgate[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_in_process_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace", str(TRACE), "--in-process", "--requests", "300", "--json",
                 "--capacity", "10%,1M"]) == 0
    result = json.loads(capsys.readouterr().out)
    reqs = load_trace(str(TRACE), 300)
    hits, total = infinite_cache(reqs)
    assert result["trace"]["infinite_cache"]["restored_blocks"] == hits and result["trace"]["blocks"] == total
    assert [(r["policy"], r["capacity"]["spec"]) for r in result["runs"]] == [
        ("adaptive", "10%"), ("prefix", "10%"), ("lru", "10%"), ("adaptive", "1M"), ("prefix", "1M"), ("lru", "1M")]
    for row in result["runs"]:
        blocks = row["capacity"]["blocks"]
        assert blocks == (int(0.1 * unique_blocks(reqs)) if row["capacity"]["spec"] == "10%" else 64)
        want = replay_policies(reqs, blocks, [row["policy"]])[row["policy"]]
        assert row["in_process"]["share_of_all"] == want
        assert row["in_process"]["share_of_infinite"] == pytest.approx(want * total / hits)
        assert 0 < row["in_process"]["cpu_us_per_block"] < 10_000  # the replay's CPU time per block
        assert "gateway" not in row
        followed = row["in_process"]["followed"]
        if row["policy"] == "adaptive":  # it evicted: the shares of its two orders
            assert set(followed) == {"prefix", "recency"} and sum(followed.values()) == pytest.approx(1.0), followed
        else:
            assert followed is None


def test_a_generated_trace_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace", "gen:scan", "--in-process", "--requests", "300", "--json",
                 "--capacity", "10%", "--policies", "lru"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["requests"] == 300
    assert main(["bench", "--trace", "gen:nope", "--in-process"]) == 2
    err = capsys.readouterr().err
    assert "no such generated trace" in err and "gen:two-turns" in err, err


@pytest.mark.slow  # matplotlib runs fc-list to build its font cache the first time it draws text
def test_plot_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "hits.png"
    assert main(["bench", "--trace", str(TRACE), "--in-process", "--requests", "300", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a short replay against real gateways ----------------------------------------------


@pytest.mark.slow
def test_short_replay_matches_the_in_process_figure(tmp_path: Path) -> None:
    workdir = tmp_path / "bench"
    workdir.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kvgate", "bench", "--trace", str(TRACE), "--requests", "200", "--cards", "2",
           "--block-size", "4K", "--policies", "lru", "--capacity", "10%", "--threads", "2", "--speedup", "8",
           "--json", "--dir", str(workdir)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    (row,) = result["runs"]
    gw = row["gateway"]
    reqs = load_trace(str(TRACE), 200)
    hits, total = infinite_cache(reqs)
    assert gw["blocks"] == total and result["trace"]["infinite_cache"]["restored_blocks"] == hits
    assert 0 < gw["restored_blocks"] <= hits
    assert gw["restore_bytes"] == gw["restored_blocks"] * 4096 and gw["restore_gib_s"] > 0
    assert gw["replay_s"] >= reqs[-1].timestamp_ms / 1000 / 8  # paced: the trace's 58.5 s at 8x
    assert gw["marks_as_in_process"] == gw["requests"] == 200  # the gateway's dialog marks are the computed ones
    # The gateway against the model of its own two cards: the same policy, marks and card map, so the same blocks.
    assert gw["restored_blocks"] == pytest.approx(gw["model"]["restored_blocks"], abs=2)
    assert [c["objects"] for c in gw["cards"]] == gw["model"]["objects_per_card"]
    # ... and against one pool of the whole capacity, in process (see the module docstring for why they differ).
    one_pool = replay_policies(reqs, row["capacity"]["blocks"], ["lru"])["lru"]
    assert row["in_process"]["share_of_all"] == one_pool
    assert abs(gw["share_of_all"] - one_pool) <= 0.01, (gw["share_of_all"], one_pool)
    # placement: every conversation and every byte is on some card
    assert sum(c["conversations"] for c in gw["cards"]) == gw["conversations"] > 0
    assert sum(c["conversations_share"] for c in gw["cards"]) == pytest.approx(1)
    assert sum(c["bytes_share"] for c in gw["cards"]) == pytest.approx(1)
    assert gw["corrupt_objects"] == gw["io_errors"] == 0
    assert os.listdir(workdir) == []  # cards, logs and sockets removed
