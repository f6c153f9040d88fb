"""`kvgate bench`: the JSON it prints, and that it cleans up after itself.

The end-to-end test runs the real thing (two gateway processes, a card on
disk, a /dev/shm region) at a small size.  It checks structure and sanity,
never the bars: on a shared 2-core machine a ratio is a measurement, not a
pass/fail property of the code.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.client import crossmem
SRC = Path(__file__).resolve().parents[1] / "src"

THROUGHPUT_FIGURES = ("ram_get", "plain_get", "tcp_get", "card_get_warm", "plain_card_get_warm", "card_get_cold",
                      "card_put")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def _run_bench(cmd: list[str], cwd: Path) -> tuple[str, str, int]:
    """Run a bench command to its end (240 s at most); it must succeed. -> (stdout, stderr, pid)"""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"bench did not finish in 240 s; stderr:\n{err}")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err}"
    return out, err, proc.pid


def _check_side(side: dict, where: str) -> None:
    for key in ("best_gib_s", "median_gib_s"):
        assert isinstance(side[key], float) and side[key] > 0 and math.isfinite(side[key]), (where, key, side)
    assert side["best_gib_s"] >= side["median_gib_s"], where
    assert side["passes"] >= 1, where


@pytest.mark.slow
def test_quick_bench_json_and_nothing_left_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "bench"
    workdir.mkdir()
    drawing = tmp_path / "figures.svg"
    cmd = [sys.executable, "-m", "kvgate", "bench", "--quick", "--json", "--object-size", "256K", "--batch", "8",
           "--dir", str(workdir), "--plot", str(drawing)]
    # cwd is the empty tmp_path too, so a stray default ./var/bench would show up below.
    out, _err, pid = _run_bench(cmd, tmp_path)

    result = json.loads(out)  # exactly one JSON document on stdout, nothing else
    svg = drawing.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    for label in ("RAM get to shm", "RAM get, plain", "card get, warm", "card warm, plain", "vs pwritev"):
        assert label in svg, f"the drawing names {label!r}"
    cfg = result["config"]
    assert (cfg["object_size"], cfg["batch"], cfg["pass_bytes"]) == (256 << 10, 8, 2 << 20)
    assert cfg["quick"] is True and cfg["threads"] >= 1 and cfg["cores"] >= 1

    figures = result["figures"]
    assert set(figures) == {*THROUGHPUT_FIGURES, "lookup"}
    for name in THROUGHPUT_FIGURES:
        fig = figures[name]
        if fig is None:  # only the cold figure may be skipped (no permission to drop caches), with a reason
            assert name == "card_get_cold"
            assert result["skipped"][name]
            continue
        _check_side(fig["kvgate"], f"{name}.kvgate")
        _check_side(fig["baseline"], f"{name}.baseline")
        assert fig["baseline"]["what"]
        assert fig["ratio"] > 0 and math.isfinite(fig["ratio"]), name
        assert fig["ratio"] == pytest.approx(fig["kvgate"]["best_gib_s"] / fig["baseline"]["best_gib_s"])
        assert fig["ratio_median"] > 0, name
        # both sides of a figure always get the same number of passes
        assert fig["kvgate"]["passes"] == fig["baseline"]["passes"], name
        if name not in ("ram_get", "plain_get", "tcp_get"):  # single-thread baselines
            assert fig["baseline"]["threads"] in (cfg["threads"], 1)
            assert set(fig["baseline"]["by_threads"]) == {str(cfg["threads"]), "1"}
        if name in ("card_get_warm", "plain_card_get_warm", "card_put"):
            # beside the raw baseline, the same passes with each payload hashed: what a checked path can reach
            checked = fig["verified"]
            _check_side(checked, f"{name}.verified")
            assert checked["passes"] == fig["kvgate"]["passes"] and set(checked["by_threads"]) == {
                str(cfg["threads"]), "1"}
            assert fig["bound"] == pytest.approx(checked["best_gib_s"] / fig["baseline"]["best_gib_s"])
            assert fig["ratio_verified"] == pytest.approx(fig["kvgate"]["best_gib_s"] / checked["best_gib_s"])
        else:
            assert "verified" not in fig and "bound" not in fig, name

    lookup = figures["lookup"]
    assert lookup["keys"] == 1000 and lookup["count"] == 1000 and lookup["count_ok"] is True
    assert lookup["reps"] == cfg["lookup_reps"] > 0
    assert 0 < lookup["best_ms"] <= lookup["p50_ms"] <= lookup["p99_ms"]
    assert lookup["one_key_p50_ms"] > 0

    for name in ("plain_get", "plain_card_get_warm"):  # which way the plain gets went, counted by the gateway
        paths = figures[name]["get_paths"]
        assert set(paths) <= {"lent", "session_region"} and sum(paths.values()) >= figures[name]["kvgate"]["passes"]
    if crossmem.files_supported and figures["plain_card_get_warm"]["get_paths"].get("lent"):
        # warm card objects into plain buffers: read by the client out of the files the gateway lent it
        assert figures["plain_card_get_warm"]["files_lent"] >= figures["plain_card_get_warm"]["kvgate"]["passes"]
    assert figures["plain_get"]["files_lent"] == 0  # RAM-tier objects are lent as pages, not files
    assert set(result["bars"]) == {"ram_get", "plain_get", "tcp_get", "card_get_warm", "plain_card_get_warm",
                                   "card_put", "lookup_p50", "lookup_p99"}
    assert all(isinstance(v, bool) for v in result["bars"].values())

    # The table (what the command prints without --json) renders this result, each bound under its ratio.
    from kvgate.bench.report import print_table

    capsys.readouterr()
    print_table(result)
    table = capsys.readouterr().out
    assert f"of {figures['card_get_warm']['bound']:.2f}" in table and "'of': the most the ratio can be" in table

    # Nothing left behind: not in --dir, not in the cwd, not in /dev/shm.
    assert list(workdir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "figures.svg"], "the drawing, and nothing else"
    assert not os.path.exists(f"/dev/shm/kvgate-bench-{pid}")


def test_measure_alternates_and_gives_every_side_the_same_passes() -> None:
    from kvgate.bench.measure import Contender, measure

    calls: list[str] = []
    series = measure([Contender("a", lambda r: calls.append(f"a{r}"), after=lambda r: calls.append(f"a-after{r}")),
                      Contender("b", lambda r: calls.append(f"b{r}"), before=lambda: calls.append("b-before"))],
                     1 << 20, budget_s=0.0, min_rounds=2, max_rounds=2)
    assert calls == ["a-1", "a-after-1", "b-before", "b-1",  # warm-up
                     "a0", "a-after0", "b-before", "b0", "a1", "a-after1", "b-before", "b1"]
    assert [len(s.seconds) for s in series.values()] == [2, 2]
    assert all(s.best_gib_s >= s.median_gib_s > 0 for s in series.values())


def test_chunks_split_like_the_gateway_pool() -> None:
    from kvgate.bench.baselines import chunks

    assert [len(c) for c in chunks(list(range(32)), 4)] == [8, 8, 8, 8]
    assert [len(c) for c in chunks(list(range(5)), 4)] == [2, 2, 1]
    assert [len(c) for c in chunks(list(range(3)), 8)] == [1, 1, 1]
    assert chunks(list(range(3)), 1) == [[0, 1, 2]]


CARDS_FIGURES = ("single_warm", "single_cold", "concurrent_warm", "concurrent_cold")


@pytest.mark.slow
def test_quick_cards_bench_both_placements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--cards 3 --placement both``: one gateway per placement; where a dialog's blocks land is measured."""
    workdir = tmp_path / "bench"
    workdir.mkdir()
    blocks, restores = 32, 8
    cmd = [sys.executable, "-m", "kvgate", "bench", "--quick", "--json", "--cards", "3", "--placement", "both",
           "--object-size", "256K", "--blocks", str(blocks), "--restores", str(restores), "--threads", "2",
           "--dir", str(workdir)]
    out, _err, pid = _run_bench(cmd, tmp_path)

    result = json.loads(out)
    assert result["mode"] == "cards"
    cfg = result["config"]
    assert cfg["cards"] == 3 and cfg["placements"] == ["dialog", "stripe"] and cfg["slots"] >= 16
    assert (cfg["object_size"], cfg["blocks"], cfg["restores"]) == (256 << 10, blocks, restores)
    assert cfg["dialog_bytes"] == blocks * (256 << 10) and cfg["concurrent_bytes"] == restores * cfg["dialog_bytes"]
    assert cfg["quick"] is True and cfg["threads"] == 2 and sorted(cfg["baseline_threads"]) == [1, 2, 6]
    assert cfg["cards_share_one_filesystem"] is True  # the cards are subdirectories of --dir

    placements = result["placements"]
    assert set(placements) == {"dialog", "stripe"}
    for p, r in placements.items():
        assert set(r["figures"]) == set(CARDS_FIGURES), p
        for name in CARDS_FIGURES:
            fig = r["figures"][name]
            if fig is None:  # only cold figures, and only with a reason
                assert name.endswith("_cold") and result["skipped"][name], (p, name)
                continue
            _check_side(fig["kvgate"], f"{p}.{name}.kvgate")
            _check_side(fig["baseline"], f"{p}.{name}.baseline")
            assert fig["baseline"]["what"], (p, name)
            assert fig["ratio"] == pytest.approx(fig["kvgate"]["best_gib_s"] / fig["baseline"]["best_gib_s"])
            assert fig["ratio_median"] > 0 and math.isfinite(fig["ratio"]), (p, name)
            assert fig["kvgate"]["passes"] == fig["baseline"]["passes"], (p, name)
            if name.startswith("single"):
                assert fig["baseline"]["threads"] in cfg["baseline_threads"]
                assert set(fig["baseline"]["by_threads"]) == {str(n) for n in cfg["baseline_threads"]}
            else:
                assert fig["baseline"]["threads"] == restores  # one raw thread per dialog, like the clients
        assert sum(r["single_blocks_per_card"]) == blocks and len(r["single_blocks_per_card"]) == 3, p
        assert sum(r["concurrent_blocks_per_card"]) == blocks * restores, p
        assert r["cards_used"] == sum(1 for n in r["single_blocks_per_card"] if n), p
        # the gateway saw every read on the cards it was meant for: no timeouts, no errors, no misses
        assert len(r["gateway_cards"]) == 3
        for card in r["gateway_cards"]:
            assert card["timeouts"] == card["errors"] == card["misses"] == 0, (p, card)
        assert sum(c["bytes_read"] for c in r["gateway_cards"]) > 0

    from kvgate.bench.report import print_cards_table

    capsys.readouterr()
    print_cards_table(result)  # what the command prints without --json
    assert "dialog" in capsys.readouterr().out

    # The point of the two placements: one dialog on one card, or spread over several.
    assert placements["dialog"]["cards_used"] == 1
    assert sum(placements["dialog"]["concurrent_dialogs_per_card"]) == restores  # each dialog on exactly one card
    assert placements["stripe"]["cards_used"] > 1
    assert set(result["stripe_vs_dialog"]) <= set(CARDS_FIGURES) and result["stripe_vs_dialog"]
    assert any("one filesystem" in n for n in result["notes"])

    # Nothing left behind: not in --dir, not in the cwd, not in /dev/shm.
    assert list(workdir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench"]
    assert not os.path.exists(f"/dev/shm/kvgate-bench-{pid}")


def test_placement_without_cards_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvgate.bench.command import add_arguments, run_bench

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run_bench(p.parse_args(["--placement", "stripe"])) == 2
    assert "--placement needs --cards" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--cards", "2", "--placement", "sideways"])


@pytest.mark.slow
def test_objects_bench_restarts_a_card_without_and_with_its_snapshot(tmp_path: Path) -> None:
    workdir = tmp_path / "bench"
    workdir.mkdir()
    n = 3000
    cmd = [sys.executable, "-m", "kvgate", "bench", "--objects", str(n), "--dialog-blocks", "300", "--json",
           "--dir", str(workdir)]
    out, _err, _pid = _run_bench(cmd, tmp_path)
    result = json.loads(out)
    cfg = result["config"]
    assert (cfg["objects"], cfg["object_size"], cfg["dialog_blocks"], cfg["lookup_keys"]) == (n, 4096, 300, 300)
    assert result["fill_s"] > 0 and result["snapshot_bytes"] > 71 * n, "the stop wrote a snapshot of every object"
    scan, restart = result["scan"], result["restart"]
    for life in (scan, restart):
        assert 0 < life["listening_s"] <= life["indexed_s"]
        assert life["lookups_after"]["n"] > 0 and life["lookups_after"]["p50_ms"] > 0
        assert math.isfinite(life["index_bytes_per_object"])
    assert restart["all_keys_found_s"] is not None and restart["all_keys_found_s"] < restart["indexed_s"] + 3.5
    log = "\n".join(result["log"])
    assert "no index snapshot; scanning the card" in log and f"index snapshot of {n + 1000} objects" in log
    assert f"{n + 1000} from its snapshot, 0 found on the card, 0 gone from it" in log
    assert set(result["bars"]) == {"ready_s", "background_lookup_p99_ms", "index_bytes_per_object"}
    # The filled card stays for the next run; nothing else is left behind.
    assert [p.name for p in workdir.iterdir()] == [f"objects-{n}-4096"]
    out, _err, _pid = _run_bench(cmd, tmp_path)
    assert json.loads(out)["fill_s"] == 0, "the card of an earlier run is used again"


@pytest.mark.slow
def test_network_bench_reads_a_served_card_warm_and_cold_against_its_baselines(tmp_path: Path) -> None:
    workdir = tmp_path / "bench"
    workdir.mkdir()
    cmd = [sys.executable, "-m", "kvgate", "bench", "--network", "--quick", "--json", "--object-size", "256K",
           "--batch", "4", "--dir", str(workdir), "--plot", str(tmp_path / "network.png")]
    out, _err, _pid = _run_bench(cmd, tmp_path)
    result = json.loads(out)
    assert (tmp_path / "network.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["mode"] == "network" and result["url"].startswith("kvgate://127.0.0.1:")
    assert (result["objects"], result["object_size"]) == (4, 256 << 10) and result["verified"]
    assert set(result["figures"]) == {"warm_batch", "warm_per_object", "cold_batch"}
    for name, f in result["figures"].items():
        for side in ("card", "raw"):
            assert f[side]["gib_s"] > 0 and math.isfinite(f[side]["gib_s"]), (name, side)
        assert math.isclose(f["ratio"], f["ratio"]) and f["ratio"] > 0, name
    assert set(result["bars"]) == {"warm_batch", "cold_batch"}
    assert list(workdir.iterdir()) == [], "the card and its server are gone"


@pytest.mark.slow
def test_pull_bench_pulls_from_a_peer_gateway_against_a_raw_stream(tmp_path: Path) -> None:
    """``--pull``: a gateway process serves its RAM tier on peer_listen; the objects come back verified and
    equal, each round beside a raw loopback stream; the prompt pull times follow from the measured rate."""
    workdir = tmp_path / "bench"
    cmd = [sys.executable, "-m", "kvgate", "bench", "--pull", "--quick", "--json", "--object-size", "256K",
           "--batch", "4", "--dir", str(workdir), "--kv-bytes-per-token", "1024"]
    out, _err, _pid = _run_bench(cmd, tmp_path)
    result = json.loads(out)
    assert result["config"]["object_size"] == 256 << 10 and result["config"]["batch"] == 4
    assert result["pull_gib_s"] > 0 and result["raw_gib_s"] > 0 and len(result["ratios"]) == 3
    assert math.isclose(result["ratio"], sorted(result["ratios"])[1], abs_tol=1e-3)  # the median round
    times = result["pull_seconds_by_prompt_tokens"]
    rate = result["pull_gib_s"] * (1 << 30)
    assert math.isclose(times["8192"], 8192 * 1024 / rate, rel_tol=1e-6), times


def test_network_bench_refuses_a_batch_its_raw_requests_cannot_name(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvgate.bench.command import add_arguments, run_bench

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run_bench(p.parse_args(["--network", "--batch", "256", "--dir", "/nonexistent/never"])) == 2
    assert "--batch must be 1 to 255 objects, got 256" in capsys.readouterr().err


def test_plot_is_refused_where_nothing_is_drawn_and_without_matplotlib(capsys, monkeypatch) -> None:
    import argparse

    from kvgate.bench.command import add_arguments, run_bench

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run_bench(p.parse_args(["--objects", "1000", "--plot", "x.svg"])) == 2
    assert "--plot draws the throughput figures, --network and --trace; not --objects" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert run_bench(p.parse_args(["--network", "--plot", "x.svg", "--dir", "/nonexistent/never"])) == 2
    assert "pip install 'kvgate[plot]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--plot", "x.jpg"])


def _ttft_row(label: str, median_s: float) -> dict:
    return {"label": label, "ttft_s": [median_s * 0.9, median_s, median_s * 1.2], "median_s": median_s,
            "min_s": median_s * 0.9, "max_s": median_s * 1.2}


@pytest.mark.slow  # matplotlib's first use on a machine runs fc-list to build its font cache
def test_vllm_ttft_replot_draws_each_restore_beside_fs(tmp_path: Path) -> None:
    """``make bench-vllm ARGS="--plot F"`` draws what ``--json`` wrote; ``--replot`` draws it again, no engines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_ttft", Path(__file__).parent.parent / "benchmarks" /
                                                  "vllm_ttft.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {"computed": _ttft_row("computed (no cache)", 11.91), "kvgate_ram": _ttft_row("kvgate RAM", 0.125),
            "fs_ram": _ttft_row("fs", 0.25), "kvgate_warm": _ttft_row("kvgate warm", 0.15),
            "fs_warm": _ttft_row("fs warm", 0.2), "kvgate_cold": _ttft_row("kvgate cold", 0.2),
            "fs_cold": _ttft_row("fs cold", 0.16), "cputier_ram": _ttft_row("vLLM CPU tier", 0.1)}
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"rows": rows}))
    drawing = tmp_path / "ttft.svg"
    assert bench.main(["--replot", str(result), "--plot", str(drawing)]) == 0
    svg = drawing.read_text()
    for text in ("RAM tier", "card, page cache warm", "card, page cache dropped", "0.50", "0.75", "1.25",
                 "computed (no cache): median 11.91 s", "kvgate", "vLLM fs tier",
                 "vLLM's own CPU tier: 0.100 s (the floor)"):
        assert text in svg, f"the drawing has {text!r}"
    with pytest.raises(SystemExit):
        bench.parse_args(["--replot", str(result)])  # nowhere to draw it
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", str(drawing), "--miss-only"])  # no restore rows to draw


@pytest.mark.slow
def test_the_put_cpu_script_times_both_sides_and_splits_the_gateways_cpu(tmp_path: Path) -> None:
    """``benchmarks/put_cpu.py``, whose figures docs/benchmarks.md quotes, runs and reports each part."""
    root = SRC.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "put_cpu.py"), "--passes", "5",
                        "--dir", str(tmp_path / "put-cpu")], env=_env(), cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("put of 32 x 2 MiB: best ") and lines[1].startswith("raw verified write")
    ratio = float(lines[2].split()[3].rstrip(","))
    assert 0 < ratio < 5
    cpu = dict(part.rsplit(" ", 1) for part in lines[3].removeprefix("CPU a pass (ms): ").split(", "))
    assert set(cpu) == {"loop user", "loop kernel", "others user", "others kernel", "raw user", "raw kernel"}
    # (clock ticks of 10 ms: five passes of some 20 ms of the gateway's CPU each leave several)
    assert sum(float(cpu[k]) for k in cpu if not k.startswith("raw")) > 0, "the gateway's threads are counted"
    one = re.fullmatch(r"put of one object of 4 KiB: best ([\d.]+) ms, median [\d.]+; raw verified write of one "
                       r"file: best ([\d.]+) ms, median [\d.]+; the request's own cost \(difference of bests\) "
                       r"(-?[\d.]+) ms", lines[4])
    assert one, lines[4]
    put1, raw1, cost = (float(g) for g in one.groups())
    assert put1 > 0 and raw1 > 0 and abs(put1 - raw1 - cost) < 0.015
    assert not (tmp_path / "put-cpu").exists(), "it removes what it wrote"
