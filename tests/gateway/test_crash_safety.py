"""The crash bar: SIGKILL mid-stream loses nothing acknowledged and never returns wrong bytes.

A child process streams puts (retention long, 1 KiB..1 MiB objects whose
bytes derive from the key index) to a gateway; the gateway is SIGKILLed while
puts are in flight, and a new gateway is started on the same card.  Every key
ever sent reads back as a miss or as exactly its bytes, and every key whose
put was acknowledged before the kill is a hit (write-through: ack = on card).

A payload byte flipped on the card (gateway stopped) reads as a miss after a
restart: the object is deleted and counted in ``corrupt_objects``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import kvgate_env
from kvgate.cards import DirectoryCard
from kvgate.keys import encode_namespace, full_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

NAMESPACE = "crash-ns"


def payload(i: int) -> bytes:
    """Size (1 KiB..1 MiB) and bytes both derive from the key index."""
    rng = np.random.default_rng(i)
    size = int(rng.integers(1 << 10, (1 << 20) + 1))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return b"key-%d" % i


STREAMER = r"""
import sys
import numpy as np
from kvgate.client import Client

sock, n = sys.argv[1], int(sys.argv[2])

def payload(i):
    rng = np.random.default_rng(i)
    size = int(rng.integers(1 << 10, (1 << 20) + 1))
    return rng.integers(0, 256, size, dtype=np.uint8)

c = Client.connect(sock, namespace=sys.argv[3], engine_id="streamer", timeout=30)
print("CONNECTED", flush=True)
i = 0
while i < n:
    batch = list(range(i, min(n, i + 1 + i % 3)))  # batches of 1..3 keys
    bufs = [payload(j) for j in batch]
    print("SEND", *batch, flush=True)
    sys.stdin.readline()  # the test's go: it has seen this SEND (a reader lagging behind a pipe sees no later one)
    try:
        stored = c.put_many([b"key-%d" % j for j in batch], bufs, retention="long")
    except Exception as e:
        print("DEAD", type(e).__name__, flush=True)
        sys.exit(0)
    print("ACK", *[j for j, ok in zip(batch, stored) if ok], flush=True)
    print("NACK", *[j for j, ok in zip(batch, stored) if not ok], flush=True)
    i = batch[-1] + 1
print("DONE", flush=True)
"""


@pytest.mark.parametrize("acks_before_kill", [3, 24])
def test_sigkill_mid_stream_keeps_every_acknowledged_put(gateway_factory, acks_before_kill: int) -> None:
    gw = gateway_factory(["--max-bytes", "32M"], name="victim")
    total = 400
    child = subprocess.Popen([sys.executable, "-c", STREAMER, gw.socket, str(total), NAMESPACE], env=kvgate_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent: set[int] = set()
    acked: set[int] = set()
    nacked: set[int] = set()
    lines: list[str] = []
    killed_at = None
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        for line in child.stdout:
            lines.append(line.strip())
            word, *nums = line.split()
            ids = {int(x) for x in nums} if word in ("SEND", "ACK", "NACK") else set()
            if word == "SEND":
                sent |= ids
                assert child.stdin is not None
                try:  # go: the child sends this batch now, and no later one before we have seen its SEND
                    child.stdin.write("\n")
                    child.stdin.flush()
                except BrokenPipeError:
                    pass
                # kill while it is in flight
                if killed_at is None and len(acked) >= acks_before_kill:
                    gw.kill(signal.SIGKILL)
                    killed_at = max(ids)
            elif word == "ACK":
                assert killed_at is None or min(ids, default=-1) <= killed_at, "ack after the kill"
                acked |= ids
            elif word == "NACK":
                nacked |= ids
            assert time.monotonic() < deadline, "streaming took too long"
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = child.stderr.read() if child.stderr else ""
    assert killed_at is not None, f"stream ended before {acks_before_kill} acks: {lines[-5:]} {err}"
    assert lines[-1].startswith("DEAD"), f"the streamer should have seen the gateway die: {lines[-5:]} {err}"
    assert not nacked, f"the gateway refused puts: {sorted(nacked)}"
    assert len(acked) >= acks_before_kill and killed_at in sent
    assert not gw.alive()

    # the same card, the same socket path (a SIGKILLed gateway leaves its socket file behind)
    assert os.path.exists(gw.socket)
    gw2 = gateway_factory(["--max-bytes", "32M"], card=gw.card, socket_path=gw.socket, name="survivor")
    with gw2.client(NAMESPACE, engine_id="checker") as c:
        order = sorted(sent)
        got = c.get_many([key(i) for i in order])
        for i, data in zip(order, got):
            if data is not None:
                assert data == payload(i), f"key {i}: wrong bytes after the crash ({len(data)} bytes)"
            if i in acked:
                assert data is not None, f"key {i} was acknowledged before the kill but is gone"
        acked_order = sorted(acked)
        assert c.lookup([key(i) for i in acked_order]) == len(acked_order)
        stats = c.stats()
    assert stats["corrupt_objects"] == 0, "a torn write became a visible object"
    hits = sum(1 for d in got if d is not None)
    assert hits >= len(acked)
    assert "Traceback" not in gw2.log(), gw2.log()


def _object_file(card_dir: str, namespace: str, k: bytes) -> str:
    return DirectoryCard(card_dir).object_path(full_key(encode_namespace(namespace), k))


def test_corrupt_payload_on_card_is_a_counted_miss_and_deleted(gateway_factory) -> None:
    gw = gateway_factory(name="before")
    keys = [key(i) for i in range(5)]
    datas = [payload(i + 1000) for i in range(5)]
    with gw.client(NAMESPACE) as c:
        assert c.put_many(keys, datas) == [True] * 5
    assert gw.stop() == 0

    victim = _object_file(gw.card, NAMESPACE, keys[2])
    assert os.path.isfile(victim)
    size = os.path.getsize(victim)
    assert size > len(datas[2])  # header + payload
    flip_at = size - len(datas[2]) // 2  # inside the payload
    with open(victim, "r+b") as f:
        f.seek(flip_at)
        b = f.read(1)
        f.seek(flip_at)
        f.write(bytes([b[0] ^ 0x40]))

    gw2 = gateway_factory(card=gw.card, name="after")
    with gw2.client(NAMESPACE) as c:
        got = c.get_many(keys)
        assert got[2] is None, "a corrupt object must read as a miss"
        for i in (0, 1, 3, 4):
            assert got[i] == datas[i]
        stats = c.stats()
        assert stats["corrupt_objects"] == 1
        assert not os.path.exists(victim), "the corrupt object must be deleted"
        # and it stays a miss, not counted twice
        assert c.get_many([keys[2]]) == [None]
        assert c.exists_many([keys[2]]) == [False]
        assert c.stats()["corrupt_objects"] == 1
        # the key can be written again
        assert c.put_many([keys[2]], [datas[2]]) == [True]
        assert c.get_many([keys[2]]) == [datas[2]]
    assert "corrupt object" in gw2.log()
