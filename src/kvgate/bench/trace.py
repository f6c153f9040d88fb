"""A request trace and the eviction policies replayed on it in process: the figures of ``--trace`` without gateways.

A throughput figure says how fast a restore runs; how often there is
something to restore depends on what the cards still hold when a request
comes back, which is the eviction policy's job.  A Mooncake-format trace
is one JSON object per line: ``timestamp`` in ms, optional;
``input_length``; ``output_length``; ``hash_ids``, prefix block ids of 512
tokens each, equal ids at equal positions being a reusable prefix.  What an
infinite cache would restore comes from the trace alone: a block counts when
it and every block before it in its request appeared in an earlier request.

The same hit rates as a replay against gateways (``kvgate.bench.replay``)
come without any gateway from ``replay_policies``, which drives the eviction
policies of ``kvgate.tiers.eviction`` in this process with the marks a fresh
gateway gives (``trace_marks``: its own ``SharedHeads``), one pool of the
whole capacity (``--in-process``): the quick way to compare policies.
``simulate`` runs the same per card, with a card map (the replay's "model").

A block's payload is a function of its id (``expected_payload``), so every
byte a replay reads back is checked (``verify_blocks``).  Everything here is
plain computation on the caller's thread.
"""

from __future__ import annotations

import inspect
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterable, Sequence

import numpy as np

from kvgate.bench import BenchError
from kvgate.heads import SharedHeads
from kvgate.keys import DialogMark, dialog_digest, encode_namespace, full_key
from kvgate.tiers.eviction import LONG, EvictionPolicy
from kvgate.tiers.policies import make_policy
from kvgate.tiers.sampled_ids import SAMPLED_POLICIES, make_sampled_policies, make_sampled_policy

NAMESPACE = "kvgate-bench-trace"
BLOCK_TOKENS = 512  # tokens per hash id in Mooncake traces (not used in any figure; for the record)
DEFAULT_BLOCK_SIZE = 16 << 10


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


# ---- generated traces: the shapes that tell eviction orders apart ---------------------------

def _fresh_ids(start: int) -> Callable[[int], list[int]]:
    nxt = [start]

    def fresh(k: int) -> list[int]:
        out = list(range(nxt[0], nxt[0] + k))
        nxt[0] += k
        return out
    return fresh


def two_turns(n: int = 12_000, seed: int = 1) -> list[TraceRequest]:
    """Chat traffic where a conversation comes back once, soon, and never again: behind a one-block system
    prompt, a first prompt of 2-8 blocks; half the conversations ask one follow-up (the first prompt and
    1-3 blocks more) 20-600 requests later.  The shape of a production conversation trace (1.5 requests a
    conversation); the prefix order keeps the dead second turns, marked used again, over first turns still
    waiting for theirs."""
    rng = random.Random(seed)
    fresh = _fresh_ids(1)
    head = [0]
    due: dict[int, list[list[int]]] = {}
    out: list[TraceRequest] = []
    i = 0
    while len(out) < n:
        for first in due.pop(i, []):
            out.append(TraceRequest(tuple(head + first + fresh(rng.randint(1, 3)))))
        first = fresh(rng.randint(2, 8))
        out.append(TraceRequest(tuple(head + first)))
        if rng.random() < 0.5:
            due.setdefault(i + rng.randint(20, 600), []).append(first)
        i += 1
    return out[:n]


def in_order(conversations: int = 200, turns: int = 12) -> list[TraceRequest]:
    """Long conversations that come back in order: round robin, each turn the whole history and 2 new blocks
    (a cyclic reuse pattern, the worst case for LRU; no randomness: the order is the point)."""
    history: list[list[int]] = [[] for _ in range(conversations)]
    fresh = _fresh_ids(0)
    out: list[TraceRequest] = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] = history[c] + fresh(2)
            out.append(TraceRequest(tuple(history[c])))
    return out


def scan(n: int = 4_000, hot: int = 100, seed: int = 3) -> list[TraceRequest]:
    """A hot set of 100 conversations of 6 blocks, read again and again (30 % of requests, each with one new
    block), through a scan of one-off prompts of 3-8 blocks."""
    rng = random.Random(seed)
    fresh = _fresh_ids(0)
    hots = [fresh(6) for _ in range(hot)]
    out: list[TraceRequest] = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(TraceRequest(tuple(rng.choice(hots) + fresh(1))))
        else:
            out.append(TraceRequest(tuple(fresh(rng.randint(3, 8)))))
    return out


