"""What ``kvgate bench`` prints: the tables of each mode, the notes under them, the bars, and the plot.

Called from the command's thread once everything is measured; only prints
(or draws a PNG), nothing here measures.
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.bench import BenchError
from kvgate.bench.measure import fmt_size
from kvgate.bench.restores import CARDS_FIGURES

# The bars: ratios to the physical baseline measured in the same run (or, for
# lookups, latencies an engine's scheduler can afford on every step).  One
# copy at the medium's speed is the aim: a figure under its bar is a path
# that still costs more than the medium.
BAR_RATIOS = {
    "ram_get": 0.8,  # RAM tier into a registered region vs np.copyto
    "plain_get": 0.8,  # RAM tier into plain buffers vs np.copyto
    "tcp_get": 0.8,  # RAM tier over loopback TCP vs a raw loopback stream
    "card_get_warm": 0.85,  # warm card into a registered region vs open+preadv+close
    "plain_card_get_warm": 0.8,  # warm card into plain buffers vs open+preadv+close
    "card_put": 0.8,  # write-through put vs open+pwritev+close+rename
}
BAR_LOOKUP_P50_MS = 0.5
BAR_LOOKUP_P99_MS = 2.0

MODEL_TOLERANCE = 0.01  # gateway vs model, in share of all blocks, before a note says they differ


def gib_s(x: float) -> str:
    return f"{x:.2f} GiB/s"


def base_label(base: dict[str, Any], plain: str) -> str:
    return "direct" if base.get("o_direct") else plain


# ---- figures 1-5 ---------------------------------------------------------------------------


FIGURE_LABELS = [("RAM get to shm", "ram_get"), ("RAM get, plain", "plain_get"), ("RAM get over TCP", "tcp_get"),
                 ("card get, warm", "card_get_warm"), ("card warm, plain", "plain_card_get_warm"),
                 ("card get, cold", "card_get_cold"), ("card put", "card_put")]

BASELINE_SHORT = {"ram_get": "copyto", "plain_get": "copyto", "tcp_get": "socket", "card_get_warm": "preadv",
                  "plain_card_get_warm": "preadv", "card_get_cold": "preadv", "card_put": "pwritev"}


def bars_passed(figures: dict[str, Any]) -> dict[str, bool]:
    out = {name: figures[name]["ratio"] >= limit for name, limit in BAR_RATIOS.items()}
    out["lookup_p50"] = figures["lookup"]["p50_ms"] <= BAR_LOOKUP_P50_MS
    out["lookup_p99"] = figures["lookup"]["p99_ms"] <= BAR_LOOKUP_P99_MS
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cfg, figs, bars = result["config"], result["figures"], result["bars"]

    def bar(ok: bool, text: str) -> str:
        return f"[green]pass[/] {text}" if ok else f"[bold red]FAIL[/] {text}"

    def gib(side: dict[str, Any], note: str = "") -> str:
        return f"{gib_s(side['best_gib_s'])}\n[dim]{note}med {side['median_gib_s']:.2f}[/]"

    short = BASELINE_SHORT

    # Sized to fit 80 columns: the second line of a cell says what the baseline is, and the medians.
    t = Table(title=f"kvgate bench{' --quick' if cfg['quick'] else ''}: best pass, ratio = kvgate / baseline")
    t.add_column("figure")
    t.add_column("kvgate", justify="right")
    t.add_column("baseline", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("bar")
    for label, name in FIGURE_LABELS:
        f = figs.get(name)
        if f is None:
            t.add_row(label, "[yellow]skipped[/]", "-", "-", "-")
            continue
        b = f["baseline"]
        paths = list(f.get("get_paths") or ())
        if f.get("files_lent"):
            paths.append("files")
        checked = f"\n[dim]of {f['bound']:.2f}[/]" if "bound" in f else ""
        t.add_row(label + (f"\n[dim]{', '.join(paths)}[/]" if paths else ""), gib(f["kvgate"]),
                  gib(b, f"{base_label(b, short[name])} x{b['threads']}, "), f"{f['ratio']:.2f}{checked}",
                  bar(bars[name], f">={BAR_RATIOS[name]}") if name in BAR_RATIOS else "-")
    f = figs["lookup"]
    t.add_row(f"lookup {f['keys']} keys", f"p50 {f['p50_ms']:.2f} ms\n[dim]p99 {f['p99_ms']:.2f}\nbest {f['best_ms']:.2f}[/]",
              f"[dim]1 key: p50\n{f['one_key_p50_ms']:.2f} ms[/]", "-",
              bar(bars["lookup_p50"], f"p50<={BAR_LOOKUP_P50_MS:g}ms") + "\n"
              + bar(bars["lookup_p99"], f"p99<={BAR_LOOKUP_P99_MS:g}ms"))
    con.print(t)
    con.print(f"machine: {cfg['cores']} cores; {fmt_size(cfg['object_size'])} objects x {cfg['batch']} = "
              f"{fmt_size(cfg['pass_bytes'])} per pass; gateway and baseline threads {cfg['threads']}; "
              f"passes RAM/plain/TCP/warm/cold/put {figs['ram_get']['kvgate']['passes']}/"
              f"{figs['plain_get']['kvgate']['passes']}/{figs['tcp_get']['kvgate']['passes']}/"
              f"{figs['card_get_warm']['kvgate']['passes']}/"
              f"{figs['card_get_cold']['kvgate']['passes'] if figs['card_get_cold'] else 0}/"
              f"{figs['card_put']['kvgate']['passes']}, {figs['lookup']['reps']} lookups; "
              f"{result['elapsed_s']:.1f} s")
    if any(f and "bound" in f for f in figs.values()):
        con.print("'of': the most the ratio can be for a path that checks every byte, as kvgate does: the same raw "
                  "reads or writes with one XXH3 pass over each payload, measured in the same passes.")
    for name, why in result["skipped"].items():
        con.print(f"[yellow]{name} skipped:[/] {why}")


# ---- --cards --------------------------------------------------------------------------------


def cards_comparison(placements: dict[str, Any]) -> dict[str, Any] | None:
    """stripe / dialog of each figure both measured: kvgate's best pass, and the ratios to each one's baseline."""
    if "dialog" not in placements or "stripe" not in placements:
        return None
    out: dict[str, Any] = {}
    for name in CARDS_FIGURES:
        d, s = placements["dialog"]["figures"][name], placements["stripe"]["figures"][name]
        if d is None or s is None:
            continue
        out[name] = {"kvgate": s["kvgate"]["best_gib_s"] / d["kvgate"]["best_gib_s"],
                     "ratio": s["ratio"] / d["ratio"]}
    return out


def cards_notes(cfg: dict[str, Any], placements: dict[str, Any]) -> list[str]:
    n, t = cfg["cards"], cfg["threads"]
    notes = []
    if n == 1:
        notes.append("One card: both placements put every block on it; the figures compare the gateway with raw "
                     "reads, not placements.")
    elif cfg["cards_share_one_filesystem"]:
        notes.append(f"All {n} cards are directories on one filesystem: a stripe restore reads from {n} cards at "
                     f"once, but here they share one disk and one page cache, so stripe cannot gain what it gains "
                     f"from {n} separate devices; a difference between placements measured here comes from the "
                     f"gateway (its per-card I/O pools, how the dialogs fell on the cards) and from noise. The "
                     f"figures are what this machine measured, nothing more.")
    else:
        notes.append(f"The {n} cards are on {cfg['card_filesystems']} different filesystems.")
    notes.append(f"The gateway runs one I/O pool of {t} threads per card: a restore from one card (dialog) "
                 f"reads on at most {t} threads, one spread over {n} cards (stripe) on up to {t * n}; the "
                 f"single-restore baseline is the best of {', '.join(map(str, cfg['baseline_threads']))} threads. "
                 f"The gateways run with the default card I/O deadline ({cfg['io_timeout_ms']} ms): 8 restores "
                 f"queued on one card wait their turn while the card makes progress, so a slow pass stays a slow "
                 f"pass.")
    for p, r in placements.items():
        bad = [i for i, c in enumerate(r["gateway_cards"]) if c.get("timeouts") or c.get("errors") or c.get("misses")]
        if bad:
            notes.append(f"{p}: the gateway counted timeouts, errors or misses on card(s) {bad}: see gateway_cards.")
    return notes


def print_cards_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cfg, places = result["config"], result["placements"]
    n, nr = cfg["cards"], cfg["restores"]

    def gib(side: dict[str, Any], note: str = "") -> str:
        return f"{gib_s(side['best_gib_s'])}\n[dim]{note}med {side['median_gib_s']:.2f}[/]"

    def spread(counts: list[int]) -> str:
        return f"{sum(1 for c in counts if c)} of {len(counts)}\n[dim]{'/'.join(map(str, counts))}[/]"

    t = Table(title=f"kvgate bench --cards {n}{' --quick' if cfg['quick'] else ''}: restores of "
                    f"{cfg['blocks']} x {fmt_size(cfg['object_size'])} dialogs; best pass, ratio = kvgate / baseline")
    for col, just in (("placement", "left"), ("figure", "left"), ("kvgate", "right"), ("baseline", "right"),
                      ("ratio", "right"), ("cards read\n[dim]blocks/card[/]", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    labels = {"single_warm": "1 restore, warm", "single_cold": "1 restore, cold",
              "concurrent_warm": f"{nr} restores, warm", "concurrent_cold": f"{nr} restores, cold"}
    for p, r in places.items():
        for i, name in enumerate(CARDS_FIGURES):
            f = r["figures"][name]
            where = spread(r["single_blocks_per_card"] if name.startswith("single") else r["concurrent_blocks_per_card"])
            if f is None:
                t.add_row(p if i == 0 else "", labels[name], "[yellow]skipped[/]", "-", "-", where)
                continue
            b = f["baseline"]
            t.add_row(p if i == 0 else "", labels[name], gib(f["kvgate"]),
                      gib(b, f"{base_label(b, 'preadv')} x{b['threads']}, "),
                      f"{f['ratio']:.2f}", where, end_section=i == len(CARDS_FIGURES) - 1)
    con.print(t)
    passes = [str(r["figures"][name]["kvgate"]["passes"]) if r["figures"][name] else "0"
              for r in places.values() for name in CARDS_FIGURES]
    con.print(f"machine: {cfg['cores']} cores; {n} directory cards, {cfg['slots']} slots; a dialog is "
              f"{cfg['blocks']} x {fmt_size(cfg['object_size'])} = {fmt_size(cfg['dialog_bytes'])}, one get_many "
              f"into registered shm; {nr} restores = {nr} client threads and connections, one dialog each; "
              f"gateway --thread-pool-size {cfg['threads']}; passes {'/'.join(passes)}; {result['elapsed_s']:.1f} s")
    for p, r in places.items():
        con.print(f"{p}: the single dialog's blocks are on {r['cards_used']} of {n} cards "
                  f"({'/'.join(map(str, r['single_blocks_per_card']))}); the {nr} dialogs touch each card "
                  f"{'/'.join(map(str, r['concurrent_dialogs_per_card']))} times")
    cmp = result.get("stripe_vs_dialog")
    if cmp:
        parts = [f"{labels[k]} x{v['kvgate']:.2f} (ratio x{v['ratio']:.2f})" for k, v in cmp.items()]
        con.print("stripe / dialog: kvgate's best pass (the two placements ran one after the other, so this "
                  "carries the machine's drift) and, in brackets, of the ratios to each one's own baseline (the "
                  "fairer comparison): " + "; ".join(parts))
    for note in result["notes"]:
        con.print(f"[dim]{note}[/]")
    for name, why in result["skipped"].items():
        con.print(f"[yellow]{name} skipped:[/] {why}")


# ---- --trace --------------------------------------------------------------------------------


def print_objects(result: dict[str, Any]) -> None:
    """``--objects N``: the scan and the restart of one card, and what its index costs."""
    from rich.console import Console
    from rich.table import Table

    from kvgate.bench.objects import BAR_BACKGROUND_LOOKUP_MS, BAR_INDEX_BYTES_PER_OBJECT, BAR_READY_S

    con = Console()
    cfg, bars = result["config"], result["bars"]

    def ms(f: dict[str, Any]) -> str:
        return f"p50 {f['p50_ms']:.2f} ms\n[dim]p99 {f['p99_ms']:.2f}, max {f['max_ms']:.2f} ({f['n']})[/]" if f["n"] else "-"

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    t = Table(title=f"kvgate bench --objects {cfg['objects']:,}: {fmt_size(cfg['object_size'])} objects, "
                    f"{cfg['dialog_blocks']} per dialog, lookups of {cfg['lookup_keys']} keys; cold: {cfg['cold']}")
    for col in ("start", "listening", "all keys of a stored dialog found", "indexed", "lookups meanwhile",
                "lookups after", "index bytes/object"):
        t.add_column(col)
    for name, label in (("scan", "no snapshot (every header read)"), ("restart", "snapshot, then checked")):
        f = result[name]
        t.add_row(label, s(f["listening_s"]), s(f["all_keys_found_s"]), s(f["indexed_s"]),
                  ms(f["lookups_during_background"]), ms(f["lookups_after"]), f"{f['index_bytes_per_object']:.0f}")
    con.print(t)
    con.print(f"snapshot {result['snapshot_bytes']:,} bytes; the stop that wrote it took {result['stop_s']:.2f} s; "
              f"empty-card RSS {result['empty_rss_kib'] / 1024:.1f} MiB")
    for line in result["log"]:
        con.print(f"[dim]{line}[/]")
    for key, ok, text in (("ready_s", bars["ready_s"], f"lookups at full speed within {BAR_READY_S:g} s"),
                          ("background_lookup_p99_ms", bars["background_lookup_p99_ms"],
                           f"lookups during a scan or check: p99 <= {BAR_BACKGROUND_LOOKUP_MS:g} ms"),
                          ("index_bytes_per_object", bars["index_bytes_per_object"],
                           f"index <= {BAR_INDEX_BYTES_PER_OBJECT:g} bytes/object")):
        con.print(("[green]pass[/] " if ok else "[bold red]FAIL[/] ") + text)


def trace_notes(result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    notes = []
    if cfg["in_process"]:
        notes.append("In process: the eviction policies alone, one pool of the whole capacity (no cards, no "
                     "gateway), with the dialog marks a gateway gives (shared heads learned the same way).")
        return notes
    notes.append(f"Marks come from the gateway's dialog_mark; placement is dialog over {cfg['slots']} slots; "
                 f"RAM tier {fmt_size(cfg['ram']) if cfg['ram'] else 'off'}. 'in process' is the same policy "
                 "with one pool of the whole capacity; 'model' is the policy per card with the gateway's marks and "
                 "card map.")
    if cfg["ram"]:
        notes.append("With a RAM tier, the reads it serves never reach the cards' policies and it holds blocks of "
                     "its own, so the model (cards only) need not match the gateway.")
    for row in result["runs"]:
        gw = row.get("gateway")
        if gw is None:
            continue
        gap = gw["share_of_all"] - gw["model"]["share_of_all"]
        if abs(gap) > MODEL_TOLERANCE and not cfg["ram"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway restored {gap:+.1%} of all blocks "
                         "against the model of its own cards.")
        if gw["marks_as_in_process"] != gw["requests"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway's dialog marks differ from the "
                         f"in-process ones for {gw['requests'] - gw['marks_as_in_process']} requests.")
        if gw["puts_refused"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: {gw['puts_refused']} blocks were not stored "
                         "(evicted by their own put: a request longer than a card).")
        if gw["corrupt_objects"] or gw["io_errors"] or gw["io_timeouts"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway counted {gw['corrupt_objects']} "
                         f"corrupt objects, {gw['io_errors']} I/O errors, {gw['io_timeouts']} timeouts.")
    return notes


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def print_trace(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    tr, cfg = result["trace"], result["config"]
    gateway = not cfg["in_process"]
    head = f" --shared-head {tr['shared_head']}" if tr["shared_head"] else ""
    t = Table(title=f"kvgate bench --trace {tr['name']}{head}{'' if gateway else ' --in-process'}")
    cols = ["policy", "capacity\n[dim]blocks[/]", "restored\n[dim]of infinite[/]"]
    if gateway:
        cols += ["in process\n[dim]model[/]", "restore\n[dim]GiB/s[/]", "dialogs\n[dim]per card[/]",
                 "bytes\n[dim]per card[/]"]
    cols.append("CPU\n[dim]us a block[/]")
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in result["runs"]:
        cap = row["capacity"]
        cells = [row["policy"], f"{cap['spec']}\n[dim]{cap['blocks']:,}[/]"]
        gw = row.get("gateway")
        fig = gw if gw is not None else row["in_process"]
        cells.append(f"{pct(fig['share_of_all'])}\n[dim]{pct(fig['share_of_infinite'])}[/]")
        if gw is not None:
            def per(key: str) -> str:
                return "/".join(f"{100 * c[key]:.0f}" for c in gw["cards"])

            cells += [f"{pct(row['in_process']['share_of_all'])}\n[dim]{pct(gw['model']['share_of_all'])}[/]",
                      "-" if gw["restore_gib_s"] is None else f"{gw['restore_gib_s']:.2f}",
                      per("conversations_share"), per("bytes_share")]
        cpu = row["in_process"].get("cpu_us_per_block")
        cells.append("-" if cpu is None else f"{cpu:.1f}")
        t.add_row(*cells)
    con.print(t)
    inf = tr["infinite_cache"]
    con.print(f"{tr['requests']:,} requests, {tr['blocks']:,} blocks ({tr['distinct_blocks']:,} distinct); an "
              f"infinite cache restores {inf['restored_blocks']:,} = {pct(inf['share_of_all'])} of all blocks. "
              "'restored': leading blocks found, as a share of all blocks (below: of the infinite cache's); capacity "
              "over all cards, as a share of the distinct blocks; 'CPU': the in-process replay's CPU time per block "
              "of a request, the policy's cost per put or hit with the replay's own (the same in every row)" +
              (f"; {cfg['cards']} directory cards per gateway, one gateway per row, blocks of "
               f"{fmt_size(cfg['block_size'])}; per card: shares in %; {result['elapsed_s']:.1f} s" if gateway
               else f"; {result['elapsed_s']:.1f} s"))
    for row in result["runs"]:
        fig = row.get("gateway") or row["in_process"]
        if fig.get("followed"):
            orders = ", ".join(f"{order} for {pct(share)}" for order, share in fig["followed"].items())
            con.print(f"{row['policy']} at {row['capacity']['spec']} followed, of its evictions: {orders}")
    for note in result["notes"]:
        con.print(f"[dim]{note}[/]")


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install 'kvgate[plot]'") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bars(title: str, rows: list[tuple[str, float, float, str, float]], path: str, note: str = "") -> None:
    """One pair of bars per row (label, kvgate GiB/s, baseline GiB/s, baseline's name, the figure's ratio),
    the ratio above each pair; drawn to ``path`` (the format from its ending: .svg or .png)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(rows) + 2), 4.5))
    xs = range(len(rows))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r[1] for r in rows], width, label="kvgate", color="#2a7ab9")
    ax.bar([x + width / 2 for x in xs], [r[2] for r in rows], width, label="baseline (same run)", color="#b0b0b0")
    for x, (_, k, b, _name, ratio) in zip(xs, rows):
        ax.annotate(f"{ratio:.2f}", (x, max(k, b)), textcoords="offset points", xytext=(0, 4), ha="center",
                    fontsize=9)
    ax.set_xticks(list(xs), [f"{r[0]}\nvs {r[3]}" for r in rows], fontsize=8)
    ax.set_ylabel("GiB/s")
    ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="dimgray")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figures(result: dict[str, Any], path: str) -> None:
    """``kvgate bench --plot``: each throughput figure's best pass beside its baseline's."""
    rows = []
    for label, name in FIGURE_LABELS:
        f = result["figures"].get(name)
        if f is None:
            continue
        b = f["baseline"]
        rows.append((label, f["kvgate"]["best_gib_s"], b["best_gib_s"], base_label(b, BASELINE_SHORT[name]),
                     f["ratio"]))
    lookup = result["figures"]["lookup"]
    cfg = result["config"]
    plot_bars(f"kvgate bench{' --quick' if cfg['quick'] else ''}: best pass, ratio = kvgate / baseline",
              rows, path, note=f"{fmt_size(cfg['object_size'])} objects x {cfg['batch']}, {cfg['cores']} cores; "
                               f"lookup of {lookup['keys']} keys: p50 {lookup['p50_ms']:.2f} ms, "
                               f"p99 {lookup['p99_ms']:.2f} ms")


