"""The README's LMCache commands, run for tests and benchmarks: ``lmcache server`` (LMCache 0.5.6,
multiprocess mode) with the kvgate L2 adapter, vLLM's OpenAI server with ``LMCacheMPConnector``, and
tests/integrations/vllm_engine.py (an offline engine with an LMCache kv_transfer_config).

Standard library and kvgate only: it runs in the project venv and starts every process under
.venv-lmcache/bin/python (make lmcache-venv).  The commands are read from README.md, so the README
cannot drift from what runs; ports, paths, sizes and the model are filled in.

    server = LMCacheServer(workdir, gateway, "lmcache1").start()   # l2=None: LMCache without kvgate
    result = run_engine(workdir, "run1", gateway, server, model_dir, requests)
    server.stop()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.helpers import GatewayProcess, free_port, kvgate_env, mapped_shm, readme_commands, run_logged_plan

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-lmcache"
VENV_PY = VENV / "bin" / "python"
ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"
CHUNK = 256  # LMCache chunk size in the README's command: a multiple of vLLM's CPU block size (128)


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
    """The README's ``lmcache server`` command, with this run's ports, L1 file name and gateway socket
    (``adapter_params``: more adapter settings; ``l2=None``: the same server without the kvgate L2 adapter,
    LMCache without kvgate; a dict: that L2 adapter of LMCache's own instead, e.g. ``{"type": "fs", ...}``)."""

    def __init__(self, workdir: Path, gw: GatewayProcess, name: str, adapter_params: dict | None = None,
                 l2: str | dict | None = "kvgate"):
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
        if l2 is None:
            i = words.index("--l2-adapter")
            del words[i:i + 2]
        elif isinstance(l2, dict):
            fill(words, "--l2-adapter", json.dumps(l2))
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

    def stop(self) -> set[str]:
        """Ctrl-C, as a user stops it; killed if it does not exit.  Returns the KV cache segments the
        stopped server left in /dev/shm, which it then removes (see docs/integrations/lmcache.md: vLLM kills its engine
        core at Ctrl-C, so LMCache never unlinks them)."""
        if self.proc is None or self.proc.poll() is not None:
            return set()
        # LMCache's connector moves vLLM's KV cache into segments of its own (lmcache_kv_<pid>_<n>)
        segments = mapped_shm(self.proc.pid, ("lmcache_kv_",))
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
    plan = {"model_dir": str(model_dir), "socket": gw.socket, "requests": requests, "drain": drain,
            "frozen": frozen, "kv_transfer_config": server.connector()}
    return run_logged_plan(VENV_PY, ENGINE, workdir, name, plan, env=env(), timeout=400)
