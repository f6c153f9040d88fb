"""The operator docs (docs/, MkDocs): the configuration page is the config table's, and the site builds clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.config import FIELDS

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_page_is_current_and_names_every_key() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == gen.page(), "docs/configuration.md is not the config table's: run python docs/gen_config.py"
    for f in FIELDS:
        assert f"| `{f.name}` | `--{f.name.replace('_', '-')}` |" in page, f.name


@pytest.mark.slow
def test_make_docs_builds_without_warnings(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                        "--config-file", str(ROOT / "mkdocs.yml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "configuration/index.html", "operations/index.html", "integrations/vllm/index.html"} <= built


@pytest.mark.parametrize("page", ["README.md", "docs/cluster.md"])
def test_the_docs_say_card_servers_encrypt_given_a_certificate(page: str) -> None:
    """Card servers serve TLS (``kvgate export --tls-cert``): no page may tell an operator they cannot."""
    text = " ".join((ROOT / page).read_text().split())
    assert "not encrypt" not in text, page
    assert "--tls-cert" in text and "kvgates://" in text, page
