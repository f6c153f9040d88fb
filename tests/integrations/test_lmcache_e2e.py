"""The real ``lmcache server`` (LMCache 0.5.6, multiprocess mode) with the kvgate L2 adapter, and vLLM
(CPU build, 0.32) with ``LMCacheMPConnector`` (``lmcache_driven``).

Processes run under .venv-lmcache/bin/python (make lmcache-venv); the test is
skipped when that venv is missing.  ``lmcache server`` is the README's command (``LMCacheServer``
reads it from README.md; ``VLLMServer`` is the README's vLLM server, which test_three_engines runs).  The engine is tests/integrations/vllm_engine.py
(tiny random-weight Llama, token-id prompts) with an LMCache kv_transfer_config.

run 1: gateway G, lmcache server L (L1 in /dev/shm, registered with G), engine:
       P (768 tokens) computed; drains until G holds P's 3 chunks.
run 2: L and the engine restarted (L1 empty): Q (768 new tokens) computed, then P restored from G
       through L (external prefix-cache hits, same greedy output as run 1); then G is killed
       (SIGKILL): R (new) and P again are still served by L and vLLM.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import GatewayProcess, free_port, kvgate_env, readme_commands

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-lmcache"
VENV_PY = VENV / "bin" / "python"
ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the LMCache venv first (make lmcache-venv)"),
]

CHUNK = 256  # LMCache chunk size: a multiple of vLLM's CPU block size (128)
PROMPT_TOKENS = 800
CHUNKS = PROMPT_TOKENS // CHUNK  # 3
CACHEABLE = CHUNKS * CHUNK  # 768


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


P, Q, R = prompt(11), prompt(12), prompt(13)


def env() -> dict[str, str]:
    e = kvgate_env({"LMCACHE_TRACK_USAGE": "false", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    e.pop("PYTHONHASHSEED", None)
    return e


def readme_command(program: str) -> tuple[dict[str, str], list[str]]:
    """The README's LMCache command whose words include ``program`` (``lmcache``, or vLLM's server module):
    (its environment assignments, its words), as written there."""
    (command,) = [(e, words) for e, words in readme_commands("LMCache") if program in words]
    return command


def fill(words: list[str], flag: str, value: str) -> None:
    words[words.index(flag) + 1] = value


class LMCacheServer:
    """The README's ``lmcache server`` command, with this test's ports, L1 file name and gateway socket
    (``adapter_params``: more adapter settings of a test)."""

    def __init__(self, workdir: Path, gw: GatewayProcess, name: str, adapter_params: dict | None = None):
        self.port, self.http_port = free_port(), free_port()
        self.log_path = workdir / f"{name}.log"
        self.readme_env, words = readme_command("lmcache")
        assert words[:2] == ["lmcache", "server"] and int(words[words.index("--chunk-size") + 1]) == CHUNK, words
        fill(words, "--port", str(self.port))
        fill(words, "--http-port", str(self.http_port))
        fill(words, "--shm-name", f"kvgate-test-{os.getpid()}")
        adapter = json.loads(words[words.index("--l2-adapter") + 1])
        adapter["adapter_params"] = {**adapter["adapter_params"], "kvgate.socket": gw.socket, **(adapter_params or {})}
        fill(words, "--l2-adapter", json.dumps(adapter))
        self.cmd = [str(VENV / "bin" / "lmcache"), *words[1:]]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "LMCacheServer":
        f = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env={**env(), **self.readme_env},
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"lmcache server exited:\n{self.log()[-4000:]}"
            try:
                with socket.create_connection(("127.0.0.1", self.http_port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"lmcache server not ready in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def connector(self) -> dict:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}


class VLLMServer:
    """The README's vLLM server command (an OpenAI server with LMCache's connector) in .venv-lmcache, with
    this test's model, port and ``lmcache server`` port."""

    def __init__(self, workdir: Path, name: str, server: LMCacheServer, model_dir: Path):
        self.port = free_port()
        self.model = str(model_dir)
        self.readme_env, words = readme_command("vllm.entrypoints.openai.api_server")
        assert words[0] == "python" and "MODEL" in words, words
        words = [str(VENV_PY) if w == "python" else self.model if w == "MODEL" else w for w in words]
        fill(words, "--port", str(self.port))
        config = json.loads(words[words.index("--kv-transfer-config") + 1])
        config["kv_connector_extra_config"]["lmcache.mp.port"] = server.port
        fill(words, "--kv-transfer-config", json.dumps(config))
        self.argv = words
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 420) -> "VLLMServer":
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         env={**env(), **self.readme_env}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vLLM exited (rc {self.proc.returncode}):\n{self.log()[-6000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not up in {timeout} s:\n{self.log()[-4000:]}")

    def complete(self, token_ids: list[int]) -> dict:
        """A greedy OpenAI completion of a token-id prompt: the reply, ``output_ids`` its token ids."""
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        out["output_ids"] = out["choices"][0]["token_ids"]
        return out

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def _kv_segments(self) -> set[str]:
        """The /dev/shm segments LMCache's connector moved vLLM's KV cache into (``lmcache_kv_<pid>_<n>``),
        as this server's processes (its process group) map them."""
        found: set[str] = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) != self.proc.pid:
                    continue
                with open(f"/proc/{pid}/maps") as f:
                    found.update(line.split()[-1] for line in f if "/dev/shm/lmcache_kv_" in line)
            except (OSError, IndexError):
                continue
        return found

    def stop(self) -> set[str]:
        """Ctrl-C, as a user stops it; killed if it does not exit.  Returns the KV cache segments the
        stopped server left in /dev/shm, which it then removes (see docs/integrations/lmcache.md: vLLM kills its engine
        core at Ctrl-C, so LMCache never unlinks them)."""
        if self.proc is None or self.proc.poll() is not None:
            return set()
        segments = self._kv_segments()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        left = {p for p in segments if os.path.exists(p)}
        for path in left:
            os.unlink(path)
        return left


def run_engine(workdir: Path, name: str, gw: GatewayProcess, server: LMCacheServer, model_dir: Path,
               requests: list[dict], drain: dict | None = None, frozen: dict | None = None) -> dict:
    out = workdir / f"{name}.json"
    plan = {"model_dir": str(model_dir), "socket": gw.socket, "requests": requests, "drain": drain,
            "frozen": frozen, "kv_transfer_config": server.connector(), "out": str(out)}
    plan_path = workdir / f"{name}.plan.json"
    plan_path.write_text(json.dumps(plan))
    log = workdir / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.run([str(VENV_PY), str(ENGINE), str(plan_path)], stdout=f, stderr=subprocess.STDOUT,
                              env=env(), cwd=str(workdir), timeout=400)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and out.exists(), f"engine run {name} failed (rc {proc.returncode}):\n{text[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = text
    result["by_name"] = {r["name"]: r for r in result["results"]}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lmcache_e2e")
    model_dir = workdir / "tiny-llama"
    gw = GatewayProcess(workdir, ["--max-bytes", "256M", "--shared-memory-size", "16M"], name="gw")
    gw.start()
    servers: list[LMCacheServer] = []
    try:
        timeouts = {"kvgate.io_timeout": 5, "kvgate.lookup_timeout": 2}
        s1 = LMCacheServer(workdir, gw, "lmcache1", timeouts).start()
        servers.append(s1)
        t0 = time.monotonic()
        r1 = run_engine(workdir, "run1", gw, s1, model_dir, [{"name": "P", "prompt_token_ids": P}],
                        drain={"expect_sets": CHUNKS, "timeout": 60, "settle": 1.0})
        r1["wall_s"] = time.monotonic() - t0
        s1.stop()
        s2 = LMCacheServer(workdir, gw, "lmcache2", timeouts).start()
        servers.append(s2)
        t0 = time.monotonic()
        r2 = run_engine(workdir, "run2", gw, s2, model_dir, [
            {"name": "Q-computed", "prompt_token_ids": Q},
            {"name": "P-restored", "prompt_token_ids": P},
        ], frozen={"gateway_pid": gw.pid, "signal": signal.SIGKILL, "requests": [
            {"name": "R-gateway-dead", "prompt_token_ids": R},
            {"name": "P-gateway-dead", "prompt_token_ids": P},
        ]})
        r2["wall_s"] = time.monotonic() - t0
        s2_alive = s2.proc is not None and s2.proc.poll() is None
        s2.stop()
        yield {"run1": r1, "run2": r2, "lmcache1": s1.log(), "lmcache2": s2.log(), "s2_alive": s2_alive,
               "card": gw.card}
    finally:
        for s in servers:
            s.stop()
        gw.cleanup()
        # LMCache unlinks its L1 file on a clean exit only (and a stale one at its next start)
        Path(f"/dev/shm/lmcache_l1_pool_kvgate-test-{os.getpid()}").unlink(missing_ok=True)


def test_restart_restores_through_lmcache_and_kvgate(runs):
    first = runs["run1"]["by_name"]["P"]
    again = runs["run2"]["by_name"]["P-restored"]
    computed = runs["run2"]["by_name"]["Q-computed"]
    print(f"\nTTFT computed (Q, {PROMPT_TOKENS} tokens) {computed['ttft']}, restored (P) {again['ttft']}; "
          f"run1 {runs['run1']['wall_s']:.1f} s, run2 {runs['run2']['wall_s']:.1f} s")
    assert first["num_cached_tokens"] == 0 and computed["external_prefix_cache_hits_delta"] == 0
    assert again["external_prefix_cache_hits_delta"] > 0, again
    assert again["external_prefix_cache_hits_delta"] == CACHEABLE, again
    assert again["output_token_ids"] == first["output_token_ids"]
    assert runs["run1"]["gateway_sets"] >= CHUNKS
    log = runs["lmcache1"]
    assert "kvgate L2 adapter: gateway" in log and "registered with the gateway" in log, log[-4000:]


def test_every_chunk_went_to_the_card_with_its_conversations_dialog_and_position(runs):
    """The adapter took each request's dialog mark at its lookup: every chunk on the card carries a dialog
    and its place in the prompt, and one dialog holds P's chunks at positions 0..CHUNKS-1."""
    import collections

    from kvgate.cards.objectformat import peek_header
    from kvgate.keys import NO_DIALOG

    metas = []
    for f in Path(runs["card"]).glob("db*/*/*"):
        if ".tmp." in f.name:  # a write still landing (layout: <name>.tmp.<host>-<boot>.<pid>.<thread>)
            continue
        raw = f.read_bytes()
        metas.append(peek_header(raw[:4096], len(raw), lambda n, raw=raw: raw[:n]).meta)
    assert metas and all(m.dialog != NO_DIALOG and m.position >= 0 for m in metas), metas
    by_dialog = collections.defaultdict(set)
    for m in metas:
        by_dialog[m.dialog].add(m.position)
    assert set(range(CHUNKS)) in by_dialog.values(), by_dialog


def test_gateway_killed_lmcache_keeps_serving(runs):
    r2 = runs["run2"]["by_name"]
    for name in ("R-gateway-dead", "P-gateway-dead"):
        assert len(r2[name]["output_token_ids"]) == 8, r2[name]
        assert r2[name]["seconds"] < 30, r2[name]
    # P is still in the restarted server's L1: same output
    assert r2["P-gateway-dead"]["output_token_ids"] == runs["run1"]["by_name"]["P"]["output_token_ids"]
    assert runs["s2_alive"], runs["lmcache2"][-4000:]
    log = runs["lmcache2"]
    assert "Traceback" not in log, log[-4000:]
