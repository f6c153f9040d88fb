"""kvgate demo: a card cluster on one host, with a client restoring through two gateways while it changes.

    make cluster-demo                     # or: .venv/bin/python demo/cluster.py

1. three storage hosts, each a ``kvgate cluster serve`` agent that runs an
   etcd member (so the hosts are the etcd cluster) and serves its 4 directory
   cards over TCP (``--export``: ``kvgate://127.0.0.1:PORT/<serial>``);
2. the leader agent publishes a view of the 12 cards; two gateways in cluster
   mode (``--cluster-etcd-endpoints``, shared cards, no RAM tier: every
   restore reads a card) follow it;
3. a client writes dialogs through one gateway and restores earlier ones
   through the other, checking every byte, and prints what it saw each second;
4. a card is drained (``kvgate cluster drain``): the gateways copy its dialogs
   away, the leader marks it drained and publishes a view without it;
5. a storage host is killed (SIGKILL of its agent, which takes its etcd member
   and its card server with it): both gateways hold its cards out, dialogs on
   the other cards restore in full; the host comes back and so do its cards.

Everything lives under ``var/demo/cluster`` (removed at the start of a run)
and every process is stopped at the end, also on errors or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from etcd3aio import Etcd3Client

from kvgate.bench.processes import AgentProcess, GatewayProcess, free_port, kvgate_env
from kvgate.client import Client
from kvgate.cluster.registry import CardState, Registry

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "var" / "demo" / "cluster"
CLUSTER = "demo"
HOSTS = ("s1", "s2", "s3")
CARDS_PER_HOST = 4
PAGES, PAGE = 4, 64 << 10


def say(msg: str = "") -> None:
    print(msg, flush=True)


def ask(endpoints: list[str], what):
    async def main():
        async with Etcd3Client(endpoints) as client:
            return await what(Registry(client, CLUSTER, call_timeout_s=2))
    return asyncio.run(main())


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - etcd electing a leader, a gateway starting: asked again
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"not within {timeout:.0f} s: {what}")


def pages(dialog: bytes) -> tuple[list[bytes], list[bytes]]:
    keys = [dialog + b"/%d" % i for i in range(PAGES)]
    return keys, [hashlib.blake2b(k).digest() * (PAGE // 64) for k in keys]


class Traffic(threading.Thread):
    """Writes a dialog through one gateway, restores an earlier one through the other, checks every byte."""

    def __init__(self, sockets: list[str]) -> None:
        super().__init__(daemon=True)
        self.sockets = sockets
        self.stop_event = threading.Event()
        self.written: list[bytes] = []
        self.restored = self.missed = self.wrong = self.failed = 0

    def run(self) -> None:
        clients = [Client.connect(s, namespace="demo", engine_id=f"engine-{i}") for i, s in enumerate(self.sockets)]
        rng = random.Random(0)
        i = 0
        while not self.stop_event.is_set():
            dialog = b"dialog-%d" % i
            keys, values = pages(dialog)
            try:
                if all(clients[i % 2].put_many(keys, values, dialog=dialog, position=0)):
                    self.written.append(dialog)
                old = rng.choice(self.written) if self.written else dialog
                keys, values = pages(old)
                c = clients[(i + 1) % 2]
                if c.lookup(keys, dialog=old) < len(keys):
                    self.missed += 1
                else:
                    got = c.get_many(keys, dialog=old)
                    self.restored += 1
                    self.wrong += sum(g is not None and bytes(g) != v for g, v in zip(got, values))
            except Exception:  # noqa: BLE001 - counted: the demo shows it
                self.failed += 1
            i += 1
            time.sleep(0.02)
        for c in clients:
            c.close()

    def line(self) -> str:
        return (f"  client: {len(self.written)} dialogs written, {self.restored} restored, {self.missed} missed, "
                f"{self.wrong} wrong bytes, {self.failed} failed calls")


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    peer = {h: f"http://127.0.0.1:{free_port()}" for h in HOSTS}
    client_url = {h: f"http://127.0.0.1:{free_port()}" for h in HOSTS}
    export = {h: free_port() for h in HOSTS}
    endpoints = [client_url[h].removeprefix("http://") for h in HOSTS]
    initial = ",".join(f"{h}={peer[h]}" for h in HOSTS)
    agents: dict[str, AgentProcess] = {}
    gateways: list[GatewayProcess] = []
    traffic: Traffic | None = None

    def agent(h: str) -> AgentProcess:
        for i in range(CARDS_PER_HOST):
            (WORK / h / f"card{i}").mkdir(parents=True, exist_ok=True)
        return AgentProcess(WORK / h, h, [
            "--cards", str(WORK / h / "card*"), "--export", f"127.0.0.1:{export[h]}",
            "--etcd-member", h, "--etcd-peer-url", peer[h], "--etcd-client-url", client_url[h],
            "--etcd-initial-cluster", initial, "--etcd-data-dir", str(WORK / h / "etcd"),
            "--cluster-name", CLUSTER, "--liveness-ttl", "2", "--interval", "0.5"])

    try:
        say(f"1. three storage hosts ({', '.join(HOSTS)}): an agent each, with an etcd member and "
            f"{CARDS_PER_HOST} cards served over TCP")
        for h in HOSTS:
            agents[h] = agent(h).start()
        view = wait(lambda: (v := ask(endpoints, lambda reg: reg.view())) and len(v.cards) == 12 and v, 90,
                    "a view of 12 cards")
        leader = ask(endpoints, lambda reg: reg.leader())
        say(f"   leader {leader}; view {view.epoch}: {len(view.cards)} cards, e.g. {view.cards[0].address}")

        say("2. two gateways in cluster mode (shared cards, no RAM tier: every restore reads a card)")
        for g in ("gw1", "gw2"):
            gateways.append(GatewayProcess(WORK / g, [
                "--cluster-etcd-endpoints", *endpoints, "--cluster-name", CLUSTER, "--shared-storage", "true",
                "--cluster-view-file", str(WORK / g / "view.json"), "--max-bytes", "0", "--port", "0",
                "--metrics-port", "0", "--card-capacity", "256M"], name=g, env=kvgate_env()).start(60))
        for gw in gateways:
            wait(lambda: len(gw.stats()["cards"]) == 12, 30, f"{gw.name} on the view's 12 cards")
        prints = {gw.name: gw.stats()["gateway"]["fingerprint"] for gw in gateways}
        say(f"   layout fingerprints {prints} (the same: both gateways put every key on the same card)")

        say("3. a client writes through one gateway and restores through the other")
        traffic = Traffic([gw.socket for gw in gateways])
        traffic.start()
        time.sleep(3)
        say(traffic.line())

        card = sorted(view.cards, key=lambda c: c.address)[0]
        say(f"4. draining card {card.serial} ({card.address})")
        r = ask(endpoints, lambda reg: reg.set_state(card.serial, CardState.DRAINING))
        say(f"   registry: {r.state.value}")
        wait(lambda: (c := ask(endpoints, lambda reg: reg.card(card.serial))) and c.state.value == "drained", 60,
             "the card drained")
        v = ask(endpoints, lambda reg: reg.view())
        say(f"   drained: the gateways copied its dialogs away; view {v.epoch} has {len(v.cards)} cards")
        say(traffic.line())

        victim = next(h for h in HOSTS if h != leader)
        lost = {c.serial for c in v.cards if f":{export[victim]}/" in c.address}
        say(f"5. SIGKILL of storage host {victim} (its agent, its etcd member, its card server): "
            f"{len(lost)} cards gone")
        before = (traffic.restored, traffic.missed)
        agents[victim].signal(signal.SIGKILL)
        t = time.monotonic()
        for gw in gateways:
            wait(lambda: set(gw.stats()["cluster"]["held_out"]) == lost, 30, f"{gw.name} holds them out")
        say(f"   both gateways hold its {len(lost)} cards out after {time.monotonic() - t:.1f} s; "
            f"etcd goes on with two members of three")
        time.sleep(3)
        say(traffic.line() + f"  (since the kill: {traffic.restored - before[0]} restored, "
            f"{traffic.missed - before[1]} missed: the dialogs of {victim}'s cards)")
        agents[victim] = agent(victim).start()
        for gw in gateways:
            wait(lambda: not gw.stats()["cluster"]["held_out"] and all(c["active"] for c in gw.stats()["cards"]),
                 60, f"{gw.name} takes the cards back")
        say(f"   {victim} is back: its cards serve again on both gateways, nothing restarted")
        time.sleep(2)
        traffic.stop_event.set()
        traffic.join(30)
        say(traffic.line())
        ok = traffic.wrong == 0 and traffic.failed == 0
        say("done: " + ("no wrong byte, no failed call" if ok else "SOMETHING WENT WRONG (see above)"))
        return 0 if ok else 1
    except (RuntimeError, KeyboardInterrupt) as e:
        say(f"demo stopped: {e}")
        for name, a in agents.items():
            say(f"--- agent {name}:\n{a.log()[-1500:]}")
        return 1
    finally:
        if traffic is not None:
            traffic.stop_event.set()
        for gw in gateways:
            gw.stop()
        for a in agents.values():
            a.signal(signal.SIGTERM)
        for gw in gateways:
            gw.cleanup()


if __name__ == "__main__":
    sys.exit(main())
