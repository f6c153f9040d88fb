"""``kvgate bench --pull``: a pull from a peer gateway against a raw loopback stream of the same bytes.

A gateway process serves its tiers on ``peer_listen``; ``--batch`` objects of
``--object-size`` are stored in its RAM tier.  This process reads them as a
peer does (``PeerTier.read_into``: one ``read_many``, every object verified
as it lands, each into a destination of its own), and, alternating with it,
receives the same bytes from a raw loopback TCP stream (a sender thread,
``sendall`` of one buffer per object, as the peer sends from one RAM entry
per object; the receiver ``recv_into`` each destination): the physical
limit of the same run.  The ratio is the median of the rounds'
ratios (bar: 0.8).  From the pull's rate, the time to pull a prompt's KV at
``--kv-bytes-per-token`` for a few prompt lengths: what a router weighs
against recomputing them (the engine's own prefill time, measured by
``make bench-vllm``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvgate.bench.baselines import loopback_pair
from kvgate.bench.processes import GatewayProcess, free_port
from kvgate.config import Config
from kvgate.keys import encode_namespace, full_key
from kvgate.tiers.peertier import PeerTier
from kvgate.tiers.store import GetItem
from kvgate.types import SizeCode

__all__ = ["BAR_PULL_RATIO", "pull_bench", "print_pull"]

BAR_PULL_RATIO = 0.8
NAMESPACE = "bench-pull"
TOKEN = "bench-pull-token"
PROMPT_TOKENS = (2048, 8192, 32768, 49152)
# Llama-3-8B in bf16: 32 layers x (K + V) x 8 KV heads x 128 dims x 2 bytes
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def _raw(dests: list[bytearray], sources: list[bytearray]) -> float:
    """Seconds to send ``sources`` over a fresh loopback pair and receive each into its destination."""
    sender, receiver = loopback_pair()
    try:
        def send() -> None:
            for src in sources:
                sender.sendall(src)

        t0 = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        for d in dests:
            v, got = memoryview(d), 0
            while got < len(d):
                n = receiver.recv_into(v[got:])
                if not n:
                    raise ConnectionError("the loopback stream closed")
                got += n
        thread.join()
        return time.perf_counter() - t0
    finally:
        sender.close()
        receiver.close()


def pull_bench(object_size: int = 2 << 20, batch: int = 32, rounds: int = 9, workdir: str | None = None,
               kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN) -> dict[str, Any]:
    """Measure; the figures as a dict (``print_pull`` prints them).  Starts and stops its gateway."""
    work = Path(workdir or tempfile.mkdtemp(prefix="kvgate-bench-pull-"))
    work.mkdir(parents=True, exist_ok=True)
    token = work / "peer.token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    port = free_port()
    ram = max(256 << 20, 4 * batch * object_size)
    gw = GatewayProcess(work, ["--storage-devices", str(work / "card"), "--max-bytes", str(ram),
                               "--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", str(token),
                               "--port", "0", "--metrics-port", "0"], name="peer")
    payload = os.urandom(object_size)
    keys = [b"object-%d" % i for i in range(batch)]
    gw.start()
    try:
        from kvgate.client import Client

        with Client.connect(gw.socket, namespace=NAMESPACE, timeout=60) as c:
            for i in range(0, batch, 8):
                stored = c.put_many(keys[i : i + 8], [payload] * len(keys[i : i + 8]), retention="short")
                if not all(stored):
                    raise RuntimeError("the peer gateway's RAM tier did not take the objects: lower --batch")
        cfg = Config(storage_devices=[str(work)], peers=[f"127.0.0.1:{port}"], peer_token_file=str(token),
                     peer_timeout_ms=60_000, max_frame_bytes=max(256 << 20, object_size + (1 << 20)))
        tier = PeerTier(cfg, f"127.0.0.1:{port}")
        fkeys = [full_key(encode_namespace(NAMESPACE), k) for k in keys]
        dests = [bytearray(object_size) for _ in keys]
        # the raw stream's sources: an object each, as the peer's RAM pages are (not one buffer sent N times,
        # which would stay in the CPU cache)
        sources = [bytearray(payload) for _ in keys]

        async def pull() -> float:
            t0 = time.perf_counter()
            sizes, _, _ = await tier.read_into([GetItem(k, b"", memoryview(d)) for k, d in zip(fkeys, dests)],
                                               own=True)
            took = time.perf_counter() - t0
            if any(s != object_size for s in sizes):
                raise RuntimeError(f"a pull missed: {[s for s in sizes if s != object_size][:3]} "
                                   f"({SizeCode.MISS} is a miss)")
            return took

        try:
            asyncio.run(pull())  # one round unmeasured: connections made, pages touched
            pulls, raws = [], []
            for r in range(rounds):
                if r % 2:
                    raws.append(_raw(dests, sources))
                    pulls.append(asyncio.run(pull()))
                else:
                    pulls.append(asyncio.run(pull()))
                    raws.append(_raw(dests, sources))
            if any(bytes(d) != payload for d in dests):
                raise RuntimeError("a pulled object differs from what was stored")
        finally:
            tier.close()
    finally:
        gw.cleanup()
    total = batch * object_size
    pull_rate = total / statistics.median(pulls)
    return {
        "config": {"object_size": object_size, "batch": batch, "rounds": rounds, "cores": os.cpu_count(),
                   "kv_bytes_per_token": kv_bytes_per_token},
        "pull_gib_s": pull_rate / (1 << 30),
        "raw_gib_s": total / statistics.median(raws) / (1 << 30),
        "ratio": statistics.median(r / p for p, r in zip(pulls, raws)),
        "ratios": [round(r / p, 3) for p, r in zip(pulls, raws)],
        "bar_ratio_min": BAR_PULL_RATIO,
        "pull_seconds_by_prompt_tokens": {n: n * kv_bytes_per_token / pull_rate for n in PROMPT_TOKENS},
    }


def print_pull(r: dict[str, Any]) -> None:
    c = r["config"]
    verdict = "met" if r["ratio"] >= r["bar_ratio_min"] else "NOT met"
    print(f"pull from a peer gateway: {c['batch']} objects of {c['object_size'] >> 10} KiB per read_many, "
          f"{c['rounds']} rounds alternating with a raw loopback stream ({c['cores']} cores)")
    print(f"  pull {r['pull_gib_s']:.2f} GiB/s, raw stream {r['raw_gib_s']:.2f} GiB/s: ratio {r['ratio']:.2f} "
          f"(bar >= {r['bar_ratio_min']}: {verdict}; rounds {', '.join(f'{x:.2f}' for x in r['ratios'])})")
    print(f"  time to pull a prompt's KV at this rate ({c['kv_bytes_per_token'] >> 10} KiB per token): "
          + ", ".join(f"{n // 1024}K tokens {s * 1e3:.0f} ms" for n, s in r["pull_seconds_by_prompt_tokens"].items()))
