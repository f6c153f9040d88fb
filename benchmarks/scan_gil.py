"""What a card scan's header reads cost the tail of a lookup, on the gateway's GIL or in a child process.

Fills a directory card with N objects (kept for the next run), indexes 100,000
of them, then times the index part of a lookup of 1,000 keys (digests and one
batched find, as ``KeyFinder.find_many`` does) every 2 ms for a few seconds:
alone, beside a thread reading headers as the start-up scan does
(``DirectoryCard.stored_objects``, 128 names a call), and beside a child
process doing the same reads.  The GIL switch interval is the serving
gateway's (1 ms).

    .venv/bin/python benchmarks/scan_gil.py --objects 100000 --dir var/scan-gil
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

from kvgate.cards import ObjectMeta
from kvgate.cards.directory.card import DirectoryCard
from kvgate.keys import dialog_digest, full_key, key_digest
from kvgate.tiers.index import CardIndex
from kvgate.tiers.rows import digest_array
from kvgate.tiers.usage import NamespaceUsage

INDEXED = 100_000
LOOKUP_KEYS = 1000
READ_BATCH = 128


def _keys(n: int) -> list[bytes]:
    return [full_key(b"ns", b"k%d" % i) for i in range(n)]


def _fill(card: DirectoryCard, keys: list[bytes], marker: str) -> None:
    if os.path.exists(marker):
        return
    payload = memoryview(b"x" * 4096)
    for i in range(0, len(keys), 1000):
        dialog = dialog_digest(b"d%d" % (i // 1000))
        card.write_many([(k, payload, ObjectMeta(dialog, j)) for j, k in enumerate(keys[i : i + 1000])])
    open(marker, "w").close()


def _read_headers_forever(location: str, n: int) -> None:
    card = DirectoryCard(location)
    card.open()
    digests = [key_digest(k) for k in _keys(n)]
    i = 0
    while True:
        card.stored_objects(digests[i : i + READ_BATCH])
        i = (i + READ_BATCH) % n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=100_000)
    p.add_argument("--dir", default="var/scan-gil")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    sys.setswitchinterval(0.001)
    location = os.path.abspath(os.path.join(args.dir, f"card-{args.objects}"))
    os.makedirs(location, exist_ok=True)
    card = DirectoryCard(location)
    card.open()
    keys = _keys(args.objects)
    _fill(card, keys, os.path.join(args.dir, f"filled-{args.objects}"))
    index = CardIndex(NamespaceUsage())
    for k in keys[:INDEXED]:
        index.put(k, 8192, 4096, ObjectMeta(), time.time_ns())
    look = keys[:LOOKUP_KEYS]

    def measure(label: str) -> None:
        end = time.perf_counter() + args.seconds
        lat = []
        while time.perf_counter() < end:
            t = time.perf_counter()
            index.find(digest_array(list(map(key_digest, look))))
            lat.append((time.perf_counter() - t) * 1000)
            time.sleep(0.002)
        lat.sort()
        print(f"{label}: p50 {statistics.median(lat):.2f} ms, p99 {lat[int(len(lat) * 0.99)]:.2f}, "
              f"max {lat[-1]:.2f} ({len(lat)} lookups)", flush=True)

    measure("alone")
    stop = threading.Event()
    digests = [key_digest(k) for k in keys]

    def reader() -> None:
        i = 0
        while not stop.is_set():
            card.stored_objects(digests[i : i + READ_BATCH])
            i = (i + READ_BATCH) % len(digests)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    measure("beside a thread reading headers")
    stop.set()
    thread.join()
    child = mp.get_context("fork").Process(target=_read_headers_forever, args=(location, args.objects), daemon=True)
    child.start()
    time.sleep(1.0)
    measure("beside a child process reading headers")
    child.kill()


if __name__ == "__main__":
    main()
