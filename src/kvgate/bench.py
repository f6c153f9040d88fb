"""`kvgate bench`: the gateway measured against this machine's physical limits.

A figure in GiB/s says little on its own: the same gateway is "fast" on one
box and "slow" on another, and a shared machine makes any absolute number
noisy.  So every figure is measured in the same run, on the same bytes and
destinations, next to the thing that bounds it physically (``np.copyto`` for
the RAM tier, raw ``preadv``/``pwritev`` of the same files for the cards), and
what is reported is the ratio.  Both sides run in alternating rounds, so a
burst of load elsewhere hits both alike, and the best round of each is kept:
noise only ever slows a pass down, it never speeds one up.

The bench starts its own gateways (real ``kvgate serve`` processes, as an
engine would talk to) and moves bytes the way engines do: through a
/dev/shm file the client registers, so the gateway reads and writes the
engine's memory in place.

    A  RAM tier twice the working set       -> figure 1 (RAM get), and the
                                               same get over TCP (inline bytes)
                                               against a raw loopback socket
    B  RAM tier off (``--max-bytes 0``)     -> figures 2-5 (card get warm and
                                               cold, card put, lookup)

``--trace FILE`` replays a request trace instead and reports prefix-cache
hit rates per eviction policy: see ``kvgate.benchtrace``.

``--cards N --placement dialog|stripe|both`` measures something else: long
restores from a gateway with N directory cards (one gateway per placement,
RAM tier off).  One dialog of ``--blocks`` objects restored by one get, and
``--restores`` dialogs restored at once by as many client connections, page
cache warm and cold, each against raw ``preadv`` of the very same files; and
how many cards the dialog's blocks landed on, read off the card directories.
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Sequence

import numpy as np

from kvgate.cards.directio import is_aligned
from kvgate.cards.objectformat import ALIGN, header_size, padded_size
from kvgate.client import Client
from kvgate.config import Config, parse_size
from kvgate.keys import encode_namespace, full_key, key_digest
from kvgate.placement import PLACEMENTS

NAMESPACE = "kvgate-bench"
LOOKUP_KEYS = 1000
LOOKUP_OBJECT_SIZE = 4096
RAM_PAGE_SIZE = 256 << 10  # the gateway's default ram_page_size, to size tier A
GIB = float(1 << 30)

# The bars: what a healthy gateway reaches on any machine, as ratios to the
# physical baseline (or, for lookups, a latency an engine's scheduler can
# afford on every request).
BAR_RAM_GET_RATIO = 0.5
BAR_CARD_GET_WARM_RATIO = 0.6
BAR_LOOKUP_P50_MS = 2.0

DROP_CACHES = "/proc/sys/vm/drop_caches"


class BenchError(RuntimeError):
    """The bench cannot run or got a wrong answer; the message says which."""


class _Terminated(BaseException):
    """SIGTERM to the bench: unwinds like Ctrl-C, so the gateways are stopped."""


# ---- command line -----------------------------------------------------------------


def int_arg(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``, or an error naming the value."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value!r}")
        return n
    return parse


def size_arg(least: int, most: int | None = None, why_most: str = "") -> Callable[[str], int]:
    """An argparse type: a size (``16K``, ``2M``) within bounds, or an error naming the value."""
    def parse(value: str) -> int:
        try:
            n = parse_size(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
        if n < least:
            unit = " byte" if least == 1 else ""
            raise argparse.ArgumentTypeError(f"must be at least {least}{unit}, got {value!r}")
        if most is not None and n > most:
            raise argparse.ArgumentTypeError(f"{value!r} is more than {_fmt_size(most)}{why_most}")
        return n
    return parse


_size_arg = size_arg(1)
_positive_int = int_arg(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure (no table, no progress)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions: the whole bench in well under a minute")
    p.add_argument("--object-size", type=_size_arg, default=2 << 20, metavar="SIZE",
                   help="bytes per object, e.g. 2M or 256K (default 2M)")
    p.add_argument("--batch", type=_positive_int, default=32, metavar="N", help="objects per request (default 32)")
    p.add_argument("--dir", metavar="DIR",
                   help="where the cards and scratch files go; a fresh temp dir is made inside it and removed at "
                        "the end (default ./var/bench); its filesystem is what the card figures measure")
    p.add_argument("--threads", type=_positive_int, default=4, metavar="N",
                   help="gateway --thread-pool-size, and thread count of the raw baselines (default 4)")
    g = p.add_argument_group("several cards", "with --cards: restores of long dialogs from a gateway with N cards, "
                                              "instead of the figures above")
    g.add_argument("--cards", type=_positive_int, metavar="N",
                   help="start a gateway with N directory cards (per placement) and measure one long restore and "
                        "--restores concurrent ones, page cache warm and cold")
    g.add_argument("--placement", choices=(*PLACEMENTS, "both"), metavar="{dialog,stripe,both}",
                   help="the gateway's --key-placement; both: one gateway each, in one run (default both)")
    g.add_argument("--blocks", type=_positive_int, default=64, metavar="N",
                   help="blocks (of --object-size) per dialog, all restored by one get (default 64)")
    g.add_argument("--restores", type=_positive_int, default=8, metavar="N",
                   help="concurrent restores of different dialogs, one client connection each (default 8)")
    from kvgate.benchtrace import add_trace_arguments  # here: benchtrace imports this module

    add_trace_arguments(p)


# ---- plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How long each figure runs; both sides of a figure always get the same number of rounds."""

    object_size: int
    batch: int
    threads: int
    quick: bool
    budget_s: float  # wall time of the measured rounds of one warm figure (both sides together)
    min_rounds: int
    max_rounds: int
    cold_rounds: int
    lookup_reps: int

    @property
    def pass_bytes(self) -> int:
        return self.object_size * self.batch

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Plan":
        if args.quick:
            return cls(args.object_size, args.batch, args.threads, True, budget_s=1.0, min_rounds=3,
                       max_rounds=50, cold_rounds=2, lookup_reps=200)
        return cls(args.object_size, args.batch, args.threads, False, budget_s=2.5, min_rounds=5,
                   max_rounds=1000, cold_rounds=3, lookup_reps=2000)


# ---- measuring --------------------------------------------------------------------


@dataclass
class Series:
    """Seconds of each timed pass of one contender; every pass moves ``nbytes``."""

    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_gib_s(self) -> float:
        return self.nbytes / min(self.seconds) / GIB

    @property
    def median_gib_s(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / GIB

    def to_json(self) -> dict[str, Any]:
        return {"best_gib_s": self.best_gib_s, "median_gib_s": self.median_gib_s, "passes": len(self.seconds),
                "best_s": min(self.seconds), "median_s": statistics.median(self.seconds)}


@dataclass
class Contender:
    """One side of a figure: a timed pass plus the untimed work around it."""

    name: str
    run: Callable[[int], None]  # one timed pass; gets the round number (for fresh keys)
    before: Callable[[], None] | None = None  # untimed, e.g. drop the page cache
    after: Callable[[int], None] | None = None  # untimed, e.g. delete what the pass wrote


def measure(contenders: Sequence[Contender], nbytes: int, *, budget_s: float, min_rounds: int,
            max_rounds: int, warmup: bool = True) -> dict[str, Series]:
    """Alternate the contenders round by round until the budget is spent.

    Alternating, rather than all of one then all of the other, means a load
    spike on the shared machine lands on both sides, and both sides always get
    the same number of passes.
    """
    if warmup:
        for c in contenders:
            if c.before:
                c.before()
            c.run(-1)
            if c.after:
                c.after(-1)
    out = {c.name: Series(nbytes) for c in contenders}
    start = time.monotonic()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.monotonic() - start < budget_s):
        for c in contenders:
            if c.before:
                c.before()
            t0 = time.perf_counter()
            c.run(rounds)
            out[c.name].seconds.append(time.perf_counter() - t0)
            if c.after:
                c.after(rounds)
        rounds += 1
    return out


