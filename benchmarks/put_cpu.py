"""Where a put's time goes: the gateway's CPU around each put, beside the raw write it is measured against.

A gateway on a directory card in ``--dir`` (as ``kvgate bench`` starts its card gateway) and a client
with a registered region.  Passes alternate: a put of 32 objects of 2 MiB (deleted after, untimed), then
the raw verified write of the same bytes on 4 threads (XXH3 of each payload, open + ``pwritev`` + close
+ rename; ``kvgate.bench.baselines.write_files_verified``).  Around each put the gateway's threads are
read from ``/proc/PID/task/*/stat``: user and kernel time of its event loop (the main thread) and of
the rest (its card writers, chiefly); around each raw pass, this process's own.  Prints per pass the
best and median time of each side, their ratio, and the CPU each took (clock ticks: meaningful as
averages over many passes).  Then the cost of a request itself: passes alternating a put of one object of
4 KiB with the raw verified write of one such file on one thread; the difference of their bests is what a
put pays before and after its writes (the round trip, the hand-off to a card thread and back, the index).

    .venv/bin/python benchmarks/put_cpu.py --passes 150
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvgate.bench.baselines import on_threads, write_files_verified
from kvgate.bench.harness import ShmRegion, bench_gateway
from kvgate.client import Client

OBJECTS = 32
SIZE = 2 << 20
SMALL = 4096
THREADS = 4
TICK = 1 / os.sysconf("SC_CLK_TCK")


def _threads_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """(user, kernel) seconds of each thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        out[int(tid)] = (int(fields[11]) * TICK, int(fields[12]) * TICK)
    return out


def _own_cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="var/put-cpu", help="where the card and the raw files go (removed at the end)")
    p.add_argument("--passes", type=int, default=150, help="passes of each side")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "raw"))
    gw = bench_gateway("put-cpu", args.dir, args.dir, max_bytes=0, threads=THREADS, card_capacity=4 << 30)
    gw.start()
    pool = ThreadPoolExecutor(THREADS)
    try:
        shm = ShmRegion(OBJECTS * SIZE)
        client = Client.connect(gw.socket, namespace="put-cpu", engine_id="put-cpu", want_shm=False)
        client.register_region(shm.path, shm.mm)
        shm.array[:] = np.random.default_rng(0).integers(0, 256, OBJECTS * SIZE, np.uint8)
        view = memoryview(shm.array)
        slices = [view[i * SIZE : (i + 1) * SIZE] for i in range(OBJECTS)]
        header = memoryview(bytes(4096))
        put_s, raw_s = [], []
        cpu = dict.fromkeys(("loop user", "loop kernel", "others user", "others kernel", "raw user", "raw kernel"),
                            0.0)
        pid = gw.proc.pid
        for r in range(args.passes):
            keys = [b"p%d-%d" % (r, i) for i in range(OBJECTS)]
            before = _threads_cpu(pid)
            t0 = time.perf_counter()
            if not all(client.put_many(keys, slices)):
                raise SystemExit("the gateway did not store a put")
            put_s.append(time.perf_counter() - t0)
            for tid, (u, k) in _threads_cpu(pid).items():
                u0, k0 = before.get(tid, (0.0, 0.0))
                who = "loop" if tid == pid else "others"
                cpu[f"{who} user"] += u - u0
                cpu[f"{who} kernel"] += k - k0
            client.delete_many(keys)
            items = [(os.path.join(args.dir, "raw", f"{r}-{i}"), header, slices[i]) for i in range(OBJECTS)]
            u0, k0 = _own_cpu()
            t0 = time.perf_counter()
            on_threads(pool, write_files_verified, items, THREADS)
            raw_s.append(time.perf_counter() - t0)
            u1, k1 = _own_cpu()
            cpu["raw user"] += u1 - u0
            cpu["raw kernel"] += k1 - k0
            for path, _h, _d in items:
                os.unlink(path)
        small = _one_object(client, view[:SMALL], os.path.join(args.dir, "raw"), args.passes)
        client.close()
    finally:
        pool.shutdown()
        gw.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
    n = args.passes
    print(f"put of {OBJECTS} x {SIZE >> 20} MiB: best {min(put_s) * 1e3:.2f} ms, "
          f"median {statistics.median(put_s) * 1e3:.2f}")
    print(f"raw verified write, {THREADS} threads: best {min(raw_s) * 1e3:.2f} ms, "
          f"median {statistics.median(raw_s) * 1e3:.2f}")
    print(f"ratio of bests {min(raw_s) / min(put_s):.2f}, of medians "
          f"{statistics.median(raw_s) / statistics.median(put_s):.2f}")
    print("CPU a pass (ms): " + ", ".join(f"{k} {v * 1e3 / n:.2f}" for k, v in cpu.items()))
    put1, raw1 = small
    print(f"put of one object of {SMALL >> 10} KiB: best {min(put1) * 1e3:.2f} ms, median "
          f"{statistics.median(put1) * 1e3:.2f}; raw verified write of one file: best {min(raw1) * 1e3:.2f} ms, "
          f"median {statistics.median(raw1) * 1e3:.2f}; the request's own cost (difference of bests) "
          f"{(min(put1) - min(raw1)) * 1e3:.2f} ms")


def _one_object(client: Client, payload: memoryview, raw_dir: str, passes: int) -> tuple[list[float], list[float]]:
    """Alternated passes: a put of ``payload`` as one object, the raw verified write of one file of it."""
    header = memoryview(bytes(4096))
    put_s, raw_s = [], []
    for r in range(passes):
        key = [b"one-%d" % r]
        t0 = time.perf_counter()
        if not all(client.put_many(key, [payload])):
            raise SystemExit("the gateway did not store a put")
        put_s.append(time.perf_counter() - t0)
        client.delete_many(key)
        path = os.path.join(raw_dir, f"one-{r}")
        t0 = time.perf_counter()
        write_files_verified([(path, header, payload)])
        raw_s.append(time.perf_counter() - t0)
        os.unlink(path)
    return put_s, raw_s


if __name__ == "__main__":
    main()
