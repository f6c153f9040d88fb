"""Helpers of the fault-injection suite: card labels, workloads, timed calls.

Every byte a test writes derives from its key, so every hit can be compared
with what it must be; every client call is timed, so a request that blocks
past ``io_timeout_ms`` (plus slack) is caught.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import xxhash

from kvgate.cards.base import new_label, parse_label
from kvgate.cards.directory.layout import LABEL_NAME
from kvgate.cards.redis.keys import LABEL_KEY
from kvgate.keys import NO_DIALOG, dialog_digest
from kvgate.placement import SlotMap, slot_of
from tests.processes import RedisServer


# ---- labels -------------------------------------------------------------------------


def label_directory(path: str | os.PathLike, serial: str) -> None:
    """Make ``path`` a directory card with a chosen serial (before any gateway opens it)."""
    os.makedirs(path, exist_ok=True)
    Path(path, LABEL_NAME).write_bytes(new_label(serial))


def label_redis(server: RedisServer, serial: str) -> None:
    """Make ``server`` a Redis card with a chosen serial (before any gateway opens it)."""
    with server.raw() as r:
        r.set(LABEL_KEY, new_label(serial))


def redis_label(server: RedisServer) -> str | None:
    """The serial of the Redis card ``server`` holds; None when it holds no label."""
    with server.raw() as r:
        raw = r.get(LABEL_KEY)
    return parse_label(raw, server.url) if raw is not None else None


def balanced_serials(names: Sequence[str], slots: int, low: int, high: int, tag: str) -> dict[str, str]:
    """Deterministic serials whose rendezvous map gives every card between ``low`` and ``high`` slots.

    Real serials are random; fixed ones make every run place every dialog on
    the same card, so a test can assert how many dialogs a fault costs.
    """
    for seed in range(100_000):
        serials = [f"{tag}-{name}-{seed}" for name in names]
        m = SlotMap(serials, slots)
        if all(low <= len(m.slots_of(s)) <= high for s in serials):
            return dict(zip(names, serials))
    raise AssertionError("no balanced serials found")


def serial_of_dialog(slot_map: SlotMap, mark: bytes) -> str:
    """The card (serial) that dialog placement puts every block of dialog ``mark`` on."""
    d = dialog_digest(mark)
    assert d != NO_DIALOG
    return slot_map.serial_of_slot(slot_of(bytes(16), d, "dialog", slot_map.slots))


# ---- workloads ----------------------------------------------------------------------


class Workload:
    """``n`` dialogs of ``blocks`` blocks of ``size`` bytes, all derived from ``tag``.

    Keys are unique per (tag, dialog, block); each block's bytes derive from
    its key, so a hit is checked byte for byte.
    """

    def __init__(self, tag: str, n: int, blocks: int = 4, size: int = 64 << 10):
        self.tag = tag
        self.n = n
        self.blocks = blocks
        self.size = size
        self._cache: dict[bytes, bytes] = {}

    def mark(self, d: int) -> bytes:
        return f"{self.tag}/dialog-{d}".encode()

    def keys(self, d: int) -> list[bytes]:
        return [f"{self.tag}/d{d}/b{b}".encode() for b in range(self.blocks)]

    def block(self, key: bytes) -> bytes:
        data = self._cache.get(key)
        if data is None:
            seed = xxhash.xxh64_intdigest(key)
            data = self._cache[key] = np.random.default_rng(seed).bytes(self.size)
        return data

    def blocks_of(self, d: int) -> list[bytes]:
        return [self.block(k) for k in self.keys(d)]


class Calls:
    """Runs client calls and remembers the slowest."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.count = 0
        self.worst = (0.0, "")

    def run(self, what: str, fn: Callable, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.monotonic() - t0
            self.count += 1
            if dt > self.worst[0]:
                self.worst = (dt, what)

    def check(self) -> None:
        dt, what = self.worst
        print(f"slowest of {self.count} calls: {dt * 1000:.0f} ms ({what})")
        assert dt < self.limit_s, (f"a request blocked for {dt * 1000:.0f} ms ({what}); the limit is "
                                   f"io_timeout_ms plus slack = {self.limit_s * 1000:.0f} ms")


def write(client, wl: Workload, dialogs: Sequence[int], calls: Calls) -> dict[int, list[bool]]:
    """put_many each dialog (one request per dialog, with its dialog mark); per dialog, stored per block."""
    out = {}
    for d in dialogs:
        out[d] = calls.run(f"put_many {wl.mark(d)!r}", client.put_many, wl.keys(d), wl.blocks_of(d),
                           dialog=wl.mark(d), position=0)
        assert len(out[d]) == wl.blocks
    return out


class WrongBytes(AssertionError):
    pass


def restore(client, wl: Workload, dialogs: Sequence[int], calls: Calls,
            lookup: bool = True) -> dict[int, tuple[list[bool], int]]:
    """lookup + get_many each dialog; every hit is compared with its bytes.

    Returns per dialog (hit per block, lookup count or -1).
    """
    out = {}
    for d in dialogs:
        keys, mark = wl.keys(d), wl.mark(d)
        n = calls.run(f"lookup {mark!r}", client.lookup, keys, dialog=mark) if lookup else -1
        bufs = [bytearray(wl.size) for _ in keys]
        got = calls.run(f"get_many {mark!r}", client.get_many, keys, into=bufs, dialog=mark)
        hits = []
        for k, g in zip(keys, got):
            if g is None:
                hits.append(False)
                continue
            if len(g) != wl.size or bytes(g) != wl.block(k):
                raise WrongBytes(f"WRONG BYTES returned for {k!r}: {len(g)} bytes, "
                                 f"{'same length, different content' if len(g) == wl.size else 'wrong length'}")
            hits.append(True)
        out[d] = (hits, n)
    return out

