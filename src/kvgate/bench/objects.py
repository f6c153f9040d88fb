"""``ObjectsBench`` (``kvgate bench --objects N``): a directory card of N objects, restarted with a cold page cache.

What a card of millions of objects costs the gateway: how long a start takes
before lookups answer at full speed, how slow lookups get while the index is
scanned or checked in the background, and how much memory the index takes.
Real gateway processes (``kvgate serve``), one directory card, RAM tier off:

    fill      N objects of ``--object-size`` written straight onto the card
              (no gateway: as another gateway would have left them), in
              dialogs of ``--dialog-blocks`` blocks
    empty     a gateway on an empty card: the RSS the index is measured
              against (same flags, same lookups)
    scan      a gateway on the card with a cold page cache and no index
              snapshot: it reads every header in the background.  Meanwhile
              lookups of 1,000 keys it indexed on writing them, back to back;
              the scan's time; RSS once indexed
    restart   that gateway stopped (it writes the snapshot) and started again
              with a cold page cache: from its start, lookups of 1,000 keys of
              stored dialogs (``WAITING_DIALOGS`` of them in turn, an engine's
              queue), back to back; when one first found all 1,000; lookups
              during the check of the snapshot against the card; the check's
              time; RSS once checked

The index's cost per object is (RSS - empty RSS) / N.  A cold page cache is
``drop_caches`` where the bench may write it (root); elsewhere every file of
the card is dropped with ``posix_fadvise(DONTNEED)``, which leaves dentries
and inodes cached (the result says which).

Runs on the command's thread; the filled card stays under ``--dir``
(``objects-<N>-<size>``) for the next run with the same N and size: filling
a million objects takes minutes.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.bench import BenchError
from kvgate.bench.baselines import DROP_CACHES
from kvgate.bench.processes import GatewayProcess
from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.client import Client
from kvgate.keys import dialog_digest, encode_namespace, full_key

NAMESPACE = "kvgate-bench"
LOOKUP_KEYS = 1000
FILL_THREADS = 4
FILLED = "kvgate-bench-filled"  # in a card the bench filled whole
SNAPSHOT_FILE = "kvgate-index"
AFTER_S = 3.0  # lookups go on this long after the background work ended: the steady figure
# Lookups cycle over this many stored dialogs, as an engine looks up the prompts waiting in its queue on every
# step (each new one also has its files prepared for the load that would follow: a cold stat of each).
WAITING_DIALOGS = 16
ENGINE_STEP_S = 0.002  # between two lookups: an engine's scheduler step, not a loop that starves the gateway
# The requirement this bench answers (docs/benchmarks.md, "A card of millions of objects").
BAR_READY_S = 30.0  # after a restart, cold page cache: lookups of stored objects at full speed within this
BAR_BACKGROUND_LOOKUP_MS = 5.0  # a 1,000-key lookup while a scan or check runs (p99)
BAR_INDEX_BYTES_PER_OBJECT = 100.0
STEPS = ["filling the card", "an empty card", "scan: cold, no snapshot", "stop: snapshot written",
         "restart: cold, snapshot", "stopping gateways"]


def _key(i: int) -> bytes:
    return b"object-%d" % i


def _mark(d: int) -> bytes:
    return b"dialog-%d" % d


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise BenchError(f"no VmRSS for pid {pid}")


def latency(ms: list[float]) -> dict[str, Any]:
    if not ms:
        return {"n": 0}
    s = sorted(ms)
    return {"n": len(s), "p50_ms": statistics.median(s), "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))],
            "max_ms": s[-1]}


@dataclass
class Life:
    """One start of a gateway: what its lookups answered and when (seconds from its start)."""

    lookups: list[tuple[float, float, int]] = field(default_factory=list)  # (at, ms, keys found)
    listening_s: float = 0.0
    all_found_s: float | None = None  # first lookup of a stored dialog that found every key
    indexed_s: float | None = None  # the card's scan or check ended
    rss_kib: int = 0

    def figures(self, empty_kib: int, objects: int) -> dict[str, Any]:
        end = self.indexed_s if self.indexed_s is not None else float("inf")
        return {"listening_s": self.listening_s, "all_keys_found_s": self.all_found_s, "indexed_s": self.indexed_s,
                "rss_kib": self.rss_kib, "index_bytes_per_object": (self.rss_kib - empty_kib) * 1024 / objects,
                "lookups_during_background": latency([ms for at, ms, _ in self.lookups if at <= end]),
                "lookups_after": latency([ms for at, ms, _ in self.lookups if at > end]),
                "slowest": sorted(((round(ms, 2), round(at, 2)) for at, ms, _ in self.lookups), reverse=True)[:5]}


class ObjectsBench:
    def __init__(self, args: argparse.Namespace, object_size: int, progress: Callable[[str], None]) -> None:
        self.n = args.objects
        self.size = object_size
        self.blocks = args.dialog_blocks
        self.threads = args.threads
        self.progress = progress
        parent = os.path.abspath(args.dir or os.path.join(".", "var", "bench"))
        os.makedirs(parent, exist_ok=True)
        self.card_dir = os.path.join(parent, f"objects-{self.n}-{self.size}")
        self.workdir = tempfile.mkdtemp(prefix="kvgate-objects-", dir=parent)
        self.ns = encode_namespace(NAMESPACE)
        self.cold_how = ""
        self.gateways: list[GatewayProcess] = []
        self.died: list[str] = []  # what a gateway that exited on its own said
        self.waiting = random.sample(range(max(1, self.n // self.blocks)), min(WAITING_DIALOGS,
                                                                               max(1, self.n // self.blocks)))

    # ---- the card ----------------------------------------------------------------------

    def fill(self) -> float:
        """Write the objects (unless an earlier run left the card whole); seconds it took."""
        if os.path.exists(os.path.join(self.card_dir, FILLED)):
            return 0.0
        shutil.rmtree(self.card_dir, ignore_errors=True)
        os.makedirs(self.card_dir)
        card = DirectoryCard(self.card_dir)
        card.open()
        payload = memoryview((bytes(range(256)) * (self.size // 256 + 1))[: self.size])
        t0 = time.monotonic()
        done = [0]  # objects written, for a look in a debugger on a long fill
        lock = threading.Lock()

        def write(start: int) -> None:
            stop = min(start + 10_000, self.n)
            for i in range(start, stop):
                d, p = divmod(i, self.blocks)
                card.write(full_key(self.ns, _key(i)), payload, ObjectMeta(dialog_digest(_mark(d)), p, time.time_ns()))
            with lock:
                done[0] += stop - start

        with ThreadPoolExecutor(FILL_THREADS) as pool:
            list(pool.map(write, range(0, self.n, 10_000)))
        card.close()
        os.sync()
        open(os.path.join(self.card_dir, FILLED), "w").close()
        return time.monotonic() - t0

    def cold(self) -> None:
        """Drop the card from the page cache (and dentries and inodes, where the bench may)."""
        os.sync()
        try:
            with open(DROP_CACHES, "w", encoding="ascii") as f:
                f.write("3\n")
            self.cold_how = "drop_caches: page cache, dentries and inodes"
            return
        except OSError:
            pass
        for root, _dirs, files in os.walk(self.card_dir):
            for name in files:
                try:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        self.cold_how = "posix_fadvise(DONTNEED) of every file (not root: dentries and inodes stay cached)"

    # ---- gateways ------------------------------------------------------------------------

    def _gateway(self, name: str, card: str) -> GatewayProcess:
        gw = GatewayProcess(self.workdir, ["--storage-devices", card, "--max-bytes", "0", "--port", "0",
                                           "--metrics-port", "0", "--thread-pool-size", str(self.threads),
                                           "--shared-memory-size", "1M", "--log-level", "info"],
                            name=name, create_cards=False)
        self.gateways.append(gw)
        return gw

    def _connect(self, gw: GatewayProcess, t0: float, life: Life) -> Client:
        while True:
            if gw.proc is not None and gw.proc.poll() is not None:
                raise BenchError(f"gateway {gw.name} exited:\n{gw.log_tail()}")
            try:
                c = Client.connect(gw.socket, namespace=NAMESPACE, engine_id=f"bench-{gw.name}", timeout=60,
                                   want_shm=False)
            except OSError:
                if time.monotonic() - t0 > 600:
                    raise BenchError(f"gateway {gw.name} did not listen within 600 s:\n{gw.log_tail()}") from None
                time.sleep(0.01)
                continue
            life.listening_s = time.monotonic() - t0
            return c

    def _stored(self) -> tuple[list[bytes], bytes]:
        """The first 1,000 keys of one of the waiting dialogs, and its mark."""
        d = random.choice(self.waiting)
        first = d * self.blocks
        return [_key(i) for i in range(first, min(first + self.blocks, first + LOOKUP_KEYS, self.n))], _mark(d)

    def _written(self, c: Client) -> Callable[[], tuple[list[bytes], bytes]]:
        """1,000 small objects written through the gateway (indexed at once, whatever its scan is doing)."""
        keys = [b"written-%d" % i for i in range(LOOKUP_KEYS)]
        if not all(c.put_many(keys, [b"x" * 16] * len(keys), dialog=b"written", position=0)):
            raise BenchError("the gateway did not store the objects to look up")
        return lambda: (keys, b"written")

    def _lookups(self, c: Client, t0: float, life: Life, keys_of: Callable[[], tuple[list[bytes], bytes]],
                 stored: bool) -> None:
        """Lookups back to back until the card is indexed and ``AFTER_S`` longer (then of stored dialogs)."""
        next_stat = 0.0
        while True:
            at = time.monotonic() - t0
            indexed = life.indexed_s is not None
            keys, mark = (self._stored if indexed else keys_of)()
            a = time.perf_counter()
            found = c.lookup(keys, dialog=mark)
            ms = (time.perf_counter() - a) * 1e3
            life.lookups.append((at, ms, found))
            if stored and found == len(keys) and life.all_found_s is None:
                life.all_found_s = at
            if not indexed and at >= next_stat:
                next_stat = at + 0.2
                if all(card["scanned"] for card in c.stats()["cards"]):
                    life.indexed_s = time.monotonic() - t0
            if indexed and at > life.indexed_s + AFTER_S:  # type: ignore[operator]
                return
            if at > 3600:
                raise BenchError("the card was not indexed within an hour")
            time.sleep(ENGINE_STEP_S)

    def _life(self, gw: GatewayProcess, cold: bool, stored: bool) -> Life:
        """Start ``gw`` (cold: page cache dropped first), look up until indexed and a while after, take its RSS."""
        if cold:
            self.cold()
        life = Life()
        t0 = time.monotonic()
        gw.spawn()
        with self._connect(gw, t0, life) as c:
            keys_of = self._stored if stored else self._written(c)
            self._lookups(c, t0, life, keys_of, stored)
            life.rss_kib = _rss_kib(gw.pid)
        return life

    def run(self) -> dict[str, Any]:
        self.progress(STEPS[0])
        fill_s = self.fill()
        self.progress(STEPS[1])
        empty_card = os.path.join(self.workdir, "card-empty")
        os.makedirs(empty_card)
        empty = self._gateway("empty", empty_card)
        empty_life = self._life(empty, cold=False, stored=False)
        empty.stop()
        snapshot = os.path.join(self.card_dir, SNAPSHOT_FILE)
        if os.path.exists(snapshot):
            os.unlink(snapshot)
        gw = self._gateway("objects", self.card_dir)
        self.progress(STEPS[2])
        scan = self._life(gw, cold=True, stored=False)
        self.progress(STEPS[3])
        t = time.monotonic()
        gw.stop(timeout=120)
        stop_s = time.monotonic() - t
        snapshot_bytes = os.path.getsize(snapshot) if os.path.exists(snapshot) else 0
        self.progress(STEPS[4])
        restart = self._life(gw, cold=True, stored=True)
        gw.stop(timeout=120)
        lines = [line.split(" kvgate.long: ", 1)[1] for line in gw.log().splitlines()
                 if " kvgate.long: " in line and "index" in line]
        r = restart.figures(empty_life.rss_kib, self.n)
        s = scan.figures(empty_life.rss_kib, self.n)
        return {
            "mode": "objects",
            "config": {"objects": self.n, "object_size": self.size, "dialog_blocks": self.blocks,
                       "lookup_keys": min(LOOKUP_KEYS, self.blocks), "cold": self.cold_how, "card": self.card_dir,
                       "threads": self.threads, "cores": os.cpu_count(), "python": sys.version.split()[0]},
            "fill_s": fill_s, "empty_rss_kib": empty_life.rss_kib, "scan": s, "stop_s": stop_s,
            "snapshot_bytes": snapshot_bytes, "restart": r, "log": lines,
            "bars": {
                "ready_s": r["all_keys_found_s"] is not None and r["all_keys_found_s"] <= BAR_READY_S,
                "background_lookup_p99_ms": all(x["lookups_during_background"].get("p99_ms", 0)
                                                <= BAR_BACKGROUND_LOOKUP_MS for x in (s, r)),
                "index_bytes_per_object": r["index_bytes_per_object"] <= BAR_INDEX_BYTES_PER_OBJECT,
            },
        }

    def close(self) -> None:
        for gw in self.gateways:
            note = gw.exit_note()
            if note is not None:
                self.died.append(note)
            gw.cleanup()
        shutil.rmtree(self.workdir, ignore_errors=True)
