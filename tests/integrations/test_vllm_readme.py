"""The README's vLLM section run as written: its ``kvgate serve`` and its CPU-build server command, taken
from the README's fenced blocks, so the README cannot drift from what runs.

What the test adds, and only that: the model (the tests' tiny random-weight Llama, with a tokenizer
built locally, for ``MODEL``), the interpreters of this checkout's venvs (``python`` is .venv-vllm's,
``kvgate`` is ``python -m kvgate`` of the suite's), the server's port, a temporary XDG_RUNTIME_DIR
shared by both (so the gateway's default socket and the tier's default meet there, as on any systemd
login) and the gateway's TCP and HTTP listeners off (the machine's other tests hold ports).

One engine start and one restart (each start costs about a minute on two cores): a completion; Ctrl-C
of the server, which kills its engine core and so leaves vLLM's CPU tier file in /dev/shm; a new server
on another path to the same model (a symlink: replicas mount models at different paths), which removes
that file at start; the same completion restored from the gateway (vLLM's external prefix-cache hits,
the gateway's hits) with the same output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvgate.client import Client
from kvgate.shmowners import owned_files, reap_dead_owners
from tests.helpers import free_port, kvgate_env, readme_commands, wait_until

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
VENV_PY = REPO / ".venv-vllm" / "bin" / "python"
HERE = Path(__file__).resolve().parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the vLLM CPU venv first (make vllm-venv)"),
]

BLOCK = 128  # the CPU platform's KV block size
PROMPT = " ".join(f"item{i} is filed under shelf {i % 97}" for i in range(500))


def vllm_readme_commands() -> tuple[list[str], dict[str, str], list[str]]:
    """(gateway argv, server env, server argv) from the README's vLLM section's ``sh`` blocks."""
    commands = readme_commands("vLLM")
    assert (["kvgate", "serve"]) in [words for _env, words in commands], commands
    (server,) = [(env, words) for env, words in commands if "vllm.entrypoints.openai.api_server" in words]
    env, words = server
    assert words[0] == "python" and "MODEL" in words, words
    return ["kvgate", "serve"], env, words


def build_model(model_dir: Path) -> None:
    """The tests' tiny random-weight Llama (vllm_engine.build_model) and a byte-level BPE tokenizer beside it
    (the benchmarks' builder: a server without a tokenizer cannot take text)."""
    code = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(REPO / 'benchmarks')!r}]\n"
            "import vllm_engine, vllm_harness\n"
            f"vllm_engine.build_model({str(model_dir)!r})\n"
            f"vllm_harness.build_tokenizer({str(model_dir)!r}, 4096)\n")
    subprocess.run([str(VENV_PY), "-c", code], check=True, capture_output=True, timeout=300)


class Server:
    """The README's server command, ``MODEL`` and ``python`` replaced, on its own port and session."""

    def __init__(self, workdir: Path, name: str, env: dict[str, str], argv: list[str], model: Path):
        self.port = free_port()
        self.model = str(model)
        self.argv = [str(VENV_PY) if w == "python" else self.model if w == "MODEL" else w for w in argv]
        self.argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.env = env
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, timeout: float = 420) -> "Server":
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

        def up() -> bool:
            assert self.proc.poll() is None, f"server exited (rc {self.proc.returncode}):\n{self.log()[-6000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(up, timeout, lambda: f"server up:\n{self.log()[-4000:]}", interval=1.0)
        return self

    def complete(self, prompt: str) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user stops it."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def test_the_readme_vllm_commands_restore_after_a_restart_on_another_path(tmp_path) -> None:
    gateway_argv, server_env, server_argv = vllm_readme_commands()
    model = tmp_path / "mnt-a" / "tiny-llama"
    build_model(model)
    other_path = tmp_path / "mnt-b" / "llama"
    other_path.parent.mkdir()
    other_path.symlink_to(model)

    run = tmp_path / "run"  # XDG_RUNTIME_DIR of both: the default socket is here
    run.mkdir()
    env = kvgate_env({"XDG_RUNTIME_DIR": str(run)})
    env.pop("PYTHONHASHSEED", None)  # the README's note: the same (here: none) on every engine
    gw = subprocess.Popen([sys.executable, "-m", "kvgate", *gateway_argv[1:], "--port", "0", "--metrics-port", "0"],
                          cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "gateway.log", "wb"), start_new_session=True)
    servers: list[Server] = []
    try:
        socket = run / "kvgate-5557.sock"
        wait_until(lambda: socket.exists() or gw.poll() is not None, 30, "the gateway's default socket")
        assert gw.poll() is None, (tmp_path / "gateway.log").read_text()

        def gateway_stats() -> dict:
            with Client.connect(str(socket), role="admin", want_shm=False, timeout=10) as c:
                return c.stats()

        marks_before = {f.path for f in owned_files("vllm")}
        first = Server(tmp_path, "server1", {**env, **server_env}, server_argv, model)
        servers.append(first)
        first.start()
        out1 = first.complete(PROMPT)
        prompt_tokens = out1["usage"]["prompt_tokens"]
        full_chunks = prompt_tokens // BLOCK
        assert full_chunks >= 10, out1["usage"]
        # Stores are asynchronous: the engine runs on until the gateway holds the prompt's chunks.
        wait_until(lambda: gateway_stats()["tiers"]["ram"]["sets"] >= full_chunks, 60, "the prompt stored")
        (tier1,) = [f for f in owned_files("vllm") if f.path not in marks_before]
        cpu_tier_file = Path("/dev/shm") / tier1.rest
        assert cpu_tier_file.exists()

        assert first.interrupt() is not None
        left_by_vllm = cpu_tier_file.exists()  # vLLM kills its engine core: its own cleanup never runs

        second = Server(tmp_path, "server2", {**env, **server_env}, server_argv, other_path)
        servers.append(second)
        second.start()
        # The new engine removed what the killed one left (the file and its mark).
        assert not cpu_tier_file.exists() and not os.path.exists(tier1.path), left_by_vllm
        hits_before = gateway_stats()["tiers"]["ram"]["hits"]
        out2 = second.complete(PROMPT)
        assert out2["choices"][0]["text"] == out1["choices"][0]["text"]
        assert out2["choices"][0]["token_ids"] == out1["choices"][0]["token_ids"]
        restored = second.metric("vllm:external_prefix_cache_hits_total")
        assert restored >= (full_chunks - 1) * BLOCK, (restored, prompt_tokens, second.log()[-4000:])
        assert gateway_stats()["tiers"]["ram"]["hits"] - hits_before >= full_chunks - 1

        # One namespace for both paths: the model's content, not where it is mounted.
        namespaces = [set(re.findall(r"namespace '(vllm\|[^']*)'", s.log())) for s in servers]
        assert namespaces[0] == namespaces[1] and len(namespaces[0]) == 1, namespaces
        assert str(tmp_path) not in next(iter(namespaces[0]))
        assert second.interrupt() is not None
    finally:
        for s in servers:
            s.kill()
        if gw.poll() is None:
            gw.terminate()
            gw.wait(30)
        # The last engine's CPU tier file stays until an engine starts again: remove it as the next one would.
        reap_dead_owners("vllm", companions=lambda f: [f.rest])