def hot_head(n: int = 4_000, head: int = 8, seed: int = 4) -> list[TraceRequest]:
    """Every prompt behind one long shared head (8 blocks); 30 % of requests continue one of the last 200
    conversations by a block, the rest start a new one of 2-5 blocks."""
    rng = random.Random(seed)
    fresh = _fresh_ids(head)
    shared = list(range(head))
    conversations: list[list[int]] = []
    out: list[TraceRequest] = []
    for _ in range(n):
        if conversations and rng.random() < 0.3:
            c = rng.choice(conversations[-200:])
            c += fresh(1)
        else:
            c = fresh(rng.randint(2, 5))
            conversations.append(c)
        out.append(TraceRequest(tuple(shared + c)))
    return out


GENERATED: Final[dict[str, Callable[[], list[TraceRequest]]]] = {
    "two-turns": two_turns, "in-order": in_order, "scan": scan, "hot-head": hot_head}
GENERATED_PREFIX: Final = "gen:"


def trace_by_name(name: str, limit: int | None = None) -> list[TraceRequest]:
    """A trace file, or a generated trace by name (``gen:two-turns``; see ``GENERATED``)."""
    if name.startswith(GENERATED_PREFIX):
        make = GENERATED.get(name.removeprefix(GENERATED_PREFIX))
        if make is None:
            raise TraceError(f"--trace {name}: no such generated trace; choose one of "
                             f"{', '.join(GENERATED_PREFIX + g for g in GENERATED)}")
        return make()[:limit]
    return load_trace(name, limit)


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


def replay_policy(name: str) -> EvictionPolicy:
    """A policy by name: the RAM tier's (``adaptive``, ``prefix``, ``lru``) or a card's (``sampled-adaptive``,
    ``sampled-prefix``, ``sampled-lru``)."""
    return make_sampled_policy(name) if name in SAMPLED_POLICIES else make_policy(name)


def policies_per_card(name: str, cards: int) -> list[EvictionPolicy]:
    """``cards`` policies by name, as a gateway's cards run them (one referee for all under
    ``sampled-adaptive``); the RAM tier's policies each on their own."""
    if name in SAMPLED_POLICIES:
        return list(make_sampled_policies(name, cards))
    return [make_policy(name) for _ in range(cards)]


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
    orders: dict[str, int] = field(default_factory=dict)  # evictions chosen under each order (adaptive only)

    @property
    def share(self) -> float:
        return self.restored / self.total if self.total else 0.0


def simulate(requests: Iterable[Any], marks: Sequence[DialogMark], policy_name: str, capacities: Sequence[int], *,
             card_of: Callable[[int, bytes | None], int] | None = None, block_size: int = DEFAULT_BLOCK_SIZE
             ) -> Simulated:
    """One policy per card, each holding at most ``capacities[card]`` blocks, driven as the gateway's
    card index drives it (``policy_name``: see ``replay_policy``).

    Per request: the leading blocks held on any card are restored and
    touched; the blocks missing from the first miss on are added at their
    positions, each with its dialog (``DialogMark.dialog_at``), on the card
    ``card_of(block id, dialog)`` chooses (card 0 if None), the last of
    each put run with ``tail=True`` where the policy takes it; then each
    card evicts while it holds more than its capacity.
    """
    policies = policies_per_card(policy_name, len(capacities))
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
    orders: dict[str, int] = {}
    for p in policies:
        for order, n in p.evictions_by_order().items():
            orders[order] = orders.get(order, 0) + n
    return Simulated(restored, total, [len(p) for p in policies], orders)


def replay_policies(requests: Iterable[Any], capacity_blocks: int, policy_names: Iterable[str]) -> dict[str, float]:
    """Share of all blocks each policy restores with one pool of ``capacity_blocks`` blocks, in process.

    ``requests``: ``TraceRequest``s or lists of block ids (a shared head
    already in front, see ``with_shared_head``).  Marks are the ones a
    gateway gives (``trace_marks``).  No gateway, no cards: the policies alone.
    """
    reqs = _ids_of(requests)
    marks = trace_marks(reqs)
    return {name: simulate(reqs, marks, name, [capacity_blocks]).share for name in policy_names}

