"""The layers of kvgate import one way (the code map in docs/architecture.md).

Every ``import kvgate...`` of every module, at the top or inside a function, is read from the source
(no import runs, so the engines' modules count too) and checked against what its layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "kvgate"

BOTTOM = {"_version", "errors", "config", "keys", "_keys", "_recent", "_mini", "types", "memcopy", "memguard", "native",
          "latency", "statview", "shmowners"}
CARD_KINDS = {"cards.directory", "cards.redis", "cards.network"}
# What each layer may import besides itself.  A layer missing here may import nothing of kvgate.
MAY_USE: dict[str, set[str]] = {
    **{b: BOTTOM for b in BOTTOM},
    "heads": BOTTOM,
    "placement": BOTTOM,
    "protocol": BOTTOM,
    "cards": BOTTOM | {"heads"} | CARD_KINDS,  # cards/kinds.py makes a card of every kind
    "cards.directory": BOTTOM | {"heads", "cards"},
    "cards.redis": BOTTOM | {"heads", "cards"},
    "cards.network": BOTTOM | {"heads", "cards"},
    # the card server serves directory cards, and speaks the network card's wire
    "cards.network.server": BOTTOM | {"heads", "cards", "cards.directory", "cards.network"},
    "tiers": BOTTOM | {"heads", "cards", "placement"} | CARD_KINDS,
    # vLLM's KV event wire, publisher and subscriber: pure messaging, below whoever publishes or reads
    "kvevents": BOTTOM,
    "gateway": BOTTOM | {"heads", "cards", "placement", "protocol", "tiers", "kvevents"} | CARD_KINDS,
    "client": BOTTOM | {"protocol"},
    "integrations": BOTTOM | {"client"},
    # the control plane: card labels and the slot map, never the card server or the gateway
    "cluster": BOTTOM | {"cards", "placement", "tiers"} | CARD_KINDS,
    "bench": BOTTOM | {"heads", "cards", "placement", "protocol", "tiers", "client", "cards.network.server", "kvevents",
              "routing"} | CARD_KINDS,
    # kvgate router: block hashes as engines make them, the index fed by KV events, scoring, the HTTP front
    "routing": BOTTOM | {"kvevents", "protocol", "client"},
    "cli": set(),  # the top: anything
    "__main__": {"cli"},
    "kvgate": BOTTOM | {"client"},  # the package's public names: the client's
}


def layer(module: str) -> str:
    """kvgate.cards.network.server -> "cards.network.server"; kvgate.tiers.ram -> "tiers"."""
    parts = module.split(".")[1:]
    if not parts:
        return "kvgate"
    if parts[0] == "cards" and len(parts) > 1 and f"cards.{parts[1]}" in CARD_KINDS:
        if parts[1] == "network" and len(parts) > 2 and parts[2] in ("server", "serverconn"):
            return "cards.network.server"
        return f"cards.{parts[1]}"
    return parts[0]


def _imported(module: str, name: str) -> str:
    """The module ``from module import name`` imports: the submodule where ``name`` is one (a package, a
    .py file, or a compiled helper's .c source), else ``module`` (``from kvgate import __version__`` is
    kvgate._version's)."""
    if module == "kvgate" and name == "__version__":
        return "kvgate._version"
    sub = SRC.parent / f"{module}.{name}".replace(".", "/")
    found = sub.is_dir() or sub.with_suffix(".py").exists() or sub.with_suffix(".c").exists()
    return f"{module}.{name}" if found else module


def imports() -> list[tuple[str, int, str, str]]:
    """(file, line, its layer, the imported layer) of every kvgate import in the package."""
    out = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvgate"):
                # `from kvgate.cards import network`: the module imported is kvgate.cards.network
                targets = [_imported(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("kvgate")]
            else:
                continue
            out += [(str(f.relative_to(SRC.parent)), node.lineno, layer(mod), layer(t)) for t in targets]
    return out


def module_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (kvgate.tiers) -> the modules of the same package it imports, at the top,
    in a function or under TYPE_CHECKING."""
    graph: dict[str, set[str]] = {}
    for f in sorted((SRC.parent / package.replace(".", "/")).rglob("*.py")):
        rel = f.relative_to(SRC.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(package):
                deps.update(_imported(node.module, a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith(package + "."))
        deps.discard(mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves through their imports, as groups (strongly connected)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_tiers_import_in_a_circle_nowhere():
    """A module of kvgate.tiers that needs something of one that imports it declares what it uses (a
    Protocol: ``restart.KeptCard``, ``mover.MovingSet``) instead of importing it back, even for types."""
    found = circles(module_imports("kvgate.tiers"))
    assert not found, f"modules of kvgate.tiers that import each other: {found}"


def test_a_circle_is_found_when_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_layer():
    unknown = sorted({(f, mine) for f, _, mine, _ in imports() if mine not in MAY_USE})
    assert not unknown, f"modules of no known layer (add them to MAY_USE): {unknown}"


def test_layers_import_one_way():
    wrong = [f"{f}:{line}: {mine} imports {theirs}" for f, line, mine, theirs in imports()
             if theirs != mine and MAY_USE.get(mine) and theirs not in MAY_USE[mine]]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("mine, theirs", [("cluster", "cards.network.server"), ("gateway", "client"),
                                          ("client", "gateway"), ("integrations", "gateway"),
                                          ("cards", "tiers"), ("tiers", "gateway")])
def test_the_rules_forbid_what_they_should(mine, theirs):
    """The table above says what the code map says: these never."""
    assert theirs not in MAY_USE[mine]


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """A lazy import counts: the checker reads function bodies too."""
    pkg = tmp_path / "kvgate"
    (pkg / "cluster").mkdir(parents=True)
    (pkg / "cards" / "network").mkdir(parents=True)
    (pkg / "cards" / "network" / "server.py").write_text("")
    (pkg / "cluster" / "agent.py").write_text("def f():\n    from kvgate.cards.network.server import X\n")
    monkeypatch.setitem(globals(), "SRC", pkg)
    assert ("kvgate/cluster/agent.py", 2, "cluster", "cards.network.server") in imports()
