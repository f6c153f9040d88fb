"""vLLM (the real CPU build) with one system prompt in front of every conversation, on a gateway with 4 cards.

Two engine processes on one gateway: the first serves eight conversations
(the same 1024-token system prompt, then 640 tokens of their own) and stores
them; the second, a new process, serves them again and must restore each in
full from kvgate.  Between the runs the gateway has learned the system
prompt as a shared head: its chunks are stored under its own mark, and
the conversations behind it get marks of their own, so they land on more
than one card instead of all on the system prompt's card.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers import GatewayProcess
from tests.integrations.test_vllm_e2e import BLOCK, VENV_PY, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason=f"{VENV_PY} is missing: build the vLLM CPU venv first (make vllm-venv)"),
]

SYSTEM_TOKENS = 1024  # 8 chunks
OWN_TOKENS = 640  # 5 chunks
CONVERSATIONS = 8
CHUNKS = (SYSTEM_TOKENS + OWN_TOKENS) // BLOCK


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


SYSTEM = tokens(100, SYSTEM_TOKENS)
CONVS = [{"name": f"C{i}", "prompt_token_ids": SYSTEM + tokens(200 + i, OWN_TOKENS)} for i in range(CONVERSATIONS)]


@pytest.fixture(scope="module")
def shared_prompt_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm_shared_prompt")
    model_dir = workdir / "tiny-llama"
    cards = [str(workdir / f"card{i}") for i in range(4)]
    gw = GatewayProcess(workdir, ["--storage-devices", *cards, "--max-bytes", "256M", "--shared-memory-size", "64M"],
                        name="gw")
    gw.start()
    try:
        stored = SYSTEM_TOKENS // BLOCK + CONVERSATIONS * (OWN_TOKENS // BLOCK)
        first = run_engine(workdir, "first", gw, model_dir, CONVS, drain={"expect_sets": stored, "timeout": 60})
        second = run_engine(workdir, "second", gw, model_dir, CONVS)
        yield {"first": first, "second": second, "stats": gw.stats(), "gateway_log": gw.log()}
    finally:
        gw.cleanup()


def test_every_conversation_behind_a_shared_system_prompt_restores_in_full(shared_prompt_runs) -> None:
    first, second = shared_prompt_runs["first"]["by_name"], shared_prompt_runs["second"]["by_name"]
    for i, c in enumerate(CONVS):
        again = second[c["name"]]
        # The first one restores the system prompt too; the rest find it in the engine's own cache by then.
        restored = CHUNKS * BLOCK if i == 0 else OWN_TOKENS
        assert again["external_prefix_cache_hits_delta"] == restored, (c["name"], again)
        assert again["num_cached_tokens"] == CHUNKS * BLOCK, (c["name"], again)
        assert again["output_token_ids"] == first[c["name"]]["output_token_ids"], c["name"]


def test_the_system_prompt_is_a_shared_head_and_conversations_spread_over_cards(shared_prompt_runs) -> None:
    stats = shared_prompt_runs["stats"]
    assert stats["shared_heads"]["blocks"] >= SYSTEM_TOKENS // BLOCK, stats["shared_heads"]
    holding = [card["objects"] for card in stats["cards"]]
    # 8 system-prompt chunks on the card of its mark, 8 x 5 conversation chunks on the cards of theirs:
    # one card holding everything would mean the marks did not tell the conversations apart. Cards win
    # slots by hashes of their random serials, so how evenly the conversations spread is chance (6 of 8
    # on the system prompt's card is about 1 run in 250); all 8 on its card by chance, 1 run in 65,536.
    assert sum(holding) >= SYSTEM_TOKENS // BLOCK + CONVERSATIONS * (OWN_TOKENS // BLOCK), holding
    assert sum(1 for objects in holding if objects) >= 2, holding
    assert "affinity_chunks=auto" in shared_prompt_runs["first"]["log"]
