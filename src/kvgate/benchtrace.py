"""`kvgate bench --trace FILE`: prefix-cache hit rates of a real request trace, per eviction policy.

A throughput figure says how fast a restore runs; how often there is
something to restore depends on what the cards still hold when a request
comes back, which is the eviction policy's job.  This replays a
Mooncake-format trace (one JSON object per line: ``timestamp`` in ms,
optional; ``input_length``; ``output_length``; ``hash_ids``, prefix block ids
of 512 tokens each, equal ids at equal positions being a reusable prefix)
against real ``kvgate serve`` processes, one per (policy, capacity), and
does per request what an engine does:

1. ``dialog_mark(keys)``: the conversation's mark, and how many leading
   keys are shared heads (a system prompt in front of every conversation),
   cut into segments that have marks of their own;
2. ``lookup`` of the leading blocks present, each run of keys with its own
   mark (``DialogMark.spans``), stopping at the first miss;
3. ``get_many`` of those blocks into a registered /dev/shm region, every
   byte checked against what was written (a block's payload is a function
   of its id, so a wrong byte fails the bench);
4. ``put_many`` of the blocks missing (``exists_many``) from the first miss
   on, at their positions in the request, split by the marks as in 2.

What it reports per policy and capacity: the restored blocks as a share of
all blocks, and of what an infinite cache would restore (computed from the
trace alone: a block counts when it and every block before it in its request
appeared in an earlier request); the restore rate of the get_many calls;
and how the conversations and bytes spread over the cards.

The same hit rates come without any gateway from ``replay_policies``, which
drives the eviction policies of ``kvgate.tiers.eviction`` in this process
with the marks a fresh gateway gives (``trace_marks``: its own
``SharedHeads``), one pool of the whole capacity (``--in-process``): the
quick way to compare policies.  With a gateway the bench also runs that
simulation per card with the gateway's own marks and card map (the
"model"), which the gateway's figure should match when the RAM tier is off:
a gap is a finding.

Capacities are payload bytes, as a share of the replayed requests' distinct
blocks times ``--block-size`` (or absolute sizes), split evenly over the
cards.  Each card holds that many blocks: the gateway's ``--card-capacity``
adds the on-card header of every object (padded to 4 KiB for direct reads).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvgate.bench import BenchError, GatewayProcess, ShmRegion, _drive, _fmt_size, int_arg, size_arg
from kvgate.cards.objectformat import header_size, padded_size
from kvgate.client import Client
from kvgate.config import Config, parse_size
from kvgate.heads import SharedHeads
from kvgate.keys import DialogMark, dialog_digest, encode_namespace, full_key, key_digest
from kvgate.placement import SlotMap, slot_of
from kvgate.tiers.eviction import LONG, POLICIES, make_policy

NAMESPACE = "kvgate-bench-trace"
BLOCK_TOKENS = 512  # tokens per hash id in Mooncake traces (not used in any figure; for the record)
DEFAULT_POLICIES = ("prefix", "lru")
DEFAULT_CAPACITIES = ("5%", "10%", "20%")
DEFAULT_CARDS = 4
DEFAULT_BLOCK_SIZE = 16 << 10
MAX_BLOCK_SIZE = 16 << 20
GIB = float(1 << 30)

# Flags that only mean something with --trace: their defaults are None (or False), so a stray one is an error.
TRACE_ONLY = ("shared_head", "policies", "capacity", "block_size", "ram", "speedup", "requests", "plot", "in_process")


# ---- command line -----------------------------------------------------------------


_non_negative_int = int_arg(0)
_count_arg = int_arg(1)
_block_size_arg = size_arg(1, MAX_BLOCK_SIZE, " a block; a replay moves every block of the trace")
_ram_arg = size_arg(0)


def _speedup_arg(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value!r}")
    return x


def _policies_arg(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",")]
    for n in names:
        if n not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown eviction policy {n!r} in {value!r}; choose from "
                                             f"{', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r} names a policy twice")
    return names


@dataclass(frozen=True)
class Capacity:
    """One ``--capacity`` entry: a share of the distinct blocks' bytes, or a size in bytes (over all cards)."""

    spec: str
    share: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "Capacity":
        s = spec.strip()
        if s.endswith("%"):
            try:
                pct = float(s[:-1])
            except ValueError:
                raise ValueError(f"{spec!r} is not a percentage (like 5%)") from None
            if not math.isfinite(pct) or pct <= 0:
                raise ValueError(f"{spec!r}: a share must be above 0%")
            return cls(s, share=pct / 100)
        try:
            n = parse_size(s)
        except ValueError:
            raise ValueError(f"{spec!r} is neither a share of the trace (5%) nor a size (64M)") from None
        if n < 1:
            raise ValueError(f"{spec!r}: a size must be at least 1 byte")
        return cls(s, nbytes=n)

    def total_bytes(self, unique_blocks: int, block_size: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        assert self.share is not None
        return int(self.share * unique_blocks * block_size)


def _capacities_arg(value: str) -> list[Capacity]:
    try:
        caps = [Capacity.parse(v) for v in value.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len({c.spec for c in caps}) != len(caps):
        raise argparse.ArgumentTypeError(f"{value!r} names a capacity twice")
    return caps


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "trace replay", "with --trace: prefix-cache hit rates of a Mooncake-format trace replayed against real "
                        "gateways, one per policy and capacity, instead of the figures above (--cards N sets "
                        "the cards of each; --dir, --threads and --json apply)")
    g.add_argument("--trace", metavar="FILE",
                   help="JSON lines of {timestamp (ms, optional), input_length, output_length, hash_ids}, e.g. "
                        "benchmarks/data/mooncake-synthetic-trace.jsonl")
    g.add_argument("--shared-head", type=_non_negative_int, metavar="N",
                   help="prepend N synthetic block ids, the same for every request (one system prompt in front of "
                        "every conversation) (default 0)")
    g.add_argument("--policies", type=_policies_arg, metavar="P,P",
                   help=f"the gateway's --eviction-policy values to compare (default {','.join(DEFAULT_POLICIES)})")
    caps = ",".join(DEFAULT_CAPACITIES).replace("%", "%%")  # argparse formats help with %
    g.add_argument("--capacity", type=_capacities_arg, metavar="C,C",
                   help="cache size over all cards, split evenly: shares of the replayed requests' distinct blocks x "
                        f"--block-size (5%%), or sizes (64M) (default {caps})")
    g.add_argument("--block-size", type=_block_size_arg, metavar="SIZE",
                   help="bytes stored per block: small, so a replay is quick (default 16K)")
    g.add_argument("--ram", type=_ram_arg, metavar="SIZE",
                   help="the gateway's RAM tier (--max-bytes) (default 0: the figures are about the cards)")
    g.add_argument("--speedup", type=_speedup_arg, metavar="X",
                   help="honour the timestamps divided by X (default: no waiting, as fast as possible)")
    g.add_argument("--requests", type=_count_arg, metavar="N", help="replay only the first N requests")
    g.add_argument("--plot", metavar="FILE.png",
                   help="hit rate vs capacity, one line per policy (needs matplotlib: pip install 'kvgate[plot]')")
    g.add_argument("--in-process", action="store_true", default=None,
                   help="no gateway: drive the eviction policies in this process (fast; one pool of the whole "
                        "capacity, no cards)")


def wants_trace(args: argparse.Namespace) -> bool:
    """Whether the command line asks for the trace replay (or names one of its flags)."""
    return getattr(args, "trace", None) is not None or any(getattr(args, n, None) is not None for n in TRACE_ONLY)


@dataclass(frozen=True)
class TraceOptions:
    trace: str
    shared_head: int
    policies: list[str]
    capacities: list[Capacity]
    cards: int
    block_size: int
    ram: int
    speedup: float | None
    requests: int | None
    plot: str | None
    in_process: bool
    threads: int
    parent_dir: str
    json: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TraceOptions":
        """Checked options; ``BenchError`` naming the flag when they do not go together."""
        if args.trace is None:
            given = [n for n in TRACE_ONLY if getattr(args, n, None) is not None]
            raise BenchError(f"--{given[0].replace('_', '-')} needs --trace FILE")
        if getattr(args, "quick", False):
            raise BenchError("--quick is for the throughput figures, not --trace")
        if getattr(args, "placement", None) is not None:
            raise BenchError("--placement is for --cards without --trace; the trace replay uses dialog placement")
        if args.plot is not None and not args.plot.lower().endswith(".png"):
            raise BenchError(f"--plot {args.plot!r}: the plot is a PNG file; name it FILE.png")
        if args.in_process and args.ram is not None:
            raise BenchError("--ram is the gateway's RAM tier; --in-process runs no gateway")
        if args.in_process and args.speedup is not None:
            raise BenchError("--speedup paces requests to a gateway; --in-process runs no gateway")
        return cls(
            trace=args.trace,
            shared_head=args.shared_head or 0,
            policies=args.policies or list(DEFAULT_POLICIES),
            capacities=args.capacity or [Capacity.parse(c) for c in DEFAULT_CAPACITIES],
            cards=args.cards or DEFAULT_CARDS,
            block_size=args.block_size or DEFAULT_BLOCK_SIZE,
            ram=args.ram or 0,
            speedup=args.speedup,
            requests=args.requests,
            plot=args.plot,
            in_process=bool(args.in_process),
            threads=args.threads,
            parent_dir=args.dir or os.path.join(".", "var", "bench"),
            json=args.json,
        )


# ---- the trace --------------------------------------------------------------------


class TraceError(BenchError):
    """The trace file cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class TraceRequest:
    ids: tuple[int, ...]  # prefix block ids, in order
    timestamp_ms: float | None = None


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a Mooncake-format trace (all by default), checked line by line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"--trace {path}: {e.strerror or e}") from None
    out: list[TraceRequest] = []
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not ids:
                raise TraceError(f"{where}: hash_ids must be a non-empty list of block ids")
            if not all(type(i) is int and i >= 0 for i in ids):
                bad = next(i for i in ids if not (type(i) is int and i >= 0))
                raise TraceError(f"{where}: hash_ids must be integers >= 0, found {bad!r}")
            ts = obj.get("timestamp")
            if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts)):
                raise TraceError(f"{where}: timestamp must be a number of ms, got {ts!r}")
            out.append(TraceRequest(tuple(ids), None if ts is None else float(ts)))
    if not out:
        raise TraceError(f"--trace {path}: no requests in the file")
    return out


def with_shared_head(requests: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """Every request with the same ``n`` synthetic block ids in front (ids above any in the trace)."""
    if n == 0:
        return list(requests)
    top = max(max(r.ids) for r in requests)
    head = tuple(range(top + 1, top + 1 + n))
    return [TraceRequest(head + r.ids, r.timestamp_ms) for r in requests]


def block_key(block_id: int) -> bytes:
    return b"blk-%d" % block_id


def _ids_of(requests: Iterable[Any]) -> list[Sequence[int]]:
    return [getattr(r, "ids", r) for r in requests]


def unique_blocks(requests: Iterable[Any]) -> int:
    seen: set[int] = set()
    for ids in _ids_of(requests):
        seen.update(ids)
    return len(seen)


def infinite_cache(requests: Iterable[Any]) -> tuple[int, int]:
    """(restorable blocks, all blocks) with a cache that never evicts: a block counts when it and every
    block before it in its request appeared in an earlier request."""
    seen: set[int] = set()
    hits = total = 0
    for ids in _ids_of(requests):
        n = 0
        for b in ids:
            if b not in seen:
                break
            n += 1
        hits += n
        total += len(ids)
        seen.update(ids)
    return hits, total


# ---- payloads: a function of the block id, so every byte read back can be checked -----------

_MUL = np.uint64(0x9E3779B97F4A7C15)
_SEED = 0xD6E8FEB86659FD93
_MASK = (1 << 64) - 1


def expected_payload(ids: Sequence[int], block_size: int) -> np.ndarray:
    """The payloads of ``ids``, one after the other (``len(ids) * block_size`` bytes): a mix of the id and
    the offset, so a block with another block's bytes, or shifted ones, differs."""
    words = -(-block_size // 8)
    seeds = np.array([((i + 1) * _SEED) & _MASK for i in ids], dtype=np.uint64)
    a = np.arange(words, dtype=np.uint64)[None, :] + seeds[:, None]
    a *= _MUL
    a ^= a >> np.uint64(29)
    raw = a.view(np.uint8).reshape(len(ids), words * 8)
    return (raw if words * 8 == block_size else raw[:, :block_size]).reshape(-1)


def verify_blocks(got: np.ndarray, ids: Sequence[int], block_size: int, want: np.ndarray | None = None) -> None:
    """``BenchError`` naming the block and byte unless ``got`` holds exactly the payloads of ``ids``."""
    if want is None:
        want = expected_payload(ids, block_size)
    want = want[: len(ids) * block_size]
    if got.size != want.size:
        raise BenchError(f"restored {got.size} bytes for {len(ids)} blocks of {block_size}: expected {want.size}")
    if np.array_equal(got, want):
        return
    bad = int(np.argmax(got != want))
    i, off = divmod(bad, block_size)
    raise BenchError(f"block {ids[i]} ({block_key(ids[i]).decode()}, position {i}) came back wrong: byte {off} "
                     f"is {int(got[bad]):#04x}, {int(want[bad]):#04x} was stored")


# ---- in-process replay: the policies alone --------------------------------------------

def trace_marks(requests: Iterable[Any], namespace: str = NAMESPACE) -> list[DialogMark]:
    """Each request's ``DialogMark`` as a fresh gateway answers ``dialog_mark``, computed here: the same
    ``SharedHeads`` learns the shared heads from the prompts in order; the mark is the first key past them,
    and each segment of the head is marked by its first key."""
    heads = SharedHeads()
    ns = encode_namespace(namespace)
    out: list[DialogMark] = []
    for ids in _ids_of(requests):
        keys = [block_key(b) for b in ids]
        shared, starts = heads.shared_prefix([full_key(ns, k) for k in keys])
        out.append(DialogMark(keys[shared] if shared < len(keys) else None, shared, [(p, keys[p]) for p in starts]))
    return out


def _accepts_tail(policy: Any) -> bool:
    """Whether ``policy.add`` takes ``tail=`` (the last block of its put batch), as newer policies do."""
    try:
        params = inspect.signature(policy.add).parameters
    except (TypeError, ValueError):
        return False
    return "tail" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@dataclass
class Simulated:
    restored: int  # blocks restored (leading blocks present)
    total: int  # blocks asked for
    resident: list[int]  # blocks held per card at the end

    @property
    def share(self) -> float:
        return self.restored / self.total if self.total else 0.0


def simulate(requests: Iterable[Any], marks: Sequence[DialogMark], policy_name: str, capacities: Sequence[int], *,
             card_of: Callable[[int, bytes | None], int] | None = None, block_size: int = DEFAULT_BLOCK_SIZE
             ) -> Simulated:
    """One policy per card, each holding at most ``capacities[card]`` blocks, driven as the gateway's
    card index drives it.

    Per request: the leading blocks held on any card are restored and
    touched; the blocks missing from the first miss on are added at their
    positions, each with its dialog (``DialogMark.dialog_at``), on the card
    ``card_of(block id, dialog)`` chooses (card 0 if None), the last of
    each put run with ``tail=True`` where the policy takes it; then each
    card evicts while it holds more than its capacity.
    """
    policies = [make_policy(policy_name) for _ in capacities]
    tail = _accepts_tail(policies[0])
    where: dict[int, int] = {}  # block id -> card
    restored = total = 0
    for ids, dm in zip(_ids_of(requests), marks, strict=True):
        total += len(ids)
        n = 0
        for b in ids:
            if b not in where:
                break
            n += 1
        restored += n
        for b in ids[:n]:
            policies[where[b]].touch(b)
        touched: set[int] = set()
        run: list[tuple[int, int, bytes | None]] = []  # (position, id, mark) of one put run
        pending: set[int] = set()  # ids in ``run`` (an id twice in one request is stored once)

        def flush() -> None:
            for j, (pos, b, m) in enumerate(run):
                c = card_of(b, m) if card_of is not None else 0
                kw = {"tail": j == len(run) - 1} if tail else {}
                policies[c].add(b, block_size, dialog_digest(m), pos, LONG, **kw)
                where[b] = c
                touched.add(c)
            run.clear()
            pending.clear()

        for i in range(n, len(ids)):
            b = ids[i]
            m = dm.dialog_at(i)
            if b in where or b in pending or (run and (run[-1][0] != i - 1 or run[-1][2] != m)):
                flush()  # a present block or a change of dialog ends a put
            if b not in where:
                run.append((i, b, m))
                pending.add(b)
        flush()
        for c in touched:
            p = policies[c]
            while len(p) > capacities[c]:
                victim = p.choose_victim()
                if victim is None:
                    break
                p.remove(victim)
                del where[victim]
    return Simulated(restored, total, [len(p) for p in policies])


def replay_policies(requests: Iterable[Any], capacity_blocks: int, policy_names: Iterable[str]) -> dict[str, float]:
    """Share of all blocks each policy restores with one pool of ``capacity_blocks`` blocks, in process.

    ``requests``: ``TraceRequest``s or lists of block ids (a shared head
    already in front, see ``with_shared_head``).  Marks are the ones a
    gateway gives (``trace_marks``).  No gateway, no cards: the policies alone.
    """
    reqs = _ids_of(requests)
    marks = trace_marks(reqs)
    return {name: simulate(reqs, marks, name, [capacity_blocks]).share for name in policy_names}


# ---- the replay against real gateways ----------------------------------------------------


@dataclass
class Run:
    """One (policy, capacity): its sizes, and what the replay measured."""

    policy: str
    capacity: Capacity
    total_bytes: int  # payload bytes over all cards, asked
    blocks_per_card: int
    card_capacity: int  # the gateway's --card-capacity: blocks_per_card objects with their headers
    gateway: GatewayProcess | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.policy} {self.capacity.spec}"


class TraceBench:
    """The gateways, client and region of one ``--trace`` run; ``close`` undoes it all (as ``Bench``)."""

    def __init__(self, opts: TraceOptions, requests: list[TraceRequest], marks: list[DialogMark], runs: list[Run],
                 progress: Callable[[str], None]):
        self.opts = opts
        self.requests = requests
        self.runs = runs
        self.progress = progress
        self.workdir = ""
        self.sockdir = ""
        self.died: list[str] = []
        self.region: ShmRegion | None = None
        self.client: Client | None = None
        self.ns = encode_namespace(NAMESPACE)
        self.max_len = max(len(r.ids) for r in requests)
        self.expected_marks = marks  # what a fresh gateway should answer (trace_marks), for the record

    def start(self) -> None:
        o = self.opts
        os.makedirs(o.parent_dir, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="kvgate-bench-trace-", dir=o.parent_dir)
        self.sockdir = tempfile.mkdtemp(prefix="kvgate-bench-")  # socket paths must stay short
        need = max(r.card_capacity for r in self.runs) * o.cards
        free = shutil.disk_usage(self.workdir).free
        if free < need + (64 << 20):  # one run's cards at a time: each run's are removed after it
            raise BenchError(f"{self.workdir}: {free >> 20} MiB free, the largest capacity needs {need >> 20} MiB "
                             "(lower --capacity or --block-size)")
        for i, r in enumerate(self.runs):
            r.gateway = GatewayProcess(
                f"{i}-{r.policy}", self.workdir, self.sockdir, max_bytes=o.ram, threads=o.threads,
                card_capacity=r.card_capacity, cards=o.cards,
                extra=["--eviction-policy", r.policy, "--key-placement", "dialog", "--shared-memory-size", "1M"])
        for r in self.runs:  # all at once: their imports overlap
            assert r.gateway is not None
            r.gateway.start()
        size = -(-self.max_len * o.block_size // 4096) * 4096
        self.region = ShmRegion(size)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except OSError:
                pass
            self.client = None
        errors = []
        for r in self.runs:
            g = r.gateway
            if g is None:
                continue
            if g.proc is not None and g.proc.poll() is not None:
                self.died.append(f"gateway {g.name} had exited with status {g.proc.returncode}:\n{g.log_tail()}")
            try:
                g.stop()
            except Exception as e:  # noqa: BLE001 - stop the others anyway
                errors.append(e)
        if self.region is not None:
            self.region.close()
            self.region = None
        for d in (self.workdir, self.sockdir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        if errors:
            raise errors[0]

    def run(self) -> dict[str, Any]:
        self.progress("starting gateways")
        self.start()
        for r in self.runs:
            self.progress(r.label)
            try:
                r.measured = self._replay(r)
            except BenchError as e:
                raise BenchError(f"{r.label}: {e}") from None
        self.progress("stopping gateways")
        return {}

    def _replay(self, run: Run) -> dict[str, Any]:
        o = self.opts
        g, region = run.gateway, self.region
        assert g is not None and region is not None
        g.wait_ready()
        c = self.client = Client.connect(g.socket_path, namespace=NAMESPACE, engine_id=f"kvgate-bench-{os.getpid()}",
                                         want_shm=False, timeout=120)
        c.register_region(region.path, region.mm)
        bs = o.block_size
        bufs = region.slices(bs, self.max_len)  # position i of a request: bufs[i]
        arr = region.array
        marks: list[DialogMark] = []
        restored = total = puts_refused = 0
        get_bytes, get_s = 0, 0.0
        started = time.monotonic()
        t0_ms = next((r.timestamp_ms for r in self.requests if r.timestamp_ms is not None), 0.0)
        for req in self.requests:
            if o.speedup is not None and req.timestamp_ms is not None:
                wait = started + (req.timestamp_ms - t0_ms) / 1000 / o.speedup - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            ids = req.ids
            keys = [block_key(b) for b in ids]
            dm = c.dialog_mark(keys)
            marks.append(dm)
            n = 0
            for s, e, d in dm.spans(0, len(keys)):  # leading blocks present, each run of keys with its dialog
                found = c.lookup(keys[s:e], dialog=d)
                n += found
                if found < e - s:
                    break
            want = expected_payload(ids, bs)
            if n:
                arr[: n * bs] = 0  # a block the gateway failed to write must not pass for the last request's bytes
                t = time.perf_counter()
                for s, e, d in dm.spans(0, n):
                    got = c.get_many(keys[s:e], into=bufs[s:e], dialog=d)
                    for i, v in enumerate(got, s):
                        if v is None or len(v) != bs:
                            raise BenchError(f"block {ids[i]} (position {i}) was found by lookup, but get_many "
                                             f"returned {'a miss' if v is None else f'{len(v)} bytes'}")
                get_s += time.perf_counter() - t
                get_bytes += n * bs
                verify_blocks(arr[: n * bs], ids[:n], bs, want)
            restored += n
            total += len(ids)
            if n == len(keys):
                continue
            # The blocks from the first miss on that are missing, put in runs of consecutive positions.
            arr[n * bs : len(ids) * bs] = want[n * bs :]
            for s, e, d in dm.spans(n, len(keys) - n):
                s, e = s + n, e + n
                present = c.exists_many(keys[s:e], dialog=d)
                i = s
                while i < e:
                    if present[i - s]:
                        i += 1
                        continue
                    j = i
                    while j < e and not present[j - s]:
                        j += 1
                    stored = c.put_many(keys[i:j], bufs[i:j], dialog=d, position=i)
                    puts_refused += stored.count(False)
                    i = j
        elapsed = time.monotonic() - started
        stats = c.stats()
        c.close()
        self.client = None
        g.stop()
        for d in g.card_dirs:  # the next run's capacity gets the disk
            shutil.rmtree(d, ignore_errors=True)
        return self._figures(run, marks, stats, restored=restored, total=total, puts_refused=puts_refused,
                             get_bytes=get_bytes, get_s=get_s, elapsed=elapsed)

    def _figures(self, run: Run, marks: list[DialogMark], stats: dict[str, Any], **m: Any) -> dict[str, Any]:
        o = self.opts
        g = run.gateway
        assert g is not None
        index = {os.path.abspath(d): i for i, d in enumerate(g.card_dirs)}
        cards: list[dict[str, Any]] = [{} for _ in g.card_dirs]
        for st in stats["cards"]:
            i = index.get(os.path.abspath(st["location"]))
            if i is not None:
                cards[i] = {k: st[k] for k in ("serial", "objects", "used_bytes", "capacity_bytes", "evictions",
                                               "hits", "misses", "errors", "timeouts")}
        serials = [cd.get("serial") for cd in cards]
        if not all(serials):
            raise BenchError(f"the gateway's stats name {sum(map(bool, serials))} of {o.cards} cards")
        # Which card holds each conversation.  The gateway does not say where a mark lives, so it is computed
        # the way the gateway computes it: the slot of the mark's digest under dialog placement, over a SlotMap
        # of the card serials its stats report, with the default storage_slots it runs with (a key sent with no
        # dialog goes by its own key).  Conversations are the distinct marks past the shared heads; the heads'
        # segments have marks too and are placed the same way, but are not counted as conversations.  The model
        # below runs every block through this same map, and its blocks per card matching the objects per card
        # the gateway reports is what checks it.
        slot_map = SlotMap(serials, Config().storage_slots)
        card_index = {s: i for i, s in enumerate(serials)}

        def card_of(block_id: int, mark: bytes | None) -> int:
            kd = b"" if mark is not None else key_digest(full_key(self.ns, block_key(block_id)))
            slot = slot_of(kd, dialog_digest(mark), "dialog", slot_map.slots)
            return card_index[slot_map.serial_of_slot(slot)]

        convs = [0] * o.cards
        for mark in {dm.mark for dm in marks if dm.mark is not None}:
            convs[card_of(0, mark)] += 1
        model = simulate(self.requests, marks, run.policy, [run.blocks_per_card] * o.cards, card_of=card_of,
                         block_size=o.block_size)
        used = sum(cd["used_bytes"] for cd in cards)
        n_convs = sum(convs)
        for cd, nconv, resident in zip(cards, convs, model.resident):
            cd["conversations"] = nconv
            cd["conversations_share"] = nconv / n_convs if n_convs else 0.0
            cd["bytes_share"] = cd["used_bytes"] / used if used else 0.0
            cd["model_objects"] = resident
        return {
            "restored_blocks": m["restored"], "blocks": m["total"],
            "marks_as_in_process": sum(a == b for a, b in zip(marks, self.expected_marks)),
            "puts_refused": m["puts_refused"],
            "restore_bytes": m["get_bytes"], "restore_s": m["get_s"],
            "restore_gib_s": m["get_bytes"] / m["get_s"] / GIB if m["get_s"] > 0 else None,
            "replay_s": m["elapsed"],
            "conversations": n_convs,
            "requests": len(marks),
            "cards": cards,
            "model": {"restored_blocks": model.restored, "share_of_all": model.share,
                      "objects_per_card": model.resident},
            "ram_hits": stats["tiers"]["ram"]["hits"],
            "corrupt_objects": stats["corrupt_objects"], "io_errors": stats["io_errors"],
            "io_timeouts": stats["io_timeouts"],
        }


# ---- running, reporting ------------------------------------------------------------------


def _stored_bytes(ns: bytes, keys: Sequence[bytes], block_size: int) -> int:
    """What one block costs on a directory card (padded header + payload), for the longest of ``keys``."""
    return padded_size(header_size(full_key(ns, max(keys, key=len)))) + block_size


def _plan_runs(opts: TraceOptions, requests: list[TraceRequest], unique: int) -> list[Run]:
    ns = encode_namespace(NAMESPACE)
    longest = max((b for r in requests for b in r.ids), default=0)
    per_object = _stored_bytes(ns, [block_key(longest)], opts.block_size)
    cards = 1 if opts.in_process else opts.cards  # in process: one pool
    runs = []
    for cap in opts.capacities:
        total = cap.total_bytes(unique, opts.block_size)
        per_card = total // cards // opts.block_size
        if per_card < 1:
            over = f" over {cards} cards" if cards > 1 else ""
            raise BenchError(f"--capacity {cap.spec}: {_fmt_size(total)}{over} is less than one block of "
                             f"{_fmt_size(opts.block_size)}{' per card' if over else ''}; raise it"
                             f"{' or lower --cards' if over else ''}")
        for p in opts.policies:
            runs.append(Run(p, cap, total, per_card, per_card * per_object))
    return runs


def _figure_row(restored: int, total: int, infinite: int) -> dict[str, Any]:
    return {"restored_blocks": restored, "share_of_all": restored / total if total else 0.0,
            "share_of_infinite": restored / infinite if infinite else None}


def run_trace_bench(args: argparse.Namespace) -> int:
    """``--trace FILE``: 0 when the replay ran, 1 when it failed, 2 on bad usage."""
    try:
        opts = TraceOptions.from_args(args)
        if opts.plot is not None:
            _check_matplotlib()
        requests = with_shared_head(load_trace(opts.trace, opts.requests), opts.shared_head)
    except BenchError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    unique = unique_blocks(requests)
    inf_hits, blocks = infinite_cache(requests)
    try:
        runs = _plan_runs(opts, requests, unique)
    except BenchError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    # The policies alone, one pool of the whole capacity: cheap, so always there beside the gateway's figure.
    marks = trace_marks(requests)
    cards = 1 if opts.in_process else opts.cards
    in_process = {(r.policy, r.capacity.spec): simulate(requests, marks, r.policy, [r.blocks_per_card * cards],
                                                        block_size=opts.block_size)
                  for r in runs}
    if not opts.in_process:
        steps = ["starting gateways", *[r.label for r in runs], "stopping gateways"]
        measured = _drive(lambda step: TraceBench(opts, requests, marks, runs, step), steps, opts.json)
        if isinstance(measured, int):
            return measured
    rows = []
    for r in runs:
        sim = in_process[(r.policy, r.capacity.spec)]
        row: dict[str, Any] = {
            "policy": r.policy,
            "capacity": {"spec": r.capacity.spec, "asked_bytes": r.total_bytes,
                         "payload_bytes": r.blocks_per_card * cards * opts.block_size,
                         "share_of_distinct": r.blocks_per_card * cards / unique,
                         "blocks": r.blocks_per_card * cards,
                         "blocks_per_card": None if opts.in_process else r.blocks_per_card,
                         "card_capacity_bytes": None if opts.in_process else r.card_capacity},
            "in_process": _figure_row(sim.restored, sim.total, inf_hits),
        }
        if r.measured:
            row["gateway"] = {**_figure_row(r.measured["restored_blocks"], r.measured["blocks"], inf_hits),
                              **{k: v for k, v in r.measured.items() if k != "restored_blocks"}}
            mod = r.measured["model"]
            row["gateway"]["model"] = {**mod, **_figure_row(mod["restored_blocks"], blocks, inf_hits)}
        rows.append(row)
    result: dict[str, Any] = {
        "mode": "trace",
        "trace": {"path": opts.trace, "name": os.path.basename(opts.trace), "requests": len(requests),
                  "blocks": blocks, "distinct_blocks": unique, "shared_head": opts.shared_head,
                  "block_tokens": BLOCK_TOKENS, "infinite_cache": _figure_row(inf_hits, blocks, inf_hits)},
        "config": {"policies": opts.policies, "capacities": [c.spec for c in opts.capacities],
                   "cards": None if opts.in_process else opts.cards,
                   "slots": None if opts.in_process else Config().storage_slots,
                   "block_size": opts.block_size, "ram": None if opts.in_process else opts.ram,
                   "speedup": opts.speedup, "in_process": opts.in_process, "threads": opts.threads,
                   "cores": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": rows,
        "elapsed_s": time.monotonic() - started,
    }
    result["notes"] = _notes(result)
    if opts.plot is not None:
        try:
            _plot(result, opts.plot)
        except Exception as e:  # noqa: BLE001 - the figures are printed anyway
            print(f"kvgate bench: --plot {opts.plot}: {e}", file=sys.stderr)
            _report(result, opts.json)
            return 1
    _report(result, opts.json)
    return 0


MODEL_TOLERANCE = 0.01  # gateway vs model, in share of all blocks, before a note says they differ


def _notes(result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    notes = []
    if cfg["in_process"]:
        notes.append("In process: the eviction policies alone, one pool of the whole capacity (no cards, no "
                     "gateway), with the dialog marks a gateway gives (shared heads learned the same way).")
        return notes
    notes.append(f"Marks come from the gateway's dialog_mark; placement is dialog over {cfg['slots']} slots; "
                 f"RAM tier {_fmt_size(cfg['ram']) if cfg['ram'] else 'off'}. 'in process' is the same policy "
                 "with one pool of the whole capacity; 'model' is the policy per card with the gateway's marks and "
                 "card map.")
    if cfg["ram"]:
        notes.append("With a RAM tier, the reads it serves never reach the cards' policies and it holds blocks of "
                     "its own, so the model (cards only) need not match the gateway.")
    for row in result["runs"]:
        gw = row.get("gateway")
        if gw is None:
            continue
        gap = gw["share_of_all"] - gw["model"]["share_of_all"]
        if abs(gap) > MODEL_TOLERANCE and not cfg["ram"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway restored {gap:+.1%} of all blocks "
                         "against the model of its own cards.")
        if gw["marks_as_in_process"] != gw["requests"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway's dialog marks differ from the "
                         f"in-process ones for {gw['requests'] - gw['marks_as_in_process']} requests.")
        if gw["puts_refused"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: {gw['puts_refused']} blocks were not stored "
                         "(evicted by their own put: a request longer than a card).")
        if gw["corrupt_objects"] or gw["io_errors"] or gw["io_timeouts"]:
            notes.append(f"{row['policy']} {row['capacity']['spec']}: the gateway counted {gw['corrupt_objects']} "
                         f"corrupt objects, {gw['io_errors']} I/O errors, {gw['io_timeouts']} timeouts.")
    return notes


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    tr, cfg = result["trace"], result["config"]
    gateway = not cfg["in_process"]
    head = f" --shared-head {tr['shared_head']}" if tr["shared_head"] else ""
    t = Table(title=f"kvgate bench --trace {tr['name']}{head}{'' if gateway else ' --in-process'}")
    cols = ["policy", "capacity\n[dim]blocks[/]", "restored\n[dim]of infinite[/]"]
    if gateway:
        cols += ["in process\n[dim]model[/]", "restore\n[dim]GiB/s[/]", "dialogs\n[dim]per card[/]",
                 "bytes\n[dim]per card[/]"]
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in result["runs"]:
        cap = row["capacity"]
        cells = [row["policy"], f"{cap['spec']}\n[dim]{cap['blocks']:,}[/]"]
        gw = row.get("gateway")
        fig = gw if gw is not None else row["in_process"]
        cells.append(f"{_pct(fig['share_of_all'])}\n[dim]{_pct(fig['share_of_infinite'])}[/]")
        if gw is not None:
            def per(key: str) -> str:
                return "/".join(f"{100 * c[key]:.0f}" for c in gw["cards"])

            cells += [f"{_pct(row['in_process']['share_of_all'])}\n[dim]{_pct(gw['model']['share_of_all'])}[/]",
                      "-" if gw["restore_gib_s"] is None else f"{gw['restore_gib_s']:.2f}",
                      per("conversations_share"), per("bytes_share")]
        t.add_row(*cells)
    con.print(t)
    inf = tr["infinite_cache"]
    con.print(f"{tr['requests']:,} requests, {tr['blocks']:,} blocks ({tr['distinct_blocks']:,} distinct); an "
              f"infinite cache restores {inf['restored_blocks']:,} = {_pct(inf['share_of_all'])} of all blocks. "
              "'restored': leading blocks found, as a share of all blocks (below: of the infinite cache's); capacity "
              "over all cards, as a share of the distinct blocks" +
              (f"; {cfg['cards']} directory cards per gateway, one gateway per row, blocks of "
               f"{_fmt_size(cfg['block_size'])}; per card: shares in %; {result['elapsed_s']:.1f} s" if gateway
               else f"; {result['elapsed_s']:.1f} s"))
    for note in result["notes"]:
        con.print(f"[dim]{note}[/]")


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install 'kvgate[plot]'") from None


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = result["trace"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    source = "in_process" if result["config"]["in_process"] else "gateway"
    for policy in result["config"]["policies"]:
        rows = sorted((r for r in result["runs"] if r["policy"] == policy),
                      key=lambda r: r["capacity"]["share_of_distinct"])
        xs = [100 * r["capacity"]["share_of_distinct"] for r in rows]
        ys = [100 * r[source]["share_of_all"] for r in rows]
        ax.plot(xs, ys, marker="o", label=policy)
    ax.axhline(100 * tr["infinite_cache"]["share_of_all"], color="grey", linestyle="--", label="infinite cache")
    ax.set_xlabel("capacity, % of the distinct blocks")
    ax.set_ylabel("restored prefix blocks, % of all blocks")
    head = f", shared head {tr['shared_head']}" if tr["shared_head"] else ""
    ax.set_title(f"{tr['name']}{head} ({'in process' if source == 'in_process' else 'kvgate gateways'})")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["Capacity", "TraceRequest", "add_trace_arguments", "trace_marks", "expected_payload", "infinite_cache",
           "load_trace", "replay_policies", "run_trace_bench", "simulate", "verify_blocks", "wants_trace",
           "with_shared_head"]
