"""Checks every card kind must pass the same way."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import redis

from kvgate.bench.processes import free_port
from kvgate.cards import Card
from kvgate.keys import full_key, key_digest
from tests.processes import RedisServer


def key(i: int | str, ns: bytes = b"tenant") -> bytes:
    return full_key(ns, f"block-{i}".encode())


def payload_for(k: bytes, size: int) -> np.ndarray:
    """Bytes that depend on key and size, so a swapped or torn object shows."""
    seed = int.from_bytes(key_digest(k)[:8], "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def check_snapshot_round_trip(card: Card, objects: int) -> None:
    """The index snapshot is replaced whole or not at all, and is no object (``objects`` are on the card)."""
    assert card.read_snapshot() is None
    w = card.snapshot_writer()
    w.write(b"an index ")
    w.write(memoryview(b"snapshot"))
    assert card.read_snapshot() is None, "not visible before its commit"
    w.commit()
    assert card.read_snapshot() == b"an index snapshot"
    w = card.snapshot_writer()
    w.write(b"half of a second one")
    w.abort()
    assert card.read_snapshot() == b"an index snapshot"
    assert len(list(card.scan())) == objects, "the snapshot is no object"
    card.drop_snapshot()
    assert card.read_snapshot() is None


def start_redis_cluster(root: Path, primaries: int = 3) -> list[RedisServer]:
    """A Redis Cluster of ``primaries`` primaries (no replicas) on loopback ports, up and serving every slot;
    the caller kills the nodes."""
    nodes = []
    try:
        for i in range(primaries):
            nodes.append(RedisServer(root / f"n{i}", policy="noeviction", extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--cluster-port", str(free_port())]).start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        for n in nodes:
            r = redis.Redis(port=n.port)
            while r.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                assert time.monotonic() < deadline, "the Redis Cluster did not come up"
                time.sleep(0.1)
            r.close()
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    return nodes
