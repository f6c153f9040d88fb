"""Reads of 2 MiB objects from a kvgate:// card against a raw loopback TCP stream of the same bytes.

    PYTHONPATH=src python benchmarks/network_card.py [--size 2MiB] [--objects 16] [--rounds 15]

A server process serves one directory card (``CardExporter``) and, on a
second port, streams the very same object files raw: the client asks for N
files with one byte each, and the server ``sendfile`` s them (the card server
sends the same way, from the same warm page cache).  The raw client
``recv_into`` s each into a destination of its own (as the card's land in
theirs) and does nothing else.
The card client reads with ``read_into`` (one request per object) and
``read_many_into`` (one request for all N), each object verified (header,
hash) in scratch memory and copied into its destination.  A last raw
variant receives the whole stream into one piece of the card's receive
size and drops it: the transport alone, at the card's cache footprint.  Rounds alternate
raw and card; the ratio printed is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

PIECE = 0  # the card's receive piece (kvgate.cards.netconn.PIECE), set in main


def serve(card_dir: str, size: int, n: int) -> None:
    """The server process: a card server and a raw sender of the same files; prints both addresses."""
    from kvgate.cards import DirectoryCard, ObjectMeta
    from kvgate.cluster.export import CardExporter
    from kvgate.keys import full_key

    card = DirectoryCard(card_dir)
    card.open()
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        k = full_key(b"bench", b"object-%d" % i)
        card.write(k, memoryview(rng.integers(0, 256, size, dtype=np.uint8)), ObjectMeta())
        paths.append(card.object_path(k))
    ex = CardExporter([card], "127.0.0.1", 0).start()
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_conn(s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        files = [open(p, "rb", buffering=0) for p in paths]
        while True:
            ask = s.recv(4)
            if len(ask) < 4:
                return
            first, count = ask[0], int.from_bytes(ask[1:], "little")
            for j in range(count):
                f = files[(first + j) % n]
                s.sendfile(f, 0, os.fstat(f.fileno()).st_size)

    def accept() -> None:
        while True:
            s, _ = raw.accept()
            threading.Thread(target=raw_conn, args=(s,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(ex.urls()[card.serial], raw.getsockname()[1], os.path.getsize(paths[0]), flush=True)
    sys.stdin.read()  # until the client is done


def main() -> None:
    from kvgate.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=2 << 20)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 1 <= args.objects <= 255:
        ap.error("--objects: 1 to 255 (the raw request names the first object in one byte)")
    if args.serve:
        serve(args.serve, args.size, args.objects)
        return

    from kvgate.cards import NetworkCard
    from kvgate.keys import full_key

    global PIECE
    from kvgate.cards.netconn import PIECE

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", os.path.join(tmp, "card"), "--size",
                                 str(args.size), "--objects", str(args.objects)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            url, raw_port, file_size = proc.stdout.readline().split()
            run(url, int(raw_port), int(file_size), args, NetworkCard, full_key)
        finally:
            proc.stdin.close()
            proc.wait(10)


def run(url: str, raw_port: int, file_size: int, args, NetworkCard, full_key) -> None:
    n, size = args.objects, args.size
    card = NetworkCard(url, io_timeout_ms=10_000)
    card.open()
    keys = [full_key(b"bench", b"object-%d" % i) for i in range(n)]
    dests = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
    items = [(k, memoryview(d)) for k, d in zip(keys, dests)]
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Each raw object lands in its own destination too, as the card's do: 16 x 2 MiB of memory written per
    # round is not the same cost as one 2 MiB buffer written again and again (that stays in the caches).
    rbufs = [memoryview(bytearray(file_size)) for _ in range(n)]

    def raw_read(first: int, count: int) -> None:
        raw.sendall(bytes([first]) + count.to_bytes(3, "little"))
        for j in range(first, first + count):
            got, rbuf = 0, rbufs[j]
            while got < file_size:
                got += raw.recv_into(rbuf[got:])

    piece = memoryview(bytearray(PIECE))

    def raw_pieces() -> None:
        """The stream of all into one scratch piece, as the card receives (the bytes are only dropped)."""
        raw.sendall(bytes([0]) + n.to_bytes(3, "little"))
        left = n * file_size
        while left:
            left -= raw.recv_into(piece[: min(left, PIECE)])

    def raw_all() -> None:
        raw_read(0, n)

    def raw_each() -> None:
        for i in range(n):
            raw_read(i, 1)

    def card_each() -> None:
        for item in items:
            card.read_into(*item)

    def card_batch() -> None:
        for r in card.read_many_into(items):
            if isinstance(r, BaseException):
                raise r

    cpu: dict[str, list[float]] = {}

    def rate(fn) -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        cpu.setdefault(fn.__name__, []).append((c1 - c0) / (n * size) * (1 << 30))
        return n * size / (t1 - t0) / (1 << 30)

    for fn in (raw_each, card_each, card_batch):  # warm up: connections, scratch, page cache
        fn()
    rows: dict[str, list[float]] = {"raw, a request per object": [], "card read_into": [],
                                    "raw, one stream of all": [], "card read_many_into": [],
                                    "raw, all into a piece": []}
    for _ in range(args.rounds):
        rows["raw, a request per object"].append(rate(raw_each))
        rows["card read_into"].append(rate(card_each))
        rows["raw, one stream of all"].append(rate(raw_all))
        rows["card read_many_into"].append(rate(card_batch))
        rows["raw, all into a piece"].append(rate(raw_pieces))
    print(f"{n} objects of {size} bytes ({file_size} on disk), {args.rounds} rounds; GiB/s of payload, median:")
    for name, rates in rows.items():
        print(f"  {name:28s} {statistics.median(rates):6.2f}  (min {min(rates):.2f}, max {max(rates):.2f})")
    print("client CPU seconds per GiB, median: " + ", ".join(
        f"{name} {statistics.median(v):.3f}" for name, v in cpu.items()))
    per = [c / r for c, r in zip(rows["card read_into"], rows["raw, a request per object"])]
    batch = [c / r for c, r in zip(rows["card read_many_into"], rows["raw, one stream of all"])]
    print(f"ratio card/raw, a request per object: {statistics.median(per):.2f}")
    pieces = [c / r for c, r in zip(rows["card read_many_into"], rows["raw, all into a piece"])]
    print(f"ratio card/raw, one batch / one stream: {statistics.median(batch):.2f}")
    print(f"ratio card/raw, one batch / one stream into a {PIECE >> 10} KiB piece: {statistics.median(pieces):.2f}")
    card.close()


if __name__ == "__main__":
    main()
