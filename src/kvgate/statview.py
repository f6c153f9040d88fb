"""``kvgate stat``: a gateway's snapshot as tables that fit an 80-column terminal, once or live.

Every table is laid out so that its column headers stay whole at 80
columns: sizes are short (``12.3 MiB`` wraps at its space when it must),
a card's serial and location share one column that folds, and what does
not fit beside the counts (a card's I/O) is a table of its own.
``watch`` redraws the tables every interval with rates per second worked
out from the counters of the snapshot before.

Runs in the ``kvgate`` command's process; it only formats what
``Client.stats()`` returned (``kvgate.gateway.status.snapshot``'s shape).

Every string a client chose (a namespace, an engine id) or a card or the
registry supplied (a serial, a path, an address) goes through ``shown``
before it reaches a table or a line: a control character in it would
otherwise reach the operator's terminal (an ESC sequence retitles or
rewrites it) or forge a table row (a newline).  The ``kvgate`` command's
other human-readable lines (``cards``, ``cluster``) use it too; JSON
output stays JSON.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# A card label's serial (a uuid4's hex): the narrowest the card column of `kvgate cards` gets.
SERIAL_WIDTH = 32
# Counters of each tier that --watch turns into rates.
TIER_RATES = (("hits", "hits/s", False), ("misses", "misses/s", False), ("bytes_read", "read/s", True),
              ("bytes_written", "written/s", True))


# C0 controls, DEL, C1 controls (0x9b is a one-byte CSI), the Unicode line and paragraph separators (line
# breaks to str.splitlines) and the bidirectional overrides and isolates (they reorder what follows them).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: Any) -> str:
    """``text`` safe to print to a terminal: each control character written as its escape (``\\x1b``,
    ``\\x0a``, ``\\u202e``), so it can neither send the terminal a sequence nor start a line of its own.

    In rich markup (a table cell) use ``cell``: ``[`` starts a tag there."""
    return _CONTROL.sub(_escaped, str(text))


def cell(text: Any) -> str:
    """``shown``, escaped for rich markup: a table cell (or markup line) holding someone else's string."""
    return escape(shown(text))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(title: str, columns: list[str], left: int = 1) -> Table:
    """A table without vertical rules; the first ``left`` columns left-aligned, the rest right-aligned.

    No column is narrower than its header, so a header is never cut; the first column (a name, a path)
    folds anywhere, the others wrap their values at spaces (``12.3 MiB``).
    """
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right", min_width=len(col),
                     overflow="fold" if i == 0 else "ellipsis")
    return t


def headline(snap: dict[str, Any]) -> Text:
    g = snap["gateway"]
    engine = g["engine"]
    return Text.from_markup(
        f"[bold]kvgate {cell(g['version'])}[/] pid {g['pid']}, up {g['uptime_s']:.0f} s, layout "
        f"{cell(g['fingerprint'])} ({cell(g['placement'])}), sessions {g['sessions']} "
        f"({g.get('sessions_in_place', 0)} in place), engine "
        f"{cell(engine['engine_id']) + ' pid ' + str(engine['pid']) if engine else '-'}, reads at "
        f"{cell(g['read_priority'])} priority")


def tiers_table(snap: dict[str, Any]) -> Table:
    """What each tier holds and what it served: the RAM tier, and the cards together (``long``)."""
    t = _table("tiers", ["tier", "objects", "used", "capacity", "evicted", "hits", "misses", "read", "written"])
    for name, v in snap["tiers"].items():
        t.add_row(cell(name), str(v["objects"]), fmt_bytes(v["used_bytes"]), fmt_bytes(v["capacity_bytes"]),
                  str(v["evictions"]), str(v["hits"]), str(v["misses"]), fmt_bytes(v["bytes_read"]),
                  fmt_bytes(v["bytes_written"]))
    return t


def _card_name(c: dict[str, Any], fold: int = 0) -> str:
    """A card's serial over its location (dimmed); both through ``cell``, as a path may hold ``[``.  ``fold``:
    the location cut into lines that long here (the table then never folds the serial, see
    ``card_list_table``)."""
    location = shown(c["location"])
    if fold:
        location = "\n".join(location[i : i + fold] for i in range(0, len(location), fold))
    return f"{cell(c['serial'] or '-')}\n[dim]{escape(location)}[/]"


def _card_state(c: dict[str, Any]) -> str:
    """The state word of ``kvgate cards`` and of the gateway's metrics (``kvgate.gateway.status.card_state``):
    serving, read_only, draining, inactive, held_out."""
    if c.get("held_out"):
        return "[red]held_out[/]"
    if not c["active"]:
        return "[red]inactive[/]"
    if c.get("state") == "draining":
        return "[yellow]draining[/]"
    return "[yellow]read_only[/]" if c["read_only"] else "serving"


