"""A real SGLang 0.5.23 server on CPU with the kvgate HiCache backend, for tests and benchmarks.

Standard library and kvgate only (no torch, no SGLang): it runs in the
project venv and starts the server under ``.venv-sglang/bin/python``.  The command is the README's
CPU command (its SGLang section), read from README.md, so the README cannot drift from what runs:
its environment (``SGLANG_USE_CPU_ENGINE``, ``PYTHONPATH`` with ``tests/integrations/sglang_stubs``,
pure-torch stand-ins for CUDA-only ``sgl_kernel`` ops) and flags as written, with the model, port,
gateway socket and ``--max-total-tokens`` filled in.

    build_model(model_dir)                       # tiny random-weight Llama (vllm_engine.build_model)
    srv = SGLangServer(workdir, model_dir, socket).start()
    r = srv.generate(token_ids, cache_salt=None) # {"output_ids", "meta_info", "seconds"}
    srv.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvgate.bench.processes import free_port
from tests.helpers import mapped_shm, readme_commands

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV_PY = REPO / ".venv-sglang" / "bin" / "python"
STUBS = HERE / "sglang_stubs"


def readme_cpu_command() -> tuple[dict[str, str], list[str]]:
    """The README's SGLang CPU command: (its environment assignments, its argv), as written there."""
    (command,) = [(env, words) for env, words in readme_commands("SGLang") if "SGLANG_USE_CPU_ENGINE" in env]
    return command


# A word-level tokenizer over the model's 4,096 ids ("t17" is id 17): the README's command loads the
# model's tokenizer, and prompts stay token ids (what a test compares), sent as OpenAI prompts.
TOKENIZER = """
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 4096)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(%r)
"""


def build_model(model_dir: str | os.PathLike, layers: int | None = None) -> None:
    """The vLLM tests' tiny random-weight Llama (float32), with a word-level tokenizer, built once.

    ``layers``: a deeper variant for benchmarks (same builder, more layers)."""
    if (Path(model_dir) / "config.json").exists() and (Path(model_dir) / "tokenizer.json").exists():
        return
    code = ("import sys; sys.path.insert(0, %r); import vllm_engine as e\n" % str(HERE))
    if layers is not None:
        code += ("from transformers import LlamaConfig\n"
                 "_orig = LlamaConfig.__init__\n"
                 "def _init(self, *a, **k):\n"
                 "    k['num_hidden_layers'] = %d\n"
                 "    _orig(self, *a, **k)\n"
                 "LlamaConfig.__init__ = _init\n" % layers)
    code += "e.build_model(%r)\n" % str(model_dir) + TOKENIZER % str(model_dir)
    subprocess.run([str(VENV_PY), "-c", code], check=True, capture_output=True, timeout=300)


# The README command's flags that put kvgate below HiCache's host memory (each takes one value).
STORAGE_FLAGS = ("--hicache-storage-backend", "--hicache-storage-prefetch-policy",
                 "--hicache-storage-backend-extra-config")


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and the value after it."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            out.append(word)
    return out


class SGLangServer:
    """One ``sglang.launch_server`` process tree (its own session, stopped by process group).

    ``storage``: ``"kvgate"`` (the README's command), None (no storage tier below HiCache's host
    memory: SGLang without kvgate) or one of SGLang's own backends (``"file"``), prefetching as
    kvgate's does."""

    def __init__(self, workdir: str | os.PathLike, model_dir: str | os.PathLike, socket: str, *,
                 name: str = "sglang", extra: dict | None = None, port: int | None = None,
                 max_total_tokens: int = 8192, storage: str | None = "kvgate"):
        self.workdir = Path(workdir)
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.log_path = self.workdir / f"{name}.log"
        self.readme_env, argv = readme_cpu_command()
        assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv
        fill = {"--model-path": self.model_dir, "--port": str(self.port), "--max-total-tokens": str(max_total_tokens)}
        for flag, value in fill.items():
            argv[argv.index(flag) + 1] = value
        i = argv.index("--hicache-storage-backend-extra-config") + 1
        config = json.loads(argv[i])
        if "kvgate.socket" not in config and os.path.basename(socket) == "kvgate-5557.sock":
            # the README's way: the backend's default socket, kvgate-5557.sock in XDG_RUNTIME_DIR
            self.readme_env["XDG_RUNTIME_DIR"] = os.path.dirname(socket)
        else:  # a gateway elsewhere (the benchmarks'): named with the key docs/integrations/sglang.md's table gives
            config["kvgate.socket"] = socket
        argv[i] = json.dumps({**config, **(extra or {})})
        if storage != "kvgate":  # the same server with no storage tier below its host memory, or another one
            argv = without_flags(argv, STORAGE_FLAGS)
            if storage is not None:  # one of SGLang's own backends (e.g. "file"), prefetching as kvgate's does
                argv += ["--hicache-storage-backend", storage, "--hicache-storage-prefetch-policy", "wait_complete"]
                self.readme_env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.workdir / f"{name}-{storage}")
        self.argv = [str(VENV_PY), *argv[1:]]
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for name, value in self.readme_env.items():  # its PYTHONPATH is relative to the checkout's root
            env[name] = str(REPO / value) if name == "PYTHONPATH" else value
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, timeout: float = 240.0) -> "SGLangServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         cwd=str(self.workdir), start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"SGLang not ready after {timeout} s:\n{self.log()[-6000:]}")

    def generate(self, token_ids: list[int], *, cache_salt: str | None = None, max_new_tokens: int = 8,
                 timeout: float = 300.0) -> dict:
        body: dict = {"input_ids": token_ids,
                      "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out

    def complete(self, token_ids: list[int], *, max_tokens: int = 8, timeout: float = 300.0,
                 via: str | None = None) -> dict:
        """An OpenAI completion of a token-id prompt, greedy: the reply, plus ``output_ids`` (the
        completion's token ids), ``meta_info.cached_tokens_details`` (where its cached tokens came
        from) and ``seconds``, as ``generate`` gives them.  ``via``: a base URL to send it to instead
        (a router in front of this server); the answer's headers are in ``headers``."""
        body = {"model": self.model_dir, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "return_cached_tokens_details": True}
        base = via or f"http://127.0.0.1:{self.port}"
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
            out["headers"] = {k.lower(): v for k, v in r.headers.items()}
        out["seconds"] = round(time.monotonic() - t0, 3)
        out["output_ids"] = out["choices"][0]["token_ids"]
        out["meta_info"] = {"cached_tokens_details": (out.get("sglext") or {}).get("cached_tokens_details"),
                            "cached_tokens": ((out.get("usage") or {}).get("prompt_tokens_details") or {})
                            .get("cached_tokens", 0)}
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGKILL the server's process group: SGLang ignores SIGTERM for seconds, and a test restart
        is a crash restart anyway (the backend must cope).  Then removes what SGLang left in /dev/shm."""
        if self.proc is None:
            return
        # SGLang's own files, which a killed server leaves behind (see docs/integrations/sglang.md): its
        # load reports (sglang_loads_*.shm) and Python's semaphores (sem.mp-*)
        leftovers = mapped_shm(self.proc.pid, ("sglang_loads_", "sem.mp-"))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        for path in leftovers:
            try:
                os.unlink(path)
            except OSError:
                pass


def storage_tokens(result: dict) -> int:
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0)


if __name__ == "__main__":  # pragma: no cover - manual use: build the tiny model
    build_model(sys.argv[1])
