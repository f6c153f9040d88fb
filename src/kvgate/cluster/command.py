"""``kvgate cluster``: the card registry from the command line, and the agent that keeps it.

    kvgate cluster serve [--cards PATH|GLOB ...] [--etcd-member NAME ...]
                                          the agent of this host (``kvgate.cluster.agent``)
    kvgate cluster leader                 the agent that leads
    kvgate cluster status                 leader, view, cards by state and liveness, agents, gateways
    kvgate cluster cards                  the registered cards
    kvgate cluster view                   the published view: epoch, cards, slots per card
    kvgate cluster register PATH|URL      label the card if it has no label yet and register it (joining);
                                          a Redis Cluster seed: one card per primary; --address: the
                                          path or glob gateways reach a directory card by
    kvgate cluster drain|undrain|retire SERIAL
    kvgate cluster relocate SERIAL --address PATH|GLOB|URL
                                          the card is reached there from now on (a moved mount, a card
                                          server on another port, a resharded Redis Cluster's new primary)
    kvgate cluster publish                the next view from the registry (joining cards become active), as
                                          the leader will; nothing when the layout would not change

Every command takes ``--etcd-endpoints`` and ``--cluster-name`` and answers
within ``--timeout`` per etcd call; ``--json`` prints what it read.  The
agent's own flags are ``kvgate.cluster.agentcli``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from typing import Any

import msgspec
from etcd3aio import EtcdError

from kvgate.cards import is_redis
from kvgate.cards.rediskeys import cluster_cards
from kvgate.cluster.registry import (CardRecord, CardState, Registry, RegistryConflict, RegistryUnavailable, View,
                                     etcd_client)
from kvgate.cluster.flags import ACTIONS, add_arguments  # noqa: F401  (kvgate's parser takes them from flags)

DEFAULT_ENDPOINTS = ["127.0.0.1:2379"]
CONNECT_S = 5.0


def run(args: argparse.Namespace) -> int:
    if args.action == "serve":
        from kvgate.cluster.agentcli import run_serve

        return run_serve(args)
    args.etcd_endpoints = args.etcd_endpoints or DEFAULT_ENDPOINTS
    try:
        return asyncio.run(_run(args))
    except (RegistryUnavailable, RegistryConflict, ValueError, OSError) as e:
        print(f"kvgate cluster {args.action}: {e}", file=sys.stderr)
        return 1 if isinstance(e, RegistryConflict) else 2


async def _run(args: argparse.Namespace) -> int:
    if args.action in ("register", "drain", "undrain", "retire", "relocate") and not args.card:
        raise ValueError("name the card (register: a directory, Redis URL or kvgate:// URL; otherwise its serial)")
    if args.action == "relocate" and not args.address:
        raise ValueError("relocate: --address names where gateways reach the card from now on")
    client = etcd_client(args.etcd_endpoints)
    try:
        async with asyncio.timeout(CONNECT_S):
            await client.connect()
    except (TimeoutError, EtcdError) as e:
        raise RegistryUnavailable(f"etcd at {', '.join(args.etcd_endpoints)} did not answer ({type(e).__name__})") \
            from None
    try:
        reg = Registry(client, args.cluster_name, args.timeout)
        return await _act(args, reg)
    finally:
        await client.close()


async def _act(args: argparse.Namespace, reg: Registry) -> int:
    if args.action == "status":
        return await _status(reg, args.json)
    if args.action == "cards":
        _show_cards(await reg.cards(), args.json)
    elif args.action == "view":
        view = await reg.view()
        if view is None:
            print("no view published yet (kvgate cluster publish)", file=sys.stderr)
            return 1
        _show_view(view, args.json)
    elif args.action == "leader":
        name = await reg.leader()
        if args.json:
            print(json.dumps({"leader": name}))
        elif name is None:
            print("no leader (is a `kvgate cluster serve` agent running?)", file=sys.stderr)
        else:
            print(name)
        return 0 if name is not None else 1
    elif args.action == "register":
        return await _register(reg, args.card, args.address, args.token_file, args.tls_ca_file)
    elif args.action in ("drain", "undrain", "retire"):
        state = {"drain": CardState.DRAINING, "undrain": CardState.ACTIVE, "retire": CardState.RETIRED}[args.action]
        record = await reg.set_state(args.card, state)
        print(f"card {record.serial}: {record.state.value}")
    elif args.action == "relocate":
        record = await reg.set_address(args.card, args.address)
        print(f"card {record.serial}: reached at {record.address} (the leader or `kvgate cluster publish` puts "
              "it in the next view; each gateway finds it there by its label)")
    elif args.action == "publish":
        return await _publish(reg, args.slots, args.json)
    return 0


async def _status(reg: Registry, as_json: bool) -> int:
    """What the cluster thinks: leader, view, cards by state and liveness, agents, gateways and their layouts."""
    cards, view, alive, agents, gateways, leader = (
        await reg.cards(), await reg.view(), await reg.alive(), await reg.agents(), await reg.gateway_reports(),
        await reg.leader())
    epoch = view.epoch if view is not None else 0
    prints = {r.get("fingerprint") for r in gateways.values() if isinstance(r, dict) and r.get("epoch") == epoch}
    doc = {
        "leader": leader, "view_epoch": epoch, "view_cards": len(view.cards) if view else 0,
        "cards_by_state": dict(Counter(r.state.value for r in cards)),
        "cards_alive": sorted(alive), "cards_not_alive": sorted(r.serial for r in cards
                                                               if r.state.value in ("joining", "active", "draining")
                                                               and r.serial not in alive),
        "agents": agents, "gateways": gateways,
        "gateways_on_view": sum(1 for r in gateways.values() if isinstance(r, dict) and r.get("epoch") == epoch),
        "layouts_agree": len(prints - {None, ""}) <= 1,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    by_state = ", ".join(f"{n} {s}" for s, n in sorted(doc["cards_by_state"].items())) or "none"
    print(f"leader: {leader or 'none (is a `kvgate cluster serve` agent running?)'}")
    print(f"view: epoch {epoch}, {doc['view_cards']} cards; registered: {by_state}")
    print(f"liveness: {len(alive)} cards reported alive; not reported: {len(doc['cards_not_alive'])}"
          + (f" ({', '.join(doc['cards_not_alive'][:8])}{', ...' if len(doc['cards_not_alive']) > 8 else ''})"
             if doc["cards_not_alive"] else ""))
    for name, a in sorted(agents.items()):
        a = a if isinstance(a, dict) else {}
        print(f"agent {name}: host {a.get('host')}, {len(a.get('cards') or [])} cards"
              + (f", exports {a['export']}" if a.get("export") else "")
              + (f", etcd member {a['etcd_member']}" if a.get("etcd_member") else ""))
    for gid, g in sorted(gateways.items()):
        g = g if isinstance(g, dict) else {}
        print(f"gateway {gid}: view {g.get('epoch')}, layout {g.get('fingerprint') or '?'}")
    if not doc["layouts_agree"]:
        print("LAYOUTS DIFFER: gateways on the same view put keys on different cards (storage_slots, num_dbs, "
              "key_placement)")
        return 1
    return 0


async def _publish(reg: Registry, slots: int, as_json: bool) -> int:
    _, view = await reg.publish_next(slots)  # what the leader does each round
    if view is None:
        current = await reg.view()
        print(f"view {current.epoch if current else 0} is current: nothing to publish")
        return 0
    _show_view(view, as_json)
    return 0


async def _register(reg: Registry, card: str, address: str | None, token_file: str | None,
                    tls_ca_file: str | None = None) -> int:
    """Label and register the card at ``card``; a Redis Cluster seed registers one card per primary."""
    from kvgate.cluster.agent import label_card

    if is_redis(card):
        if address:
            raise ValueError("--address is for a directory card (the path or glob gateways reach it by)")
        locations = await asyncio.to_thread(cluster_cards, card)
    else:
        locations = [card]
    taken = 0
    for location in locations:
        record = await asyncio.to_thread(label_card, location, address, token_file, tls_ca_file)
        if await reg.register(record):
            taken += 1
            print(f"card {record.serial} at {record.address} registered (joining; the leader or `kvgate cluster "
                  f"publish` makes it active)")
        else:
            print(f"card {record.serial} at {record.address} is registered already", file=sys.stderr)
    return 0 if taken else 1


def _show_cards(records: list[CardRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps(msgspec.to_builtins(records), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"registered cards ({len(records)})")
    for col in ("serial", "kind", "address", "state", "capacity", "weight"):
        t.add_column(col)
    for r in records:
        t.add_row(r.serial, r.kind, r.address, r.state.value, str(r.capacity or "-"), f"{r.weight:g}")
    Console().print(t)


def _show_view(view: View, as_json: bool) -> None:
    if as_json:
        print(json.dumps(msgspec.to_builtins(view), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    shares: Counter[Any] = Counter(view.owners)
    t = Table(title=f"view {view.epoch} ({view.slots} slots)")
    for col in ("serial", "address", "state", "slots"):
        t.add_column(col)
    for r in view.cards:
        t.add_row(r.serial, r.address, r.state.value, str(shares.get(r.serial, 0)))
    Console().print(t)
