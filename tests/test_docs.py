"""The operator docs (docs/, MkDocs): the configuration page is the config table's, the site builds clean, every
page is in the nav and every relative link lands; the README stays a short front door that links to them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


# ---- the README is the front door, the docs hold the depth --------------------------------------------------

README_MAX_LINES = 345  # a newcomer's ten minutes; what does not fit goes to docs/ (docs/development.md)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the depth to a docs/ page and link it")


def _nav_pages(node) -> set[str]:
    if isinstance(node, str):
        return {node} if node.endswith(".md") else set()
    if isinstance(node, dict):
        return set().union(*(_nav_pages(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_nav_pages(v) for v in node))
    return set()


def test_every_docs_page_is_in_the_nav() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"mkdocs.yml's nav names pages that do not exist: {sorted(nav - pages)}"


LINK = re.compile(r"\]\(([^()\s]+)\)")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file(page: Path) -> None:
    """README links to ``docs/x.md``; docs pages link to each other relative to themselves (no ``docs/``)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # commands, not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


def test_the_code_map_names_modules_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    code_map = text[text.index("\n## Code map\n"):]
    named = set(re.findall(r"`(kvgate(?:\.\w+)+)`", code_map))
    assert named, "no module named in the code map"
    missing = []
    for name in sorted(named):
        path = ROOT / "src" / Path(*name.split("."))
        if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
            missing.append(name)
    assert not missing, f"docs/architecture.md's code map names modules that do not exist: {missing}"


def test_the_readme_links_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text()
    linked = {t.split("#", 1)[0] for t in LINK.findall(text)}
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"
