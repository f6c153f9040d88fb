"""The words every layer shares (``kvgate.types``): here, the one HOST:PORT parser every address goes through."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvgate.types import split_host_port

SRC = Path(__file__).resolve().parent.parent / "src" / "kvgate"


@pytest.mark.parametrize("text, want", [
    ("10.0.0.7:8000", ("10.0.0.7", 8000)),
    ("  gw-1.example:9100 ", ("gw-1.example", 9100)),
    ("[::1]:7000", ("::1", 7000)),
    ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
])
def test_host_and_port_come_apart_with_ipv6_brackets_dropped(text: str, want: tuple[str, int]) -> None:
    assert split_host_port(text) == want


@pytest.mark.parametrize("text, why", [
    ("10.0.0.7", "no ':PORT'"),
    (":8000", "no host"),
    ("host:http", "port 'http' is not a number"),
    ("host:0", "from 1 to 65535"),
    ("host:65536", "from 1 to 65535"),
    ("host:-1", "is not a number"),
])
def test_a_bad_address_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        split_host_port(text)


def test_a_bare_port_takes_the_default_host_and_port_0_only_when_asked() -> None:
    assert split_host_port(":8000", default_host="127.0.0.1") == ("127.0.0.1", 8000)
    assert split_host_port("0.0.0.0:0", any_port=True) == ("0.0.0.0", 0)


def test_no_module_splits_an_address_by_hand() -> None:
    """``x.rpartition(":")`` of an address is this parser's job (one place for brackets and port checks)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "types.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rpartition"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == ":"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    allowed = {"config.py"}  # is_wildcard: the host as written ("[::]" is a wildcard), no port check wanted
    assert [f for f in found if f.split(":")[0] not in allowed] == [], found
