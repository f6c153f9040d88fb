"""The plain-buffer figures of ``kvgate bench``: ``get_many(into=numpy arrays)`` outside any registered region.

A client with a session region and no registered region is what SGLang's and
LMCache's host pools, and plain Python users, look like to the gateway.  Its
gets take the one-copy path where the gateway may lend its memory (the
client reads it with ``process_vm_readv``, or a warm card object out of the
file the gateway lends it open), else two copies through the session
region; each figure says which path the gateway counted (``get_paths``,
``files_lent``), so a figure from a slower path cannot pass for a faster one.

Called by ``Bench.run`` on the command's thread, after the figure that stored
the objects (the RAM get, the warm card get); each blocks until measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvgate.bench import BenchError
from kvgate.bench.baselines import on_threads, read_files, read_files_verified
from kvgate.bench.measure import Contender, measure, ratio
from kvgate.client import Client

if TYPE_CHECKING:
    from kvgate.bench.harness import Bench


def plain_buffers(size: int, count: int) -> list[np.ndarray]:
    """``count`` arrays of ``size`` bytes, each its own allocation, touched so no pass pays its page faults."""
    out = [np.empty(size, dtype=np.uint8) for _ in range(count)]
    for a in out:
        a.fill(0)
    return out


def _paths_taken(client: Client, before: dict[str, int]) -> dict[str, int]:
    after = client.stats()["get_paths"]
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}


def _verify(bufs: list[np.ndarray], ref: np.ndarray, what: str) -> None:
    size = bufs[0].size
    for i, b in enumerate(bufs):
        if not np.array_equal(b, ref[i * size:(i + 1) * size]):
            raise BenchError(f"{what}: wrong bytes in object {i}")


def _figure(bench: "Bench", client: Client, keys: list[bytes], bufs: list[np.ndarray], baselines: list[Contender],
            what: str, pick: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    osz = bench.plan.object_size
    for b in bufs:
        b.fill(0)

    def get(_r: int) -> None:
        got = client.get_many(keys, into=bufs)
        if any(g is None or len(g) != osz for g in got):
            raise BenchError(f"{what}: a plain-buffer get missed or came back short")

    get(0)
    _verify(bufs, bench.ref, what)
    before = client.stats()
    s = measure([Contender("kvgate", get), *baselines], bench.plan.pass_bytes, **bench.timing)
    _verify(bufs, bench.ref, what)
    out = pick(s)
    out["get_paths"] = _paths_taken(client, before["get_paths"])
    # card objects the client read itself out of files the gateway lent it open
    out["files_lent"] = client.stats()["files_lent"]["objects"] - before["files_lent"]["objects"]
    return out


def plain_get(bench: "Bench") -> dict[str, Any]:
    """1a. RAM tier into plain buffers vs one-thread ``np.copyto`` into the same buffers."""
    osz, batch = bench.plan.object_size, bench.plan.batch
    keys = [f"ram-{i}".encode() for i in range(batch)]  # stored by the RAM get
    bufs = plain_buffers(osz, batch)
    src = [bench.ref[i * osz:(i + 1) * osz] for i in range(batch)]

    def copy_pass(_r: int) -> None:
        for d, s in zip(bufs, src):
            np.copyto(d, s)

    return _figure(bench, bench.plain_clients[0], keys, bufs, [Contender("copyto", copy_pass)],
                   "RAM-tier get into plain buffers",
                   lambda s: ratio(s["kvgate"], {**s["copyto"].to_json(), "what": "np.copyto", "threads": 1}))


def plain_card_get_warm(bench: "Bench", items: list[tuple[str, int, memoryview]]) -> dict[str, Any]:
    """2a. Warm card into plain buffers vs open+preadv+close of the same files into the same buffers."""
    osz, batch = bench.plan.object_size, bench.plan.batch
    keys = [f"card-{i}".encode() for i in range(batch)]  # stored by the warm card get
    bufs = plain_buffers(osz, batch)
    plain_items = [(path, offset, memoryview(b)) for (path, offset, _d), b in zip(items, bufs)]
    read_files(plain_items)
    _verify(bufs, bench.ref, "raw read into plain buffers")
    return _figure(bench, bench.plain_clients[1], keys, bufs,
                   [*bench.raw_contenders(lambda _r, n: on_threads(bench.pool, read_files, plain_items, n)),
                    *bench.raw_contenders(lambda _r, n: on_threads(bench.pool, read_files_verified, plain_items, n),
                                          kind="verified")],
                   "card get (warm) into plain buffers", lambda s: bench.raw_figure(s, "open+preadv+close"))
