"""``kvgate bench``: its flags, and the runs they choose (figures 1-5, ``--cards N``, ``--objects N``,
``--network``, ``--trace FILE``).

``kvgate.cli`` adds the flags (``add_arguments``) and calls ``run_bench`` on
its main thread; a run blocks until it is measured and printed.  SIGTERM and
Ctrl-C stop the gateways before the command returns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable

from kvgate.bench import BenchError
from kvgate.bench.harness import Bench
from kvgate.bench.measure import Plan, fmt_size
from kvgate.bench.network import STEPS as NETWORK_STEPS
from kvgate.bench.network import MAX_OBJECTS as NETWORK_MAX_OBJECTS
from kvgate.bench.network import NetworkBench, plot_network, print_network
from kvgate.bench.objects import STEPS as OBJECTS_STEPS
from kvgate.bench.objects import ObjectsBench
from kvgate.bench.replay import (
    DEFAULT_CAPACITIES,
    DEFAULT_POLICIES,
    TRACE_ONLY,
    Capacity,
    TraceBench,
    TraceOptions,
    plan_runs,
)
from kvgate.bench.report import (
    BAR_LOOKUP_P50_MS,
    BAR_LOOKUP_P99_MS,
    BAR_RATIOS,
    bars_passed,
    cards_comparison,
    cards_notes,
    check_matplotlib,
    plot_bars,
    plot_figures,
    plot_trace,
    print_cards_table,
    print_objects,
    print_table,
    print_trace,
    trace_notes,
)
from kvgate.bench.restores import CardsBench, placements_of
from kvgate.bench.trace import (
    BLOCK_TOKENS,
    GENERATED,
    GENERATED_PREFIX,
    Simulated,
    infinite_cache,
    trace_by_name,
    simulate,
    trace_marks,
    unique_blocks,
    with_shared_head,
)
from kvgate.config import Config, parse_size
from kvgate.placement import PLACEMENTS
from kvgate.tiers.policies import POLICIES
from kvgate.tiers.sampled_ids import card_policy

MAX_BLOCK_SIZE = 16 << 20
DEFAULT_OBJECT_SIZE = 2 << 20
OBJECTS_OBJECT_SIZE = 4 << 10  # --objects: a card of many small objects, as the index sees it


class _Terminated(BaseException):
    """SIGTERM to the bench: unwinds like Ctrl-C, so the gateways are stopped."""


# ---- flags --------------------------------------------------------------------------


def int_arg(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``, or an error naming the value."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value!r}")
        return n
    return parse


def size_arg(least: int, most: int | None = None, why_most: str = "") -> Callable[[str], int]:
    """An argparse type: a size (``16K``, ``2M``) within bounds, or an error naming the value."""
    def parse(value: str) -> int:
        try:
            n = parse_size(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
        if n < least:
            unit = " byte" if least == 1 else ""
            raise argparse.ArgumentTypeError(f"must be at least {least}{unit}, got {value!r}")
        if most is not None and n > most:
            raise argparse.ArgumentTypeError(f"{value!r} is more than {fmt_size(most)}{why_most}")
        return n
    return parse


_size_arg = size_arg(1)


def _plot_arg(value: str) -> str:
    if not value.lower().endswith((".svg", ".png")):
        raise argparse.ArgumentTypeError(f"{value!r}: the plot is an SVG or PNG file; name it FILE.svg or FILE.png")
    return value
_positive_int = int_arg(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure (no table, no progress)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions: the whole bench in well under a minute")
    p.add_argument("--object-size", type=_size_arg, metavar="SIZE",
                   help="bytes per object, e.g. 2M or 256K (default 2M; 4K with --objects)")
    p.add_argument("--batch", type=_positive_int, default=32, metavar="N", help="objects per request (default 32)")
    p.add_argument("--dir", metavar="DIR",
                   help="where the cards and scratch files go; a fresh temp dir is made inside it and removed at "
                        "the end (default ./var/bench); its filesystem is what the card figures measure")
    p.add_argument("--plot", type=_plot_arg, metavar="FILE.svg|FILE.png",
                   help="draw the figures too: kvgate beside each baseline (with --trace: hit rate against "
                        "capacity, one line per policy); needs matplotlib: pip install 'kvgate[plot]'")
    p.add_argument("--threads", type=_positive_int, default=4, metavar="N",
                   help="gateway --thread-pool-size, and thread count of the raw baselines (default 4)")
    g = p.add_argument_group("several cards", "with --cards: restores of long dialogs from a gateway with N cards, "
                                              "instead of the figures above")
    g.add_argument("--cards", type=_positive_int, metavar="N",
                   help="start a gateway with N directory cards (per placement) and measure one long restore and "
                        "--restores concurrent ones, page cache warm and cold")
    g.add_argument("--placement", choices=(*PLACEMENTS, "both"), metavar="{dialog,stripe,both}",
                   help="the gateway's --key-placement; both: one gateway each, in one run (default both)")
    g.add_argument("--blocks", type=_positive_int, default=64, metavar="N",
                   help="blocks (of --object-size) per dialog, all restored by one get (default 64)")
    g.add_argument("--restores", type=_positive_int, default=8, metavar="N",
                   help="concurrent restores of different dialogs, one client connection each (default 8)")
    g = p.add_argument_group("a card of many objects", "with --objects: one directory card of N objects started "
                                                      "cold without and with its index snapshot, instead of the "
                                                      "figures above")
    g.add_argument("--objects", type=int_arg(1000), metavar="N",
                   help="objects on the card (filled once, kept under --dir for the next run with the same N and "
                        "size)")
    g.add_argument("--dialog-blocks", type=_positive_int, default=1000, metavar="N",
                   help="blocks per dialog; a lookup asks for the first 1,000 of one dialog (default 1000)")
    g = p.add_argument_group("a card served over the network", "with --network: reads of --batch objects from a "
                                                                "kvgate:// card served by a server process, warm "
                                                                "and cold, against a raw loopback stream and the "
                                                                "server's raw O_DIRECT read, instead of the "
                                                                "figures above")
    g.add_argument("--network", action="store_true", help="measure a kvgate:// card (kvgate export) over loopback")
    g = p.add_argument_group("the router's scoring", "with --route: the router scoring a 32K-token prompt over 64 "
                                                     "endpoints (an index of overlapping holdings), and hashing it, "
                                                     "instead of the figures above")
    g.add_argument("--route", action="store_true", help="measure kvgate router's block hashing and scoring (no I/O)")
    g = p.add_argument_group("a pull from a peer gateway", "with --pull: --batch objects of --object-size pulled "
                                                           "from a gateway's peer_listen, verified, against a raw "
                                                           "loopback stream of the same bytes, instead of the "
                                                           "figures above")
    g.add_argument("--pull", action="store_true", help="measure a pull from a peer gateway (peers, peer_listen)")
    g.add_argument("--kv-bytes-per-token", type=int_arg(1), default=None, metavar="N",
                   help="with --pull: KV bytes per token of the model, for the time to pull a prompt "
                        "(default: Llama-3-8B in bf16, 128 KiB)")
    add_trace_arguments(p)


# ---- --trace flags ------------------------------------------------------------------


_non_negative_int = int_arg(0)
_count_arg = int_arg(1)
_block_size_arg = size_arg(1, MAX_BLOCK_SIZE, " a block; a replay moves every block of the trace")
_ram_arg = size_arg(0)


def _speedup_arg(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value!r}")
    return x


def _policies_arg(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",")]
    for n in names:
        if n not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown eviction policy {n!r} in {value!r}; choose from "
                                             f"{', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r} names a policy twice")
    return names


def _capacities_arg(value: str) -> list[Capacity]:
    try:
        caps = [Capacity.parse(v) for v in value.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len({c.spec for c in caps}) != len(caps):
        raise argparse.ArgumentTypeError(f"{value!r} names a capacity twice")
    return caps


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "trace replay", "with --trace: prefix-cache hit rates of a Mooncake-format trace replayed against real "
                        "gateways, one per policy and capacity, instead of the figures above (--cards N sets "
                        "the cards of each; --dir, --threads and --json apply)")
    g.add_argument("--trace", metavar="FILE",
                   help="JSON lines of {timestamp (ms, optional), input_length, output_length, hash_ids}, e.g. "
                        "benchmarks/data/mooncake-synthetic-trace.jsonl; or a generated trace: "
                        + ", ".join(GENERATED_PREFIX + g for g in GENERATED))
    g.add_argument("--shared-head", type=_non_negative_int, metavar="N",
                   help="prepend N synthetic block ids, the same for every request (one system prompt in front of "
                        "every conversation) (default 0)")
    g.add_argument("--policies", type=_policies_arg, metavar="P,P",
                   help=f"the gateway's --eviction-policy values to compare (default {','.join(DEFAULT_POLICIES)})")
    caps = ",".join(DEFAULT_CAPACITIES).replace("%", "%%")  # argparse formats help with %
    g.add_argument("--capacity", type=_capacities_arg, metavar="C,C",
                   help="cache size over all cards, split evenly: shares of the replayed requests' distinct blocks x "
                        f"--block-size (5%%), or sizes (64M) (default {caps})")
    g.add_argument("--block-size", type=_block_size_arg, metavar="SIZE",
                   help="bytes stored per block: small, so a replay is quick (default 16K)")
    g.add_argument("--ram", type=_ram_arg, metavar="SIZE",
                   help="the gateway's RAM tier (--max-bytes) (default 0: the figures are about the cards)")
    g.add_argument("--speedup", type=_speedup_arg, metavar="X",
                   help="honour the timestamps divided by X (default: no waiting, as fast as possible)")
    g.add_argument("--requests", type=_count_arg, metavar="N", help="replay only the first N requests")
    g.add_argument("--in-process", action="store_true", default=None,
                   help="no gateway: drive the eviction policies in this process (fast; one pool of the whole "
                        "capacity, no cards)")


def wants_trace(args: argparse.Namespace) -> bool:
    """Whether the command line asks for the trace replay (or names one of its flags)."""
    return getattr(args, "trace", None) is not None or any(getattr(args, n, None) is not None for n in TRACE_ONLY)


# ---- running ------------------------------------------------------------------------


def _drive(make: Callable[[Callable[[str], None]], Bench], steps: list[str], quiet: bool) -> dict[str, Any] | int:
    """Run a bench with a progress bar on stderr; its measurements, or the exit status when it failed."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description:<26}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=quiet)
    task = progress.add_task("kvgate bench", total=len(steps) - 1)

    def step(name: str) -> None:
        progress.update(task, description=name, completed=steps.index(name))

    def on_sigterm(_sig: int, _frame: FrameType | None) -> None:
        raise _Terminated()

    # SIGTERM unwinds like Ctrl-C, so the gateways are stopped and the files removed.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    bench = make(step)
    try:
        with progress:
            try:
                measured = bench.run()
            finally:
                progress.update(task, description="stopping gateways")
                bench.close()
            progress.update(task, completed=len(steps) - 1)
    except (KeyboardInterrupt, _Terminated):
        print("kvgate bench: interrupted; gateways stopped", file=sys.stderr)
        return 130
    except (BenchError, OSError, RuntimeError) as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        for tail in bench.died:
            print(tail, file=sys.stderr)
        return 1
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return measured


