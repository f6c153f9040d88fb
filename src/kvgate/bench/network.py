"""``kvgate bench --network``: reads from a ``kvgate://`` card against the raw limits of the same run.

A server process (this module run with ``--serve``) serves one directory
card with ``CardExporter`` and, on a second port, answers three raw requests
over the very same object files: stream N of them with ``sendfile`` (the
card server sends the same way, from the same page cache), drop them from
the page cache, and read them with ``O_DIRECT`` on the server itself (the
disk's own speed, no page cache, no network).

The client measures, in rounds that alternate raw and card:

- warm: ``read_many_into`` of N objects (one request) against one raw
  stream of the same N files, each landing in a destination of its own;
  ``read_into`` per object against a raw request per object;
- cold: the files dropped from the page cache, ``read_many_into`` against
  the server's raw ``O_DIRECT`` read of the files (dropped again first).

Every card read is verified (header, lengths, hash) as a gateway's is.
The ratio printed per figure is the median of the rounds' ratios.  Runs on
the caller's thread; blocks until measured.
"""

from __future__ import annotations

import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from kvgate.bench import BenchError

BAR_WARM_RATIO = 0.8  # a batch read against one raw loopback stream of the same bytes
BAR_COLD_RATIO = 0.8  # a cold batch read against the server's raw O_DIRECT read
MAX_OBJECTS = 255  # the raw request names its first object in one byte
STEPS = ["starting the card server", "warm reads", "cold reads", "stopping the card server"]

_STREAM, _DROP, _DIRECT = b"S", b"D", b"O"


# ---- the server process ----------------------------------------------------------------


