"""A real ``kvgate serve`` with kv_events on: what engines store and what the tiers drop goes out as vLLM
KV events, read by vLLM's own decoder (a subprocess under .venv-vllm) and by kvgate's Subscriber; a
subscriber that missed batches catches up by replay, a late one by a snapshot; malformed replay
requests leave the gateway serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from kvgate.bench.processes import free_port
from kvgate.errors import InvalidArgument
from kvgate.gateway.status import render
from kvgate.kvevents.subscriber import Subscriber
from kvgate.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, seq_bytes
from tests.helpers import hello_reply, kvgate_env, venv_python

VENV_PY = venv_python(".venv-vllm")
SCRIPT = Path(__file__).resolve().parents[1] / "kvevents" / "vllm_events.py"
pytestmark = pytest.mark.slow


def vkey(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def events_gateway(gateway_factory, topic: str = "gw", buffer: int = 10_000, extra=()):
    pub, rep = free_port(), free_port()
    gw = gateway_factory(["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                          "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                          "--kv-events-topic", topic, "--kv-events-buffer", str(buffer), *extra])
    return gw, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


def wait_for(sub: Subscriber, want, timeout: float = 20.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += sub.poll(0.1)
        if want(got):
            return got
    raise AssertionError(f"not seen in {timeout} s; got {[(t, s, [type(e).__name__ for e in b.events]) for t, s, b in got]}")


def hashes(got, kind, topic=None) -> list:
    return [h for t, _, b in got if topic is None or t == topic for e in b.events if isinstance(e, kind)
            for h in e.block_hashes]


def test_the_client_checks_its_key_form():
    from kvgate.client import Client
    with pytest.raises(InvalidArgument, match="block_keys"):
        Client.connect("/nonexistent.sock", block_keys="sglang")
    with pytest.raises(InvalidArgument, match="block_size"):
        Client.connect("/nonexistent.sock", block_keys="vllm", block_size=-1)


@pytest.mark.skipif(not VENV_PY.exists(), reason="needs .venv-vllm (make vllm-venv)")
def test_vllms_decoder_reads_what_a_gateway_publishes(gateway_factory, tmp_path):
    gw, pub, _ = events_gateway(gateway_factory)
    ready = tmp_path / "ready"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"out": str(tmp_path / "out.json"), "subscribe": {
        "endpoint": pub, "count": 2, "timeout_s": 60, "ready_file": str(ready)}}))
    proc = subprocess.Popen([str(VENV_PY), str(SCRIPT), str(plan)], env=kvgate_env(None),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the vLLM subscriber never got ready"
            time.sleep(0.1)
        with gw.client("v", block_keys="vllm", block_size=256) as c:
            c.put_many([vkey(1, 0), vkey(2, 0), vkey(2, 1)], [b"a" * 100] * 3)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    received = json.loads((tmp_path / "out.json").read_text())["received"]
    by_topic = {r["topic"]: r["batch"]["events"] for r in received}
    assert set(by_topic) == {"gw"} | {t for t in by_topic if t.startswith("gw@card:")} and len(by_topic) == 2
    for topic, events in by_topic.items():
        medium = "CPU" if topic == "gw" else "STORAGE"
        got = [(h["hex"], e["group_idx"]) for e in events for h in e["block_hashes"]]
        assert sorted(got) == sorted([(vkey(1)[:32].hex(), 0), (vkey(2)[:32].hex(), 0), (vkey(2)[:32].hex(), 1)])
        for e in events:
            assert (e["type"], e["medium"], e["block_size"], e["locality"], e["ownership"], e["token_ids"],
                    e["parent_block_hash"]) == ("BlockStored", medium, 256, "LOCAL", "kvgate", [], None)


def test_an_eviction_publishes_block_removed(gateway_factory):
    gw, pub, rep = events_gateway(gateway_factory, extra=["--max-bytes", "8M"])
    sub = Subscriber(pub, rep)
    try:
        with gw.client("v", block_keys="vllm", block_size=16) as c:
            c.put_many([vkey(0)], [b"x" * 4096])
            wait_for(sub, lambda got: vkey(0)[:32] in hashes(got, BlockStored, "gw"))
            for i in range(1, 40):  # 39 MiB through an 8 MiB RAM tier
                c.put_many([vkey(i)], [b"x" * (1 << 20)])
        got = wait_for(sub, lambda got: vkey(0)[:32] in hashes(got, BlockRemoved, "gw"))
        removed = [e for t, _, b in got if t == "gw" for e in b.events if isinstance(e, BlockRemoved)]
        assert all(e.medium == "CPU" and e.group_idx == 0 and e.ownership == "kvgate" for e in removed)
        # what left the RAM tier is still on the card: no removal there
        assert vkey(0)[:32] not in hashes(got, BlockRemoved, next(t for t, _, _ in got if t != "gw"))
    finally:
        sub.close()


def test_a_subscriber_that_missed_1000_batches_catches_up_by_replay(gateway_factory):
    gw, pub, rep = events_gateway(gateway_factory)
    sub = Subscriber(pub, rep, snapshot_on_join=False)
    try:
        with gw.client("v", block_keys="vllm") as c:
            c.put_many([vkey(10_000)], [b"w"])
            wait_for(sub, lambda got: got)
            sub._sub.disconnect(pub)  # deaf from here
            start = sub.last_seq
            for i in range(500):  # each put: a batch for the RAM tier and one for the card
                c.put_many([vkey(i)], [b"p"], retention="long")
                time.sleep(0.012)  # the gateway publishes per 10 ms flush
            sub._sub.connect(pub)
            time.sleep(0.5)
            c.put_many([vkey(777_777)], [b"l"])
        got = wait_for(sub, lambda got: vkey(777_777)[:32] in hashes(got, BlockStored, "gw"), timeout=60)
        assert got[-1][1] - start >= 1000, "fewer than 1,000 batches were missed"
        assert sub.stats["gaps"] == 1 and sub.stats["replays"] == 1 and sub.stats["gaps_unrecovered"] == 0
        assert sorted(set(hashes(got, BlockStored, "gw"))) == sorted(vkey(i)[:32] for i in [*range(500), 777_777])
        seqs = [s for _, s, _ in got]
        assert seqs == list(range(start + 1, start + 1 + len(seqs)))
    finally:
        sub.close()


def test_a_late_joiner_gets_a_snapshot_and_malformed_requests_change_nothing(gateway_factory):
    gw, pub, rep = events_gateway(gateway_factory, buffer=10)
    with gw.client("v", block_keys="vllm", block_size=32) as c:
        for i in range(50):  # 100 batches through a ring of 10
            c.put_many([vkey(i, i % 3)], [b"s"])
            time.sleep(0.012)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(rep)
        for frames in ([b"", b"bad"], [b"junk"], [b"", seq_bytes(1), b"x"], [b"\xff" * 5000]):
            dealer.send_multipart(frames)
        time.sleep(0.3)
        dealer.close(0)
        sub = Subscriber(pub, rep)
        try:
            got = wait_for(sub, lambda got: len(hashes(got, BlockStored)) >= 100)
            ram = [e for t, _, b in got if t == "gw" for e in b.events]
            assert isinstance(ram[0], AllBlocksCleared)
            assert sorted((h, e.group_idx) for e in ram[1:] for h in e.block_hashes) == sorted(
                (vkey(i)[:32], i % 3) for i in range(50))
            assert all(e.block_size == 32 and e.medium == "CPU" for e in ram[1:])
            c.put_many([vkey(99)], [b"n"])  # and the gateway still serves, and publishes
            wait_for(sub, lambda got: vkey(99)[:32] in hashes(got, BlockStored, "gw"))
        finally:
            sub.close()
    assert gw.alive()
    st = gw.stats()["kv_events"]
    assert st["malformed_requests"] == 4 and st["snapshots"] >= 1 and st["dropped"] == 0, st
    metrics = render(gw.stats()).decode()  # the same counters on /metrics
    assert "kvgate_kv_events_malformed_requests_total 4.0" in metrics, metrics


def test_snapshot_time(gateway_factory):
    """How long a late joiner's snapshot of N objects on a card takes, gateway to subscriber (the figure in
    docs/events.md: N=200,000 (KVGATE_SNAPSHOT_N) took 0.65 s on the 2-core test machine, about 310,000
    objects a second, so a million about 3.3 s; the default N keeps the test short)."""
    n = int(os.environ.get("KVGATE_SNAPSHOT_N", "20000"))
    gw, pub, rep = events_gateway(gateway_factory, extra=["--card-capacity", "4G"])
    with gw.client("v", block_keys="vllm") as c:
        for i in range(0, n, 1000):
            c.put_many([vkey(j) for j in range(i, min(n, i + 1000))], [b"s"] * min(1000, n - i))
    sub = Subscriber(pub, rep, replay_timeout=120)
    try:
        t0 = time.perf_counter()
        got = wait_for(sub, lambda got: len(hashes(got, BlockStored)) - len(hashes(got, BlockStored, "gw")) >= n,
                       timeout=120)
        took = time.perf_counter() - t0
    finally:
        sub.close()
    print(f"\nsnapshot of {n} objects: {took:.2f} s ({n / took:,.0f} objects/s)", file=sys.stderr)
    card = next(t for t, _, _ in got if t != "gw")
    assert sorted(set(hashes(got, BlockStored, card))) == sorted(vkey(i)[:32] for i in range(n))


def test_an_endpoint_in_use_stops_the_start_naming_the_key(tmp_path):
    from tests.helpers import run_kvgate
    (tmp_path / "card").mkdir()
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        for flags, key in ((["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"], "kv_events_endpoint"),
                           (["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{port}"], "kv_events_replay_endpoint")):
            r = run_kvgate("serve", "--storage-devices", str(tmp_path / "card"), "--port", "0", "--metrics-port", "0",
                           "--socket", str(tmp_path / "s.sock"), *flags, timeout=60)
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
            errors = [ln for ln in r.stderr.splitlines() if ln.strip() and " INFO " not in ln]
            assert len(errors) == 1 and f"config key {key}: cannot bind" in errors[0], r.stderr
            assert not (tmp_path / "s.sock").exists()
    finally:
        taken.close(0)


def test_the_gateway_refuses_a_key_form_it_does_not_know(gateway_factory):
    from kvgate import protocol as p
    gw = gateway_factory()

    reply = hello_reply(gw.socket, p.Hello(id=1, namespace="n", block_keys="sglang", want_shm=False))
    assert reply.code == p.ErrorCode.BAD_REQUEST and "block_keys" in reply.message, reply
    with gw.client("n", block_keys="vllm", block_size=16) as c:  # a known one is taken
        c.put_many([vkey(1)], [b"x"])


def test_a_gateway_announces_the_cards_it_mounts_before_anything_is_stored(gateway_factory):
    """A router learns which gateways read a card from the card's topic: an empty card is announced too
    (the prefill/decode hand-off asks whether the decode endpoint's gateway can read a card)."""
    from kvgate.routing.index import KvIndex

    gw, pub, rep = events_gateway(gateway_factory)
    serials = [c["serial"] for c in gw.stats()["cards"]]
    assert serials and all(serials)
    sub = Subscriber(pub, rep)  # joins after the announcement: it comes by replay
    try:
        got = wait_for(sub, lambda got: {f"gw@card:{s}" for s in serials} <= {t for t, _, _ in got})
    finally:
        sub.close()
    index = KvIndex()
    for topic, _seq, batch in got:
        index.apply("gw", topic, batch)
    assert index.mounts("gw") == frozenset(serials)
    assert len(index) == 0  # an announcement stores nothing
