"""Real ``kvgate cluster serve`` agents against a real etcd: registration, liveness, leadership, drains,
etcd members run by the agents, and an etcd outage.  Short TTLs (2 s, etcd's minimum) keep them fast."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from etcd3aio import Etcd3Client

from kvgate.bench.processes import free_port
from kvgate.cluster.member import EtcdMember
from kvgate.cluster.registry import CardState, Registry, RegistryUnavailable
from tests.cluster.common import ETCD, AgentProcess, EtcdServer
from tests.helpers import run_kvgate, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")]
CLUSTER = "t"
TTL = 2
FAST = ["--cluster-name", CLUSTER, "--liveness-ttl", str(TTL), "--interval", "0.2", "--slots", "64"]


def ask(endpoints: str | list[str], what: Callable[[Registry], Awaitable[Any]]) -> Any:
    """One registry read (or write) from the test, with its own client."""
    async def main() -> Any:
        async with Etcd3Client([endpoints] if isinstance(endpoints, str) else endpoints) as client:
            return await what(Registry(client, CLUSTER, call_timeout_s=5))

    return asyncio.run(main())


def answered(what: Callable[[], Any]) -> Any:
    """``what()``, or None while etcd does not answer (a cluster still forming)."""
    try:
        return what()
    except RegistryUnavailable:
        return None


def states(endpoint: str) -> dict[str, CardState]:
    return {r.serial: r.state for r in ask(endpoint, lambda reg: reg.cards())}


def view_of(endpoint: str) -> tuple[int, list[str]]:
    v = ask(endpoint, lambda reg: reg.view())
    return (0, []) if v is None else (v.epoch, [c.serial for c in v.cards])


def card_dirs(root: Path, *names: str) -> list[str]:
    out = []
    for n in names:
        (root / n).mkdir(parents=True)
        out.append(str(root / n))
    return out


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


@pytest.fixture
def agents():
    made: list[AgentProcess] = []
    yield made
    for a in made:
        a.stop()


def test_an_agent_registers_its_cards_publishes_and_its_liveness_goes_with_it(tmp_path, etcd, agents) -> None:
    cards = card_dirs(tmp_path, "c1", "c2")  # not labelled yet: the agent labels them
    a1 = AgentProcess(tmp_path, "a1", ["--cards", str(tmp_path / "c*"), "--etcd-endpoints", etcd.endpoint, *FAST])
    agents.append(a1.start())
    alive = wait_until(lambda: (d := ask(etcd.endpoint, lambda reg: reg.alive())) and len(d) == 2 and d, 15,
                       a1.log_tail)
    assert sorted(doc["address"] for doc in alive.values()) == cards
    assert {doc["agent"] for doc in alive.values()} == {"a1"}
    wait_until(lambda: view_of(etcd.endpoint)[1] == sorted(alive), 10, a1.log_tail)
    assert set(states(etcd.endpoint).values()) == {CardState.ACTIVE}
    # The agent's own doc lists its cards from the round that reports them alive.
    docs = wait_until(lambda: (d := ask(etcd.endpoint, lambda reg: reg.agents())) and
                      list(d.values())[0]["cards"] == sorted(alive) and d, 5, a1.log_tail)
    (agent_doc,) = docs.values()
    assert agent_doc["export"] is None and agent_doc["etcd_member"] is None
    out = run_kvgate("cluster", "leader", "--json", "--etcd-endpoints", etcd.endpoint, "--cluster-name", CLUSTER)
    assert json.loads(out.stdout) == {"leader": "a1"}, out.stderr

    async def by_etcd3aio(reg: Registry) -> bytes:  # the layout agreed with the gateways: etcd3aio's Election
        return (await reg.client.election(f"/kvgate/{CLUSTER}/leader").leader(timeout=5)).kvs[0].value

    assert ask(etcd.endpoint, by_etcd3aio) == b"a1"
    view = ask(etcd.endpoint, lambda reg: reg.view())

    # A card whose label no longer reads back (its disk went) is not reported alive until it reads again.
    (tmp_path / "c2" / "kvgate-card.json").rename(tmp_path / "label")
    wait_until(lambda: len(ask(etcd.endpoint, lambda reg: reg.alive())) == 1, 5, a1.log_tail)
    (tmp_path / "label").rename(tmp_path / "c2" / "kvgate-card.json")
    wait_until(lambda: len(ask(etcd.endpoint, lambda reg: reg.alive())) == 2, 5, a1.log_tail)
    assert ask(etcd.endpoint, lambda reg: reg.view()) == view, "health is no business of the view"

    killed = time.monotonic()
    a1.signal(signal.SIGKILL)
    wait_until(lambda: not ask(etcd.endpoint, lambda reg: reg.alive()), TTL + 3, "alive/ keys gone after the TTL")
    assert time.monotonic() - killed > TTL - 1, "the lease lapses, nothing deletes the keys before"
    assert ask(etcd.endpoint, lambda reg: reg.view()) == view, "a lapsed agent changes no view"
    assert set(states(etcd.endpoint).values()) == {CardState.ACTIVE}, "registrations stay"

    # Started again: the same cards, registered already, and the same layout: no new view.  SIGTERM: gone at once.
    agents.append(a2 := AgentProcess(tmp_path, "a1-again", ["--cards", *cards, "--etcd-endpoints", etcd.endpoint,
                                                             *FAST]).start())
    wait_until(lambda: len(ask(etcd.endpoint, lambda reg: reg.alive())) == 2, 15, a2.log_tail)
    wait_until(lambda: ask(etcd.endpoint, lambda reg: reg.leader()) == "a1-again", 10, a2.log_tail)
    time.sleep(0.6)  # three leader rounds
    assert ask(etcd.endpoint, lambda reg: reg.view()) == view
    assert a2.signal(signal.SIGTERM) == 0, a2.log_tail()
    assert ask(etcd.endpoint, lambda reg: reg.alive()) == {}, "revoked on the way out, not left to the TTL"
    assert ask(etcd.endpoint, lambda reg: reg.leader()) is None
    assert "lease" in a2.log() and "revoked" in a2.log()


def test_the_leader_fails_over_without_a_new_view_and_a_new_card_makes_one(tmp_path, etcd, agents) -> None:
    flags = ["--etcd-endpoints", etcd.endpoint, *FAST]
    a1 = AgentProcess(tmp_path, "a1", ["--cards", *card_dirs(tmp_path, "c1"), *flags]).start()
    agents.append(a1)
    wait_until(lambda: ask(etcd.endpoint, lambda reg: reg.leader()) == "a1", 15, a1.log_tail)
    a2 = AgentProcess(tmp_path, "a2", ["--cards", *card_dirs(tmp_path, "c2"), *flags]).start()
    agents.append(a2)
    wait_until(lambda: len(view_of(etcd.endpoint)[1]) == 2, 15, lambda: a1.log_tail() + a2.log_tail())
    epoch = view_of(etcd.endpoint)[0]
    assert ask(etcd.endpoint, lambda reg: reg.leader()) == "a1", "the first candidate leads"

    killed = time.monotonic()
    a1.signal(signal.SIGKILL)
    wait_until(lambda: ask(etcd.endpoint, lambda reg: reg.leader()) == "a2", TTL + 5, a2.log_tail, interval=0.05)
    failover = time.monotonic() - killed
    print(f"leader failover after SIGKILL: {failover:.2f} s (TTL {TTL} s)")
    wait_until(lambda: "leadership won" in a2.log(), 5, a2.log_tail)
    time.sleep(1.0)  # five rounds of the new leader
    assert view_of(etcd.endpoint)[0] == epoch, "no card changed: no new view"
    assert "published" not in a2.log()

    a3 = AgentProcess(tmp_path, "a3", ["--cards", *card_dirs(tmp_path, "c3"), *flags]).start()
    agents.append(a3)
    wait_until(lambda: len(view_of(etcd.endpoint)[1]) == 3, 15, lambda: a2.log_tail() + a3.log_tail())
    assert view_of(etcd.endpoint)[0] == epoch + 1, "the new card: one new view"
    assert re.search(rf"view {epoch + 1} published: 3 cards", a2.log())


def test_a_draining_card_is_drained_once_every_reporting_gateway_copied_it_away(tmp_path, etcd, agents) -> None:
    a1 = AgentProcess(tmp_path, "a1", ["--cards", *card_dirs(tmp_path, "c1", "c2"), "--etcd-endpoints",
                                       etcd.endpoint, *FAST]).start()
    agents.append(a1)
    wait_until(lambda: len(view_of(etcd.endpoint)[1]) == 2, 15, a1.log_tail)
    serial = sorted(states(etcd.endpoint))[0]
    out = run_kvgate("cluster", "drain", serial, "--etcd-endpoints", etcd.endpoint, "--cluster-name", CLUSTER)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: (v := ask(etcd.endpoint, lambda reg: reg.view())) and
               {c.serial: c.state for c in v.cards}[serial] is CardState.DRAINING, 5, a1.log_tail)

    async def gateways(reg: Registry, g1: list[str], g2: list[str]) -> int:
        lease = await reg.grant(30)
        await reg.report_gateway(lease, "g1", {"epoch": 2, "drained": g1})
        await reg.report_gateway(lease, "g2", {"epoch": 2, "drained": g2})
        return lease

    lease = ask(etcd.endpoint, lambda reg: gateways(reg, [serial], []))
    time.sleep(1.0)  # five leader rounds: g2 has not copied it away
    assert states(etcd.endpoint)[serial] is CardState.DRAINING
    ask(etcd.endpoint, lambda reg: gateways(reg, [serial], [serial]))
    wait_until(lambda: view_of(etcd.endpoint)[1] == sorted(set(states(etcd.endpoint)) - {serial}), 5, a1.log_tail)
    assert states(etcd.endpoint)[serial] is CardState.DRAINED
    assert f"card {serial}: drained" in a1.log()
    ask(etcd.endpoint, lambda reg: reg.revoke(lease))


def _member_pids(agent: AgentProcess) -> list[int]:
    return [int(p) for p in re.findall(r"etcd member \S+ started \(pid (\d+)", agent.log())]


def test_agents_run_a_three_member_etcd_that_outlives_a_member(tmp_path, agents) -> None:
    names = ["m1", "m2", "m3"]
    peers = {n: f"http://127.0.0.1:{free_port()}" for n in names}
    clients = {n: f"http://127.0.0.1:{free_port()}" for n in names}
    initial = ",".join(f"{n}={peers[n]}" for n in names)
    endpoints = [c.removeprefix("http://") for c in clients.values()]
    for i, n in enumerate(names):
        cards = ["--cards", *card_dirs(tmp_path, f"c-{n}")] if n != "m3" else []  # m3: a witness host
        agents.append(AgentProcess(tmp_path, n, [
            *cards, "--etcd-member", n, "--etcd-peer-url", peers[n], "--etcd-client-url", clients[n],
            "--etcd-initial-cluster", initial, "--etcd-data-dir", str(tmp_path / f"etcd-{n}"), *FAST]).start())
    logs = lambda: "".join(a.log_tail(1500) for a in agents)  # noqa: E731
    wait_until(lambda: answered(lambda: len(view_of(endpoints)[1]) == 2), 30, logs)
    # The witness (no cards) registers on its own keep-alive, not with the view: it may come a moment later.
    wait_until(lambda: answered(lambda: len(ask(endpoints, lambda reg: reg.agents())) == 3), 10, logs)

    m2 = agents[1]
    (pid,) = _member_pids(m2)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # Two members of three answer (after an etcd election, if the killed one led).
    wait_until(lambda: answered(lambda: ask([endpoints[0], endpoints[2]], lambda reg: reg.leader())), 5, logs)
    print(f"etcd answers again {time.monotonic() - started:.2f} s after one of its 3 members was killed")
    wait_until(lambda: len(_member_pids(m2)) == 2, 10, m2.log_tail)
    member = EtcdMember("m2", peers["m2"], clients["m2"], initial, tmp_path / "etcd-m2")
    wait_until(lambda: asyncio.run(member.answers()), 15, m2.log_tail)
    print(f"etcd member restarted by its agent and healthy after {time.monotonic() - started:.2f} s")
    assert "initial cluster state existing" in m2.log().split("started (pid")[-1], "back on its own data"

    assert m2.signal(signal.SIGTERM) == 0, m2.log_tail()
    assert re.search(r"etcd member m2 stopped [\d.]+ s after SIGTERM", m2.log()), m2.log_tail()
    new_pid = _member_pids(m2)[-1]
    with pytest.raises(ProcessLookupError):
        os.kill(new_pid, 0)  # the agent stopped its member with it


def test_liveness_comes_back_after_an_etcd_outage_and_a_lapsed_lease(tmp_path, etcd, agents) -> None:
    a1 = AgentProcess(tmp_path, "a1", ["--cards", *card_dirs(tmp_path, "c1"), "--etcd-endpoints", etcd.endpoint,
                                       *FAST]).start()
    agents.append(a1)
    wait_until(lambda: view_of(etcd.endpoint)[0] == 1, 15, a1.log_tail)

    etcd.stop()
    time.sleep(2 * TTL + 0.5)  # the agent gives its lease up for lapsed
    etcd.start()
    back = time.monotonic()
    wait_until(lambda: ask(etcd.endpoint, lambda reg: reg.alive()), 10, a1.log_tail)
    print(f"alive/ keys back {time.monotonic() - back:.2f} s after etcd answered again")
    time.sleep(TTL + 1)  # the lease of before (a restarted etcd extends it) is gone: the new one holds the keys
    assert ask(etcd.endpoint, lambda reg: reg.alive()), a1.log_tail()
    assert a1.log().count("granted") == 2, a1.log_tail()
    wait_until(lambda: a1.log().count("leadership won") == 2, 5, a1.log_tail)
    assert view_of(etcd.endpoint)[0] == 1, "the outage changed no card: no new view"

    # A lease that lapses while etcd is up (revoked here, as etcd would on a missed TTL): back on its own too.
    async def revoke(reg: Registry) -> None:
        resp = await reg.client.kv.get(reg.prefix + b"agents/a1")
        await reg.revoke(resp.kvs[0].lease)

    ask(etcd.endpoint, revoke)
    wait_until(lambda: ask(etcd.endpoint, lambda reg: reg.alive()), 5, a1.log_tail)
    assert "lapsed" in a1.log()


def test_serve_says_what_is_wrong_with_its_flags(tmp_path) -> None:
    out = run_kvgate("cluster", "serve", "--etcd-member", "m1", "--etcd-peer-url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "needs --etcd-client-url, --etcd-initial-cluster as well" in out.stderr
    out = run_kvgate("cluster", "serve", "--etcd-endpoints", "etcd.example:2379")
    assert out.returncode == 2 and "an IPv4 address and port" in out.stderr, out.stderr
    out = run_kvgate("cluster", "serve", "--etcd-member", "m1", "--etcd-peer-url", "http://127.0.0.1:1",
                     "--etcd-client-url", "http://127.0.0.1:2", "--etcd-initial-cluster", "m2=http://127.0.0.1:1")
    assert out.returncode == 2 and "must list this member as m1=http://127.0.0.1:1" in out.stderr, out.stderr


def test_an_agent_that_outlives_its_stop_bound_fails_with_its_log(tmp_path) -> None:
    """The test helper's stop wait: an agent still running after it is an assertion carrying the agent's log,
    not a bare timeout (a process that ignores SIGTERM stands in for a stuck agent)."""
    a = AgentProcess(tmp_path, "stuck", [])
    a.args = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ignoring SIGTERM', flush=True); time.sleep(60)"]
    a.start()
    try:
        wait_until(lambda: "ignoring SIGTERM" in a.log(), 10, a.log_tail)
        with pytest.raises(AssertionError, match=r"(?s)agent stuck still runs 1 s after signal 15.*ignoring SIGTERM"):
            a.signal(signal.SIGTERM, 1.0)
    finally:
        a.stop()
