"""One ``Client`` shared by threads, and clients in several processes, on one real gateway.

A client shared by threads must be exactly as correct as one client per
thread: every thread writes contents of its own (distinct per thread, round
and object) and reads them back, with destination buffers and packed, on
every path the bytes can take: the session region, a registered region, the
frames (TCP), and a session region smaller than the objects (those travel
inline over the Unix socket).  Every byte is checked.

One engine per gateway: every client of a gateway passes the same engine_id.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

from tests.helpers import free_port, freeze
from kvgate.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE = "sharing"
NAMESPACE = "sharing-ns"
THREADS = 4
ROUNDS = 12
OBJECTS = 8
KIB = 1 << 10
MIB = 1 << 20


def content(thread: int, rnd: int, obj: int, size: int) -> np.ndarray:
    """Bytes that name their writer: no two (thread, round, object) share a byte pattern at any offset."""
    seed = (thread * 1_000_003 + rnd * 10_007 + obj * 101 + 1) & 0xFFFFFFFF
    x = np.arange(size, dtype=np.uint32)
    x *= np.uint32(2654435761)
    x += np.uint32(seed * 40503 & 0xFFFFFFFF)
    return (x >> np.uint32(13)).astype(np.uint8)


def size_of(thread: int, rnd: int, obj: int, smallest: int, largest: int) -> int:
    step = (largest - smallest) // 7
    return smallest + ((thread * 3 + rnd * 5 + obj * 7) % 8) * step + obj  # odd sizes too


def key_of(thread: int, obj: int) -> bytes:
    return f"t{thread}/o{obj}".encode()  # rewritten every round: what a thread reads back is its latest


def check(got, want: np.ndarray, what: str) -> None:
    assert got is not None, f"{what}: a miss"
    arr = np.frombuffer(got, dtype=np.uint8)
    assert arr.nbytes == want.nbytes, f"{what}: {arr.nbytes} bytes, expected {want.nbytes}"
    if not np.array_equal(arr, want):
        bad = int(np.flatnonzero(arr != want)[0])
        raise AssertionError(f"{what}: wrong bytes from offset {bad} of {want.nbytes}")


class Slices:
    """Each thread's own source and destination buffers inside one registered /dev/shm file."""

    def __init__(self, per_thread: int):
        self.per_thread = per_thread
        self.path = f"/dev/shm/kvgtest-sharing-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, THREADS * 2 * per_thread)
            self.mm = mmap.mmap(fd, THREADS * 2 * per_thread)
        finally:
            os.close(fd)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)

    def area(self, thread: int, which: int) -> np.ndarray:
        start = (thread * 2 + which) * self.per_thread
        return self.arr[start : start + self.per_thread]

    def close(self) -> None:
        del self.arr
        self.mm.close()
        os.unlink(self.path)


def run_threads(client: Client, smallest: int, largest: int, slices: Slices | None = None) -> int:
    """THREADS threads share ``client``; returns how many objects were read back and checked."""
    checked = [0] * THREADS
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            start.wait(timeout=30)
            keys = [key_of(t, o) for o in range(OBJECTS)]
            for r in range(ROUNDS):
                sizes = [size_of(t, r, o, smallest, largest) for o in range(OBJECTS)]
                wants = [content(t, r, o, s) for o, s in enumerate(sizes)]
                if slices is None:
                    sources = wants
                    dests = [np.zeros(largest + 64, dtype=np.uint8) for _ in range(OBJECTS)]
                else:  # in place: the sources and destinations lie in the registered region
                    src, dst = slices.area(t, 0), slices.area(t, 1)
                    sources, dests, off = [], [], 0
                    for w in wants:
                        src[off : off + w.nbytes] = w
                        sources.append(src[off : off + w.nbytes])
                        dests.append(dst[off : off + w.nbytes])
                        off += w.nbytes
                    dst[:] = 0
                assert client.put_many(keys, sources, retention="short") == [True] * OBJECTS
                got = client.get_many(keys, into=dests)
                for o in range(OBJECTS):
                    check(got[o], wants[o], f"thread {t} round {r} object {o} (into)")
                got = client.get_many(keys)
                for o in range(OBJECTS):
                    check(got[o], wants[o], f"thread {t} round {r} object {o} (packed)")
                checked[t] += 2 * OBJECTS
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=100)
    assert not any(th.is_alive() for th in threads), "a thread is still running"
    if errors:
        raise errors[0]
    assert not client.broken
    return sum(checked)


GATEWAY_ARGS = ["--max-bytes", "160M", "--shared-memory-size", "8M"]


@pytest.mark.parametrize("path", ["session-region", "registered-region", "tcp", "small-session-region"])
def test_threads_sharing_a_client_read_their_own_bytes(gateway_factory, path: str) -> None:
    port = free_port()
    args = GATEWAY_ARGS + ["--port", str(port), "--max-frame-bytes", "4M"]
    smallest, largest = 256 * KIB, MIB
    if path == "small-session-region":
        # objects up to 1.5 MiB, a 1 MiB region: some are staged in it, the larger travel inline
        args += ["--shared-memory-size", "1M"]
        largest = 3 * MIB // 2
    gw = gateway_factory(args)
    target = f"127.0.0.1:{port}" if path == "tcp" else gw.socket
    slices = Slices(OBJECTS * (largest + 64)) if path == "registered-region" else None
    try:
        with Client.connect(target, namespace=NAMESPACE, engine_id=ENGINE, timeout=60) as c:
            if slices is not None:
                c.register_region(slices.path, slices.mm)
            assert run_threads(c, smallest, largest, slices) == THREADS * ROUNDS * OBJECTS * 2
    finally:
        if slices is not None:
            slices.close()


