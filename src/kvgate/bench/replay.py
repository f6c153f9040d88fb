"""``kvgate bench --trace FILE``: a request trace replayed against real gateways, one per policy and capacity.

Per request the replay does what an engine does:

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
all blocks, and of what an infinite cache would restore; the restore rate
of the get_many calls; and how the conversations and bytes spread over the
cards.  It also runs the policy per card in process (``trace.simulate``)
with the gateway's own marks and card map (the "model"), which the
gateway's figure should match when the RAM tier is off: a gap is a finding.

Capacities are payload bytes, as a share of the replayed requests' distinct
blocks times ``--block-size`` (or absolute sizes), split evenly over the
cards.  Each card holds that many blocks: the gateway's ``--card-capacity``
adds the on-card header of every object (padded to 4 KiB for direct reads).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvgate.bench import BenchError
from kvgate.bench.harness import READY_S, ShmRegion, bench_gateway, stop_gateways
from kvgate.bench.measure import GIB, fmt_size
from kvgate.bench.processes import GatewayProcess
from kvgate.bench.trace import (
    DEFAULT_BLOCK_SIZE,
    NAMESPACE,
    TraceRequest,
    block_key,
    expected_payload,
    simulate,
    verify_blocks,
)
from kvgate.cards.objectformat import padded_object_size
from kvgate.client import Client
from kvgate.config import Config, parse_size
from kvgate.keys import DialogMark, dialog_digest, encode_namespace, full_key, key_digest
from kvgate.placement import SlotMap, slot_of
from kvgate.tiers.referee import EXPERTS
from kvgate.tiers.sampled_ids import card_policy

DEFAULT_POLICIES = ("adaptive", "prefix", "lru")
DEFAULT_CAPACITIES = ("5%", "10%", "20%")
DEFAULT_CARDS = 4

# Flags that only mean something with --trace: their defaults are None (or False), so a stray one is an error.
TRACE_ONLY = ("shared_head", "policies", "capacity", "block_size", "ram", "speedup", "requests", "in_process")


# ---- what a run is asked ------------------------------------------------------------------


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


@dataclass(frozen=True)
class TraceOptions:
    """The flags of one ``--trace`` run, checked, with their defaults filled in."""

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


def _stored_bytes(ns: bytes, keys: Sequence[bytes], block_size: int) -> int:
    """What one block costs on a directory card (padded header + payload), for the longest of ``keys``."""
    return padded_object_size(full_key(ns, max(keys, key=len)), block_size)


def plan_runs(opts: TraceOptions, requests: list[TraceRequest], unique: int) -> list[Run]:
    """A run per (capacity, policy), sized; ``BenchError`` when a capacity is less than a block per card."""
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
            raise BenchError(f"--capacity {cap.spec}: {fmt_size(total)}{over} is less than one block of "
                             f"{fmt_size(opts.block_size)}{' per card' if over else ''}; raise it"
                             f"{' or lower --cards' if over else ''}")
        for p in opts.policies:
            runs.append(Run(p, cap, total, per_card, per_card * per_object))
    return runs


class TraceBench:
    """The gateways, client and region of one ``--trace`` run; ``close`` undoes it all.

    Driven as ``Bench`` is, from the command's thread: ``run`` replays the
    trace against each run's gateway in turn, one request at a time, and
    blocks until the last is done.
    """

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
            r.gateway = bench_gateway(
                f"{i}-{r.policy}", self.workdir, self.sockdir, max_bytes=o.ram, threads=o.threads,
                card_capacity=r.card_capacity, cards=o.cards,
                extra=["--eviction-policy", r.policy, "--key-placement", "dialog", "--shared-memory-size", "1M"])
        for r in self.runs:  # all at once: their imports overlap
            assert r.gateway is not None
            r.gateway.spawn()
        size = -(-self.max_len * o.block_size // 4096) * 4096
        self.region = ShmRegion(size)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except OSError:
                pass
            self.client = None
        errors = stop_gateways([r.gateway for r in self.runs if r.gateway is not None], self.died)
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
        g.wait_ready(READY_S)
        c = self.client = Client.connect(g.socket, namespace=NAMESPACE, engine_id=f"kvgate-bench-{os.getpid()}",
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
                                               "hits", "misses", "errors", "timeouts", "prefix_order_evictions",
                                               "recency_order_evictions")}
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
        model = simulate(self.requests, marks, card_policy(run.policy), [run.blocks_per_card] * o.cards,
                         card_of=card_of, block_size=o.block_size)
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
            "orders": {order: sum(cd.get(f"{order}_order_evictions", 0) for cd in cards) for order in EXPERTS},
            "ram_hits": stats["tiers"]["ram"]["hits"],
            "corrupt_objects": stats["corrupt_objects"], "io_errors": stats["io_errors"],
            "io_timeouts": stats["io_timeouts"],
        }
