"""Shared pieces of the vLLM demo and benchmark: a kvgate gateway process, engine runs, page-cache drops.

Only the standard library and kvgate are imported here, so the orchestrating
scripts start fast; everything that imports vLLM, torch or transformers runs
in ``vllm_engine.py`` (one engine process per run, so every run after the
first is a real engine restart).

Every process started here runs in its own session and is stopped by the
scripts in a ``finally`` (an engine's whole process group: SIGTERM, then
SIGKILL); SIGTERM/SIGHUP to the orchestrator are turned into ``SystemExit``
so that the ``finally`` runs on those too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.bench.processes import GatewayProcess

REPO = Path(__file__).resolve().parents[1]
ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"
VENV_PY = REPO / ".venv-vllm" / "bin" / "python"
BLOCK = 128  # the KV block size of vLLM's CPU platform (tokens)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def exit_on_sigterm() -> None:
    """SIGTERM / SIGHUP raise SystemExit, so ``finally`` blocks stop what we started."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def engine_python() -> str:
    """The interpreter of the vLLM venv (this one when it is that venv)."""
    if VENV_PY.exists():
        return str(VENV_PY)
    return sys.executable


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # With PYTHONHASHSEED unset, vLLM's sha256 block hashes use a fixed seed: keys are stable
    # across processes (a restarted engine finds what the previous one stored).
    env.pop("PYTHONHASHSEED", None)
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def drop_page_cache() -> bool:
    """sync + drop the page cache, dentries and inodes; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM the process group, wait, SIGKILL what is left."""
    if proc.poll() is None:
        _kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc, signal.SIGKILL)  # children that outlived their parent (vLLM engine core, workers)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    return proc.returncode


class Gateway(GatewayProcess):
    """One gateway of the vLLM runs: started by the engine venv's interpreter with the engines'
    environment, in its own session, cwd the repository, a status file beside its log."""

    def __init__(self, workdir: Path, card: Path, *, name: str = "gateway", max_bytes: str = "1G",
                 extra_args: Sequence[str] = ()):
        workdir = Path(workdir)
        super().__init__(workdir, ["--storage-devices", str(card), "--port", "0", "--metrics-port", "0",
                                   "--max-bytes", max_bytes, "--shared-memory-size", "64M",
                                   "--status-file", str(workdir / f"{name}.status.prom"), *extra_args],
                         name=name, python=engine_python(), env=engine_env(), cwd=REPO)

    def start(self, timeout: float = 30.0) -> Gateway:
        super().start(timeout)
        return self


class EngineFailed(RuntimeError):
    pass


class EngineRunner:
    """Runs ``vllm_engine.py PLAN`` in a new process (its own session) and returns its results."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.env = engine_env(env)
        self.current: subprocess.Popen | None = None

    def run(self, name: str, plan: dict[str, Any], timeout: float = 900.0, echo: bool = True) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        out = self.workdir / f"{name}.json"
        plan = {**plan, "out": str(out)}
        plan_path = self.workdir / f"{name}.plan.json"
        plan_path.write_text(json.dumps(plan))
        log_path = self.workdir / f"{name}.log"
        for p in (out, Path(str(out) + ".engine_id")):
            if p.exists():
                p.unlink()
        t0 = time.monotonic()
        with open(log_path, "wb") as logf:
            self.current = proc = subprocess.Popen([engine_python(), str(ENGINE), str(plan_path)],
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                                   cwd=str(REPO), start_new_session=True)
            timed_out = threading.Event()

            def watchdog() -> None:
                timed_out.set()
                _kill_group(proc, signal.SIGKILL)

            timer = threading.Timer(timeout, watchdog)
            timer.daemon = True
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:  # the engine's own progress lines are echoed
                    logf.write(line)
                    if echo and line.startswith(b"[engine]"):
                        log(line.decode(errors="replace").rstrip())
                proc.wait()
            finally:
                timer.cancel()
                stop_process(proc)
                self.current = None
                self._unlink_leaked_region(out)
        if timed_out.is_set():
            raise EngineFailed(f"engine run {name} took more than {timeout:.0f} s and was killed; log {log_path}")
        if proc.returncode != 0 or not out.exists():
            tail = log_path.read_text(errors="replace")[-5000:]
            raise EngineFailed(f"engine run {name} failed (exit code {proc.returncode}); log {log_path}:\n{tail}")
        result = json.loads(out.read_text())
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["log_path"] = str(log_path)
        return result

    @staticmethod
    def _unlink_leaked_region(out: Path) -> None:
        # vLLM unlinks its /dev/shm CPU tier only in a clean shutdown; when it force-kills its
        # engine core (about 5 s after shutdown starts) the file stays.
        id_file = Path(str(out) + ".engine_id")
        if id_file.exists():
            leaked = Path(f"/dev/shm/vllm_offload_{id_file.read_text().strip()}.mmap")
            try:
                leaked.unlink()
            except OSError:
                pass

    def close(self) -> None:
        if self.current is not None:
            stop_process(self.current)
            self.current = None


def median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def unix_socket_ok(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
        return True
    except OSError:
        return False


# ---- the random-weight model and its tokenizer (built locally, nothing is downloaded) -----------

def corpus_text(max_chars: int = 1_500_000) -> str:
    """Deterministic English-ish text from this machine: the Python standard library's sources."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    n = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        n += len(text)
        if n >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def build_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on local text with the `tokenizers` library, saved for transformers/vLLM.

    Ids 0, 1, 2 are <unk>, <s>, </s> (the model config's bos/eos ids)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = corpus_text()
    tok.train_from_iterator((text[i:i + 10_000] for i in range(0, len(text), 10_000)), trainer=trainer)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 1 << 20, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False}, indent=1))
    (model_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1))


def build_model(model_dir: Path, config: dict[str, Any], dtype: str = "float32", seed: int = 0) -> None:
    """A Llama with random weights (transformers LlamaConfig, save_pretrained); skipped when present."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, torch_dtype=dtype, **config)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    for p in tmp.iterdir():  # next to a tokenizer that may already be there
        os.replace(p, model_dir / p.name)
    tmp.rmdir()