def _chunks(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """At most ``n`` contiguous chunks, as the gateway's IoPool.map_chunks splits a batch."""
    n = max(1, min(n, len(items)))
    size = -(-len(items) // n)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _on_threads(pool: ThreadPoolExecutor | None, fn: Callable[[Sequence[Any]], None], items: Sequence[Any],
                threads: int) -> None:
    """Run ``fn`` over ``items`` split across ``threads`` (1: in this thread, no hand-off at all)."""
    if threads == 1 or pool is None:
        fn(items)
        return
    for f in [pool.submit(fn, c) for c in _chunks(items, threads)]:
        f.result()


def _drop_caches() -> None:
    """Flush dirty pages, then drop page cache, dentries and inodes (needs root)."""
    os.sync()
    with open(DROP_CACHES, "w", encoding="ascii") as f:
        f.write("3\n")


def _can_drop_caches() -> str | None:
    """None when dropping the page cache works here, else why not."""
    try:
        _drop_caches()
    except OSError as e:
        return f"cannot drop the page cache ({DROP_CACHES}: {e.strerror or e}); run as root to measure cold reads"
    return None


# ---- raw baselines ------------------------------------------------------------------


def _read_files(items: Sequence[tuple[str, int, memoryview]], direct: bool = False) -> None:
    """The physical card read: open, one preadv of the whole file (header to scratch, payload in place), close.

    ``direct``: with ``O_DIRECT``, the device straight into the destination and
    the page cache bypassed (destinations must then be page aligned).
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
    finally:
        hdr.release()
        scratch.close()


def _read_files_direct(items: Sequence[tuple[str, int, memoryview]]) -> None:
    _read_files(items, direct=True)


def _direct_ok(items: Sequence[tuple[str, int, memoryview]]) -> bool:
    """Whether ``_read_files_direct`` can read these: aligned offsets, lengths and destinations."""
    if not hasattr(os, "O_DIRECT") or not items:
        return False
    if any(h % ALIGN or len(d) % ALIGN or not is_aligned(d) for _, h, d in items):
        return False
    try:
        _read_files_direct(items[:1])
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


def _write_files(items: Sequence[tuple[str, memoryview, memoryview]]) -> None:
    """The physical card write: a new temp file, one pwritev of header and payload, close, rename."""
    for final, header, payload in items:
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, [header, payload])
        finally:
            os.close(fd)
        os.rename(tmp, final)


# ---- processes and memory -------------------------------------------------------------


class GatewayProcess:
    """A ``kvgate serve`` child with its own socket, card and log; stopped with SIGTERM."""

    def __init__(self, name: str, workdir: str, sockdir: str, *, max_bytes: int, threads: int, card_capacity: int,
                 cards: int = 1, tcp: bool = False, extra: Sequence[str] = ()):
        self.name = name
        # One card: card-<name>; several: card-<name>-0 .. card-<name>-<N-1>, each a directory card of its own.
        self.card_dirs = ([os.path.join(workdir, f"card-{name}")] if cards == 1 else
                          [os.path.join(workdir, f"card-{name}-{i}") for i in range(cards)])
        self.card_dir = self.card_dirs[0]
        self.socket_path = os.path.join(sockdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"gateway-{name}.log")
        self.args = [
            # TCP needs a port of its own: --port 0 turns the listener off
            "--storage-devices", *self.card_dirs, "--max-bytes", str(max_bytes), "--port", str(_free_port() if tcp else 0),
            "--metrics-port", "0", "--socket", self.socket_path, "--card-capacity", str(card_capacity),
            "--thread-pool-size", str(threads), "--log-level", "warning", *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for d in self.card_dirs:  # a gateway never creates a configured card directory itself
            os.makedirs(d, exist_ok=True)
        # The child must import this very kvgate, however the bench was started.
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvgate", "serve", *self.args], env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the socket accepts a connection (the RAM tier is touched by then)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"gateway {self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                try:
                    s.connect(self.socket_path)
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise BenchError(f"gateway {self.name} did not listen on {self.socket_path} within {timeout_s:.0f} s:\n"
                                 f"{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP socket pair over 127.0.0.1, set up as the client and the gateway set theirs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


class ShmRegion:
    """The client's own /dev/shm file, as an engine keeps its CPU KV tier.

    Allocated (``posix_fallocate``) and touched before anything is timed, so
    no figure pays first-touch page faults; registered with each gateway, so
    buffers inside it move with no copy on the client side.
    """

    def __init__(self, size: int):
        self.path = f"/dev/shm/kvgate-bench-{os.getpid()}"
        self.size = size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileExistsError:  # left by a dead bench that had our pid
            os.unlink(self.path)
            fd = os.open(self.path, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.array[:: mmap.PAGESIZE] = 0
        self.view = memoryview(self.mm)

    def slices(self, size: int, count: int) -> list[memoryview]:
        return [self.view[i * size : (i + 1) * size] for i in range(count)]

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self.view.release()
            self.mm.close()
        except BufferError:
            pass  # a slice is still referenced somewhere; the mapping goes with it (the file is gone already)


# ---- the bench --------------------------------------------------------------------------


def _gib_s(x: float) -> str:
    return f"{x:.2f} GiB/s"


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 4)) == 0:
            v = n / (1 << shift)
            return f"{v:g} {unit}"
    return f"{n} B"


def _base_label(base: dict[str, Any], plain: str) -> str:
    return "direct" if base.get("o_direct") else plain


def _ratio(gw: Series, base: dict[str, Any]) -> dict[str, Any]:
    return {"kvgate": gw.to_json(), "baseline": base, "ratio": gw.best_gib_s / base["best_gib_s"],
            "ratio_median": gw.median_gib_s / base["median_gib_s"]}


def _figure(series: dict[str, Series], name: str, thread_counts: Sequence[int], what: str) -> dict[str, Any]:
    """``name`` against the fastest raw series: the physical limit is the best the machine does.

    Raw series are ``raw<n>`` (buffered reads or writes on n threads) and, for
    cold reads, ``direct<n>`` (the same reads with ``O_DIRECT``).
    """
    raw = [(kind, n) for kind in ("raw", "direct") for n in thread_counts if f"{kind}{n}" in series]
    kind, best = max(raw, key=lambda kn: series[f"{kn[0]}{kn[1]}"].best_gib_s)
    base = {**series[f"{kind}{best}"].to_json(), "what": what + (" with O_DIRECT" if kind == "direct" else ""),
            "o_direct": kind == "direct", "threads": best,
            "by_threads": {str(n): series[f"raw{n}"].to_json() for n in thread_counts}}
    direct = {str(n): series[f"direct{n}"].to_json() for n in thread_counts if f"direct{n}" in series}
    if direct:
        base["direct_by_threads"] = direct
    return _ratio(series[name], base)


class Bench:
    """Everything one run owns: gateways, clients, region, scratch dirs; ``close`` undoes it all."""

    def __init__(self, plan: Plan, parent_dir: str, progress: Callable[[str], None]):
        self.plan = plan
        self.progress = progress
        self.parent_dir = parent_dir
        self.workdir = ""  # made by start(), under parent_dir
        self.sockdir = ""  # made by start(), under the temp dir
        self.died: list[str] = []  # log tails of gateways that were dead before close() stopped them
        self.gateways: list[GatewayProcess] = []
        self.clients: list[Client] = []
        self.region: ShmRegion | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.ns = encode_namespace(NAMESPACE)
        # Set by run(): what every figure shares.
        self.ram_client: Client
        self.card_client: Client
        self.tcp_client: Client  # the RAM gateway again, over TCP
        self.slices: list[memoryview] = []  # the batch's destinations (and put sources) in the region
        self.ref = np.empty(0, dtype=np.uint8)  # the batch's payload, outside the region
        self.timing: dict[str, Any] = {}

    @property
    def shm(self) -> ShmRegion:
        assert self.region is not None, "start() first"
        return self.region

    # -- setup / teardown --

    def start(self) -> tuple[Client, Client]:
        plan = self.plan
        ws = plan.pass_bytes
        os.makedirs(self.parent_dir, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="kvgate-bench-", dir=self.parent_dir)
        # Unix socket paths are limited to ~108 bytes: keep them short, apart from --dir.
        self.sockdir = tempfile.mkdtemp(prefix="kvgate-bench-")
        free = shutil.disk_usage(self.workdir).free
        if free < 4 * ws + (64 << 20):
            raise BenchError(f"{self.workdir}: {free >> 20} MiB free, the bench needs about {(4 * ws) >> 20} MiB")
        pages = -(-plan.object_size // RAM_PAGE_SIZE) * plan.batch
        card_capacity = max(8 << 30, 8 * ws)
        self.gateways = [
            GatewayProcess("ram", self.workdir, self.sockdir, max_bytes=2 * pages * RAM_PAGE_SIZE,
                           threads=plan.threads, card_capacity=card_capacity, tcp=True),
            GatewayProcess("card", self.workdir, self.sockdir, max_bytes=0, threads=plan.threads,
                           card_capacity=card_capacity),
        ]
        for g in self.gateways:  # both start at once: their imports and RAM-tier touching overlap
            g.start()
        size = max(ws, LOOKUP_KEYS * LOOKUP_OBJECT_SIZE)
        self.region = ShmRegion(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.pool = ThreadPoolExecutor(max_workers=plan.threads, thread_name_prefix="bench-raw")
        for g in self.gateways:
            g.wait_ready()
            # No session region: every byte goes through our registered region, as an engine's would.
            c = Client.connect(g.socket_path, namespace=NAMESPACE, engine_id=f"kvgate-bench-{os.getpid()}",
                               want_shm=False, timeout=120)
            self.clients.append(c)
            c.register_region(self.region.path, self.region.mm)
        port = self.clients[0].stats()["gateway"]["port"]
        self.tcp_client = Client.connect(f"127.0.0.1:{port}", namespace=NAMESPACE,
                                         engine_id=f"kvgate-bench-{os.getpid()}", timeout=120)
        self.clients.append(self.tcp_client)
        return self.clients[0], self.clients[1]

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except OSError:
                pass
        self.clients = []
        errors = []
        for g in self.gateways:
            if g.proc is not None and g.proc.poll() is not None:
                self.died.append(f"gateway {g.name} had exited with status {g.proc.returncode}:\n{g.log_tail()}")
            try:
                g.stop()
            except Exception as e:  # noqa: BLE001 - stop the others anyway
                errors.append(e)
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.region is not None:
            self.region.close()
        for d in (self.workdir, self.sockdir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        if errors:
            raise errors[0]

    # -- helpers --

    def _object_paths(self, card_dir: str, keys: list[bytes]) -> list[str]:
        """The card's files of ``keys``, in key order, found on disk as any reader would."""
        found = [p for p in glob.glob(os.path.join(card_dir, "db*", "*", "*"))
                 if ".tmp." not in os.path.basename(p) and os.path.isfile(p)]
        by_name = {os.path.basename(p): p for p in found}
        paths = []
        for k in keys:
            p = by_name.get(key_digest(full_key(self.ns, k)).hex())
            if p is None:
                raise BenchError(f"object {k!r} is not among the {len(found)} files under {card_dir}")
            paths.append(p)
        return paths

    @staticmethod
    def _check_got(got: list, size: int) -> None:
        for i, g in enumerate(got):
            if g is None:
                raise BenchError(f"object {i} missed")
            if len(g) != size:
                raise BenchError(f"object {i} came back with {len(g)} bytes, expected {size}")

    def _verify(self, ref: np.ndarray, what: str) -> None:
        got = self.shm.array[: ref.size]
        if not np.array_equal(got, ref):
            bad = int(np.argmax(got != ref))
            raise BenchError(f"{what}: wrong bytes at offset {bad} (object {bad // self.plan.object_size})")

    @property
    def _thread_counts(self) -> list[int]:
        """The baselines run with the gateway's thread count and with one thread (once if they are equal)."""
        return list(dict.fromkeys((self.plan.threads, 1)))

    def _raw_contenders(self, pass_fn: Callable[[int, int], None], before: Callable[[], None] | None = None,
                        after: Callable[[int], None] | None = None) -> list[Contender]:
        """One contender per thread count; ``pass_fn(round, threads)`` is one raw pass."""
        return [Contender(f"raw{n}", lambda r, n=n: pass_fn(r, n), before, after) for n in self._thread_counts]

    def _direct_contenders(self, items: list[tuple[str, int, memoryview]]) -> list[Contender]:
        """Cold reads with O_DIRECT, one contender per thread count (none where O_DIRECT cannot read these)."""
        if not _direct_ok(items):
            return []
        return [Contender(f"direct{n}", lambda _r, n=n: _on_threads(self.pool, _read_files_direct, items, n),
                          _drop_caches) for n in self._thread_counts]

    def _figure(self, series: dict[str, Series], what: str) -> dict[str, Any]:
        """kvgate against the faster raw thread count: the physical limit is the best the machine does."""
        return _figure(series, "kvgate", self._thread_counts, what)

    @staticmethod
    def _ratio(gw: Series, base: dict[str, Any]) -> dict[str, Any]:
        return _ratio(gw, base)

    # -- figures --

    def run(self) -> dict[str, Any]:
        """Every figure, in order; returns ``{"figures": ..., "skipped": {figure: reason}}``."""
        self.progress("starting gateways")
        self.ram_client, self.card_client = self.start()
        ws = self.plan.pass_bytes
        self.slices = self.shm.slices(self.plan.object_size, self.plan.batch)
        # The payload, kept apart from the region: source of the copy baseline and of every check.
        self.ref = np.empty(ws, dtype=np.uint8)
        self.ref[:] = np.frombuffer(np.random.default_rng().bytes(ws), dtype=np.uint8)
        self.shm.array[:ws] = self.ref
        self.timing = dict(budget_s=self.plan.budget_s, min_rounds=self.plan.min_rounds,
                           max_rounds=self.plan.max_rounds)
        figures: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        self.progress("RAM-tier get")
        figures["ram_get"] = self._ram_get()
        self.progress("RAM-tier get over TCP")
        figures["tcp_get"] = self._tcp_get()
        self.progress("card get (warm)")
        figures["card_get_warm"], card_get, items = self._card_get_warm()
        self.progress("card get (cold)")
        why = _can_drop_caches()
        if why is None:
            figures["card_get_cold"] = self._card_get_cold(card_get, items)
        else:
            figures["card_get_cold"] = None
            skipped["card_get_cold"] = why
        self.progress("card put")
        figures["card_put"] = self._card_put()
        self.progress("lookup")
        figures["lookup"] = self._lookup()
        self.progress("stopping gateways")
        return {"figures": figures, "skipped": skipped}

    def _ram_get(self) -> dict[str, Any]:
        """1. RAM tier into the registered region vs single-thread np.copyto into the same slices."""
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.ram_client
        keys = [f"ram-{i}".encode() for i in range(batch)]
        if not all(client.put_many(keys, slices, retention="short")):
            raise BenchError("the RAM-tier gateway did not store the batch (RAM tier too small?)")
        region[:ws] = 0
        self._check_got(client.get_many(keys, into=slices), osz)
        self._verify(ref, "RAM-tier get")
        src = [ref[i * osz : (i + 1) * osz] for i in range(batch)]
        dst = [region[i * osz : (i + 1) * osz] for i in range(batch)]

        def copy_pass(_r: int) -> None:
            for d, s in zip(dst, src):
                np.copyto(d, s)

        s = measure([Contender("kvgate", lambda _r: client.get_many(keys, into=slices)),
                     Contender("copyto", copy_pass)], ws, **self.timing)
        return self._ratio(s["kvgate"], {**s["copyto"].to_json(), "what": "np.copyto", "threads": 1})

    def _tcp_get(self) -> dict[str, Any]:
        """1b. The objects of 1 over TCP (inline bytes, one frame) vs a loopback socket moving the same bytes.

        The baseline sends the batch with ``sendall`` and receives it with
        ``recv_into`` straight into the same slices: what a TCP client of this
        machine's Python cannot beat.  The gateway also copies the objects out
        of its RAM tier into the reply, so a ratio of 1 is out of reach.
        """
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.tcp_client
        keys = [f"ram-{i}".encode() for i in range(batch)]  # stored by _ram_get
        region[:ws] = 0
        self._check_got(client.get_many(keys, into=slices), osz)
        self._verify(ref, "RAM-tier get over TCP")
        src = [ref[i * osz : (i + 1) * osz] for i in range(batch)]
        sender, receiver = _loopback_pair()

        def send() -> None:
            for b in src:
                sender.sendall(b)

        def socket_pass(_r: int) -> None:
            assert self.pool is not None
            sending = self.pool.submit(send)
            for d in slices:
                view, got = d, 0
                while got < len(view):
                    n = receiver.recv_into(view[got:])
                    if not n:
                        raise BenchError("the loopback socket closed")
                    got += n
            sending.result()

        try:
            region[:ws] = 0
            socket_pass(0)
            self._verify(ref, "loopback socket")
            s = measure([Contender("kvgate", lambda _r: client.get_many(keys, into=slices)),
                         Contender("socket", socket_pass)], ws, **self.timing)
        finally:
            sender.close()
            receiver.close()
        return self._ratio(s["kvgate"], {**s["socket"].to_json(), "what": "loopback TCP sendall/recv_into",
                                         "threads": 1})

    def _card_get_warm(self) -> tuple[dict[str, Any], Callable[[int], None], list[tuple[str, int, memoryview]]]:
        """2. Card get, page cache warm, vs open+preadv+close of the same files into the same bytes."""
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.card_client
        keys = [f"card-{i}".encode() for i in range(batch)]
        region[:ws] = ref
        if not all(client.put_many(keys, slices, retention="long")):
            raise BenchError("the card gateway did not store the batch")
        paths = self._object_paths(self.gateways[1].card_dir, keys)
        items = [(p, os.path.getsize(p) - osz, d) for p, d in zip(paths, slices)]
        region[:ws] = 0
        _read_files(items)  # warms the page cache, and proves the baseline moves the real bytes
        self._verify(ref, "raw read")
        region[:ws] = 0

        def card_get(_r: int) -> None:
            self._check_got(client.get_many(keys, into=slices), osz)

        card_get(0)
        self._verify(ref, "card get")
        s = measure([Contender("kvgate", card_get),
                     *self._raw_contenders(lambda _r, n: _on_threads(self.pool, _read_files, items, n))],
                    ws, **self.timing)
        return self._figure(s, "open+preadv+close"), card_get, items

    def _card_get_cold(self, card_get: Callable[[int], None], items: list[tuple[str, int, memoryview]]) -> dict[str, Any]:
        """3. As 2, with the page cache dropped before every pass of either side; few passes, they are slow."""
        n = self.plan.cold_rounds
        s = measure([Contender("kvgate", card_get, _drop_caches),
                     *self._raw_contenders(lambda _r, t: _on_threads(self.pool, _read_files, items, t), _drop_caches),
                     *self._direct_contenders(items)],
                    self.plan.pass_bytes, budget_s=0.0, min_rounds=n, max_rounds=n, warmup=False)
        self.shm.array[: self.plan.pass_bytes] = 0
        _drop_caches()
        card_get(0)
        self._verify(self.ref, "cold card get")
        return self._figure(s, "open+preadv+close")

    def _card_put(self) -> dict[str, Any]:
        """4. Write-through put from the region vs new files (temp name, pwritev, rename); fresh names each pass."""
        batch, client, slices = self.plan.batch, self.card_client, self.slices
        self.shm.array[: self.plan.pass_bytes] = self.ref

        def put_keys(r: int) -> list[bytes]:
            return [f"put-{r}-{i}".encode() for i in range(batch)]

        def card_put(r: int) -> None:
            if not all(client.put_many(put_keys(r), slices, retention="long")):
                raise BenchError("the card gateway did not store a put batch")

        scratch = os.path.join(self.workdir, "raw-write")
        os.makedirs(scratch)
        # A header as long as the card's (padded to a block), so both sides write files of the same size.
        header = memoryview(bytes(padded_size(header_size(full_key(self.ns, put_keys(0)[0])))))

        def raw_items(r: int) -> list[tuple[str, memoryview, memoryview]]:
            return [(os.path.join(scratch, f"{r}-{i}"), header, d) for i, d in enumerate(slices)]

        def raw_delete(r: int) -> None:
            for path, _h, _d in raw_items(r):
                os.unlink(path)

        # Both sides delete what a pass wrote (untimed), so the filesystem does not fill up.
        s = measure([Contender("kvgate", card_put, after=lambda r: client.delete_many(put_keys(r))),
                     *self._raw_contenders(lambda r, n: _on_threads(self.pool, _write_files, raw_items(r), n),
                                           after=raw_delete)],
                    self.plan.pass_bytes, **self.timing)
        return self._figure(s, "open+pwritev+close+rename")

    def _lookup(self) -> dict[str, Any]:
        """5. Lookup of 1,000 stored keys: what an engine asks on every scheduling step."""
        client = self.card_client
        keys = [f"lookup-{i:04d}".encode() for i in range(LOOKUP_KEYS)]
        small = self.shm.slices(LOOKUP_OBJECT_SIZE, LOOKUP_KEYS)
        if not all(client.put_many(keys, small, retention="long")):
            raise BenchError("the card gateway did not store the lookup objects")

        def timed(ks: list[bytes], reps: int) -> np.ndarray:
            out = np.empty(reps)
            for i in range(reps):
                t0 = time.perf_counter()
                n = client.lookup(ks)
                out[i] = time.perf_counter() - t0
                if n != len(ks):
                    raise BenchError(f"lookup of {len(ks)} stored keys answered {n}")
            return out * 1e3

        timed(keys, 10)
        ms = timed(keys, self.plan.lookup_reps)
        one = timed(keys[:1], min(200, self.plan.lookup_reps))  # the fixed cost of a request, for scale
        return {
            "keys": LOOKUP_KEYS, "reps": len(ms), "count": LOOKUP_KEYS, "count_ok": True,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "best_ms": float(ms.min()), "one_key_p50_ms": float(np.percentile(one, 50)),
        }


# ---- several cards: long restores under dialog and stripe placement ----------------------

CARDS_FIGURES = ("single_warm", "single_cold", "concurrent_warm", "concurrent_cold")
CARDS_SLOTS_MIN = 16
DIALOG_SHIFT = 4096  # dialog d's payload starts d * this many bytes into the random reference


def _card_files(card_dirs: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Every object file on the cards, by file name (the key digest): (card index, path)."""
    out: dict[str, tuple[int, str]] = {}
    for i, d in enumerate(card_dirs):
        for p in glob.glob(os.path.join(d, "db*", "*", "*")):
            if ".tmp." not in os.path.basename(p) and os.path.isfile(p):
                out[os.path.basename(p)] = (i, p)
    return out


def _placements(choice: str | None) -> list[str]:
    return list(PLACEMENTS) if choice in (None, "both") else [choice]


class CardsBench(Bench):
    """``--cards N``: one gateway per placement, each with N directory cards of its own.

    A dialog is ``blocks`` objects written with one dialog mark; a restore is
    one ``get_many`` of all its blocks, with that mark, into the registered
    region (zero copy).  Under dialog placement the blocks sit on one card,
    under stripe on (about) all N, and which cards they landed on is read off
    the card directories, not assumed.  Every restore figure runs alternately
    with raw ``preadv`` of the very same files into the same destinations.
    """

    def __init__(self, plan: Plan, parent_dir: str, progress: Callable[[str], None], *, cards: int,
                 placements: Sequence[str], blocks: int, restores: int):
        super().__init__(plan, parent_dir, progress)
        self.cards = cards
        self.placements = list(placements)
        self.blocks = blocks
        self.restores = restores
        self.by_placement: dict[str, tuple[GatewayProcess, list[Client]]] = {}
        self.restore_pool: ThreadPoolExecutor | None = None

    @property
    def slots(self) -> int:
        return max(CARDS_SLOTS_MIN, 4 * self.cards)

    @property
    def dialog_bytes(self) -> int:
        return self.plan.object_size * self.blocks

    @property
    def _thread_counts(self) -> list[int]:
        """Raw threads of the single restore: the gateway's pool size, all its card pools together, and 1."""
        t = self.plan.threads
        return list(dict.fromkeys((t, t * self.cards, 1)))

    # -- setup / teardown --

    def start(self) -> tuple[Client, Client]:  # type: ignore[override]
        plan = self.plan
        total = self.dialog_bytes * self.restores
        os.makedirs(self.parent_dir, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="kvgate-bench-", dir=self.parent_dir)
        self.sockdir = tempfile.mkdtemp(prefix="kvgate-bench-")
        free = shutil.disk_usage(self.workdir).free
        if free < total + (64 << 20):  # one placement's dialogs at a time: each is deleted before the next
            raise BenchError(f"{self.workdir}: {free >> 20} MiB free, the bench needs about {total >> 20} MiB "
                             "(lower --blocks, --restores or --object-size)")
        region_size = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
        shm_free = shutil.disk_usage("/dev/shm").free
        if shm_free < region_size + (64 << 20):
            raise BenchError(f"/dev/shm: {shm_free >> 20} MiB free, the destination region needs {region_size >> 20} MiB "
                             "(lower --blocks, --restores or --object-size)")
        card_capacity = max(8 << 30, 2 * total)
        for p in self.placements:
            g = GatewayProcess(p, self.workdir, self.sockdir, max_bytes=0, threads=plan.threads,
                               card_capacity=card_capacity, cards=self.cards,
                               extra=["--storage-slots", str(self.slots), "--key-placement", p])
            self.gateways.append(g)
        for g in self.gateways:
            g.start()
        self.region = ShmRegion(region_size)
        self.pool = ThreadPoolExecutor(max_workers=max(self._thread_counts), thread_name_prefix="bench-raw")
        self.restore_pool = ThreadPoolExecutor(max_workers=self.restores, thread_name_prefix="bench-restore")
        # A gateway serves one engine: every connection names the same engine, as an engine's workers would.
        engine_id = f"kvgate-bench-{os.getpid()}"
        for p, g in zip(self.placements, self.gateways):
            g.wait_ready()
            clients = []
            for _ in range(self.restores):
                c = Client.connect(g.socket_path, namespace=NAMESPACE, engine_id=engine_id, want_shm=False,
                                   timeout=120)
                self.clients.append(c)
                c.register_region(self.region.path, self.region.mm)
                clients.append(c)
            self.by_placement[p] = (g, clients)
        return self.clients[0], self.clients[0]

    def close(self) -> None:
        if self.restore_pool is not None:
            self.restore_pool.shutdown(wait=True)
        super().close()

    # -- helpers --

    def _expected(self, d: int) -> np.ndarray:
        """Dialog ``d``'s bytes: a window of the random reference, shifted per dialog so a mixed-up restore
        shows; a view, so checking a GiB of restores costs one compare, not a copy."""
        return self.ref[d * DIALOG_SHIFT : d * DIALOG_SHIFT + self.dialog_bytes]

    def _verify_dialogs(self, dialogs: Sequence[int], what: str) -> None:
        ws = self.dialog_bytes
        for d in dialogs:
            got, want = self.shm.array[d * ws : (d + 1) * ws], self._expected(d)
            # Compared 8 bytes at a time where the length allows (offsets are multiples of 8 anyway).
            wide = (got.view(np.uint64), want.view(np.uint64)) if ws % 8 == 0 else (got, want)
            if not np.array_equal(*wide):
                bad = int(np.argmax(got != want))
                raise BenchError(f"{what}: dialog {d}: wrong bytes at offset {bad} "
                                 f"(block {bad // self.plan.object_size})")

    def _card_trouble(self, p: str) -> str:
        """What the gateway counted against its cards, to explain a miss; empty when nothing."""
        _g, clients = self.by_placement[p]
        try:
            cards = clients[0].stats()["cards"]
        except Exception:  # noqa: BLE001 - only an explanation; the error it explains is what matters
            return ""
        bad = [f"{os.path.basename(c['location'])}: {c['timeouts']} I/O timeouts, {c['errors']} errors, "
               f"{'active' if c['active'] else 'OUT OF SERVICE'}"
               for c in cards if c["timeouts"] or c["errors"] or not c["active"]]
        return f" (gateway cards: {'; '.join(bad)})" if bad else ""

    # -- figures --

    def run(self) -> dict[str, Any]:
        """Both placements in turn; returns ``{"placements": {p: ...}, "skipped": {figure: reason}}``."""
        self.progress("starting gateways")
        self.start()
        size = self.dialog_bytes + self.restores * DIALOG_SHIFT
        self.ref = np.frombuffer(np.random.default_rng().bytes(size), dtype=np.uint8).copy()
        self.timing = {"budget_s": self.plan.budget_s, "min_rounds": self.plan.min_rounds,
                       "max_rounds": self.plan.max_rounds}
        skipped: dict[str, str] = {}
        why = _can_drop_caches()
        if why is not None:
            skipped = {"single_cold": why, "concurrent_cold": why}
        out = {}
        for p in self.placements:
            try:
                out[p] = self._placement(p, cold=why is None)
            except BenchError as e:
                raise BenchError(f"{p} placement: {e}{self._card_trouble(p)}") from None
        self.progress("stopping gateways")
        return {"placements": out, "skipped": skipped}

    def _placement(self, p: str, cold: bool) -> dict[str, Any]:
        plan = self.plan
        osz, nb, nr, ws = plan.object_size, self.blocks, self.restores, self.dialog_bytes
        g, clients = self.by_placement[p]
        region = self.shm.array
        keys = [[f"dialog{d}-block{i:04d}".encode() for i in range(nb)] for d in range(nr)]
        marks = [f"kvgate-bench-dialog-{d}".encode() for d in range(nr)]
        view = self.shm.view
        slices = [[view[d * ws + i * osz : d * ws + (i + 1) * osz] for i in range(nb)] for d in range(nr)]

        self.progress(f"{p}: writing")
        for d in range(nr):  # one put per dialog, with its mark, as an engine offloads a finished prefill
            region[d * ws : (d + 1) * ws] = self._expected(d)
            if not all(clients[0].put_many(keys[d], slices[d], retention="long", dialog=marks[d], position=0)):
                raise BenchError(f"{p}: the gateway did not store dialog {d}")

        # Where the blocks landed, read off the card directories.
        files = _card_files(g.card_dirs)
        items: list[list[tuple[str, int, memoryview]]] = []
        card_of: list[list[int]] = []
        for d in range(nr):
            its, cards = [], []
            for k, dest in zip(keys[d], slices[d]):
                found = files.get(key_digest(full_key(self.ns, k)).hex())
                if found is None:
                    raise BenchError(f"{p}: object {k!r} is on none of the {self.cards} cards ({len(files)} files)")
                its.append((found[1], os.path.getsize(found[1]) - osz, dest))
                cards.append(found[0])
            items.append(its)
            card_of.append(cards)
        single_per_card = [card_of[0].count(i) for i in range(self.cards)]
        all_per_card = [sum(c.count(i) for c in card_of) for i in range(self.cards)]
        dialogs_per_card = [sum(1 for c in card_of if i in c) for i in range(self.cards)]

        c0 = clients[0]
        rpool = self.restore_pool
        assert rpool is not None

        def single(_r: int) -> None:
            self._check_got(c0.get_many(keys[0], into=slices[0], dialog=marks[0]), osz)

        def restore(d: int) -> None:
            self._check_got(clients[d].get_many(keys[d], into=slices[d], dialog=marks[d]), osz)

        def concurrent(_r: int) -> None:
            for f in [rpool.submit(restore, d) for d in range(nr)]:
                f.result()

        def raw_concurrent(_r: int) -> None:
            for f in [rpool.submit(_read_files, items[d]) for d in range(nr)]:
                f.result()

        def raw_single(before: Callable[[], None] | None) -> list[Contender]:
            return self._raw_contenders(lambda _r, n: _on_threads(self.pool, _read_files, items[0], n), before)

        # Untimed checks: the baseline moves the real bytes (and warms the page cache), and so do both restores.
        total = nr * ws
        region[:total] = 0
        raw_concurrent(0)
        self._verify_dialogs(range(nr), f"{p}: raw read")
        region[:total] = 0
        single(0)
        self._verify_dialogs([0], f"{p}: single restore")
        region[:total] = 0
        concurrent(0)
        self._verify_dialogs(range(nr), f"{p}: {nr} concurrent restores")

        what = "open+preadv+close"
        figures: dict[str, Any] = {}
        self.progress(f"{p}: single restore warm")
        s = measure([Contender("kvgate", single), *raw_single(None)], ws, **self.timing)
        figures["single_warm"] = _figure(s, "kvgate", self._thread_counts, what)
        n = plan.cold_rounds
        cold_timing: dict[str, Any] = {"budget_s": 0.0, "min_rounds": n, "max_rounds": n, "warmup": False}
        self.progress(f"{p}: single restore cold")
        if cold:
            s = measure([Contender("kvgate", single, _drop_caches), *raw_single(_drop_caches),
                         *self._direct_contenders(items[0])], ws, **cold_timing)
            figures["single_cold"] = _figure(s, "kvgate", self._thread_counts, what)
        else:
            figures["single_cold"] = None
        conc_what = f"{what}, one thread per dialog"
        self.progress(f"{p}: {nr} restores warm")
        s = measure([Contender("kvgate", concurrent), Contender(f"raw{nr}", raw_concurrent)], total, **self.timing)
        figures["concurrent_warm"] = _figure(s, "kvgate", [nr], conc_what)
        self.progress(f"{p}: {nr} restores cold")
        if cold:
            def direct_concurrent(_r: int) -> None:
                for f in [rpool.submit(_read_files_direct, items[d]) for d in range(nr)]:
                    f.result()

            direct = [Contender(f"direct{nr}", direct_concurrent, _drop_caches)] if _direct_ok(items[0]) else []
            s = measure([Contender("kvgate", concurrent, _drop_caches), Contender(f"raw{nr}", raw_concurrent, _drop_caches),
                         *direct], total, **cold_timing)
            figures["concurrent_cold"] = _figure(s, "kvgate", [nr], conc_what)
            region[:total] = 0
            _drop_caches()
            concurrent(0)
            self._verify_dialogs(range(nr), f"{p}: cold concurrent restores")
        else:
            figures["concurrent_cold"] = None

        # What the gateway itself counted per card (reads of every pass above, warm-up and checks included).
        index = {os.path.abspath(d): i for i, d in enumerate(g.card_dirs)}
        per_card = [{} for _ in range(self.cards)]
        for st in c0.stats()["cards"]:
            i = index.get(os.path.abspath(st["location"]))
            if i is not None:
                per_card[i] = {k: st[k] for k in ("objects", "hits", "misses", "bytes_read", "timeouts", "errors")}
        filesystems = len({os.stat(d).st_dev for d in g.card_dirs})
        for d in range(nr):  # untimed; the next placement starts from an empty disk
            c0.delete_many(keys[d], dialog=marks[d])
        return {
            "figures": figures,
            "cards_used": sum(1 for x in single_per_card if x),
            "single_blocks_per_card": single_per_card,
            "concurrent_cards_used": sum(1 for x in all_per_card if x),
            "concurrent_blocks_per_card": all_per_card,
            "concurrent_dialogs_per_card": dialogs_per_card,
            "gateway_cards": per_card,
            "card_filesystems": filesystems,
        }


def _cards_comparison(placements: dict[str, Any]) -> dict[str, Any] | None:
    """stripe / dialog of each figure both measured: kvgate's best pass, and the ratios to each one's baseline."""
    if "dialog" not in placements or "stripe" not in placements:
        return None
    out: dict[str, Any] = {}
    for name in CARDS_FIGURES:
        d, s = placements["dialog"]["figures"][name], placements["stripe"]["figures"][name]
        if d is None or s is None:
            continue
        out[name] = {"kvgate": s["kvgate"]["best_gib_s"] / d["kvgate"]["best_gib_s"],
                     "ratio": s["ratio"] / d["ratio"]}
    return out


def _cards_notes(cfg: dict[str, Any], placements: dict[str, Any]) -> list[str]:
    n, t = cfg["cards"], cfg["threads"]
    notes = []
    if n == 1:
        notes.append("One card: both placements put every block on it; the figures compare the gateway with raw "
                     "reads, not placements.")
    elif cfg["cards_share_one_filesystem"]:
        notes.append(f"All {n} cards are directories on one filesystem: a stripe restore reads from {n} cards at "
                     f"once, but here they share one disk and one page cache, so stripe cannot gain what it gains "
                     f"from {n} separate devices; a difference between placements measured here comes from the "
                     f"gateway (its per-card I/O pools, how the dialogs fell on the cards) and from noise. The "
                     f"figures are what this machine measured, nothing more.")
    else:
        notes.append(f"The {n} cards are on {cfg['card_filesystems']} different filesystems.")
    notes.append(f"The gateway runs one I/O pool of {t} threads per card: a restore from one card (dialog) "
                 f"reads on at most {t} threads, one spread over {n} cards (stripe) on up to {t * n}; the "
                 f"single-restore baseline is the best of {', '.join(map(str, cfg['baseline_threads']))} threads. "
                 f"The gateways run with the default card I/O deadline ({cfg['io_timeout_ms']} ms): 8 restores "
                 f"queued on one card wait their turn while the card makes progress, so a slow pass stays a slow "
                 f"pass.")
    for p, r in placements.items():
        bad = [i for i, c in enumerate(r["gateway_cards"]) if c.get("timeouts") or c.get("errors") or c.get("misses")]
        if bad:
            notes.append(f"{p}: the gateway counted timeouts, errors or misses on card(s) {bad}: see gateway_cards.")
    return notes


def _print_cards_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cfg, places = result["config"], result["placements"]
    n, nr = cfg["cards"], cfg["restores"]

    def gib(side: dict[str, Any], note: str = "") -> str:
        return f"{_gib_s(side['best_gib_s'])}\n[dim]{note}med {side['median_gib_s']:.2f}[/]"

    def spread(counts: list[int]) -> str:
        return f"{sum(1 for c in counts if c)} of {len(counts)}\n[dim]{'/'.join(map(str, counts))}[/]"

    t = Table(title=f"kvgate bench --cards {n}{' --quick' if cfg['quick'] else ''}: restores of "
                    f"{cfg['blocks']} x {_fmt_size(cfg['object_size'])} dialogs; best pass, ratio = kvgate / baseline")
    for col, just in (("placement", "left"), ("figure", "left"), ("kvgate", "right"), ("baseline", "right"),
                      ("ratio", "right"), ("cards read\n[dim]blocks/card[/]", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    labels = {"single_warm": "1 restore, warm", "single_cold": "1 restore, cold",
              "concurrent_warm": f"{nr} restores, warm", "concurrent_cold": f"{nr} restores, cold"}
    for p, r in places.items():
        for i, name in enumerate(CARDS_FIGURES):
            f = r["figures"][name]
            where = spread(r["single_blocks_per_card"] if name.startswith("single") else r["concurrent_blocks_per_card"])
            if f is None:
                t.add_row(p if i == 0 else "", labels[name], "[yellow]skipped[/]", "-", "-", where)
                continue
            b = f["baseline"]
            t.add_row(p if i == 0 else "", labels[name], gib(f["kvgate"]),
                      gib(b, f"{_base_label(b, 'preadv')} x{b['threads']}, "),
                      f"{f['ratio']:.2f}", where, end_section=i == len(CARDS_FIGURES) - 1)
    con.print(t)
    passes = [str(r["figures"][name]["kvgate"]["passes"]) if r["figures"][name] else "0"
              for r in places.values() for name in CARDS_FIGURES]
    con.print(f"machine: {cfg['cores']} cores; {n} directory cards, {cfg['slots']} slots; a dialog is "
              f"{cfg['blocks']} x {_fmt_size(cfg['object_size'])} = {_fmt_size(cfg['dialog_bytes'])}, one get_many "
              f"into registered shm; {nr} restores = {nr} client threads and connections, one dialog each; "
              f"gateway --thread-pool-size {cfg['threads']}; passes {'/'.join(passes)}; {result['elapsed_s']:.1f} s")
    for p, r in places.items():
        con.print(f"{p}: the single dialog's blocks are on {r['cards_used']} of {n} cards "
                  f"({'/'.join(map(str, r['single_blocks_per_card']))}); the {nr} dialogs touch each card "
                  f"{'/'.join(map(str, r['concurrent_dialogs_per_card']))} times")
    cmp = result.get("stripe_vs_dialog")
    if cmp:
        parts = [f"{labels[k]} x{v['kvgate']:.2f} (ratio x{v['ratio']:.2f})" for k, v in cmp.items()]
        con.print("stripe / dialog: kvgate's best pass (the two placements ran one after the other, so this "
                  "carries the machine's drift) and, in brackets, of the ratios to each one's own baseline (the "
                  "fairer comparison): " + "; ".join(parts))
    for note in result["notes"]:
        con.print(f"[dim]{note}[/]")
    for name, why in result["skipped"].items():
        con.print(f"[yellow]{name} skipped:[/] {why}")


def _bars(figures: dict[str, Any]) -> dict[str, bool]:
    return {
        "ram_get": figures["ram_get"]["ratio"] >= BAR_RAM_GET_RATIO,
        "card_get_warm": figures["card_get_warm"]["ratio"] >= BAR_CARD_GET_WARM_RATIO,
        "lookup_p50": figures["lookup"]["p50_ms"] <= BAR_LOOKUP_P50_MS,
    }


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cfg, figs, bars = result["config"], result["figures"], result["bars"]

    def bar(ok: bool, text: str) -> str:
        return f"[green]pass[/] {text}" if ok else f"[bold red]FAIL[/] {text}"

    def gib(side: dict[str, Any], note: str = "") -> str:
        return f"{_gib_s(side['best_gib_s'])}\n[dim]{note}med {side['median_gib_s']:.2f}[/]"

    short = {"ram_get": "copyto", "tcp_get": "socket", "card_get_warm": "preadv", "card_get_cold": "preadv",
             "card_put": "pwritev"}

    # Sized to fit 80 columns: the second line of a cell says what the baseline is, and the medians.
    t = Table(title=f"kvgate bench{' --quick' if cfg['quick'] else ''}: best pass, ratio = kvgate / baseline")
    t.add_column("figure")
    t.add_column("kvgate", justify="right")
    t.add_column("baseline", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("bar")
    rows = [("RAM get to shm", "ram_get", f">={BAR_RAM_GET_RATIO}"), ("RAM get over TCP", "tcp_get", None),
            ("card get, warm", "card_get_warm", f">={BAR_CARD_GET_WARM_RATIO}"),
            ("card get, cold", "card_get_cold", None), ("card put", "card_put", None)]
    for label, name, limit in rows:
        f = figs[name]
        if f is None:
            t.add_row(label, "[yellow]skipped[/]", "-", "-", "-")
            continue
        b = f["baseline"]
        t.add_row(label, gib(f["kvgate"]), gib(b, f"{_base_label(b, short[name])} x{b['threads']}, "), f"{f['ratio']:.2f}",
                  bar(bars[name], limit) if limit else "-")
    f = figs["lookup"]
    t.add_row(f"lookup {f['keys']} keys", f"p50 {f['p50_ms']:.2f} ms\n[dim]p99 {f['p99_ms']:.2f}\nbest {f['best_ms']:.2f}[/]",
              f"[dim]1 key: p50\n{f['one_key_p50_ms']:.2f} ms[/]", "-", bar(bars["lookup_p50"], f"<={BAR_LOOKUP_P50_MS:g}ms"))
    con.print(t)
    con.print(f"machine: {cfg['cores']} cores; {_fmt_size(cfg['object_size'])} objects x {cfg['batch']} = "
              f"{_fmt_size(cfg['pass_bytes'])} per pass; gateway and baseline threads {cfg['threads']}; "
              f"passes RAM/TCP/warm/cold/put {figs['ram_get']['kvgate']['passes']}/{figs['tcp_get']['kvgate']['passes']}/"
              f"{figs['card_get_warm']['kvgate']['passes']}/"
              f"{figs['card_get_cold']['kvgate']['passes'] if figs['card_get_cold'] else 0}/"
              f"{figs['card_put']['kvgate']['passes']}, {figs['lookup']['reps']} lookups; "
              f"{result['elapsed_s']:.1f} s")
    for name, why in result["skipped"].items():
        con.print(f"[yellow]{name} skipped:[/] {why}")


def _drive(make: Callable[[Callable[[str], None]], Bench], steps: list[str], quiet: bool) -> dict[str, Any] | int:
    """Run a bench with a progress bar on stderr; its measurements, or the exit status when it failed."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description:<26}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=quiet)
    task = progress.add_task("kvgate bench", total=len(steps) - 1)

    def step(name: str) -> None:
        progress.update(task, description=name, completed=steps.index(name))

    def on_sigterm(_sig: int, _frame: FrameType | None) -> None:
        raise _Terminated()

    # SIGTERM unwinds like Ctrl-C, so the gateways are stopped and the files removed.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    bench = make(step)
    try:
        with progress:
            try:
                measured = bench.run()
            finally:
                progress.update(task, description="stopping gateways")
                bench.close()
            progress.update(task, completed=len(steps) - 1)
    except (KeyboardInterrupt, _Terminated):
        print("kvgate bench: interrupted; gateways stopped", file=sys.stderr)
        return 130
    except (BenchError, OSError, RuntimeError) as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        for tail in bench.died:
            print(tail, file=sys.stderr)
        return 1
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return measured


def run_bench(args: argparse.Namespace) -> int:
    """Run every figure; 0 even when a bar fails (a measurement is not a test), 1 on errors, 2 on bad usage."""
    from kvgate.benchtrace import run_trace_bench, wants_trace

    if wants_trace(args):
        return run_trace_bench(args)
    if getattr(args, "cards", None) is not None:
        return run_cards_bench(args)
    if getattr(args, "placement", None) is not None:
        print("kvgate bench: --placement needs --cards N", file=sys.stderr)
        return 2
    plan = Plan.from_args(args)
    parent = args.dir or os.path.join(".", "var", "bench")
    started = time.monotonic()
    steps = ["starting gateways", "RAM-tier get", "RAM-tier get over TCP", "card get (warm)", "card get (cold)", "card put",
             "lookup",
             "stopping gateways"]
    measured = _drive(lambda step: Bench(plan, parent, step), steps, args.json)
    if isinstance(measured, int):
        return measured

    result: dict[str, Any] = {
        "config": {
            "object_size": plan.object_size, "batch": plan.batch, "pass_bytes": plan.pass_bytes,
            "threads": plan.threads, "quick": plan.quick, "cores": os.cpu_count(), "dir": os.path.abspath(parent),
            "budget_s": plan.budget_s, "min_rounds": plan.min_rounds, "max_rounds": plan.max_rounds,
            "cold_rounds": plan.cold_rounds, "lookup_reps": plan.lookup_reps, "python": sys.version.split()[0],
        },
        **measured,
        "bar_limits": {"ram_get_ratio_min": BAR_RAM_GET_RATIO, "card_get_warm_ratio_min": BAR_CARD_GET_WARM_RATIO,
                       "lookup_p50_ms_max": BAR_LOOKUP_P50_MS},
        "elapsed_s": time.monotonic() - started,
    }
    result["bars"] = _bars(result["figures"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def run_cards_bench(args: argparse.Namespace) -> int:
    """``--cards N``: long restores under each placement, against raw reads of the same files."""
    plan = Plan.from_args(args)
    parent = args.dir or os.path.join(".", "var", "bench")
    placements = _placements(args.placement)
    started = time.monotonic()
    nr = args.restores
    steps = ["starting gateways",
             *[f"{p}: {what}" for p in placements for what in ("writing", "single restore warm", "single restore cold",
                                                                f"{nr} restores warm", f"{nr} restores cold")],
             "stopping gateways"]
    made: list[CardsBench] = []

    def make(step: Callable[[str], None]) -> CardsBench:
        made.append(CardsBench(plan, parent, step, cards=args.cards, placements=placements, blocks=args.blocks,
                               restores=nr))
        return made[0]

    measured = _drive(make, steps, args.json)
    if isinstance(measured, int):
        return measured
    bench = made[0]
    filesystems = max(r["card_filesystems"] for r in measured["placements"].values())
    result: dict[str, Any] = {
        "mode": "cards",
        "config": {
            "cards": args.cards, "placements": placements, "slots": bench.slots, "object_size": plan.object_size,
            "blocks": args.blocks, "dialog_bytes": bench.dialog_bytes, "restores": nr,
            "concurrent_bytes": bench.dialog_bytes * nr, "threads": plan.threads,
            "baseline_threads": bench._thread_counts, "io_timeout_ms": Config().io_timeout_ms, "quick": plan.quick,
            "cores": os.cpu_count(),
            "dir": os.path.abspath(parent), "cards_share_one_filesystem": filesystems == 1,
            "card_filesystems": filesystems, "budget_s": plan.budget_s, "min_rounds": plan.min_rounds,
            "max_rounds": plan.max_rounds, "cold_rounds": plan.cold_rounds, "python": sys.version.split()[0],
        },
        **measured,
        "elapsed_s": time.monotonic() - started,
    }
    result["stripe_vs_dialog"] = _cards_comparison(result["placements"])
    result["notes"] = _cards_notes(result["config"], result["placements"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_cards_table(result)
    return 0


__all__ = ["BenchError", "add_arguments", "run_bench", "run_cards_bench"]
