"""kvgate.kvevents.wire: vLLM's KV event payload, both event forms, refusals that name what is wrong, and the
bytes checked against vLLM's own classes (a subprocess under .venv-vllm)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.errors import InvalidArgument
from kvgate.kvevents.wire import (
    END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch, seq_bytes,
    seq_from_bytes,
)
from tests.helpers import run_json_script, venv_python

from pathlib import Path

VENV_PY = venv_python(".venv-vllm")
SCRIPT = Path(__file__).resolve().parent / "vllm_events.py"

hashes = st.lists(st.one_of(st.binary(min_size=1, max_size=40), st.integers(0, 2**64 - 1)), max_size=5)
opt_str = st.none() | st.text(max_size=8)
opt_int = st.none() | st.integers(0, 2**31)
stored = st.builds(
    BlockStored, block_hashes=hashes, parent_block_hash=st.none() | st.binary(min_size=1, max_size=32),
    token_ids=st.lists(st.integers(0, 2**31), max_size=8), block_size=st.integers(0, 4096), lora_id=opt_int,
    medium=opt_str, lora_name=opt_str,
    extra_keys=st.none() | st.lists(st.none() | st.tuples(st.text(max_size=4), st.integers(0, 99)), max_size=3),
    group_idx=opt_int, kv_cache_spec_kind=opt_str, kv_cache_spec_sliding_window=opt_int, locality=opt_str,
    ownership=opt_str, session_id=opt_str, lookahead_token_ids=st.none() | st.lists(st.integers(0, 99), max_size=3))
removed = st.builds(BlockRemoved, block_hashes=hashes, medium=opt_str, group_idx=opt_int, locality=opt_str,
                    ownership=opt_str)
batches = st.builds(EventBatch, ts=st.floats(allow_nan=False), events=st.lists(
    st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6), data_parallel_rank=opt_int)


@settings(max_examples=200, deadline=None)
@given(batches, st.booleans())
def test_round_trip_both_forms(batch, positional):
    assert decode_batch(encode_batch(batch, positional=positional)) == batch


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.one_of(stored, removed, st.just(AllBlocksCleared())), st.booleans()), max_size=6))
def test_a_batch_may_mix_the_forms(pairs):
    """Each event decodes by its own form: a map or a positional array."""
    raw = [msgspec.msgpack.decode(encode_batch(EventBatch(0.0, [ev]), positional=pos))[1][0] for ev, pos in pairs]
    payload = msgspec.msgpack.encode([0.0, raw, None])
    assert decode_batch(payload).events == [ev for ev, _ in pairs]


def test_the_map_form_is_vllms():
    ev = BlockStored(block_hashes=[b"h"], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                     medium="CPU", lora_name=None, group_idx=2)
    assert msgspec.msgpack.decode(encode_batch(EventBatch(1.0, [ev, AllBlocksCleared()]))) == [1.0, [
        {"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None, "token_ids": [],
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 2},
        {"type": "AllBlocksCleared"}], None]


def test_an_old_short_positional_event_decodes():
    """An old release's short positional events: BlockStored with five fields, BlockRemoved with one."""
    payload = msgspec.msgpack.encode([3.0, [["BlockStored", [1, 2], None, [5, 6], 2, None],
                                            ["BlockRemoved", [1]]]])
    batch = decode_batch(payload)
    assert batch.events == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5, 6], block_size=2, lora_id=None,
                    medium=None, lora_name=None), BlockRemoved(block_hashes=[1], medium=None)]
    assert batch.data_parallel_rank is None


def test_unknown_fields_of_a_newer_engine_are_ignored():
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU",
                                             "future": 1}, ["BlockRemoved", [b"b"], "GPU", 0, None, None, "more"]]])
    assert decode_batch(payload).events == [BlockRemoved([b"a"], "GPU"), BlockRemoved([b"b"], "GPU", group_idx=0)]


@pytest.mark.parametrize("payload, named", [
    (b"", "truncated"),
    (b"\xc1", "invalid"),
    (msgspec.msgpack.encode(5), "array"),
    (msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), "Nope"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]), "block_hashes"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", "notalist", None, [], 1]]]), "block_hashes"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": None}]]),
     "block_hashes"),
    (msgspec.msgpack.encode(["x", []]), "ts"),
])
def test_a_malformed_payload_is_refused_naming_what(payload, named):
    with pytest.raises(InvalidArgument, match="malformed KV event batch") as info:
        decode_batch(payload)
    assert named.lower() in str(info.value).lower()


def test_sequence_frames():
    assert seq_bytes(258) == b"\0\0\0\0\0\0\x01\x02"
    assert seq_from_bytes(seq_bytes(2**63)) == 2**63
    assert seq_from_bytes(END_SEQ) == -1
    with pytest.raises(InvalidArgument, match="8 bytes"):
        seq_from_bytes(b"\0")


def _plain(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _report(batch: EventBatch, *, vllm_fields: bool = True) -> dict:
    events = []
    for ev in batch.events:
        d = {"type": type(ev).__name__}
        d.update({f: _plain(getattr(ev, f)) for f in ev.__struct_fields__
                  if not (vllm_fields and f == "lookahead_token_ids")})
        events.append(d)
    return {"ts": batch.ts, "rank": batch.data_parallel_rank, "events": events}


@pytest.mark.slow
@pytest.mark.skipif(not VENV_PY.exists(), reason="needs .venv-vllm (make vllm-venv)")
def test_vllms_own_classes_read_ours_and_we_read_theirs(tmp_path):
    ours = [
        EventBatch(4.5, [BlockStored(block_hashes=[b"\xaa" * 32, 17], parent_block_hash=b"\x01" * 32,
                                     token_ids=[9, 8], block_size=16, lora_id=None, medium="CPU", lora_name=None,
                                     extra_keys=[None, ("s", 1)], group_idx=3, locality="LOCAL",
                                     ownership="kvgate", session_id="x", lookahead_token_ids=[4]),
                         BlockRemoved(block_hashes=[b"\xaa" * 32], medium="STORAGE", group_idx=3,
                                      locality="LOCAL", ownership="kvgate"),
                         AllBlocksCleared()], data_parallel_rank=None),
        EventBatch(5.0, [], data_parallel_rank=2),
    ]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"out": str(tmp_path / "out.json"), "encode": True,
                                "decode": [encode_batch(b).hex() for b in ours]}))
    result = run_json_script(VENV_PY, SCRIPT, [plan], tmp_path / "out.json")
    # vLLM 0.32 has no lookahead_token_ids: its decoder skips ours, and reads every other field as sent
    assert result["decoded"] == [_report(b) for b in ours]
    for payload, theirs in zip(result["encoded"], result["encoded_events"]):
        assert _report(decode_batch(bytes.fromhex(payload))) == theirs
