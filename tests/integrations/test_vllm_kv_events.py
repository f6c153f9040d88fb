"""A real vLLM CPU engine (0.32, the tests' tiny random-weight Llama) stores through a gateway with
kv_events on: the gateway's events carry exactly the block hashes vLLM computes for the prompt (as
``kvgate.routing.hashing`` reproduces them, itself checked against vLLM's functions), one per offloaded
chunk, group 0, with the chunk's tokens as block_size: what the vLLM integration declares in its hello."""

from __future__ import annotations

import pytest

from kvgate.bench.processes import free_port
from kvgate.kvevents.subscriber import Subscriber
from kvgate.kvevents.wire import BlockStored
from kvgate.routing.hashing import DEFAULT_NONE_HASH_SEED, BlockHasher
from tests.helpers import GatewayProcess, wait_until
from tests.integrations.test_vllm_e2e import BLOCK, FULL_CHUNKS, P, VENV_PY, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} is missing: build the vLLM CPU venv first "
                                                   "(make vllm-venv)"),
]


def test_a_gateways_events_carry_the_engines_block_hashes(tmp_path):
    pub, rep = free_port(), free_port()
    gw = GatewayProcess(tmp_path, ["--max-bytes", "256M", "--shared-memory-size", "64M",
                                   "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                                   "--kv-events-topic", "gw"], name="gw")
    gw.start()
    got: list = []
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
    sub.start_thread(got.extend)
    try:
        run_engine(tmp_path, "run", gw, tmp_path / "tiny-llama", [{"name": "P", "prompt_token_ids": P}],
                   drain={"expect_sets": FULL_CHUNKS, "timeout": 60})
        ram = lambda: [e for t, _, b in list(got) if t == "gw" for e in b.events if isinstance(e, BlockStored)]  # noqa: E731
        wait_until(lambda: sum(len(e.block_hashes) for e in ram()) >= FULL_CHUNKS, 20,
                   lambda: f"the gateway published {len(ram())} stored events: {got[-3:]}")
    finally:
        sub.close()
        gw.cleanup()
    expected = BlockHasher("sha256", BLOCK, seed=DEFAULT_NONE_HASH_SEED).hashes(P)[:FULL_CHUNKS]
    events = ram()
    # the engine's store jobs finish in any order, and the gateway publishes them as they land
    assert sorted(h for e in events for h in e.block_hashes) == sorted(expected)
    assert {(e.group_idx, e.block_size, e.medium) for e in events} == {(0, BLOCK, "CPU")}
