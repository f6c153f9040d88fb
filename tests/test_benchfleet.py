"""The fleet benchmark's own parts (``benchmarks/fleet.py``, ``make bench-fleet``): the conversations it
takes from the trace, the token ids it gives them, and the oracle its served tokens are judged against.
The run itself starts three vLLM engines (minutes): ``make demo-fleet`` is its short form."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet  # noqa: E402


def _trace(tmp_path: Path, rows: list[tuple[int, list[int]]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": 512 * len(h), "output_length": 3,
                                        "hash_ids": h}) + "\n" for ts, h in rows))
    return path


def test_conversations_are_grouped_by_first_block_in_turn_order(tmp_path: Path) -> None:
    path = _trace(tmp_path, [(0, [1, 2]), (1, [5]), (2, [1, 2, 3]), (3, [7, 8]), (4, [1, 2, 4]),
                             (5, [7, 9]), (6, [1, 2, 3, 6])])
    turns = fleet.conversations(path, n=5, min_turns=2, max_turns=3)
    # [5] has one request: skipped; conversation 0 ([1, ...]) keeps its first 3 turns
    assert [(t.conv, t.turn, t.hash_ids) for t in turns] == [
        (0, 0, [1, 2]), (0, 1, [1, 2, 3]), (1, 0, [7, 8]), (0, 2, [1, 2, 4]), (1, 1, [7, 9])]
    assert len(fleet.conversations(path, n=1, min_turns=2, max_turns=9)) == 4


def test_tokens_share_what_the_trace_shares_and_differ_per_salt(tmp_path: Path) -> None:
    path = _trace(tmp_path, [(0, [1, 2]), (1, [1, 2, 3]), (2, [4, 5])])
    turns = fleet.conversations(path, n=9, min_turns=1, max_turns=9)
    fleet.assign_tokens(turns, 0, block_tokens=16, system_blocks=1, max_tokens=10_000, vocab=4096)
    a, b, c = (t.tokens for t in turns)
    system = fleet.BLOCK
    assert a[:system] == b[:system] == c[:system]  # the shared system prompt
    assert len(a) == system + 32 and len(b) == system + 48 and b[:len(a)] == a  # block 1, 2 the same
    assert c[system:system + 16] != a[system:system + 16]
    again = fleet.conversations(path, n=9, min_turns=1, max_turns=9)
    fleet.assign_tokens(again, 1, block_tokens=16, system_blocks=1, max_tokens=10_000, vocab=4096)
    assert again[0].tokens != a  # another policy's run: nothing to find of the one before
    fleet.assign_tokens(again, 1, block_tokens=16, system_blocks=1, max_tokens=150, vocab=4096)
    assert [len(t.tokens) for t in again] == [150, 150, 150]
    assert all(10 <= x < 4096 for t in again for x in t.tokens)


def test_the_oracle_serves_whole_blocks_of_answered_prompts_but_never_the_last_token() -> None:
    B = fleet.BLOCK
    o = fleet.Oracle()
    p = list(range(3 * B))
    assert o.servable(p) == 0
    o.answered(p)
    assert o.servable(p) == 2 * B  # the same prompt again: vLLM computes its last token, so block 3 is not
    assert o.servable(p + [1]) == 3 * B
    assert o.servable(p[:B] + [9] * (2 * B)) == B  # a prefix that parts after its first block
    assert o.servable([9] + p[1:]) == 0  # the first block differs: nothing, whatever follows


def test_make_targets_run_the_fleet_benchmark() -> None:
    text = (ROOT / "Makefile").read_text()
    assert "bench-fleet: $(STAMP) $(VLLM_STAMP)\n\t$(BIN)/python benchmarks/fleet.py $(ARGS)" in text
    assert "demo-fleet: $(STAMP) $(VLLM_STAMP)\n\t$(BIN)/python benchmarks/fleet.py --demo $(ARGS)" in text