def plot_trace(result: dict[str, Any], path: str) -> None:
    """``kvgate bench --trace --plot``: restored blocks against capacity, one line per policy."""
    plt = _pyplot()
    tr = result["trace"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    source = "in_process" if result["config"]["in_process"] else "gateway"
    for policy in result["config"]["policies"]:
        rows = sorted((r for r in result["runs"] if r["policy"] == policy),
                      key=lambda r: r["capacity"]["share_of_distinct"])
        xs = [100 * r["capacity"]["share_of_distinct"] for r in rows]
        ys = [100 * r[source]["share_of_all"] for r in rows]
        ax.plot(xs, ys, marker="o", label=policy)
    ax.axhline(100 * tr["infinite_cache"]["share_of_all"], color="grey", linestyle="--", label="infinite cache")
    ax.set_xlabel("capacity, % of the distinct blocks")
    ax.set_ylabel("restored prefix blocks, % of all blocks")
    head = f", shared head {tr['shared_head']}" if tr["shared_head"] else ""
    ax.set_title(f"{tr['name']}{head} ({'in process' if source == 'in_process' else 'kvgate gateways'})")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The rows of ``make bench-vllm`` in the order they are drawn, each kvgate row beside the fs row of its
# engine and page-cache state (``benchmarks/vllm_ttft.py`` names them).
TTFT_PAIRS = (("kvgate_ram", "fs_ram", "RAM tier"), ("kvgate_warm", "fs_warm", "card, page cache warm"),
              ("kvgate_cold", "fs_cold", "card, page cache dropped"))


def plot_ttft(result: dict[str, Any], path: str) -> None:
    """``make bench-vllm ARGS="--plot FILE"``: TTFT per configuration (median, min-max whiskers), kvgate beside
    the ``fs`` tier restoring in the same engine, the ratio of medians above each pair; vLLM's own CPU tier
    (no secondary tier read) as a dashed line over the RAM pair; the computed prefill (about 100x a restore)
    as a note."""
    plt = _pyplot()
    rows = result["rows"]
    pairs = [(k, f, label) for k, f, label in TTFT_PAIRS if k in rows and f in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.38
    for x, (k, f, _label) in enumerate(pairs):
        for dx, key, color, name in ((-width / 2, k, "#2a7ab9", "kvgate"), (width / 2, f, "#b0b0b0", "vLLM fs tier")):
            r = rows[key]
            ax.bar(x + dx, r["median_s"], width, color=color, label=name if x == 0 else None,
                   yerr=[[r["median_s"] - r["min_s"]], [r["max_s"] - r["median_s"]]], capsize=3)
        ratio = rows[k]["median_s"] / rows[f]["median_s"]
        ax.annotate(f"{ratio:.2f}", (x, max(rows[k]["max_s"], rows[f]["max_s"])), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=9)
    ax.set_xticks(range(len(pairs)), [label for _k, _f, label in pairs], fontsize=9)
    ax.set_ylabel("time to first token, s")
    ax.set_ylim(0, 1.15 * max(rows[key]["max_s"] for k, f, _ in pairs for key in (k, f)))  # room for the ratios
    ax.set_title("vLLM TTFT, restored: kvgate beside the fs tier in the same engine (ratio of medians)",
                 fontsize=10)
    floor = rows.get("cputier_ram")
    ram = next((x for x, (k, _f, _l) in enumerate(pairs) if k == "kvgate_ram"), None)
    if floor is not None and ram is not None:  # no secondary tier read at all: what any restore costs the engine
        ax.hlines(floor["median_s"], ram - width, ram + width, colors="black", linestyles="dashed",
                  label=f"vLLM's own CPU tier: {floor['median_s']:.3f} s (the floor)")
    computed = rows.get("computed")
    if computed is not None:  # 60-150x the restores: a note, not a bar that flattens them
        fig.text(0.01, 0.01, f"computed (no cache): median {computed['median_s']:.2f} s", fontsize=8,
                 color="dimgray")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