def _drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _direct_read(paths: list[str], buf: mmap.mmap) -> float:
    """Read each file whole with ``O_DIRECT`` into ``buf`` (page-aligned), one after the other; seconds."""
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            size, got = os.fstat(fd).st_size, 0
            while got < size:
                n = os.preadv(fd, [memoryview(buf)[got:]], got)
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def serve(card_dir: str, size: int, n: int) -> None:
    """Write N objects of ``size`` bytes to a new card, serve it and the raw requests; print both addresses."""
    from kvgate.cards import DirectoryCard, ObjectMeta
    from kvgate.cards.network.server import CardExporter
    from kvgate.keys import full_key

    os.makedirs(card_dir, exist_ok=True)
    card = DirectoryCard(card_dir)
    card.open()
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        k = full_key(b"bench", b"object-%d" % i)
        card.write(k, memoryview(rng.integers(0, 256, size, dtype=np.uint8)), ObjectMeta())
        paths.append(card.object_path(k))
    os.sync()  # clean pages: a drop from the page cache then drops them all
    largest = max(os.path.getsize(p) for p in paths)
    direct_buf = mmap.mmap(-1, (largest + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    direct_buf[:] = b"\0" * len(direct_buf)  # touched: the baseline pays no page faults
    ex = CardExporter([card], "127.0.0.1", 0).start()
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_conn(s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        files = [open(p, "rb", buffering=0) for p in paths]
        while True:
            ask = s.recv(5)
            if len(ask) < 5:
                return
            op, first, count = ask[:1], ask[1], int.from_bytes(ask[2:], "little")
            if op == _STREAM:
                for j in range(count):
                    f = files[(first + j) % n]
                    s.sendfile(f, 0, os.fstat(f.fileno()).st_size)
            elif op == _DROP:
                _drop(paths)
                s.sendall(b"k")
            elif op == _DIRECT:
                _drop(paths)
                s.sendall(struct.pack("<d", _direct_read(paths, direct_buf)))

    def accept() -> None:
        while True:
            s, _ = raw.accept()
            threading.Thread(target=raw_conn, args=(s,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(ex.urls()[card.serial], raw.getsockname()[1], os.path.getsize(paths[0]), flush=True)
    sys.stdin.read()  # until the client is done
    ex.stop()


# ---- the client ------------------------------------------------------------------------


class NetworkBench:
    """One server process, one ``NetworkCard``; ``run`` measures, ``close`` stops the server."""

    def __init__(self, parent: str, size: int, objects: int, rounds: int, step: Callable[[str], None]):
        if not 1 <= objects <= MAX_OBJECTS:
            raise ValueError(f"objects: 1 to {MAX_OBJECTS}, got {objects}")
        self.size, self.n, self.rounds, self.step = size, objects, rounds, step
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.TemporaryDirectory(dir=parent, prefix="network-")
        self.died: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def run(self) -> dict[str, Any]:
        from kvgate.bench.processes import kvgate_env
        from kvgate.cards import NetworkCard
        from kvgate.keys import full_key

        self.step("starting the card server")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate.bench.network", os.path.join(self.tmp.name, "card"), str(self.size),
             str(self.n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=kvgate_env())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 3:
            self.died.append(f"card server exited with {self.proc.wait(10)}")
            raise BenchError("the card server did not start")
        url, raw_port, file_size = line[0], int(line[1]), int(line[2])
        card = NetworkCard(url, io_timeout_ms=30_000, max_object_bytes=max(256 << 20, 2 * file_size))
        card.open()
        raw = socket.create_connection(("127.0.0.1", raw_port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return self._measure(card, raw, url, file_size, full_key)
        finally:
            raw.close()
            card.close()

    def _measure(self, card, raw: socket.socket, url: str, file_size: int, full_key) -> dict[str, Any]:
        n, size = self.n, self.size
        keys = [full_key(b"bench", b"object-%d" % i) for i in range(n)]
        dests = [np.ones(size, dtype=np.uint8) for _ in range(n)]  # touched
        items = [(k, memoryview(d)) for k, d in zip(keys, dests)]
        # Each raw object lands in a destination of its own too, as the card's do: N x 2 MiB written per round
        # is not the cost of one buffer written again and again (that one stays in the CPU caches).
        rbufs = [memoryview(bytearray(b"\1" * file_size)) for _ in range(n)]

        def ask(op: bytes, first: int = 0, count: int = 0) -> None:
            raw.sendall(op + bytes([first]) + count.to_bytes(3, "little"))

        def receive(nbytes: int) -> bytes:
            got = b""
            while len(got) < nbytes:
                more = raw.recv(nbytes - len(got))
                if not more:
                    raise BenchError("the card server closed its raw connection")
                got += more
            return got

        def raw_read(first: int, count: int) -> None:
            ask(_STREAM, first, count)
            for j in range(first, first + count):
                got, rbuf = 0, rbufs[j]
                while got < file_size:
                    k = raw.recv_into(rbuf[got:])
                    if not k:
                        raise BenchError("the card server closed its raw connection")
                    got += k

        def card_batch() -> None:
            for r in card.read_many_into(items):
                if isinstance(r, BaseException):
                    raise BenchError(f"a card read failed: {r}")

        def timed(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return n * size / (time.perf_counter() - t0) / (1 << 30)

        def drop() -> None:
            ask(_DROP)
            receive(1)

        def direct() -> float:
            ask(_DIRECT)
            (seconds,) = struct.unpack("<d", receive(8))
            return n * size / seconds / (1 << 30)

        def raw_all() -> None:
            raw_read(0, n)

        def raw_each() -> None:
            for i in range(n):
                raw_read(i, 1)

        def card_each() -> None:
            for k, d in items:
                card.read_into(k, d)

        self.step("warm reads")
        for fn in (raw_each, card_each, raw_all, card_batch):  # warm up: connections, scratch, page cache
            fn()
        warm: dict[str, list[float]] = {"raw_stream": [], "card_batch": [], "raw_per_object": [], "card_per_object": []}
        for _ in range(self.rounds):
            warm["raw_stream"].append(timed(raw_all))
            warm["card_batch"].append(timed(card_batch))
            warm["raw_per_object"].append(timed(raw_each))
            warm["card_per_object"].append(timed(card_each))
        for d in dests:
            d[:] = 0
        card_batch()
        rng = np.random.default_rng(0)  # the server's payloads, made again
        intact = all(np.array_equal(d, rng.integers(0, 256, size, dtype=np.uint8)) for d in dests)
        self.step("cold reads")
        cold: dict[str, list[float]] = {"raw_direct": [], "card_batch": []}
        for _ in range(self.rounds):
            cold["raw_direct"].append(direct())
            drop()
            cold["card_batch"].append(timed(card_batch))
        self.step("stopping the card server")

        def ratio(num: list[float], den: list[float]) -> float:
            return statistics.median(a / b for a, b in zip(num, den))

        def med(rates: list[float]) -> dict[str, float]:
            return {"gib_s": statistics.median(rates), "min": min(rates), "max": max(rates)}

        figures = {
            "warm_batch": {"card": med(warm["card_batch"]), "raw": med(warm["raw_stream"]),
                           "ratio": ratio(warm["card_batch"], warm["raw_stream"]), "bar": BAR_WARM_RATIO,
                           "baseline": "raw stream"},
            "warm_per_object": {"card": med(warm["card_per_object"]), "raw": med(warm["raw_per_object"]),
                                "ratio": ratio(warm["card_per_object"], warm["raw_per_object"]), "bar": None,
                                "baseline": "raw per file"},
            "cold_batch": {"card": med(cold["card_batch"]), "raw": med(cold["raw_direct"]),
                           "ratio": ratio(cold["card_batch"], cold["raw_direct"]), "bar": BAR_COLD_RATIO,
                           "baseline": "O_DIRECT"},
        }
        return {"mode": "network", "url": url, "objects": n, "object_size": size, "file_size": file_size,
                "rounds": self.rounds, "cold_rounds": len(cold["card_batch"]), "figures": figures,
                "verified": intact, "cores": os.cpu_count()}

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        self.tmp.cleanup()


def plot_network(result: dict[str, Any], path: str) -> None:
    """``kvgate bench --network --plot``: each read's card rate beside its baseline's."""
    from kvgate.bench.report import plot_bars

    names = {"warm_batch": "batch, warm", "warm_per_object": "per object, warm", "cold_batch": "batch, cold"}
    rows = [(names[k], f["card"]["gib_s"], f["raw"]["gib_s"], f["baseline"], f["ratio"])
            for k, f in result["figures"].items()]
    plot_bars(f"kvgate:// card: {result['objects']} x {result['object_size'] >> 10} KiB per batch, medians", rows,
              path, note=f"{result['rounds']} warm, {result['cold_rounds']} cold rounds; {result['cores']} cores")


def print_network(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvgate:// card: batches of {result['objects']} x {result['object_size'] >> 10} KiB, GiB/s "
                    f"(medians of {result['rounds']} warm, {result['cold_rounds']} cold rounds)",
              caption="raw stream: one loopback TCP stream of the same files (sendfile); raw per file: a request "
                      "per file; O_DIRECT: the server reads the files itself, one after the other, no page cache")
    for col in ("read", "card", "baseline", "raw", "ratio", "bar"):
        t.add_column(col, justify="right" if col in ("card", "raw", "ratio", "bar") else "left")
    names = {"warm_batch": "batch, warm", "warm_per_object": "per object, warm", "cold_batch": "batch, cold"}
    for key, f in result["figures"].items():
        bar = "" if f["bar"] is None else f">={f['bar']:.1f} " + ("ok" if f["ratio"] >= f["bar"] else "SHORT")
        t.add_row(names[key], f"{f['card']['gib_s']:.2f}", f["baseline"], f"{f['raw']['gib_s']:.2f}",
                  f"{f['ratio']:.2f}", bar)
    Console().print(t)
    if not result["verified"]:
        print("kvgate bench: the objects read back were not the ones written", file=sys.stderr)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
