"""``kvgate stat``'s tables (``kvgate.statview``): whole headers at 80 columns, rates, --namespaces, --watch."""

from __future__ import annotations

import json
import re

import pytest
from rich.console import Console

from kvgate import statview
from tests.helpers import run_kvgate

LONG_NS = "vllm|meta-llama/Llama-3.1-8B-Instruct|tp0of1|bf16|a-long-namespace-name"


@pytest.fixture
def busy(gateway_factory, tmp_path):
    """A gateway on a card at a long path, with two namespaces that stored and read."""
    card = tmp_path / "a-rather-long-directory-name-for-the-cards" / "nvme0-card-directory"
    card.mkdir(parents=True)
    gw = gateway_factory(["--storage-devices", str(card), "--max-bytes", "64M"], create_cards=False)
    for ns in (LONG_NS, "sglang|model-b"):
        with gw.client(ns) as c:
            assert all(c.put_many([b"k%d" % i for i in range(30)], [b"x" * 100_000] * 30))
            c.get_many([b"k1", b"absent"])
    return gw


def _rendered(renderable, width: int = 80) -> str:
    con = Console(width=width, record=True, color_system=None)
    con.print(renderable)
    return con.export_text()


def _head(lines: list[str]) -> int:
    """The index of a table's header line: the one above its rule."""
    return next(i for i, line in enumerate(lines) if line.strip().startswith("─")) - 1


def _first_column(text: str, headers: list[str]) -> str:
    """The first column's text, lines joined (a name folded over several lines comes back whole)."""
    lines = text.splitlines()
    head = _head(lines)
    end = re.search(rf"\s{re.escape(headers[1])}(\s|$)", lines[head]).start()
    return "".join(line[:end].strip() for line in lines[head + 2:])


def test_every_table_keeps_its_headers_whole_at_80_columns(busy) -> None:
    snap = busy.stats()
    tables = [statview.tiers_table(snap), *statview.cards_tables(snap), *statview.namespaces_tables(snap),
              statview.rates_table(snap, snap, 1.0),
              statview.card_list_table([{**c, "slots": 1024, "state": "serving"} for c in snap["cards"]], 0, "f")]
    for t in tables:
        text = _rendered(t)
        assert max(len(line) for line in text.splitlines()) <= 80, text
        headers = [str(c.header) for c in t.columns]
        line = text.splitlines()[_head(text.splitlines())]
        for h in headers:
            assert re.search(rf"(^|\s){re.escape(h)}(\s|$)", line), f"{h!r} is cut in {line!r}"
    whole = _rendered(statview.view(snap))
    assert max(len(line) for line in whole.splitlines()) <= 80
    cards = statview.cards_tables(snap)[0]
    names = _first_column(_rendered(cards), [str(c.header) for c in cards.columns])
    assert names == snap["cards"][0]["serial"] + snap["cards"][0]["location"], "serial and path fold, whole"


def test_the_footer_says_which_path_gets_took(busy) -> None:
    snap = busy.stats()
    text = _rendered(statview.footer(snap))
    line = next(x for x in text.splitlines() if x.startswith("gets by path: "))
    shown = dict(re.findall(r"([a-z ]+?) (\d+)(?:, |$)", line.removeprefix("gets by path: ").strip()))
    assert {k.replace(" ", "_"): int(v) for k, v in shown.items()} == snap["get_paths"]
    assert sum(snap["get_paths"].values()) >= 2  # one get_many per namespace
    files = next(x for x in text.splitlines() if x.startswith("card objects read out of lent files: "))
    assert files == (f"card objects read out of lent files: {snap['files_lent']['objects']} "
                     f"({snap['files_lent']['open']} open now)")


def test_rates_come_from_the_counters_of_two_snapshots() -> None:
    tier = {"hits": 10, "misses": 4, "bytes_read": 1 << 20, "bytes_written": 0}
    before = {"tiers": {"ram": tier}, "lookups": 100}
    after = {"tiers": {"ram": {**tier, "hits": 30, "bytes_read": 3 << 20}}, "lookups": 140}
    text = _rendered(statview.rates_table(before, after, 2.0))
    assert "per second over the last 2.0 s: 20 lookups" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("ram"))
    assert row.split()[1:] == ["10", "0", "1.0", "MiB", "0", "B"]


