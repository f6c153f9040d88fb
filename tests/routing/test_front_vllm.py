"""``kvgate router`` in front of two real vLLM CPU engines (the tests' tiny random-weight Llama, one start
each, started together, each publishing its KV events): a prompt one engine has computed goes to that
engine (the router's hashes of /tokenize's tokens meet the engine's own block hashes); completions and
chats, plain and streamed, come back as the engine answers them directly; the settings check reads the
engine's real /server_info (dev mode); after a SIGKILL of one engine, requests keep succeeding on the
other and /health and /metrics say it is down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_until
from tests.integrations.test_vllm_readme import VENV_PY, build_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                   f"(make vllm-venv)"),
]

BLOCK = 128  # the CPU platform's KV block size
# the engines' chat template (the tiny tokenizer has none of its own): --chat-template
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = " ".join(f"item{i} is filed under shelf {i % 97}" for i in range(40))


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _same(answer: bytes, stream: bool) -> list:
    """What must agree between two answers: the choices (texts, token ids, finish reasons), not ids/times."""
    if not stream:
        return json.loads(answer)["choices"]
    events = [line[len(b"data: "):] for line in answer.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", answer[-200:]
    return [c for e in events[:-1] for c in json.loads(e)["choices"]]


class Engine:
    def __init__(self, tmp: Path, name: str, model: Path, dev: bool, template: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pub, replay = free_port(), free_port()
        self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        # vLLM binds its PUB socket only to a wildcard address (tcp://*:PORT); to a host it connects
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        self.log_path = tmp / f"{name}.log"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1" if dev else "0"}
        env.pop("PYTHONHASHSEED", None)
        argv = [str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", "2048", "--enable-prefix-caching", "--chat-template", str(template),
                "--kv-events-config", json.dumps(events)]
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def up(self) -> bool:
        assert self.proc.poll() is None, f"engine exited:\n{self.log_path.read_text(errors='replace')[-4000:]}"
        try:
            return _get(self.url + "/health")[0] == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def test_router_in_front_of_two_vllm_engines(tmp_path: Path) -> None:
    model = tmp_path / "model"
    build_model(model)
    # one engine shows its cache config (dev mode): the router checks its block size for real
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    engines = [Engine(tmp_path, "a", model, True, template), Engine(tmp_path, "b", model, False, template)]
    router = None
    try:
        for e in engines:
            wait_until(e.up, 300, f"engine {e.url} up")
        config = tmp_path / "router.yaml"
        config.write_text(json.dumps({"endpoints": [{"url": e.url, "events": e.events, "events_replay": e.replay}
                                                    for e in engines]}))  # JSON is YAML
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # the engines run without one
        router = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "router", "--config", str(config),
             "--host", "127.0.0.1", "--port", "0", "--block-size", str(BLOCK)], env=env,
            stdout=subprocess.PIPE, stderr=open(tmp_path / "router.log", "wb"), text=True)
        line = router.stdout.readline()  # its one line once it serves (logs go to stderr); '' if it exits
        assert "serving on" in line and "2 of 2 endpoints routable" in line, \
            line + (tmp_path / "router.log").read_text(errors="replace")[-4000:]
        base = "http://127.0.0.1:" + line.split("serving on 127.0.0.1:")[1].split()[0]

        status, health = _get(base + "/health")
        assert status == 200
        a, b = json.loads(health)["endpoints"]
        assert a["state"] == "up" and "block_size" not in a["unchecked"] and "hash_algo" not in a["unchecked"]
        assert b["state"] == "up" and "block_size" in b["unchecked"]

        # cache-aware for real: a prompt engine b has computed (its own KV events say so) goes to b
        cached = {"model": "tiny", "prompt": "shelf " + PROMPT, "max_tokens": 1, "temperature": 0}
        assert _post(engines[1].url + "/v1/completions", cached)[0] == 200

        def scored() -> dict | None:
            got = {e["url"]: e for e in json.loads(_post(base + "/v1/score", cached)[1])["endpoints"]}
            return got if got[engines[1].url]["gpu"] > 0 else None

        by = wait_until(scored, 30, "engine b's KV events in the router's index")
        # the prompt's first block came with its tokens: hashed as the router does, and equal (a real
        # engine's events, so the seed/algorithm check refuses nobody who agrees)
        feeds = {f["source"]: f for f in json.loads(_get(base + "/health")[1])["feeds"]}
        assert feeds[engines[1].url]["hashes_checked"] >= 1 and feeds[engines[1].url]["refused"] is None, feeds
        blocks = json.loads(_post(base + "/v1/score", cached)[1])["blocks"]
        assert by[engines[1].url]["gpu"] == blocks >= 2 and by[engines[0].url]["matched"] == 0, by
        for _ in range(3):
            assert _post(base + "/v1/completions", cached)[0] == 200
        _s, metrics = _get(base + "/metrics")
        assert f'kvgate_router_requests_total{{endpoint="{engines[1].url}",policy="cache-aware"}} 3.0' \
            in metrics.decode(), metrics.decode()

        requests = [
            ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": 6, "temperature": 0}),
        ]
        for path, body in requests:
            for stream in (False, True):
                req = {**body, "stream": stream}
                direct = _post(engines[1].url + path, req)
                routed = _post(base + path, req)
                assert direct[0] == routed[0] == 200, (direct, routed)
                assert _same(routed[1], stream) == _same(direct[1], stream), (path, stream)
        status, score = _post(base + "/v1/score", {"model": "tiny", "prompt": PROMPT})
        assert status == 200 and json.loads(score)["blocks"] == json.loads(score)["tokens"] // BLOCK

        engines[0].kill()
        for _ in range(4):
            status, _answer = _post(base + "/v1/completions", requests[0][1])
            assert status == 200
        status, health = _get(base + "/health")
        assert status == 200
        a, b = json.loads(health)["endpoints"]
        assert a["state"] == "down" and b["state"] == "up", health
        _s, metrics = _get(base + "/metrics")
        assert f'kvgate_router_endpoint_up{{endpoint="{engines[0].url}"}} 0.0' in metrics.decode()
        assert f'kvgate_router_endpoint_up{{endpoint="{engines[1].url}"}} 1.0' in metrics.decode()

        router.send_signal(signal.SIGTERM)
        assert router.wait(20) == 0
    finally:
        if router is not None and router.poll() is None:
            router.kill()
            router.wait(10)
        for e in engines:
            e.kill()
