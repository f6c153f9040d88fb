"""Outside ``kvgate.tiers`` the tiers are reached only through the store (``TieredStore``'s methods and
properties: ``fingerprint``, ``status``, ``card_set``, ``size_in_ram``, ...), never through its tiers
(``store.ram``, ``store.cards``, ``store.tiers``; ``store.long`` was the card set's name): what those hold
is the tiers' own business, and the store's methods say what a caller means.

Read from the source (no import runs): every attribute ``ram``, ``cards``, ``tiers`` or ``long`` taken of
something named ``store`` (``store.ram``, ``self.store.cards``, ``gw.store.ram.size_of``), and the text
``store.ram`` and the like anywhere (strings and comments that would name them for ``getattr``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "kvgate"
TIER_ATTRIBUTES = {"ram", "long", "cards", "tiers"}
TEXT = re.compile(r"\bstore\.(ram|long|cards|tiers)\b")


def _is_store(node: ast.expr) -> bool:
    """``store``, ``self.store``, ``gw.store``, ``self._store``: a name or attribute that says store."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lstrip("_") == "store" or name.endswith("_store")


def reaches_into_store(source: str, filename: str = "<source>") -> list[str]:
    """``line: text`` of every place in ``source`` that names a store's RAM tier or card set."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in TIER_ATTRIBUTES and _is_store(node.value):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    for i, line in enumerate(source.splitlines(), 1):
        if TEXT.search(line) and not any(f.startswith(f"{i}: ") for f in found):
            found.append(f"{i}: {line.strip()}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_no_module_outside_the_tiers_names_a_stores_ram_tier_or_card_set() -> None:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "tiers":
            continue
        for where in reaches_into_store(path.read_text(encoding="utf-8"), str(path)):
            problems.append(f"src/kvgate/{rel}:{where}")
    assert not problems, ("reached into the store's tiers; use (or add) a TieredStore method that says what "
                          "is meant:\n" + "\n".join(problems))


def test_the_scan_finds_each_form() -> None:
    source = ("a = store.ram.size_of(k)\nb = self.store.long.fingerprint\nc = gw._store.ram\n"
              "d = store.counters.long.sets\ne = getattr(x, 'store.long')\nf = self.store.cards.set\n"
              "g = store.tiers[0]\n")
    assert [w.split(":")[0] for w in reaches_into_store(source)] == ["1", "2", "3", "5", "6", "7"]