@pytest.mark.slow
def test_stat_namespaces_watch_and_a_reader_that_goes(busy) -> None:
    r = run_kvgate("stat", "--socket", busy.socket, "--namespaces", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "namespace traffic" in r.stdout and "tiers" not in r.stdout
    held = r.stdout.split("namespace traffic")[0]
    assert _first_column(held, ["namespace", "RAM objects"]) == "sglang|model-b" + LONG_NS, "sorted, whole"
    r = run_kvgate("stat", "--socket", busy.socket, "--namespaces", "--json")
    got = json.loads(r.stdout)
    assert set(got) == {LONG_NS, "sglang|model-b"} and got["sglang|model-b"]["card_objects"] == 30
    r = run_kvgate("stat", "--socket", busy.socket, "--watch", "0.2", "--updates", "2", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "per second over the last" in r.stdout and "cards" in r.stdout
    bad = run_kvgate("stat", "--socket", busy.socket, "--watch", "1", "--json")
    assert bad.returncode == 2 and "--json prints one snapshot" in bad.stderr


def test_names_a_client_chose_are_shown_as_they_are_never_as_markup() -> None:
    """Namespaces come from clients and paths from operators: ``[/]`` or ``[bold]`` in one is text."""
    snap = {"namespaces": {"[bold]x[/bold]": {"ram_objects": 1, "ram_bytes": 1, "card_objects": 0, "card_bytes": 0,
                                              "sets": 1, "bytes_written": 1, "gets": 0, "hits": 0, "bytes_read": 0},
                           "odd[/]": {"ram_objects": 0, "ram_bytes": 0, "card_objects": 0, "card_bytes": 0,
                                      "sets": 0, "bytes_written": 0, "gets": 0, "hits": 0, "bytes_read": 0}}}
    text = _rendered(statview.view(snap, namespaces_only=True), width=120)
    assert "[bold]x[/bold]" in text and "odd[/]" in text
    card = {"serial": "s", "location": "/mnt/[a]/card", "state": "serving", "slots": 1}
    assert "/mnt/[a]/card" in _rendered(statview.card_list_table([card], 0, "f"), width=120)


# ---- strings others chose ---------------------------------------------------------------------------------

# A terminal title (OSC), a colour and a screen clear (CSI, and its one-byte form), a right-to-left override,
# and a newline that starts a row of its own.
HOSTILE = "ns\x1b]0;owned\x07\x1b[31m\x9b2J\u202e\nforged-row"
HOSTILE_SHOWN = r"ns\x1b]0;owned\x07\x1b[31m\x9b2J\u202e\x0aforged-row"
RAW_CONTROLS = ("\x1b", "\x07", "\x9b", "\u202e")


def test_shown_writes_every_control_character_as_its_escape() -> None:
    assert statview.shown(HOSTILE) == HOSTILE_SHOWN
    assert statview.shown("vllm|meta-llama/Llama-3.1-8B|tp0of1|bf16 é 模型") == \
        "vllm|meta-llama/Llama-3.1-8B|tp0of1|bf16 é 模型", "printable text (any script) is left alone"
    assert statview.shown("a\tb\rc\x00d\x7fe\u2028f\u2066g") == r"a\x09b\x0dc\x00d\x7fe\u2028f\u2066g"
    assert statview.cell("[bold]x\n") == r"\[bold]x\x0a"


def test_a_card_has_one_state_word_in_stat_and_in_the_card_list() -> None:
    base = {"serial": "s", "location": "/c", "slots": 1, "objects": 0, "used_bytes": 0, "capacity_bytes": 0,
            "hits": 0, "misses": 0, "errors": 0, "bytes_read": 0, "bytes_written": 0}
    for row, word in [({"active": True, "read_only": False, "state": "serving"}, "serving"),
                      ({"active": True, "read_only": True, "state": "serving"}, "read_only"),
                      ({"active": True, "read_only": False, "state": "draining"}, "draining"),
                      ({"active": False, "read_only": False, "state": "inactive"}, "inactive"),
                      ({"active": False, "read_only": False, "state": "inactive", "held_out": "no agent"}, "held_out")]:
        card = {**base, **row}
        listed = _rendered(statview.card_list_table([card], 0, "f"), width=120)
        stat = _rendered(statview.cards_tables({"cards": [card]})[0], width=120)
        assert re.search(rf"\s{word}\s", listed) and re.search(rf"\s{word}\s", stat), (word, listed, stat)
    pending = _rendered(statview.card_list_table([{"serial": None, "location": "/p", "state": "pending",
                                                   "slots": 0}], 0, "f"), width=120)
    assert re.search(r"\spending\s", pending), pending


def test_the_card_list_keeps_serials_whole_at_80_columns_and_folds_paths() -> None:
    serial = "0123456789abcdef0123456789abcdef"
    path = "/srv/a-rather-long-directory-name-for-the-cards/nvme0-card-directory-" + "x" * 30
    cards = [{"serial": serial, "location": path, "state": state, "slots": 1024, "objects": 123456,
              "used_bytes": 123 << 30, "capacity_bytes": 1023 << 30} for state in ("serving", "inactive")]
    text = _rendered(statview.card_list_table(cards, 7, "0123456789abcdef"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert sum(1 for line in lines if re.match(rf"\s*{serial}\s", line)) == 2, f"a serial on one line: {text}"
    names = _first_column(text, [str(c.header) for c in statview.card_list_table(cards, 7, "f").columns])
    assert names == (serial + path) * 2, "the locations fold, whole"
    for word in ("capacity", "inactive", "1024"):
        assert word in text, (word, text)


@pytest.mark.slow
def test_stat_and_cards_show_what_clients_and_cards_named_escaped_and_json_as_it_is(gateway_factory,
                                                                                   tmp_path) -> None:
    card = tmp_path / "card\x1b]0;owned\x07\nforged-row"
    card.mkdir()
    gw = gateway_factory(["--storage-devices", str(card)], create_cards=False)
    with gw.client(HOSTILE, engine_id="engine\x1b[2J\nforged-row") as c:
        assert c.put_many([b"k"], [b"v" * 1000]) == [True]
        for args in (["stat"], ["stat", "--namespaces"], ["cards"]):
            r = run_kvgate(*args, "--socket", gw.socket, env={"COLUMNS": "200"})
            assert r.returncode == 0, r.stderr
            for raw in RAW_CONTROLS:
                assert raw not in r.stdout, (args, raw, r.stdout)
            assert not any(line.lstrip().startswith("forged-row") for line in r.stdout.splitlines()), r.stdout
            assert r"\x0aforged-row" in "".join(line.strip() for line in r.stdout.splitlines()), (args, r.stdout)
        r = run_kvgate("stat", "--socket", gw.socket, env={"COLUMNS": "200"})
        assert r"engine\x1b[2J\x0aforged-row" in r.stdout and HOSTILE_SHOWN in r.stdout, r.stdout
        assert "serving" in r.stdout and "active" not in r.stdout, "stat and cards say the same word"
        assert "serving" in run_kvgate("cards", "--socket", gw.socket).stdout
        snap = json.loads(run_kvgate("stat", "--socket", gw.socket, "--json").stdout)
        assert HOSTILE in snap["namespaces"] and snap["cards"][0]["location"] == str(card), "JSON stays JSON"


@pytest.mark.slow
def test_watch_into_a_file_writes_each_view_as_it_is_taken_and_ends_on_sigterm(gateway, tmp_path) -> None:
    import signal
    import subprocess
    import sys

    from tests.helpers import kvgate_env, wait_until

    out = tmp_path / "watch.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "stat", "--watch", "0.2", "--socket", gateway.socket],
                                stdout=f, stderr=subprocess.PIPE, env=kvgate_env({"COLUMNS": "100"}))
    try:
        wait_until(lambda: out.read_text().count("per second over the last") >= 2, 20,
                   lambda: f"two views with rates in the file while it runs: {out.read_text()!r}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert "\x1b" not in text and "Traceback" not in proc.stderr.read().decode()
    views = text.count("tiers")
    assert views >= 3 and len(re.findall(r"^─* ?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ─*$", text, re.M)) == views, text