def cards_tables(snap: dict[str, Any]) -> list[Table]:
    """The cards' contents and health, then their I/O (a card is its serial over its location)."""
    t = _table("cards", ["card", "state", "objects", "used", "capacity", "hits", "misses", "errors"], left=2)
    io = _table("card I/O", ["card", "read", "written", "page cache copies", "direct reads"])
    for c in snap["cards"]:
        name = _card_name(c)
        t.add_row(name, _card_state(c), str(c["objects"]), fmt_bytes(c["used_bytes"]), fmt_bytes(c["capacity_bytes"]),
                  str(c["hits"]), str(c["misses"]), str(c["errors"]))
        rates = [c.get("cached_copy_bytes_per_second", 0), c.get("direct_read_bytes_per_second", 0)]
        io.add_row(name, fmt_bytes(c["bytes_read"]), fmt_bytes(c["bytes_written"]),
                   *(f"{fmt_bytes(r)}/s" if r else "-" for r in rates))
    return [t, io]


def peers_table(snap: dict[str, Any]) -> Table:
    """The peer gateways this one reads from (``peers``), and what peers read from it (``peer_listen``)."""
    t = _table("peers", ["peer", "asked", "pulled", "bytes", "failures", "resting", "known absent"], left=1)
    for p in snap.get("peers", []):
        t.add_row(cell(p["address"]), str(p["gets"]), str(p["hits"]), fmt_bytes(p["bytes_read"]),
                  str(p["failures"]), f"{p['resting_s']:.0f} s" if p.get("resting_s") else "-",
                  str(p.get("negative_hits", 0)))
        if p.get("namespace_refused"):  # its engines run our namespace's model another way: not asked
            t.add_row(f"  refused: {cell(p.get('namespace_difference', ''))}", str(p["namespace_refused"]),
                      "-", "-", "-", "-", "-")
    sources = snap.get("peer_sources") or {}
    if sources.get("chosen") or sources.get("unknown"):  # requests naming where their KV is (remote_kv_source)
        t.add_row("(requests by source)", f"{sources.get('chosen', 0)} chosen", "-", "-",
                  f"{sources.get('unknown', 0)} unknown", "-", "-")
    served = snap.get("peer_listen")
    if served is not None:
        refused = f"{served['refused']} refused" + (f", {served['tls_failed']} TLS" if served.get("tls_failed") else "")
        t.add_row(f"(served on {cell(served['listen'])})", "-", str(served["served_objects"]),
                  fmt_bytes(served["served_bytes"]), refused, "-", "-")
    return t


def card_list_table(cards: list[dict[str, Any]], generation: int, fingerprint: str) -> Table:
    """``kvgate cards``: the card set, pending cards too, with each card's slots."""
    t = _table(f"cards (generation {generation}, layout {cell(fingerprint)})",
               ["card", "state", "slots", "objects", "used", "capacity"], left=2)
    # A serial is what an operator copies into `kvgate cards drain`: the card column is as wide as the longest
    # and never folds (the locations are cut to that width beforehand), the sizes wrap at their spaces instead.
    # (rich widens a min_width column after fitting the table, past the terminal's edge; stat's tables have
    # too many columns for a whole serial at 80: theirs fold with the location.)
    width = max([len(shown(c["serial"] or "-")) for c in cards] + [SERIAL_WIDTH])
    t.columns[0].no_wrap = True
    for c in cards:
        # A card's word is stat's (read_only, held_out too); an entry with no card yet has only its state.
        state = _card_state(c) if "active" in c else cell(c["state"])
        t.add_row(_card_name(c, width), state, str(c["slots"]),
                  str(c.get("objects", "-")), fmt_bytes(c["used_bytes"]) if "used_bytes" in c else "-",
                  fmt_bytes(c["capacity_bytes"]) if "capacity_bytes" in c else "-")
    return t


def namespaces_tables(snap: dict[str, Any]) -> list[Table]:
    """What each namespace holds (RAM, cards), then what it stored and read."""
    held = _table("namespaces", ["namespace", "RAM objects", "RAM bytes", "card objects", "card bytes"])
    traffic = _table("namespace traffic", ["namespace", "sets", "written", "gets", "hits", "read"])
    for ns, v in sorted((snap.get("namespaces") or {}).items()):
        held.add_row(cell(ns), str(v["ram_objects"]), fmt_bytes(v["ram_bytes"]), str(v["card_objects"]),
                     fmt_bytes(v["card_bytes"]))
        traffic.add_row(cell(ns), str(v["sets"]), fmt_bytes(v["bytes_written"]), str(v["gets"]), str(v["hits"]),
                        fmt_bytes(v["bytes_read"]))
    return [held, traffic]


