"""The physical limits a figure is measured against: raw reads and writes of the same files, a loopback socket.

Each does the least the job takes (open, one ``preadv`` or ``pwritev``,
close), split over threads the way the gateway's I/O pool splits a batch, so
a figure's ratio says what the gateway adds on top.  The ``verified`` variants
add what kvgate never skips: one XXH3 pass over each payload (a read checks
what it read, a put hashes what it writes), so a figure can also say how close
it comes to the least any checked path costs.  Cold reads need the page
cache dropped before every pass, which needs root.  Called from the bench's
own thread and its raw-baseline pool; every call blocks on I/O.
"""

from __future__ import annotations

import mmap
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvgate.bench import BenchError
from kvgate.cards.directory.directio import is_aligned
from kvgate.cards.objectformat import ALIGN
from kvgate.keys import payload_hash

DROP_CACHES = "/proc/sys/vm/drop_caches"


# ---- threads and the page cache ---------------------------------------------------------


def chunks(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """At most ``n`` contiguous chunks, as the gateway's IoPool.map_chunks splits a batch."""
    n = max(1, min(n, len(items)))
    size = -(-len(items) // n)
    return [items[i : i + size] for i in range(0, len(items), size)]


def on_threads(pool: ThreadPoolExecutor | None, fn: Callable[[Sequence[Any]], None], items: Sequence[Any],
               threads: int) -> None:
    """Run ``fn`` over ``items`` split across ``threads`` (1: in this thread, no hand-off at all)."""
    if threads == 1 or pool is None:
        fn(items)
        return
    for f in [pool.submit(fn, c) for c in chunks(items, threads)]:
        f.result()


def drop_caches() -> None:
    """Flush dirty pages, then drop page cache, dentries and inodes (needs root)."""
    os.sync()
    with open(DROP_CACHES, "w", encoding="ascii") as f:
        f.write("3\n")


def can_drop_caches() -> str | None:
    """None when dropping the page cache works here, else why not."""
    try:
        drop_caches()
    except OSError as e:
        return f"cannot drop the page cache ({DROP_CACHES}: {e.strerror or e}); run as root to measure cold reads"
    return None


# ---- raw reads and writes ------------------------------------------------------------------


def read_files(items: Sequence[tuple[str, int, memoryview]], direct: bool = False, verified: bool = False) -> None:
    """The physical card read: open, one preadv of the whole file (header to scratch, payload in place), close.

    ``direct``: with ``O_DIRECT``, the device straight into the destination and
    the page cache bypassed (destinations must then be page aligned).
    ``verified``: then one XXH3 pass over each payload where it landed.
    """
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    scratch = mmap.mmap(-1, max((h for _, h, _ in items), default=0) or mmap.PAGESIZE)  # aligned for O_DIRECT
    hdr = memoryview(scratch)
    try:
        for path, hsize, dest in items:
            fd = os.open(path, flags)
            try:
                n = os.preadv(fd, [hdr[:hsize], dest], 0)
            finally:
                os.close(fd)
            if n != hsize + len(dest):
                raise BenchError(f"{path}: read {n} bytes, expected {hsize + len(dest)}")
            if verified:
                payload_hash(dest)
    finally:
        hdr.release()
        scratch.close()


def read_files_direct(items: Sequence[tuple[str, int, memoryview]]) -> None:
    read_files(items, direct=True)


def read_files_verified(items: Sequence[tuple[str, int, memoryview]]) -> None:
    read_files(items, verified=True)


def direct_ok(items: Sequence[tuple[str, int, memoryview]]) -> bool:
    """Whether ``read_files_direct`` can read these: aligned offsets, lengths and destinations."""
    if not hasattr(os, "O_DIRECT") or not items:
        return False
    if any(h % ALIGN or len(d) % ALIGN or not is_aligned(d) for _, h, d in items):
        return False
    try:
        read_files_direct(items[:1])
    except OSError:
        return False
    return True


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """pwritev until everything is written (a short write is legal)."""
    offset = 0
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise BenchError("write made no progress")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if n:
            parts = [parts[0][n:], *parts[1:]]


def write_files(items: Sequence[tuple[str, memoryview, memoryview]], verified: bool = False) -> None:
    """The physical card write: a new temp file, one pwritev of header and payload, close, rename.
    ``verified``: each payload hashed (XXH3) first, as a put hashes what its header records."""
    for final, header, payload in items:
        if verified:
            payload_hash(payload)
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, [header, payload])
        finally:
            os.close(fd)
        os.rename(tmp, final)


def write_files_verified(items: Sequence[tuple[str, memoryview, memoryview]]) -> None:
    write_files(items, verified=True)


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP socket pair over 127.0.0.1, set up as the client and the gateway set theirs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b
