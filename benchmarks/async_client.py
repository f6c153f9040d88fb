"""AsyncClient vs Client vs a memory copy, and how long a large transfer holds the event loop.

    .venv/bin/python benchmarks/async_client.py [--objects 256] [--object-size 1M] [--json]

One gateway (RAM tier, one directory card, a TCP listener) holds N objects
stored with retention "short" (RAM tier only).  Figures, all in one run:

  get      get_many of all N into plain numpy buffers, one call a pass, by
           AsyncClient and Client over the Unix socket (through the session
           region: the gateway copies into it, the client copies out) and
           over TCP (received straight into the buffers), next to
           ``np.copyto`` of the same bytes from one set of buffers into
           another, one thread.  The passes alternate between contenders
           (kvgate.bench.measure.measure), so load on the shared machine lands on all.
  loop     the longest time the event loop could not run a 1 ms ticker:
           idle (the machine's noise), during the client's own copy of 64
           MiB on the loop and on a worker thread, and during 64 MiB
           get_many and put_many over the Unix socket with the copies through
           the session region on the loop and on a worker thread (AsyncClient
           moves them there from OFFLOAD_BYTES up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvgate import AsyncClient, Client
from kvgate.client import async_client as asyncclient
from kvgate.bench.command import size_arg
from kvgate.bench.harness import bench_gateway
from kvgate.bench.measure import Contender, measure

GIB = 1 << 30
MIB = 1 << 20


def _fill(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    """Sleep 1 ms at a time; record by how much each wake-up came late."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        gaps.append(time.perf_counter() - t0 - 0.001)


async def _stalls(call, reps: int) -> list[tuple[float, float]]:
    """(longest ticker delay, the call's time) of each of ``reps`` awaits of ``call()``."""
    out = []
    for _ in range(reps):
        stop, gaps = asyncio.Event(), []
        tick = asyncio.ensure_future(_ticker(stop, gaps))
        await asyncio.sleep(0.01)
        gaps.clear()
        t0 = time.perf_counter()
        await call()
        took = time.perf_counter() - t0
        await asyncio.sleep(0.003)
        stop.set()
        await tick
        out.append((max(gaps, default=0.0), took))
    return out


def _stall_figure(what: str, where: str, runs: list[tuple[float, float]]) -> dict[str, Any]:
    stalls, times = [r[0] * 1e3 for r in runs], [r[1] * 1e3 for r in runs]
    return {"what": what, "copies": where, "median_stall_ms": statistics.median(stalls), "max_stall_ms": max(stalls),
            "median_call_ms": statistics.median(times), "calls": len(runs)}


