"""A card is three parts, each the only writer of its fields: the catalog (``kvgate.tiers.catalog``), the I/O
channel (``kvgate.tiers.channel``) and the life (``kvgate.tiers.life``), put together by ``ManagedCard``.

Read from the source (no import runs): no module assigns an attribute through a card's part
(``mc.catalog.room = ...``, ``self.life.scanned = ...`` in the card, ``catalog.leaving = ...``) or of a
managed card itself (``mc.pattern = ...``); a part changes another's state only by calling it.  And each
part says in its docstring who calls it, on which thread, and what never blocks.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kvgate"
PARTS = {"catalog", "life", "channel"}  # attribute names under which a card holds its parts
CARDS = {"mc", "cs", "managed"}  # what the code calls a ManagedCard


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain does not start at a plain name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += t.elts if isinstance(t, ast.Tuple) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def writes_through_a_part(source: str) -> list[str]:
    """``line: target`` of each assignment to an attribute reached through a card's part or of a card."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if not isinstance(t, ast.Attribute):
                continue
            chain = _chain(t)
            if chain is None:
                continue
            through = chain[:-1]
            if PARTS & set(through[1:] if through[0] == "self" else through) or through[0] in CARDS | PARTS:
                found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def _holds_cards(path: Path, text: str) -> bool:
    """Modules that can hold a managed card: the tiers, and whatever names a card or the card set."""
    return path.parent.name == "tiers" or any(n in text for n in ("ManagedCard", "CardSet", "card_set", "Card"
                                                                   "Catalog", "CardLife", "CardChannel"))


def test_no_module_writes_a_field_of_a_card_or_of_one_of_its_parts() -> None:
    problems = []
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not _holds_cards(path, text):
            continue
        checked += 1
        for where in writes_through_a_part(text):
            problems.append(f"{path.relative_to(SRC)}:{where}")
    assert checked > 20, f"only {checked} modules checked"
    assert not problems, "a card's part is written from outside it; call a method of the part:\n" + "\n".join(problems)


def test_the_scan_finds_each_form() -> None:
    source = ("mc.pattern = p\nself.catalog.leaving = set()\nself.life.scanned = True\ncatalog.tier = s\n"
              "a.b.catalog.room.capacity += 1\nself.catalog = c\nself.index.tier = s\nx.y = 1\n"
              "mc.catalog.counters.hits, z = 1, 2\n")
    assert [w.split(":")[0] for w in writes_through_a_part(source)] == ["1", "2", "3", "4", "5", "9"]


@pytest.mark.parametrize("module, cls", [("kvgate.tiers.catalog", "CardCatalog"), ("kvgate.tiers.channel", "CardChannel"),
                                         ("kvgate.tiers.life", "CardLife"), ("kvgate.tiers.card", "ManagedCard")])
def test_each_part_states_who_calls_it_and_on_which_thread(module: str, cls: str) -> None:
    mod = importlib.import_module(module)
    doc = (mod.__doc__ or "").lower()
    assert "who calls it" in doc and "loop" in doc and "never" in doc and ("block" in doc or "wait" in doc), (
        f"{module}'s docstring must say who calls {cls}, on which thread, and what never blocks")
    assert getattr(mod, cls).__doc__