def test_abort_wakes_the_thread_in_a_call_and_the_one_waiting_for_the_client(gateway_factory) -> None:
    gw = gateway_factory(GATEWAY_ARGS)
    c = gw.client(NAMESPACE, engine_id=ENGINE)
    assert c.put_many([b"k"], [b"v"]) == [True]
    results: dict[str, object] = {}

    def call(name: str) -> None:
        try:
            results[name] = c.get_many([b"k"])
        except Exception as e:  # noqa: BLE001 - what abort gave this thread
            results[name] = e

    freeze(gw.pid)  # no reply will come: one thread waits in the call, one for the client
    try:
        threads = [threading.Thread(target=call, args=(name,)) for name in ("first", "second")]
        for th in threads:
            th.start()
        time.sleep(0.5)  # the point: nothing returns meanwhile, and both threads are waiting by then
        assert results == {}, "a call returned from a stopped gateway"
        c.abort()
        for th in threads:
            th.join(timeout=20)
        assert not any(th.is_alive() for th in threads), "abort did not wake a thread"
        assert all(isinstance(results[name], ConnectionError) for name in ("first", "second")), results
        assert c.broken
    finally:
        os.kill(gw.pid, signal.SIGCONT)
        c.close()
    with gw.client(NAMESPACE, engine_id=ENGINE) as c2:
        assert c2.get_many([b"k"]) == [b"v"]


# ---- several processes, each with its own client ----------------------------------------------

PROCESSES = 3
PROC_ROUNDS = 8
PROC_OBJECTS = 6


def proc_key(p: int, rnd: int, obj: int) -> bytes:
    return f"p{p}/r{rnd}/o{obj}".encode()  # written once: readable by every process once written


def proc_content(p: int, rnd: int, obj: int) -> np.ndarray:
    return content(p, rnd, obj, size_of(p, rnd, obj, 64 * KIB, 512 * KIB))


def proc_worker(target: str, p: int, written, results) -> None:
    """Write this process's rounds and read them back; after each round, read whatever the others wrote.

    ``written``: a barrier every process passes once its first round is stored, so every process
    reads the others' objects while they write more.
    """
    own = others = 0
    try:
        with Client.connect(target, namespace=NAMESPACE, engine_id=ENGINE, timeout=60) as c:
            for r in range(PROC_ROUNDS):
                keys = [proc_key(p, r, o) for o in range(PROC_OBJECTS)]
                wants = [proc_content(p, r, o) for o in range(PROC_OBJECTS)]
                assert c.put_many(keys, wants, retention="short") == [True] * PROC_OBJECTS
                if r == 0:
                    written.wait(timeout=60)
                for o, g in enumerate(c.get_many(keys, into=[bytearray(w.nbytes) for w in wants])):
                    check(g, wants[o], f"process {p} round {r} object {o} (into)")
                for o, g in enumerate(c.get_many(keys)):
                    check(g, wants[o], f"process {p} round {r} object {o} (packed)")
                own += 2 * PROC_OBJECTS
                for q in range(PROCESSES):  # the others' rounds so far: a miss (not written yet) or their bytes
                    if q == p:
                        continue
                    where = [(qr, o) for qr in range(r + 1) for o in range(PROC_OBJECTS)]
                    for (qr, o), g in zip(where, c.get_many([proc_key(q, qr, o) for qr, o in where])):
                        if g is not None:
                            check(g, proc_content(q, qr, o), f"process {p} reading process {q} round {qr} object {o}")
                            others += 1
        results.put((p, own, others, ""))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        written.abort()  # the others do not wait for this one
        results.put((p, own, others, f"{type(e).__name__}: {e}"))


def test_processes_with_their_own_clients_read_exact_bytes(gateway_factory) -> None:
    gw = gateway_factory(GATEWAY_ARGS)
    ctx = multiprocessing.get_context("spawn")
    written, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=proc_worker, args=(gw.socket, p, written, results)) for p in range(PROCESSES)]
    for proc in procs:
        proc.start()
    try:
        got = sorted(results.get(timeout=100) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    for p, own, others, error in got:
        assert error == "", f"process {p}: {error}"
        assert own == 2 * PROC_ROUNDS * PROC_OBJECTS
        assert others >= (PROCESSES - 1) * PROC_OBJECTS, f"process {p} read too few of the others' objects"
    # at rest every process's every object is there, byte for byte, for a client that wrote none of them
    with gw.client(NAMESPACE, engine_id=ENGINE) as c:
        for p in range(PROCESSES):
            where = [(r, o) for r in range(PROC_ROUNDS) for o in range(PROC_OBJECTS)]
            for (r, o), g in zip(where, c.get_many([proc_key(p, r, o) for r, o in where])):
                check(g, proc_content(p, r, o), f"at rest: process {p} round {r} object {o}")
