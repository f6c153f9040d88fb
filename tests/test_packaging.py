"""What an install of kvgate carries: the version it was built from, its type information, its extras."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import kvgate


def test_the_version_is_the_installed_distribution_s_and_names_its_commit_in_a_checkout() -> None:
    # Every venv's editable install writes the same src/kvgate/_version.py; a tree with uncommitted changes
    # adds the date (".d20261202"), which may differ between two installs.
    def undated(v: str) -> str:
        return re.sub(r"\.d\d{8}$", "", v)

    assert undated(kvgate.__version__) == undated(importlib.metadata.version("kvgate"))
    if (Path(__file__).resolve().parents[1] / ".git").exists():
        assert re.search(r"\+g[0-9a-f]{7,}", kvgate.__version__) or re.fullmatch(r"\d+\.\d+\.\d+", kvgate.__version__), \
            f"{kvgate.__version__}: built from a checkout, the version names the commit (or a tag)"


def test_py_typed_ships_and_each_integration_is_an_extra() -> None:
    assert (Path(kvgate.__file__).parent / "py.typed").exists()
    extras = set(importlib.metadata.metadata("kvgate").get_all("Provides-Extra") or [])
    assert {"vllm", "sglang", "lmcache", "bench", "plot", "test"} <= extras


def test_kvgate_version_prints_it(capsys) -> None:
    import pytest

    from kvgate.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvgate {kvgate.__version__}"