async def _loop_figures(c: AsyncClient, keys: list[bytes], srcs: list[np.ndarray], dests: list[np.ndarray],
                        reps: int) -> list[dict[str, Any]]:
    """The event loop's longest stall during: nothing (the machine's noise), the client's own copy of
    the bytes (what OFFLOAD_BYTES decides), and whole get_many / put_many calls through the session
    region (the gateway's copies run on the same cores meanwhile)."""
    loop = asyncio.get_running_loop()
    mib = sum(s.nbytes for s in srcs) >> 20

    def copy() -> None:
        for d, s in zip(dests, srcs):
            np.copyto(d, s)

    async def idle() -> None:
        await asyncio.sleep(0.02)

    async def copy_on_loop() -> None:
        copy()

    async def copy_on_thread() -> None:
        await loop.run_in_executor(None, copy)

    async def get() -> None:
        got = await c.get_many(keys, into=dests)
        assert all(g is not None for g in got)

    async def put() -> None:
        assert await c.put_many(keys, srcs, retention="short") == [True] * len(keys)

    figures = [_stall_figure("nothing (20 ms sleep)", "-", await _stalls(idle, reps))]
    for where, fn in (("event loop", copy_on_loop), ("worker thread", copy_on_thread)):
        figures.append(_stall_figure(f"np.copyto of {mib} MiB", where, await _stalls(fn, reps)))
    saved = asyncclient.OFFLOAD_BYTES
    try:
        for what, fn in ((f"get_many of {mib} MiB", get), (f"put_many of {mib} MiB", put)):
            for where, limit in (("event loop", 1 << 62), ("worker thread", saved)):
                asyncclient.OFFLOAD_BYTES = limit
                figures.append(_stall_figure(what, where, await _stalls(fn, reps)))
    finally:
        asyncclient.OFFLOAD_BYTES = saved
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=256, help="objects per get_many (default 256)")
    p.add_argument("--object-size", type=size_arg(1), default=MIB, metavar="SIZE", help="default 1M")
    p.add_argument("--budget", type=float, default=8.0, help="seconds of measured passes (default 8)")
    p.add_argument("--stall-reps", type=int, default=9, help="calls per loop-stall figure (default 9)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    n, size = args.objects, args.object_size
    total = n * size
    region = max(total, 64 * MIB)
    say = (lambda *_: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    workdir = tempfile.mkdtemp(prefix="kvg-async-bench-")
    sockdir = tempfile.mkdtemp(prefix="kvg-", dir="/tmp")
    gw = bench_gateway("async", workdir, sockdir, max_bytes=2 * total + 128 * MIB, threads=2,
                       card_capacity=1 << 30, tcp=True, extra=["--shared-memory-size", str(region)])
    tcp = f"127.0.0.1:{gw.tcp_port}"
    loop = asyncio.new_event_loop()
    out: dict[str, Any] = {"objects": n, "object_size": size, "pass_bytes": total, "session_region": region,
                           "offload_bytes": asyncclient.OFFLOAD_BYTES}
    try:
        say(f"gateway: RAM tier, session region {region >> 20} MiB, {n} x {size} B objects")
        gw.start(60.0)
        srcs = _fill(n, size)
        dests = [np.empty(size, np.uint8) for _ in range(n)]
        keys = [f"obj-{i}".encode() for i in range(n)]
        sync_u = Client.connect(gw.socket, namespace="bench", engine_id="bench")
        sync_t = Client.connect(tcp, namespace="bench", engine_id="bench")
        async_u = loop.run_until_complete(AsyncClient.connect(gw.socket, namespace="bench", engine_id="bench"))
        async_t = loop.run_until_complete(AsyncClient.connect(tcp, namespace="bench", engine_id="bench"))
        if not all(sync_u.put_many(keys, srcs, retention="short")):
            raise SystemExit("the gateway did not store every object (RAM tier too small?)")

        def checked(got: list) -> None:
            for g, s in zip(got, srcs):
                if g is None or not np.array_equal(np.frombuffer(g, np.uint8), s):
                    raise SystemExit("a get returned wrong bytes")

        for name, c in (("sync unix", sync_u), ("sync tcp", sync_t)):
            checked(c.get_many(keys, into=dests))
        for name, c in (("async unix", async_u), ("async tcp", async_t)):
            checked(loop.run_until_complete(c.get_many(keys, into=dests)))

        def copy_pass(_r: int) -> None:
            for d, s in zip(dests, srcs):
                np.copyto(d, s)

        say("get_many: AsyncClient, Client (Unix socket, TCP), np.copyto")
        series = measure([
            Contender("memcpy", copy_pass),
            Contender("async_unix", lambda _r: loop.run_until_complete(async_u.get_many(keys, into=dests))),
            Contender("sync_unix", lambda _r: sync_u.get_many(keys, into=dests)),
            Contender("async_tcp", lambda _r: loop.run_until_complete(async_t.get_many(keys, into=dests))),
            Contender("sync_tcp", lambda _r: sync_t.get_many(keys, into=dests)),
        ], total, budget_s=args.budget, min_rounds=5, max_rounds=200)
        base = series["memcpy"]
        out["get"] = {name: {**s.to_json(), "best_vs_memcpy": s.best_gib_s / base.best_gib_s,
                             "median_vs_memcpy": s.median_gib_s / base.median_gib_s}
                      for name, s in series.items()}

        say("event loop stalls: 64 MiB get_many and put_many over the Unix socket")
        m = max(1, (64 * MIB) // size)
        out["loop"] = loop.run_until_complete(_loop_figures(async_u, keys[:m], srcs[:m], dests[:m],
                                                            args.stall_reps))

        for c in (sync_u, sync_t):
            c.close()
        for c in (async_u, async_t):
            loop.run_until_complete(c.close())
    finally:
        loop.close()
        gw.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)

    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"get_many of {n} x {size} B ({total / GIB:.2f} GiB a pass), RAM tier, best / median GiB/s:")
    for name, s in out["get"].items():
        print(f"  {name:11s} {s['best_gib_s']:6.2f} / {s['median_gib_s']:6.2f}   vs memcpy "
              f"{s['best_vs_memcpy']:.2f} / {s['median_vs_memcpy']:.2f}   ({s['passes']} passes)")
    print("event loop's longest stall (1 ms ticker), median / worst of the calls; the call's median time:")
    for f in out["loop"]:
        print(f"  {f['what']:22s} copies on {f['copies']:13s} {f['median_stall_ms']:6.2f} / {f['max_stall_ms']:6.2f} ms"
              f"   call {f['median_call_ms']:6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
