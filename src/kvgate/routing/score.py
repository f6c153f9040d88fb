"""Scoring endpoints for one prompt: how much of it each can restore, at what cost, and how loaded it is.

The cost of sending a prompt of ``n`` blocks to an endpoint, in units of "one block's prefill"::

    cost = prefill + gpu * tier_costs["gpu"] + cpu * tier_costs["cpu"] + storage * tier_costs["storage"]
           + running * load_costs["running"] + waiting * load_costs["waiting"]
           + prefill_ahead * load_costs["prefill_ahead"]

- ``prefill = n - matched``: the blocks the endpoint must compute.  ``matched`` is the longest prefix of
  the prompt's blocks the endpoint can get from ANY of its tiers (the first block held by none of them
  stops it: vLLM reuses only a prefix, each block's hash depends on all before it).
- Each matched position is credited to the best tier that holds it: the engine's GPU (``gpu``), then RAM
  (``cpu``: the engine's own CPU offload, or its gateway's RAM tier), then storage (``storage``: any card
  its gateway mounts, and with the router's ``peer_pulls`` what the other gateways hold, which it pulls).
  A restored block is not free: it is copied back (RAM) or read from a card.
  Defaults (``DEFAULT_TIER_COSTS``): gpu 0, cpu 0.1, storage 0.25 of recomputing the block, rough ratios of
  a block's copy/read time to its prefill time on a mid-size model; set them from measurements
  (``kvgate bench`` gives the restore side).
- The load term: each request running on the endpoint costs ``load_costs["running"]`` blocks (default 4:
  decode steps it shares the batch with), each waiting one ``load_costs["waiting"]`` (default 32: the
  prefill queued ahead of us).  With these, an idle endpoint that must compute 32 more blocks than a busy
  one is chosen over the busy one when the busy one has a queued request: the knobs set that trade-off.
  ``prefill_ahead``: the blocks still to compute of the requests this router sent the endpoint that have
  not answered their first token yet (default 1 per block: a prefill ahead of ours in the engine's batch
  delays our first token by about its own compute).  The engine's metrics say how many requests run, not
  how much prefill they still do; the router knows that of its own requests, and a prompt sent where its
  KV is but behind another's long prefill can wait longer than it would to restore it elsewhere
  (``make bench-fleet``: docs/router.md, "A fleet, measured").

Why this shape: it is the time-to-first-token a request would see, in prefill-block units, with the
restore and queueing terms linear (they are, to first order).  Lower is better; ``best`` picks the lowest
cost (ties: most matched blocks, then the first endpoint in the caller's order).

Offloaded chunks: a source that publishes one key per chunk of ``f`` blocks (``KvIndex.set_factor``) holds
a block where it holds the key of the block's chunk (the chunk's last block's hash).

Speed: ``score`` looks each prompt block up once (one dict lookup gives every source and tier), cuts
the prompt at the first block nobody holds, and folds consecutive blocks with the same holders into runs
(a fleet's holdings are prefixes: 2048 blocks over 64 endpoints made 126 runs); numpy then works on a
(runs x endpoints) matrix per tier.  ``kvgate bench --route`` (32K tokens, 64 endpoints, 8 shared cards,
1.3 M index entries) on the 2-core build machine, shared with other work: p50 0.42 ms, p99 0.76 ms
(bar 1 ms); the lookups are ~0.13 ms of it, the run fold ~0.1 ms, the 64 ``Score`` objects ~0.09 ms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgate.errors import InvalidArgument
from kvgate.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from kvgate.routing.index import KvIndex, card_source

__all__ = ["DEFAULT_TIER_COSTS", "DEFAULT_LOAD_COSTS", "Endpoint", "Score", "Scorer", "best", "check_costs"]

DEFAULT_TIER_COSTS: dict[str, float] = {"gpu": 0.0, "cpu": 0.1, "storage": 0.25}
DEFAULT_LOAD_COSTS: dict[str, float] = {"running": 4.0, "waiting": 32.0, "prefill_ahead": 1.0}


@dataclass
class Endpoint:
    """One place a request can go.  ``engine``: the index source id of its engine's own events (None: it
    publishes none); ``gateway``: the source id of its gateway's events (None: no gateway); ``cards``: card
    serials it can read besides those its gateway publishes (``KvIndex.mounts``); ``peers``: source ids of
    other gateways its gateway pulls from (their RAM tiers and cards count as its storage: a pull costs
    about what a card read does); ``running`` /
    ``waiting``: its engine's current requests (from its metrics); ``prefill_ahead``: prompt blocks still to
    compute of requests sent to it that have not answered their first token."""

    name: str
    engine: str | None = None
    gateway: str | None = None
    cards: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    running: int = 0
    waiting: int = 0
    prefill_ahead: int = 0


@dataclass(slots=True)
class Score:
    """One endpoint's figures for one prompt: matched blocks per tier (a block counted once, in its best
    tier), ``prefill`` blocks left to compute, the load, and the ``cost`` (module docstring)."""

    endpoint: str
    gpu: int
    cpu: int
    storage: int
    prefill: int
    running: int
    waiting: int
    cost: float
    blocks: int = field(default=0)

    @property
    def matched(self) -> int:
        return self.gpu + self.cpu + self.storage


def best(scores: Sequence[Score]) -> Score:
    """The cache-aware choice: lowest cost, then most matched blocks, then the earliest in ``scores``."""
    if not scores:
        raise InvalidArgument("best: no endpoint to choose from")
    return min(enumerate(scores), key=lambda p: (p[1].cost, -p[1].matched, p[0]))[1]


def check_costs(given: Mapping[str, float] | None, defaults: dict[str, float], what: str) -> dict[str, float]:
    out = dict(defaults)
    for k, v in (given or {}).items():
        if k not in defaults:
            raise InvalidArgument(f"{what}: unknown key {k!r}; the keys are {', '.join(defaults)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise InvalidArgument(f"{what}[{k!r}] must be a number >= 0, got {v!r}")
        out[k] = float(v)
    return out


def _bit_matrix(masks: list[int], nbits: int) -> np.ndarray:
    """(len(masks), more than nbits) bool matrix: row i is True in column j where bit j of masks[i] is set;
    column ``nbits`` is always False (the column of "no such source")."""
    nbytes = (nbits + 1 + 7) // 8
    raw = b"".join(m.to_bytes(nbytes, "little") for m in masks)
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(len(masks), nbytes)
    return np.unpackbits(arr, axis=1, bitorder="little").view(bool)


class _Columns:
    """Per tier, the bit columns of every endpoint, padded to the same count ``k`` with the always-clear
    column: a tier's (runs x endpoints) matrix is one gather (and, for k > 1, an OR over the last axis).
    No BLAS matmul: its threads were measured to add 8 ms tails on a busy 2-core machine; ``reduceat``
    was 3x slower than this."""

    def __init__(self, per_endpoint: list[list[int]], none: int) -> None:
        self.k = max(1, max((len(b) for b in per_endpoint), default=1))
        self.flat = np.array([x for bits in per_endpoint for x in bits + [none] * (self.k - len(bits))],
                             dtype=np.intp)
        self.E = len(per_endpoint)

    def held(self, B: np.ndarray) -> np.ndarray:
        got = B[:, self.flat]
        if self.k == 1:
            return got
        return got.reshape(B.shape[0], self.E, self.k).any(axis=2)


class Scorer:
    """Scores endpoints against a ``KvIndex``.  ``tier_costs`` / ``load_costs``: overrides of
    ``DEFAULT_TIER_COSTS`` / ``DEFAULT_LOAD_COSTS`` (InvalidArgument for an unknown key or a negative)."""

    first_slice = 256  # runs in the first slice (see ``score``)

    def __init__(self, index: KvIndex, tier_costs: Mapping[str, float] | None = None,
                 load_costs: Mapping[str, float] | None = None) -> None:
        self.index = index
        self.tier_costs = check_costs(tier_costs, DEFAULT_TIER_COSTS, "tier_costs")
        self.load_costs = check_costs(load_costs, DEFAULT_LOAD_COSTS, "load_costs")
        self._cols_key: Any = None
        self._cols: tuple[_Columns, _Columns, _Columns] | None = None

    def _columns(self, endpoints: Sequence[Endpoint]) -> tuple[_Columns, _Columns, _Columns]:
        """Each endpoint's GPU, CPU and storage bits; cached until the endpoints or the index's layout change
        (rebuilding costs ~100 us for 64 endpoints)."""
        index = self.index
        key = (index.layout_version, tuple((ep.engine, ep.gateway, ep.cards, ep.peers) for ep in endpoints))
        if key == self._cols_key and self._cols is not None:
            return self._cols
        g: list[list[int]] = []
        c: list[list[int]] = []
        st: list[list[int]] = []
        for ep in endpoints:
            g.append([b for b in (index.bit_of(MEDIUM_GPU, ep.engine),) if b is not None])
            c.append([b for b in (index.bit_of(MEDIUM_CPU, ep.engine), index.bit_of(MEDIUM_CPU, ep.gateway))
                      if b is not None])
            serials = set(ep.cards) | (index.mounts(ep.gateway) if ep.gateway is not None else set())
            pulled = [index.bit_of(MEDIUM_CPU, p) for p in ep.peers if p != ep.gateway]
            for p in ep.peers:
                serials |= index.mounts(p)
            st.append(sorted({b for b in (*(index.bit_of(MEDIUM_STORAGE, card_source(x)) for x in serials), *pulled)
                              if b is not None}))
        none = index.width
        self._cols_key, self._cols = key, (_Columns(g, none), _Columns(c, none), _Columns(st, none))
        return self._cols

    def score(self, keys: Sequence[bytes | int], endpoints: Sequence[Endpoint]) -> list[Score]:
        """One ``Score`` per endpoint, in order, for a prompt whose block hashes are ``keys``
        (``BlockHasher.keys(tokens)``, or its ``hashes``: bytes are turned into keys here)."""
        index = self.index
        n = len(keys)
        if keys and not isinstance(keys[0], int):
            keys = [int.from_bytes(k[-8:], "big") for k in keys]  # type: ignore[index]
        E = len(endpoints)
        masks = index.holder_masks(keys) if E else []
        if E and index._factors:
            masks = self._chunked(masks, keys)
        # Runs of positions with the same holders: a prompt's holdings are prefixes, so a 2048-block prompt
        # over 64 endpoints has ~200 runs, not 2048 positions; the first position nobody holds ends the span.
        run_masks: list[int] = []
        run_starts: list[int] = []
        prev = -1
        span = 0
        for m in masks:
            if not m:
                break
            if m != prev:
                run_masks.append(m)
                run_starts.append(span)
                prev = m
            span += 1
        if not run_masks:
            return [self._make(ep, 0, 0, 0, n) for ep in endpoints]
        cols_g, cols_c, cols_s = self._columns(endpoints)
        starts = np.array(run_starts + [span], dtype=np.int64)
        # Runs in growing slices: once every endpoint has a gap inside the slice, the rest cannot count.
        # Holdings full of holes (every block its own run) stop in the first slice (measured side by side: 1.7 ms
        # for 2048 runs in one go, 0.5 ms with slices); long shared prefixes have few runs anyway.
        R = len(run_masks)
        limit = self.first_slice
        while True:
            limit = min(limit, R)
            B = _bit_matrix(run_masks[:limit], index.width)  # (runs x bits)
            g_held = cols_g.held(B)  # (runs x endpoints)
            c_held = cols_c.held(B)
            any_held = g_held | c_held | cols_s.held(B)
            held_all = any_held.all(axis=0)
            if limit == R or not held_all.any():
                break
            limit *= 4
        lengths = np.diff(starts[:limit + 1])
        # the matched prefix per endpoint ends at its first run none of its tiers holds
        gap_run = np.where(held_all, limit, np.argmin(any_held, axis=0))
        R = limit
        ends = np.concatenate(([0], np.cumsum(lengths)))
        matched = ends[gap_run]
        in_prefix = np.arange(R)[:, None] < gap_run[None, :]
        gpu = np.einsum("i,ij->j", lengths, (g_held & in_prefix).view(np.uint8))
        cpu = np.einsum("i,ij->j", lengths, (c_held & ~g_held & in_prefix).view(np.uint8))
        out = []
        for j, ep in enumerate(endpoints):
            gj, cj = int(gpu[j]), int(cpu[j])
            out.append(self._make(ep, gj, cj, int(matched[j]) - gj - cj, n))
        return out

    def _chunked(self, masks: list[int], keys: Sequence[int]) -> list[int]:
        """``masks`` with each chunked pair's bit (``KvIndex.set_factor``) read at the end of the position's
        chunk: a chunk key held means every block of the chunk is; the last partial chunk is never held."""
        for f, fmask in self.index.factor_masks().items():
            ends = self.index.holder_masks(keys[f - 1::f])  # chunk c ends at block c*f + f - 1
            keep = ~fmask
            out = []
            for i, m in enumerate(masks):
                c = i // f
                out.append((m & keep) | (ends[c] & fmask if c < len(ends) else 0))
            masks = out
        return masks

    def _make(self, ep: Endpoint, gpu: int, cpu: int, storage: int, n: int) -> Score:
        t, load = self.tier_costs, self.load_costs
        prefill = n - gpu - cpu - storage
        cost = (prefill + gpu * t["gpu"] + cpu * t["cpu"] + storage * t["storage"]
                + ep.running * load["running"] + ep.waiting * load["waiting"]
                + ep.prefill_ahead * load["prefill_ahead"])
        return Score(ep.name, gpu, cpu, storage, prefill, ep.running, ep.waiting, cost, n)
