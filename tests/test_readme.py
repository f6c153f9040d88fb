"""The README's examples do what it says they do, against a real gateway; the settings tables its engine
sections link to (docs/integrations/) and the configuration page name every key the code takes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, kvgate_env, readme_section

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent


def _default_socket_gateway(gateway_factory, tmp_path):
    """A gateway on the default socket of XDG_RUNTIME_DIR=tmp_path/run, and the environment that finds it
    (the README's examples name no socket)."""
    run = tmp_path / "run"
    run.mkdir()
    gw = gateway_factory(socket_path=run / "kvgate-5557.sock")
    return gw, {**kvgate_env(), "XDG_RUNTIME_DIR": str(run)}


def test_the_python_example_runs_and_returns_what_its_comments_say(gateway_factory, tmp_path) -> None:
    gw, env = _default_socket_gateway(gateway_factory, tmp_path)
    (code,) = re.findall(r"```python\n(.*?)```", readme_section("Using it from Python"), re.S)[:1]
    assert "Client.connect(namespace=" in code  # the default socket, as after a bare `kvgate serve`
    # The comments promise results: check them after the example ran.
    code += """
with Client.connect(SOCK, namespace="llama-3-8b|bf16|tp1", engine_id="engine-0") as c:
    assert c.lookup([b"block-1", b"block-2", b"block-3"], dialog=mark) == 2
    got = c.get_many([b"block-1", b"block-2"], into=dests, dialog=mark)
    assert all(isinstance(v, memoryview) for v in got)
    assert [bytes(v) for v in got] == [bytes(b) for b in blocks]
    assert c.get_many([b"block-1", b"block-3"], dialog=mark) == [bytes(blocks[0]), None]
print("ok")
""".replace("SOCK", repr(gw.socket))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_the_prewarm_example_answers_as_shown(gateway_factory) -> None:
    port = free_port()
    gw = gateway_factory(["--metrics-port", str(port)])
    section = readme_section("Using it from Python")
    body = re.search(r"-d '(\{.*?\})'", section).group(1)
    req = json.loads(body)
    with gw.client(req["namespace"]) as c:
        assert c.put_many([k.encode() for k in req["keys"]], [b"x" * 4096] * len(req["keys"]),
                          dialog=req["dialog"].encode(), position=0) == [True, True]
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/cache/prewarm", data=body.encode(), method="POST")
    with urllib.request.urlopen(http, timeout=10) as r:
        assert json.loads(r.read()) == {"in_ram": 2, "asked": 2}


def test_the_asyncio_example_restores_what_was_stored(gateway_factory, tmp_path) -> None:
    gw, env = _default_socket_gateway(gateway_factory, tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", readme_section("Using it from Python"), re.S)
    (code,) = [b for b in blocks if "AsyncClient" in b]
    code += """
import asyncio
import numpy as np
from kvgate import Client
with Client.connect(SOCK, namespace="llama-3-8b|bf16|tp1", engine_id="engine-0") as c:
    assert c.put_many([b"a", b"b"], [b"x" * 100, b"y" * 200]) == [True, True]
dests = [np.zeros(300, np.uint8) for _ in range(3)]
got = asyncio.run(restore([b"a", b"b", b"c"], dests))
assert [bytes(v) for v in got] == [b"x" * 100, b"y" * 200]
print("ok")
""".replace("SOCK", repr(gw.socket))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_the_lmcache_page_lists_every_adapter_param_and_the_readme_command_parses() -> None:
    from kvgate.integrations.lmcache.settings import PARAM_KEYS, parse_params

    section = readme_section("LMCache")
    page = (ROOT / "docs/integrations/lmcache.md").read_text()
    adapter = page[:page.index("\n## In-process LMCache")]  # the adapter's table, not the connector's part
    table = set(re.findall(r"^\| `(kvgate\.[a-z_0-9]+)`(?: / `(kvgate\.[a-z_0-9]+)`)?", adapter, re.M))
    listed = {k for pair in table for k in pair if k}
    assert listed == set(PARAM_KEYS), (listed ^ set(PARAM_KEYS))
    spec = json.loads(re.search(r"--l2-adapter '(\{.*?\})'", section, re.S).group(1))
    assert spec["module_path"] == "kvgate.integrations.lmcache" and spec["class_name"] == "KvgateL2Adapter"
    assert parse_params(spec["adapter_params"]).target == "/tmp/kvgate-5557.sock"
    connector = json.loads(re.search(r"--kv-transfer-config '(\{\"kv_connector\": \"LMCacheMPConnector\".*?\})'",
                                     section, re.S).group(1))
    assert connector["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"


def test_the_lmcache_remote_connector_config_parses_and_its_keys_are_the_adapters_less_two() -> None:
    from kvgate.integrations.lmcache.settings import (
        CONNECTOR_KEYS,
        PARAM_KEYS,
        connector_plugin_name,
        parse_connector_config,
    )

    sub = readme_section("In-process LMCache: the remote connector plugin", page="docs/integrations/lmcache.md")
    (conf,) = re.findall(r"```yaml\n(.*?)```", sub, re.S)
    plugins = json.loads(re.search(r"^remote_storage_plugins: (\[.*\])$", conf, re.M).group(1))
    extra = dict(re.findall(r"^  (remote_storage_plugin\.[\w.]+): (\S+)$", conf, re.M))
    name = connector_plugin_name(plugins, extra, "KvgateRemoteConnector")
    assert extra[f"remote_storage_plugin.{name}.module_path"] == "kvgate.integrations.lmcache"
    assert parse_connector_config(extra, name).target == "/tmp/kvgate-5557.sock"
    left_out = set(re.findall(r"^Its settings are the keys of the table above but `(kvgate\.\w+)` and\n`(kvgate\.\w+)`",
                              sub, re.M)[0])
    assert set(CONNECTOR_KEYS) == set(PARAM_KEYS) - left_out
    assert (README.parent / "tests/integrations/test_lmcache_remote.py").exists()


def test_the_sglang_page_names_every_key_and_the_readme_command_lines_parse() -> None:
    from kvgate.integrations.sglang.settings import (
        BACKEND_CLASS,
        BACKEND_MODULE,
        EXTRA_CONFIG_KEYS,
        UNSUPPORTED_KEYS,
        settings_from_extra,
    )

    from kvgate.config import default_socket_path

    section = readme_section("SGLang")
    cmds = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if "--hicache-storage-backend-extra-config" in b]
    assert len(cmds) == 2, cmds  # a GPU's and the CPU engine's
    for cmd in cmds:
        extra = json.loads(re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", cmd, re.S).group(1))
        assert (extra["module_path"], extra["class_name"], extra["interface_v1"]) == (BACKEND_MODULE, BACKEND_CLASS, 1)
        # no socket named: the bare `kvgate serve` of the section's first block and the backend meet
        assert settings_from_extra(extra).target == default_socket_path()
    page = (ROOT / "docs/integrations/sglang.md").read_text()
    table = "\n".join(line for line in page.splitlines() if line.startswith("| `kvgate."))
    for key in [*EXTRA_CONFIG_KEYS, *UNSUPPORTED_KEYS]:
        assert f"`{key}`" in table, key
    for script in re.findall(r"benchmarks/\w+\.py", section + page):
        assert (README.parent / script).exists(), script
    assert "bench-sglang:" in (README.parent / "Makefile").read_text()


def test_the_configuration_table_lists_every_key_with_its_default() -> None:
    from kvgate.config import FIELDS, FIELDS_BY_NAME, default_text

    shown: dict[str, str] = {}
    for line in readme_section("Every key, explained", page="docs/configuration.md").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        keys = re.findall(r"`(\w+)`", cells[0])
        values = [v.replace("`", "") for v in (cells[1].split(", ") if len(keys) > 1 else [cells[1]])]
        assert len(values) == len(keys), line
        shown.update(zip(keys, values))
    assert set(shown) == set(FIELDS_BY_NAME), set(shown) ^ set(FIELDS_BY_NAME)
    for f in FIELDS:
        expected = default_text(f)
        if expected is not None:
            assert shown[f.name] == expected, (f.name, shown[f.name], expected)
        elif "(default: " not in f.help:  # a default derived at start is described, not "unset"
            assert shown[f.name] == "unset", (f.name, shown[f.name])


def test_every_benchmark_script_the_readme_and_the_docs_name_exists() -> None:
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for script in set(re.findall(r"benchmarks/\w+\.py", page.read_text())):
            assert (ROOT / script).exists(), (page.name, script)


@pytest.mark.parametrize("engine", ["vLLM", "LMCache", "SGLang"])
def test_the_engine_pages_show_the_readme_commands_as_the_readme_has_them(engine: str) -> None:
    """Each engine's docs page repeats the commands of its README section (the ones the tests run): the
    same bytes, so the two cannot drift apart."""
    page = (ROOT / f"docs/integrations/{engine.lower()}.md").read_text()
    for block in re.findall(r"```sh\n.*?```", readme_section(engine), re.S):
        assert block in page, (engine, block[:80])