def footer(snap: dict[str, Any]) -> Text:
    # Which way gets reached the clients' buffers: a lent (cross-memory) count of 0 while
    # session-region gets grow means the one-copy path is off or refused for those clients.
    paths = ", ".join(f"{name.replace('_', ' ')} {n}" for name, n in snap.get("get_paths", {}).items())
    # Card objects the clients read themselves out of files lent open (the one-copy way from a warm card).
    files = snap.get("files_lent")
    return Text(f"lookups {snap['lookups']}, corrupt objects {snap['corrupt_objects']}, io errors {snap['io_errors']}, "
                f"io timeouts {snap['io_timeouts']}, oldest io {snap['oldest_io_age_s']:.3f} s"
                + (f"\ngets by path: {paths}" if paths else "")
                + (f"\ncard objects read out of lent files: {files['objects']} ({files['open']} open now)"
                   if files else ""))


def rates_table(before: dict[str, Any], after: dict[str, Any], seconds: float) -> Table:
    """Per second over the last interval: each tier's hits, misses and bytes, and the lookups."""

    def rate(now: float, was: float) -> float:
        return max(0.0, now - was) / seconds if seconds > 0 else 0.0

    lookups = rate(after["lookups"], before["lookups"])
    t = _table(f"per second over the last {seconds:.1f} s: {lookups:.0f} lookups",
               ["tier", *(label for _, label, _ in TIER_RATES)])
    for name, v in after["tiers"].items():
        was = before["tiers"].get(name, v)
        t.add_row(cell(name), *(fmt_bytes(rate(v[k], was[k])) if is_bytes else f"{rate(v[k], was[k]):.0f}"
                          for k, _label, is_bytes in TIER_RATES))
    return t


def view(snap: dict[str, Any], namespaces_only: bool = False, before: tuple[dict[str, Any], float] | None = None
         ) -> RenderableType:
    """Everything ``kvgate stat`` shows of ``snap`` (``before``: the snapshot of an interval ago, its age)."""
    if namespaces_only:
        return Group(*namespaces_tables(snap))
    parts: list[RenderableType] = [headline(snap)]
    if before is not None:
        parts.append(rates_table(before[0], snap, before[1]))
    parts += [tiers_table(snap), *cards_tables(snap)]
    if snap.get("peers") or snap.get("peer_listen"):
        parts.append(peers_table(snap))
    if snap.get("namespaces"):
        parts += namespaces_tables(snap)
    parts.append(footer(snap))
    return Group(*parts)


def watch(fetch: Callable[[], dict[str, Any]], interval: float, updates: int | None = None,
          namespaces_only: bool = False, console: Console | None = None) -> None:
    """Show ``view`` every ``interval`` seconds (``updates`` times, or until Ctrl-C or SIGTERM), with rates.

    To a terminal, one view redrawn in place; to a file or a pipe (``kvgate stat --watch > file``), each view
    below the last under the time it was taken, flushed at once: a redraw in place reaches no file (rich
    writes a live view there only when it ends).  SIGTERM ends it as Ctrl-C does, the last view shown (on
    the main thread, where the handler can be set; the one before is put back)."""
    con = console or Console()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        (_watch_live if con.is_terminal else _watch_lines)(fetch, interval, updates, namespaces_only, con)
    except KeyboardInterrupt:
        pass
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _views(fetch: Callable[[], dict[str, Any]], interval: float, updates: int | None,
           namespaces_only: bool) -> Iterator[RenderableType]:
    """The first view, then one every ``interval`` seconds with the rates since the one before."""
    snap, taken = fetch(), time.monotonic()
    yield view(snap, namespaces_only)
    done = 0
    while updates is None or done < updates:
        time.sleep(interval)
        now_snap, now = fetch(), time.monotonic()
        yield view(now_snap, namespaces_only, (snap, now - taken))
        snap, taken = now_snap, now
        done += 1


def _watch_live(fetch: Callable[[], dict[str, Any]], interval: float, updates: int | None, namespaces_only: bool,
                con: Console) -> None:
    from rich.live import Live

    views = _views(fetch, interval, updates, namespaces_only)
    with Live(next(views), console=con, auto_refresh=False, transient=False) as live:
        for v in views:
            live.update(v, refresh=True)


def _watch_lines(fetch: Callable[[], dict[str, Any]], interval: float, updates: int | None,
                 namespaces_only: bool, con: Console) -> None:
    for v in _views(fetch, interval, updates, namespaces_only):
        con.rule(time.strftime("%Y-%m-%d %H:%M:%S"), align="left")
        con.print(v)
        con.file.flush()