def _draw(path: str | None, draw: Callable[[dict[str, Any], str], None], result: dict[str, Any]) -> int:
    """Draw ``result`` to ``path`` (if asked); 0, or 1 when the drawing failed (said; the figures are printed
    anyway)."""
    if path is None:
        return 0
    try:
        draw(result, path)
    except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the measurements
        print(f"kvgate bench: --plot {path}: {e}", file=sys.stderr)
        return 1
    return 0


def _matplotlib_missing(args: argparse.Namespace) -> bool:
    """With --plot, whether matplotlib is missing (said, before anything is measured)."""
    if getattr(args, "plot", None) is None:
        return False
    try:
        check_matplotlib()
    except BenchError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return True
    return False


def run_bench(args: argparse.Namespace) -> int:
    """Run every figure; 0 even when a bar fails (a measurement is not a test), 1 on errors, 2 on bad usage."""
    if getattr(args, "plot", None) is not None and not wants_trace(args):
        if getattr(args, "objects", None) is not None or getattr(args, "cards", None) is not None:
            print("kvgate bench: --plot draws the throughput figures, --network and --trace; not --objects or "
                  "--cards", file=sys.stderr)
            return 2
        if _matplotlib_missing(args):
            return 2
    if getattr(args, "route", False):
        return run_route_bench(args)
    if getattr(args, "objects", None) is not None:
        return run_objects_bench(args)
    if args.object_size is None:
        args.object_size = DEFAULT_OBJECT_SIZE
    if getattr(args, "network", False):
        return run_network_bench(args)
    if getattr(args, "pull", False):
        return run_pull_bench(args)
    if wants_trace(args):
        return run_trace_bench(args)
    if getattr(args, "cards", None) is not None:
        return run_cards_bench(args)
    if getattr(args, "placement", None) is not None:
        print("kvgate bench: --placement needs --cards N", file=sys.stderr)
        return 2
    plan = Plan.from_args(args)
    parent = args.dir or os.path.join(".", "var", "bench")
    started = time.monotonic()
    steps = ["starting gateways", "RAM-tier get", "RAM-tier get into plain buffers", "RAM-tier get over TCP",
             "card get (warm)", "card get (warm) into plain buffers", "card get (cold)", "card put", "lookup",
             "stopping gateways"]
    measured = _drive(lambda step: Bench(plan, parent, step), steps, args.json)
    if isinstance(measured, int):
        return measured

    result: dict[str, Any] = {
        "config": {
            "object_size": plan.object_size, "batch": plan.batch, "pass_bytes": plan.pass_bytes,
            "threads": plan.threads, "quick": plan.quick, "cores": os.cpu_count(), "dir": os.path.abspath(parent),
            "budget_s": plan.budget_s, "min_rounds": plan.min_rounds, "max_rounds": plan.max_rounds,
            "cold_rounds": plan.cold_rounds, "lookup_reps": plan.lookup_reps, "python": sys.version.split()[0],
        },
        **measured,
        "bar_limits": {**{f"{name}_ratio_min": v for name, v in BAR_RATIOS.items()},
                       "lookup_p50_ms_max": BAR_LOOKUP_P50_MS, "lookup_p99_ms_max": BAR_LOOKUP_P99_MS},
        "elapsed_s": time.monotonic() - started,
    }
    result["bars"] = bars_passed(result["figures"])
    drawn = _draw(args.plot, plot_figures, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return drawn


def run_route_bench(args: argparse.Namespace) -> int:
    """``--route``: the router's ``score`` over a filled index, and the prompt's hashing; in-process, no I/O."""
    from kvgate.bench.route import print_route, route_bench
    started = time.monotonic()
    result = route_bench(reps=300 if args.quick else 3000)
    result["elapsed_s"] = time.monotonic() - started
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_route(result)
    return 0


def run_pull_bench(args: argparse.Namespace) -> int:
    """``--pull``: a pull from a peer gateway's ``peer_listen`` against a raw loopback stream (``kvgate.bench.pull``)."""
    from kvgate.bench.pull import DEFAULT_KV_BYTES_PER_TOKEN, print_pull, pull_bench
    started = time.monotonic()
    try:
        result = pull_bench(args.object_size, args.batch or 32, rounds=3 if args.quick else 9, workdir=args.dir,
                            kv_bytes_per_token=args.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN)
    except (OSError, RuntimeError, TimeoutError) as e:
        print(f"kvgate bench --pull: {e}", file=sys.stderr)
        return 1
    result["elapsed_s"] = time.monotonic() - started
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_pull(result)
    return 0


def run_objects_bench(args: argparse.Namespace) -> int:
    """``--objects N``: one card of N objects, its start-up without and with a snapshot, and its index's memory."""
    started = time.monotonic()
    size = args.object_size or OBJECTS_OBJECT_SIZE
    measured = _drive(lambda step: ObjectsBench(args, size, step), OBJECTS_STEPS, args.json)  # type: ignore[arg-type]
    if isinstance(measured, int):
        return measured
    measured["elapsed_s"] = time.monotonic() - started
    if args.json:
        print(json.dumps(measured, indent=2))
    else:
        print_objects(measured)
    return 0


def run_network_bench(args: argparse.Namespace) -> int:
    """``--network``: a ``kvgate://`` card's reads, warm and cold, against the raw limits of the same run."""
    if args.batch > NETWORK_MAX_OBJECTS:
        print(f"kvgate bench: --network: --batch must be 1 to {NETWORK_MAX_OBJECTS} objects, got {args.batch}",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    parent = args.dir or os.path.join(".", "var", "bench")
    rounds = 5 if args.quick else 15
    measured = _drive(lambda step: NetworkBench(parent, args.object_size, args.batch, rounds, step),  # type: ignore[arg-type]
                      NETWORK_STEPS, args.json)
    if isinstance(measured, int):
        return measured
    measured["elapsed_s"] = time.monotonic() - started
    measured["bars"] = {k: f["ratio"] >= f["bar"] for k, f in measured["figures"].items() if f["bar"] is not None}
    drawn = _draw(args.plot, plot_network, measured)
    if args.json:
        print(json.dumps(measured, indent=2))
    else:
        print_network(measured)
    return drawn if measured["verified"] else 1


def run_cards_bench(args: argparse.Namespace) -> int:
    """``--cards N``: long restores under each placement, against raw reads of the same files."""
    plan = Plan.from_args(args)
    parent = args.dir or os.path.join(".", "var", "bench")
    placements = placements_of(args.placement)
    started = time.monotonic()
    nr = args.restores
    steps = ["starting gateways",
             *[f"{p}: {what}" for p in placements for what in ("writing", "single restore warm", "single restore cold",
                                                                f"{nr} restores warm", f"{nr} restores cold")],
             "stopping gateways"]
    made: list[CardsBench] = []

    def make(step: Callable[[str], None]) -> CardsBench:
        made.append(CardsBench(plan, parent, step, cards=args.cards, placements=placements, blocks=args.blocks,
                               restores=nr))
        return made[0]

    measured = _drive(make, steps, args.json)
    if isinstance(measured, int):
        return measured
    bench = made[0]
    filesystems = max(r["card_filesystems"] for r in measured["placements"].values())
    result: dict[str, Any] = {
        "mode": "cards",
        "config": {
            "cards": args.cards, "placements": placements, "slots": bench.slots, "object_size": plan.object_size,
            "blocks": args.blocks, "dialog_bytes": bench.dialog_bytes, "restores": nr,
            "concurrent_bytes": bench.dialog_bytes * nr, "threads": plan.threads,
            "baseline_threads": bench.thread_counts, "io_timeout_ms": Config().io_timeout_ms, "quick": plan.quick,
            "cores": os.cpu_count(),
            "dir": os.path.abspath(parent), "cards_share_one_filesystem": filesystems == 1,
            "card_filesystems": filesystems, "budget_s": plan.budget_s, "min_rounds": plan.min_rounds,
            "max_rounds": plan.max_rounds, "cold_rounds": plan.cold_rounds, "python": sys.version.split()[0],
        },
        **measured,
        "elapsed_s": time.monotonic() - started,
    }
    result["stripe_vs_dialog"] = cards_comparison(result["placements"])
    result["notes"] = cards_notes(result["config"], result["placements"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_cards_table(result)
    return 0


def _figure_row(restored: int, total: int, infinite: int) -> dict[str, Any]:
    return {"restored_blocks": restored, "share_of_all": restored / total if total else 0.0,
            "share_of_infinite": restored / infinite if infinite else None}


def _followed(orders: dict[str, int]) -> dict[str, float] | None:
    """The share of its evictions a switching policy chose in each order; None for one that does not switch."""
    n = sum(orders.values())
    return {order: k / n for order, k in orders.items()} if n else None


def run_trace_bench(args: argparse.Namespace) -> int:
    """``--trace FILE``: 0 when the replay ran, 1 when it failed, 2 on bad usage."""
    try:
        opts = TraceOptions.from_args(args)
        if opts.plot is not None:
            check_matplotlib()
        requests = with_shared_head(trace_by_name(opts.trace, opts.requests), opts.shared_head)
    except BenchError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    unique = unique_blocks(requests)
    inf_hits, blocks = infinite_cache(requests)
    try:
        runs = plan_runs(opts, requests, unique)
    except BenchError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    # The policies alone (as the cards run them), one pool of the whole capacity: cheap, so always there
    # beside the gateway's figure.
    marks = trace_marks(requests)
    cards = 1 if opts.in_process else opts.cards
    in_process: dict[tuple[str, str], tuple[Simulated, float]] = {}
    for r in runs:
        cpu = time.process_time()
        sim = simulate(requests, marks, card_policy(r.policy), [r.blocks_per_card * cards], block_size=opts.block_size)
        in_process[(r.policy, r.capacity.spec)] = sim, time.process_time() - cpu
    if not opts.in_process:
        steps = ["starting gateways", *[r.label for r in runs], "stopping gateways"]
        measured = _drive(lambda step: TraceBench(opts, requests, marks, runs, step), steps, opts.json)
        if isinstance(measured, int):
            return measured
    rows = []
    for r in runs:
        sim, cpu_s = in_process[(r.policy, r.capacity.spec)]
        row: dict[str, Any] = {
            "policy": r.policy,
            "capacity": {"spec": r.capacity.spec, "asked_bytes": r.total_bytes,
                         "payload_bytes": r.blocks_per_card * cards * opts.block_size,
                         "share_of_distinct": r.blocks_per_card * cards / unique,
                         "blocks": r.blocks_per_card * cards,
                         "blocks_per_card": None if opts.in_process else r.blocks_per_card,
                         "card_capacity_bytes": None if opts.in_process else r.card_capacity},
            # The replay's CPU time per block of a request: the policy's cost per put or hit, and the replay's
            # own work (the same in every row: the difference between two rows is the policies').
            "in_process": {**_figure_row(sim.restored, sim.total, inf_hits), "followed": _followed(sim.orders),
                           "cpu_us_per_block": cpu_s / sim.total * 1e6 if sim.total else None},
        }
        if r.measured:
            row["gateway"] = {**_figure_row(r.measured["restored_blocks"], r.measured["blocks"], inf_hits),
                              **{k: v for k, v in r.measured.items() if k != "restored_blocks"},
                              "followed": _followed(r.measured["orders"])}
            mod = r.measured["model"]
            row["gateway"]["model"] = {**mod, **_figure_row(mod["restored_blocks"], blocks, inf_hits)}
        rows.append(row)
    result: dict[str, Any] = {
        "mode": "trace",
        "trace": {"path": opts.trace, "name": os.path.basename(opts.trace), "requests": len(requests),
                  "blocks": blocks, "distinct_blocks": unique, "shared_head": opts.shared_head,
                  "block_tokens": BLOCK_TOKENS, "infinite_cache": _figure_row(inf_hits, blocks, inf_hits)},
        "config": {"policies": opts.policies, "capacities": [c.spec for c in opts.capacities],
                   "cards": None if opts.in_process else opts.cards,
                   "slots": None if opts.in_process else Config().storage_slots,
                   "block_size": opts.block_size, "ram": None if opts.in_process else opts.ram,
                   "speedup": opts.speedup, "in_process": opts.in_process, "threads": opts.threads,
                   "cores": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": rows,
        "elapsed_s": time.monotonic() - started,
    }
    result["notes"] = trace_notes(result)
    drawn = _draw(opts.plot, plot_trace, result)
    print_trace(result, opts.json)
    return drawn
