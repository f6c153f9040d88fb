"""Prefill on one engine, decode on another, the next turn prefilled on a third: three real vLLM CPU engines
(0.32), each with its own kvgate gateway, the three gateways on one shared card, behind ``kvgate router``
with endpoint roles (A prefill, B decode, C prefill).

- Turn 1 through the router: A computes the prompt (one token), its gateway stores the prompt's blocks on
  the card, the router sees them in the events and sends the request to B, which restores them (every
  full block before the last token: cached tokens) and decodes: the same tokens as one engine computing
  it all (C, with a cache salt so it shares nothing).
- A is SIGKILLed; turn 2 (turn 1's prompt, its answer, a new message) through the router: prefilled on C,
  which restores turn 1 INCLUDING the blocks B's decoded tokens filled (B stored them when turn 1 ended),
  and decoded on B: again the same tokens as one engine.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet  # noqa: E402
from kvgate.bench.processes import GatewayProcess, free_port  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not fleet.VENV_PY.exists(), reason=f"{fleet.VENV_PY} is missing: build the vLLM CPU venv "
                                                          "first (make vllm-venv)"),
]

BLOCK = fleet.BLOCK  # 128 tokens on vLLM's CPU platform
OUT1 = 100  # turn 1's answer: tokens 300..399 of the conversation, so block 3 (256..383) holds decoded ones


def _complete(url: str, tokens: list[int], max_tokens: int, salt: str | None = None) -> tuple[dict, dict]:
    """A non-streamed completion of token ids: (the JSON answer, the answer's headers)."""
    import urllib.request

    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), dict(r.headers)


def _cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_prefill_on_a_decode_on_b_next_turn_prefilled_on_c(tmp_path: Path) -> None:
    model, card = tmp_path / "model", tmp_path / "card"
    card.mkdir()
    fleet.build_model(model)
    gateways, engines, router = [], [], None
    try:
        specs = []
        for name in "abc":
            pub, rep = free_port(), free_port()
            gw = GatewayProcess(tmp_path / f"gw-{name}", [
                "--max-bytes", "256M", "--shared-memory-size", "64M", "--port", "0", "--metrics-port", "0",
                "--storage-devices", str(card), "--shared-storage", "true",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{rep}", "--kv-events-topic", f"gw-{name}"], name=f"gw-{name}")
            gw.start()
            gateways.append(gw)
            specs.append((f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
        engines = [fleet.Engine(tmp_path, f"engine-{name}", model, gw) for name, gw in zip("abc", gateways)]
        for e in engines:
            e.start()
        for e in engines:
            wait_until(e.up, 600, f"{e.name} up")
        a, b, c = engines
        endpoints = [{"url": e.url, "events": e.events, "events_replay": e.replay, "gateway_events": pub,
                      "gateway_replay": rep, "role": role}
                     for e, (pub, rep), role in zip(engines, specs, ("prefill", "decode", "prefill"))]
        router = fleet.Router(tmp_path, "cache-aware", endpoints, {"handoff_timeout": 30})
        base = f"http://127.0.0.1:{router.port}"

        rng = random.Random(7)
        p1 = [rng.randrange(1, 4000) for _ in range(300)]
        turn1, h1 = _complete(base, p1, OUT1)
        assert (h1["x-kvgate-prefill"], h1["x-kvgate-endpoint"], h1["x-kvgate-handoff"]) == (a.url, b.url, "stored"), h1
        assert h1["x-kvgate-prefill-cached"] == "0"  # A computed the prompt
        assert _cached(turn1) == 2 * BLOCK, turn1["usage"]  # B restored both of the prompt's full blocks
        out1 = turn1["choices"][0]["token_ids"]
        alone1, _ = _complete(c.url, p1, OUT1, salt="one-engine")
        assert _cached(alone1) == 0
        assert out1 == alone1["choices"][0]["token_ids"] and len(out1) == OUT1

        # turn 2 goes to C: A is gone (SIGKILL), and the router sees it at its next health poll
        a.kill()  # its engine core and workers with it (a SIGKILL of the server alone leaves them running)

        def a_down() -> bool:
            status, health = fleet._get(base + "/health")
            return {e["url"]: e["state"] for e in json.loads(health)["endpoints"]}[a.url] == "down"

        wait_until(a_down, 30, "the router sees engine A down")
        p2 = p1 + out1 + [rng.randrange(1, 4000) for _ in range(300)]  # 700 tokens: 5 blocks before the last
        turn2, h2 = _complete(base, p2, 20)
        assert (h2["x-kvgate-prefill"], h2["x-kvgate-endpoint"], h2["x-kvgate-handoff"]) == (c.url, b.url, "stored"), h2
        # C restored turn 1 with the block B's decoded tokens filled: 3 blocks (tokens 0..383; the prompt was 300)
        assert h2["x-kvgate-prefill-cached"] == str(3 * BLOCK), h2
        assert _cached(turn2) == 5 * BLOCK, turn2["usage"]  # B: 3 blocks on its GPU, 2 that C computed
        alone2, _ = _complete(c.url, p2, 20, salt="one-engine")
        assert turn2["choices"][0]["token_ids"] == alone2["choices"][0]["token_ids"]
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        for gw in gateways:
            gw.stop()
            gw.cleanup()
