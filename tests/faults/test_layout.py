"""Key layout across gateways (SPEC 4): the fingerprint guard, card order, adding a card.

- A gateway whose cards give another layout than ``--key-layout-fingerprint``
  says refuses to start, naming both fingerprints.
- The same cards listed in another order give the same fingerprint and the
  same slot map: what one gateway wrote, the other restores in full.
- Adding a sixth card moves only the slots it wins (about 1/6), so only the
  dialogs on those slots become misses; nothing is ever read wrong.

Cards get fixed serials (labels written by the test) so every run lays keys
out the same way.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from kvgate.placement import SlotMap, fingerprint
from tests.faults.common import (
    Calls,
    Workload,
    balanced_serials,
    label_directory,
    restore,
    serial_of_dialog,
    write,
)
from tests.helpers import run_kvgate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NAMESPACE = "layout-ns"
FP_LINE = re.compile(r"Key layout fingerprint ([0-9a-f]{16})")


def make_cards(base: Path, names, slots: int, low: int, high: int, tag: str) -> dict[str, str]:
    """Directory cards ``base/<name>`` with balanced fixed serials; returns name -> serial."""
    serials = balanced_serials(names, slots, low, high, tag)
    for name, serial in serials.items():
        label_directory(base / name, serial)
    return serials


def cli_fingerprint(paths, slots: int) -> str:
    r = run_kvgate("fingerprint", "--storage-devices", *map(str, paths), "--storage-slots", str(slots))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def gw_args(paths, slots: int, *extra: str) -> list[str]:
    return ["--storage-devices", *map(str, paths), "--storage-slots", str(slots), "--shared-storage", "true",
            "--max-bytes", "0", *extra]


def test_a_gateway_with_another_layout_refuses_to_start(tmp_path: Path, gateway_factory) -> None:
    cards = tmp_path / "cards"
    serials = make_cards(cards, ("a", "b", "c"), 16, 4, 7, "layout")
    first = gateway_factory(gw_args([cards / "a", cards / "b"], 16), name="first")
    logged = FP_LINE.findall(first.log())
    assert logged, first.log()
    fp_first = logged[-1]
    assert first.stats()["gateway"]["fingerprint"] == fp_first
    assert cli_fingerprint([cards / "a", cards / "b"], 16) == fp_first
    assert fp_first == fingerprint(SlotMap([serials["a"], serials["b"]], 16), 1, "dialog")
    fp_second = cli_fingerprint([cards / "a", cards / "b", cards / "c"], 16)
    assert fp_second != fp_first

    r = run_kvgate("serve", *gw_args([cards / "a", cards / "b", cards / "c"], 16, "--key-layout-fingerprint", fp_first),
                   "--port", "0", "--metrics-port", "0", "--shared-memory-size", "8M",
                   "--socket", str(tmp_path / "second.sock"), timeout=30)
    assert r.returncode != 0, f"the second gateway started:\n{r.stderr}"
    assert fp_first in r.stderr and fp_second in r.stderr, r.stderr
    assert "refusing to start" in r.stderr
    assert not (tmp_path / "second.sock").exists()

    # the right fingerprint (same cards, another order) starts, and the first gateway is unharmed
    again = gateway_factory(gw_args([cards / "b", cards / "a"], 16, "--key-layout-fingerprint", fp_first), name="again")
    assert again.stats()["gateway"]["fingerprint"] == fp_first
    assert first.alive() and first.stats()["gateway"]["fingerprint"] == fp_first


def test_same_cards_in_another_order_give_the_same_layout(tmp_path: Path, gateway_factory) -> None:
    cards = tmp_path / "cards"
    names = ("a", "b", "c")
    make_cards(cards, names, 16, 4, 7, "order")
    prints = {cli_fingerprint([cards / n for n in perm], 16) for perm in itertools.permutations(names)}
    assert len(prints) == 1, prints
    (fp,) = prints
    writer = gateway_factory(gw_args([cards / n for n in names], 16), name="writer")
    reader = gateway_factory(gw_args([cards / n for n in ("c", "a", "b")], 16, "--key-layout-fingerprint", fp),
                             name="reader")
    st_w, st_r = writer.stats(), reader.stats()
    assert st_w["gateway"]["fingerprint"] == st_r["gateway"]["fingerprint"] == fp
    # the same serials give the same map (the fingerprint hashes the owner of every slot)
    m_w = SlotMap([c["serial"] for c in st_w["cards"]], 16)
    m_r = SlotMap([c["serial"] for c in st_r["cards"]], 16)
    assert m_w.owner == m_r.owner
    # and the data agrees: everything one wrote, the other restores
    calls = Calls(5.0)
    wl = Workload("order", 30, blocks=2, size=16 << 10)
    with writer.client(NAMESPACE) as cw, reader.client(NAMESPACE) as cr:
        assert all(all(s) for s in write(cw, wl, range(wl.n), calls).values())
        got = restore(cr, wl, range(wl.n), calls)
    assert all(all(hits) and n == wl.blocks for hits, n in got.values())
    by_card = {c["location"]: c["hits"] for c in reader.stats()["cards"]}
    assert all(h > 0 for h in by_card.values()), by_card  # the dialogs really were spread over the cards


def test_adding_a_sixth_card_moves_only_its_share(tmp_path: Path, gateway_factory) -> None:
    cards = tmp_path / "cards"
    slots = 64
    names = tuple(f"card{i}" for i in range(6))
    serials = make_cards(cards, names, slots, 8, 14, "grow")
    five, six = [cards / n for n in names[:5]], [cards / n for n in names]
    fp5, fp6 = cli_fingerprint(five, slots), cli_fingerprint(six, slots)
    assert fp5 != fp6
    m5 = SlotMap([serials[n] for n in names[:5]], slots)
    m6 = SlotMap(list(serials.values()), slots)
    assert fingerprint(m5, 1, "dialog") == fp5 and fingerprint(m6, 1, "dialog") == fp6
    moved = [s for s in range(slots) if m5.owner[s] != m6.owner[s]]
    assert all(m6.owner[s] == serials["card5"] for s in moved), "a slot moved between two old cards"
    assert 0.5 / 6 < len(moved) / slots < 2 / 6, f"{len(moved)} of {slots} slots moved"

    old = gateway_factory(gw_args(five, slots), name="five")
    new = gateway_factory(gw_args(six, slots), name="six")
    assert old.stats()["gateway"]["fingerprint"] == fp5 and new.stats()["gateway"]["fingerprint"] == fp6
    calls = Calls(5.0)
    wl = Workload("grow", 120, blocks=2, size=8 << 10)
    with old.client(NAMESPACE) as co, new.client(NAMESPACE) as cn:
        assert all(all(s) for s in write(co, wl, range(wl.n), calls).values())
        got = restore(cn, wl, range(wl.n), calls)  # every hit compared byte for byte
    lost = {d for d, (hits, _n) in got.items() if not any(hits)}
    kept = {d for d, (hits, _n) in got.items() if all(hits)}
    assert lost | kept == set(range(wl.n)), "a dialog restored in part"
    on_new = {d for d in range(wl.n) if serial_of_dialog(m6, wl.mark(d)) == serials["card5"]}
    assert lost == on_new, "misses are not exactly the dialogs whose slots moved to the new card"
    assert 0 < len(lost) / wl.n < 2.5 / 6, f"{len(lost)} of {wl.n} dialogs moved"
