"""A directory card's read and write paths in one process, beside the raw file calls: where the
gateway's figures stop short of ``kvgate bench``'s baselines.

32 objects of 2 MiB on a directory card in ``--dir`` (page cache warm), passes alternating:

- ``raw read``: open + ``preadv`` of each payload + close, into plain buffers;
- ``raw read + hash``: the same, and XXH3 of each payload where it landed (what a client reading a
  lent file does, ``kvgate.client.crossmem.read_files``);
- ``card read``: ``DirectoryCard.read_into`` into memory the card may load (header and payload in
  one ``preadv``, verified there), what a get into a region used in place costs;
- ``raw write``: open + ``pwritev`` + close + rename of each object;
- ``card write``: ``DirectoryCard.write`` of each (hash, header and payload in one ``pwritev``,
  rename);
- ``card open``: ``DirectoryCard.open_cached_many`` of all 32 (what the gateway does to lend them to a
  client as open files), then closing them: milliseconds a pass, on one thread and split over two.

Each on one thread and on two (half the objects each).  Prints best and median GiB/s and each
path's ratio to its raw side.

    .venv/bin/python benchmarks/card_paths.py --dir var/card-paths
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from kvgate.bench.measure import Contender, measure, script_main
from kvgate.cards import ObjectMeta
from kvgate.cards.base import close_files
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.objectformat import header_size, padded_size
from kvgate.keys import full_key, payload_hash
from kvgate.memcopy import Abandon

OBJECTS = 32
SIZE = 2 << 20


def main() -> None:
    script_main(__doc__, "var/card-paths", 4.0, _run, width=28)


def _run(where: str, seconds: float) -> dict:
    card = DirectoryCard(where)
    card.open()
    keys = [full_key(b"card-paths", b"%d" % i) for i in range(OBJECTS)]
    data = np.random.default_rng(0).integers(0, 256, SIZE, np.uint8)
    meta = ObjectMeta(b"\0" * 16, 0, time.time_ns(), False)
    for k in keys:
        card.write(k, memoryview(data), meta)
    paths = [card.object_path(k) for k in keys]
    poff = padded_size(header_size(keys[0]))
    bufs = [np.zeros(SIZE, np.uint8) for _ in keys]
    spare = os.path.join(where, "raw-written")
    os.makedirs(spare)
    pool = ThreadPoolExecutor(2)

    def raw_read(i: int, hashed: bool) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [bufs[i]], poff)
        finally:
            os.close(fd)
        if hashed:
            payload_hash(bufs[i])

    def raw_write(i: int) -> None:
        tmp = os.path.join(spare, f"{i}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwritev(fd, [bufs[i][:poff], data], 0)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(spare, str(i)))

    def card_read(i: int) -> None:
        # a guard per object, as each card call of the gateway has its own (threads never share one)
        card.read_into(keys[i], memoryview(bufs[i]), Abandon(own=True))

    def card_write(i: int) -> None:
        card.write(keys[i], memoryview(data), meta)

    def on(threads: int, one: Callable[[int], None]) -> Callable[[int], None]:
        if threads == 1:
            return lambda _r: [one(i) for i in range(OBJECTS)] and None
        halves = [range(0, OBJECTS // 2), range(OBJECTS // 2, OBJECTS)]
        return lambda _r: list(pool.map(lambda part: [one(i) for i in part], halves)) and None

    rounds = {"budget_s": seconds, "min_rounds": 5, "max_rounds": 10_000}
    out: dict = {}
    for threads in (1, 2):
        reads = measure([Contender("raw read", on(threads, lambda i: raw_read(i, False))),
                         Contender("raw read + hash", on(threads, lambda i: raw_read(i, True))),
                         Contender("card read", on(threads, card_read))], OBJECTS * SIZE, **rounds)
        writes = measure([Contender("raw write", on(threads, raw_write)),
                          Contender("card write", on(threads, card_write))], OBJECTS * SIZE, **rounds)
        for series, base in ((reads, "raw read"), (writes, "raw write")):
            for name, s in series.items():
                f = s.to_json()
                if name != base:
                    f.update(of=f"{base}, {threads} thread{'s' if threads > 1 else ''}",
                             ratio=s.best_gib_s / series[base].best_gib_s,
                             ratio_median=s.median_gib_s / series[base].median_gib_s)
                out[f"{name}, {threads} thread{'s' if threads > 1 else ''}"] = f
    def open_all(part: range) -> None:
        close_files(card.open_cached_many([keys[i] for i in part], Abandon(own=True)))

    halves = [range(0, OBJECTS // 2), range(OBJECTS // 2, OBJECTS)]
    opens = measure([Contender("card open, 1 thread", lambda _r: open_all(range(OBJECTS))),
                     Contender("card open, 2 threads", lambda _r: list(pool.map(open_all, halves)) and None)],
                    OBJECTS * SIZE, **rounds)
    for name, s in opens.items():
        out[name] = {"best_ms": min(s.seconds) * 1e3, "median_ms": statistics.median(s.seconds) * 1e3,
                     "passes": len(s.seconds), "objects": OBJECTS}
    pool.shutdown()
    card.close()
    return out


if __name__ == "__main__":
    main()
