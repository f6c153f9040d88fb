"""One exception tree: every exception class kvgate defines derives from ``KvgateError``, read from every
module's source (the engine integrations too, which this venv cannot import), and the tree the
documentation draws names every error ``kvgate.errors`` defines."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import kvgate.errors

SRC = Path(kvgate.errors.__file__).resolve().parent
REPO = SRC.parents[1]
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
# Not errors: a BaseException that unwinds the bench's run on SIGTERM, like KeyboardInterrupt.
NOT_ERRORS = {"_Terminated"}


def _exception_classes() -> dict[str, list[str]]:
    """Every class of kvgate's source whose bases name an exception (builtin or kvgate's): name -> bases."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b).split(".")[-1] for b in node.bases]
                classes[node.name] = (str(path.relative_to(SRC)), bases)
    found: dict[str, list[str]] = {}
    changed = True
    while changed:  # a class is an exception when one of its bases is
        changed = False
        for name, (where, bases) in classes.items():
            if name not in found and any(b in BUILTIN_EXCEPTIONS or b in found for b in bases):
                found[name] = bases
                changed = True
    return found


def test_every_exception_kvgate_defines_is_a_kvgate_error() -> None:
    found = _exception_classes()
    assert len(found) > 30  # the walk finds them (cards, tiers, gateway, cluster, client, integrations)

    def is_kvgate(name: str, seen: frozenset = frozenset()) -> bool:
        return name == "KvgateError" or any(b in found and b not in seen and is_kvgate(b, seen | {name})
                                            for b in found.get(name, []))

    strays = sorted(n for n in found if n not in NOT_ERRORS and not is_kvgate(n))
    assert not strays, f"exceptions outside the KvgateError tree: {strays}"


def test_the_documented_tree_names_every_error_of_kvgate_errors() -> None:
    defined = {n for n, v in vars(kvgate.errors).items()
               if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == "kvgate.errors"}
    drawn = set(re.findall(r"^\s*(?:[│ ]*[├└]── )?(\w+)\b", kvgate.errors.__doc__.split("::")[1], re.M))
    assert defined <= drawn, f"not in kvgate.errors' tree: {sorted(defined - drawn)}"
    for page in ("README.md", "docs/errors.md"):
        text = (REPO / page).read_text()
        if page == "README.md":  # its Errors section draws the tree and links the page with the rest
            text = text[text.index("\n## Errors\n"):].split("\n## ", 2)[1]
            assert "(docs/errors.md)" in text, "README.md's Errors section must link docs/errors.md"
        missing = sorted(n for n in defined if n not in text)
        assert not missing, f"{page} does not name {missing}"
