"""A real SGLang 0.5.23 server on CPU with the kvgate HiCache backend, for tests and benchmarks.

Standard library and kvgate only (no torch, no SGLang): it runs in the
project venv and starts the server under ``.venv-sglang/bin/python``.  The server gets ``tests/integrations/sglang_stubs``
on PYTHONPATH (pure-torch stand-ins for CUDA-only ``sgl_kernel`` ops; test
scaffolding, not part of the backend) and the checkout's ``src``.

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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV_PY = REPO / ".venv-sglang" / "bin" / "python"
STUBS = HERE / "sglang_stubs"


def build_model(model_dir: str | os.PathLike, layers: int | None = None) -> None:
    """The vLLM tests' tiny random-weight Llama (float32 on disk; served as bf16), built once.

    ``layers``: a deeper variant for benchmarks (same builder, more layers)."""
    if (Path(model_dir) / "config.json").exists():
        return
    code = ("import sys; sys.path.insert(0, %r); import vllm_engine as e\n" % str(HERE))
    if layers is not None:
        code += ("from transformers import LlamaConfig\n"
                 "_orig = LlamaConfig.__init__\n"
                 "def _init(self, *a, **k):\n"
                 "    k['num_hidden_layers'] = %d\n"
                 "    _orig(self, *a, **k)\n"
                 "LlamaConfig.__init__ = _init\n" % layers)
    code += "e.build_model(%r)\n" % str(model_dir)
    subprocess.run([str(VENV_PY), "-c", code], check=True, capture_output=True, timeout=300)


class SGLangServer:
    """One ``sglang.launch_server`` process tree (its own session, stopped by process group)."""

    def __init__(self, workdir: str | os.PathLike, model_dir: str | os.PathLike, socket: str, *,
                 name: str = "sglang", extra: dict | None = None, port: int | None = None,
                 max_total_tokens: int = 8192):
        self.workdir = Path(workdir)
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.log_path = self.workdir / f"{name}.log"
        config = {"backend_name": "kvgate", "module_path": "kvgate.integrations.sglang",
                  "class_name": "KvgateHiCacheStorage", "interface_v1": 1,
                  "hicache_storage_pass_prefix_keys": True, "kvgate.socket": socket, **(extra or {})}
        self.argv = [
            str(VENV_PY), "-m", "sglang.launch_server", "--model-path", self.model_dir, "--dtype", "bfloat16",
            "--skip-tokenizer-init", "--device", "cpu", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--host", "127.0.0.1",
            "--port", str(self.port), "--max-total-tokens", str(max_total_tokens), "--mem-fraction-static", "0.05",
            "--skip-server-warmup", "--disable-cuda-graph", "--page-size", "16", "--enable-hierarchical-cache",
            "--hicache-ratio", "2", "--hicache-write-policy", "write_through", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(config)]
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(REPO / "src")])
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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGKILL the server's process group: SGLang ignores SIGTERM for seconds, and a test restart
        is a crash restart anyway (the backend must cope)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


def storage_tokens(result: dict) -> int:
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0)


if __name__ == "__main__":  # pragma: no cover - manual use: build the tiny model
    build_model(sys.argv[1])
