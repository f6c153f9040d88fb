"""Run under .venv-vllm/bin/python: vLLM's own KV event classes read kvgate's bytes and write theirs.

One argument, a JSON plan; the findings go to the plan's "out" as JSON.  Plan keys (each optional):

- "decode": hex payloads; each is decoded with ``msgspec.msgpack.Decoder(KVEventBatch)`` (what vLLM's
  consumers use) and reported as ``{"ts", "rank", "events": [{"type", field: value...}]}``, bytes as hex.
- "encode": true: vLLM's own events (every kind, bytes and int hashes, every field set) encoded with
  vLLM's encoder; reported as "encoded" (hex payloads) and "encoded_events" (as "decode" reports them).
- "subscribe": {"endpoint", "topic", "count", "timeout_s", "ready_file"}: a ZMQ SUB reads ``count``
  messages (three frames each, as vLLM's publisher sends) and decodes each payload with vLLM's decoder;
  reported as "received": [{"topic", "seq", "batch"}].  "ready_file" is written once the SUB is
  connected (and has had 0.5 s to join), so the test publishes after that.
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def plain(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def report(batch: KVEventBatch) -> dict:
    events = []
    for ev in batch.events:
        d = {"type": type(ev).__name__}
        d.update({f: plain(getattr(ev, f)) for f in ev.__struct_fields__})
        events.append(d)
    return {"ts": batch.ts, "rank": batch.data_parallel_rank, "events": events}


def main() -> None:
    plan = json.loads(open(sys.argv[1]).read())
    out: dict = {}
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    if "decode" in plan:
        out["decoded"] = [report(dec.decode(bytes.fromhex(p))) for p in plan["decode"]]
    if plan.get("encode"):
        batches = [
            KVEventBatch(ts=1.25, events=[
                BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=b"\x00" * 32,
                            token_ids=[1, 2, 3, 4], block_size=2, lora_id=7, medium="GPU", lora_name="l",
                            extra_keys=[("a", 1), None], group_idx=1, kv_cache_spec_kind="full_attention",
                            kv_cache_spec_sliding_window=128, locality="LOCAL", ownership="lmcache",
                            session_id="s1"),
                BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU", group_idx=1, locality="REMOTE",
                             ownership="x"),
                AllBlocksCleared(),
            ], data_parallel_rank=3),
            KVEventBatch(ts=2.5, events=[
                BlockStored(block_hashes=[2**63 + 5, 9], parent_block_hash=None, token_ids=[], block_size=16,
                            lora_id=None, medium=None, lora_name=None),
                BlockRemoved(block_hashes=[9], medium="CPU"),
            ]),
        ]
        enc = msgspec.msgpack.Encoder()
        out["encoded"] = [enc.encode(b).hex() for b in batches]
        out["encoded_events"] = [report(b) for b in batches]
    if "subscribe" in plan:
        s = plan["subscribe"]
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(s["endpoint"])
        sock.setsockopt(zmq.SUBSCRIBE, s.get("topic", "").encode())
        if s.get("ready_file"):
            time.sleep(0.5)
            open(s["ready_file"], "w").close()
        received = []
        deadline = time.monotonic() + s.get("timeout_s", 30)
        while len(received) < s["count"] and time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            topic, seq, payload = sock.recv_multipart()
            received.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                             "batch": report(dec.decode(payload))})
        sock.close(0)
        out["received"] = received
    with open(plan["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
