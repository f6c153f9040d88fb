"""BlockHasher against vLLM 0.32's own code (in .venv-vllm, a subprocess): the same bytes for every
algorithm, with PYTHONHASHSEED set and unset; vLLM's offloading keys likewise."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from kvgate.errors import InvalidArgument
from kvgate.routing.hashing import ALGOS, BlockHasher, block_key, offload_keys

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

# Runs in .venv-vllm: vLLM's hashes (init_none_hash + hash_block_tokens, chained as
# get_request_block_hasher chains them), its offloading keys, and kvgate's BlockHasher there too (the CBOR
# algorithms need cbor2, which vLLM has and kvgate's own venv may lack).
VLLM_SCRIPT = r"""
import json, os, sys
from itertools import islice
from vllm.v1.core import kv_cache_utils as k
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.kv_offload.base import make_offload_key
from kvgate.routing.hashing import BlockHasher
case = json.loads(sys.stdin.read())
tokens, bs, out = case["tokens"], case["block_size"], {}
for algo in case["algos"]:
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    parent, hashes = None, []
    for i in range(len(tokens) // bs):
        parent = k.hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], None)
        hashes.append(parent)
    ours = BlockHasher(algo, bs, seed=None).hashes(tokens)
    # the offloading connector's chunk keys: islice(hashes, factor - 1, None, factor) + group index
    offl = {f: [make_offload_key(h, 3).hex() for h in islice(hashes, f - 1, None, f)] for f in (1, 4)}
    out[algo] = {"vllm": [h.hex() for h in hashes], "kvgate_in_vllm_venv": [h.hex() for h in ours],
                 "offload": offl}
print(json.dumps(out))
"""


def _vllm(tokens: list[int], block_size: int, algos: list[str], seed: str | None) -> dict:
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is missing (make venvs builds it)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    p = subprocess.run([str(VLLM_PY), "-c", VLLM_SCRIPT], input=json.dumps(
        {"tokens": tokens, "block_size": block_size, "algos": algos}), capture_output=True, text=True,
        env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _has_cbor2() -> bool:
    try:
        import cbor2  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["1234", None], ids=["PYTHONHASHSEED=1234", "unset"])
def test_hashes_are_vllms_byte_for_byte(seed: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(16 * 9 + 5)]  # 9 full blocks and a partial one
    # without a seed vLLM seeds the xxhash algorithms randomly per process: nothing to compare to
    algos = list(ALGOS) if seed is not None else ["sha256", "sha256_cbor"]
    got = _vllm(tokens, 16, algos, seed)
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    for algo in algos:
        vllm = got[algo]["vllm"]
        assert len(vllm) == 9
        # kvgate in vLLM's venv: every algorithm, CBOR ones included
        assert got[algo]["kvgate_in_vllm_venv"] == vllm, algo
        # kvgate in its own venv (the router's): where the algorithm's library is present
        if "cbor" in algo and not _has_cbor2():
            with pytest.raises(InvalidArgument, match="cbor2"):
                BlockHasher(algo, 16, seed=seed)
            continue
        ours = BlockHasher(algo, 16, seed=seed)
        assert [h.hex() for h in ours.hashes(tokens)] == vllm, algo
        assert [h.hex() for h in ours.hashes(tokens)] == vllm, algo  # again, from the LRU
        assert ours.hits == 9
        for factor in (1, 4):
            assert [k.hex() for k in offload_keys(ours.hashes(tokens), 3, factor)] == got[algo]["offload"][str(factor)]


@pytest.mark.slow
def test_block_size_and_a_prefix_extension_match_vllm() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(32_000) for _ in range(32 * 6)]
    got = _vllm(tokens, 32, ["sha256"], "0")
    h = BlockHasher("sha256", 32, seed="0")
    assert [x.hex() for x in h.hashes(tokens[:32 * 3])] == got["sha256"]["vllm"][:3]
    assert [x.hex() for x in h.hashes(tokens)] == got["sha256"]["vllm"]  # the first 3 from the cache
    assert h.hits == 3 and h.misses == 6


def test_xxhash_without_a_seed_is_refused_naming_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(InvalidArgument, match="PYTHONHASHSEED"):
        BlockHasher("xxhash", 16)
    assert len(BlockHasher("xxhash", 16, seed="5").hashes(list(range(32)))[0]) == 16


def test_unknown_algorithm_and_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        BlockHasher("md5")
    with pytest.raises(InvalidArgument, match="block_size"):
        BlockHasher("sha256", 0)
    with pytest.raises(InvalidArgument, match="factor"):
        offload_keys([b"x" * 32], 0, 0)


def test_only_full_blocks_are_hashed_and_the_seed_changes_every_hash() -> None:
    a = BlockHasher("sha256", 16, seed="a", cache_size=0)
    b = BlockHasher("sha256", 16, seed="b", cache_size=0)
    assert a.hashes(list(range(15))) == []
    ha, hb = a.hashes(list(range(40))), b.hashes(list(range(40)))
    assert len(ha) == 2 and not set(ha) & set(hb)
    # a block's hash depends on every block before it
    assert a.hashes([1] * 16 + list(range(16)))[1] != a.hashes([2] * 16 + list(range(16)))[1]


def test_block_key_is_the_int_vllm_events_carry() -> None:
    h = bytes(range(32))
    assert block_key(h) == int.from_bytes(h, "big") & (2**64 - 1)
    assert block_key(block_key(h)) == block_key(h)
    hasher = BlockHasher("sha256", 16, seed="0")
    assert hasher.keys(list(range(64))) == [block_key(x) for x in hasher.hashes(list(range(64)))]
