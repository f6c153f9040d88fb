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
agent's own flags are ``kvgate.cli.agent``'s.
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

from kvgate.cards import CardUnavailable, is_redis
from kvgate.cards.redis.keys import cluster_cards
from kvgate.cluster.registry import (CardRecord, CardState, Registry, RegistryConflict, RegistryUnavailable, View,
                                     etcd_client)
from kvgate.cli.cluster_flags import ACTIONS, add_arguments  # noqa: F401  (kvgate's parser takes them from flags)
from kvgate.statview import cell, fmt_bytes, shown  # what registries, agents and cards name is printed escaped

DEFAULT_ENDPOINTS = ["127.0.0.1:2379"]
CONNECT_S = 5.0


def run(args: argparse.Namespace) -> int:
    args.etcd_endpoints = args.etcd_endpoints or DEFAULT_ENDPOINTS
    try:
        return asyncio.run(_run(args))
    except (RegistryUnavailable, RegistryConflict, ValueError, OSError) as e:
        print(f"kvgate cluster {args.action}: {shown(e)}", file=sys.stderr)
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
    if args.action in ("status", "cards", "view") and await _no_such_cluster(reg, args):
        return 1
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
            print(shown(name))
        return 0 if name is not None else 1
    elif args.action == "register":
        return await _register(reg, args.card, args.address, args.token_file, args.tls_ca_file)
    elif args.action in ("drain", "undrain", "retire"):
        state = {"drain": CardState.DRAINING, "undrain": CardState.ACTIVE, "retire": CardState.RETIRED}[args.action]
        if state is CardState.DRAINING and not args.force:
            await _refuse_draining_the_last(reg, args.card)
        try:
            record = await reg.set_state(args.card, state)
        except RegistryConflict as e:
            if state is CardState.RETIRED:
                raise RegistryConflict(f"{e}{await _retire_hint(reg, args)}") from None
            raise
        print(f"card {shown(record.serial)}: {record.state.value}")
    elif args.action == "relocate":
        record = await reg.set_address(args.card, args.address)
        print(f"card {shown(record.serial)}: reached at {shown(record.address)} (the leader or `kvgate cluster "
              "publish` puts it in the next view; each gateway finds it there by its label)")
    elif args.action == "publish":
        return await _publish(reg, args.slots, args.json)
    return 0


def _command(args: argparse.Namespace, action: str, card: str) -> str:
    """The ``kvgate cluster`` command line of ``action`` on ``card`` with this one's etcd and cluster flags."""
    flags = ""
    if args.etcd_endpoints != DEFAULT_ENDPOINTS:
        flags += " --etcd-endpoints " + " ".join(args.etcd_endpoints)
    if args.cluster_name != "default":
        flags += f" --cluster-name {args.cluster_name}"
    return f"kvgate cluster {action}{' ' + card if card else ''}{flags}"


async def _retire_hint(reg: Registry, args: argparse.Namespace) -> str:
    """What to do first when a card cannot be retired yet: a card in the view is drained (its objects copied
    onto the others by the gateways) before it leaves."""
    record = await reg.card(args.card)
    if record is None:
        return ""
    if record.state is CardState.ACTIVE:
        return (f"; drain it first ({_command(args, 'drain', record.serial)}): the gateways copy its objects onto "
                "the other cards, the leader marks it drained, and then it can be retired")
    if record.state is CardState.DRAINING:
        return ("; it is draining: it can be retired once the leader marks it drained, when every gateway has "
                f"copied its objects away (`{_command(args, 'cards', '')}` shows its state)")
    return ""


async def _no_such_cluster(reg: Registry, args: argparse.Namespace) -> bool:
    """Say so and return True when etcd holds nothing of ``--cluster-name`` (a typo shows an empty cluster
    otherwise), naming the clusters it holds."""
    if await reg.exists():
        return False
    names = await reg.clusters()
    there = (f"clusters there: {', '.join(shown(n) for n in names)}" if names else
             "it holds none yet (kvgate cluster register makes one)")
    print(f"kvgate cluster {args.action}: no cluster named {shown(args.cluster_name)!r} in etcd at "
          f"{', '.join(args.etcd_endpoints)}; {there} (--cluster-name)", file=sys.stderr)
    return True


async def _refuse_draining_the_last(reg: Registry, serial: str) -> None:
    """A drain that would leave the cluster no card in service (every gateway's puts then answer False) is
    refused (``RegistryConflict``) unless forced.  (A cluster drain always copies first, and only a drained
    or a joining card can be retired, so no change here drops what a drain moved.)"""
    serving = [r.serial for r in await reg.cards() if r.state in (CardState.ACTIVE, CardState.JOINING)]
    if serving == [serial]:
        raise RegistryConflict(f"card {serial} not drained: it is the last card in service, and without it every "
                               "gateway refuses every put (answers False). Instead: register another card first "
                               "(`kvgate cluster register`); or --force to drain it anyway")


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
    print(f"leader: {shown(leader) if leader else 'none (is a `kvgate cluster serve` agent running?)'}")
    print(f"view: epoch {epoch}, {doc['view_cards']} cards; registered: {by_state}")
    not_alive = [shown(s) for s in doc["cards_not_alive"]]
    print(f"liveness: {len(alive)} cards reported alive; not reported: {len(not_alive)}"
          + (f" ({', '.join(not_alive[:8])}{', ...' if len(not_alive) > 8 else ''})" if not_alive else ""))
    for name, a in sorted(agents.items()):
        a = a if isinstance(a, dict) else {}
        print(f"agent {shown(name)}: host {shown(a.get('host'))}, {len(a.get('cards') or [])} cards"
              + (f", exports {shown(a['export'])}" if a.get("export") else "")
              + (f", etcd member {shown(a['etcd_member'])}" if a.get("etcd_member") else ""))
    for gid, g in sorted(gateways.items()):
        g = g if isinstance(g, dict) else {}
        print(f"gateway {shown(gid)}: view {shown(g.get('epoch'))}, layout {shown(g.get('fingerprint') or '?')}")
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
        try:
            record = await asyncio.to_thread(label_card, location, address, token_file, tls_ca_file)
        except CardUnavailable as e:
            raise CardUnavailable(e.errno, _as_register_says(e.strerror), e.filename) from None
        if await reg.register(record):
            taken += 1
            print(f"card {shown(record.serial)} at {shown(record.address)} registered (joining; the leader or "
                  "`kvgate cluster publish` makes it active)")
        else:
            print(f"card {shown(record.serial)} at {shown(record.address)} is registered already",
                  file=sys.stderr)
    return 0 if taken else 1


# What a card's error suggests to a gateway's operator (a config key) and what register takes instead.
_REGISTER_SAYS = ((", or set create_card_dirs: true", " (register creates no card directory)"),
                  ("set card_token_file on the gateway to the file of kvgate export --token-file",
                   "pass --token-file FILE, the file of its server's kvgate export --token-file (and set "
                   "card_token_file on the gateways)"),
                  ("set card_tls_ca_file to the CA that signed it",
                   "pass --tls-ca-file FILE, the CA that signed it (and set card_tls_ca_file on the gateways)"),
                  ("set card_tls_ca_file to the CA of its certificate",
                   "pass --tls-ca-file FILE, the CA of its certificate (and set card_tls_ca_file on the gateways)"))


def _as_register_says(why: str) -> str:
    for gateway_says, register_says in _REGISTER_SAYS:
        why = why.replace(gateway_says, register_says)
    return why


def _show_cards(records: list[CardRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps(msgspec.to_builtins(records), indent=2))
        return
    from rich.console import Console

    # The address under the serial (dimmed), as `kvgate cards` shows a card: beside it, at 80 columns, a
    # long path got 7 columns.
    t = _table(f"registered cards ({len(records)})", ("serial / address", "kind", "state", "capacity", "weight"))
    for r in records:
        t.add_row(f"{cell(r.serial)}\n[dim]{cell(r.address)}[/]", cell(r.kind), cell(r.state.value),
                  fmt_bytes(r.capacity) if r.capacity else "-", f"{r.weight:g}")
    Console().print(t)


def _table(title: str, columns: tuple[str, ...]) -> Any:
    """A table of cards whose serials stay whole (they are what the other commands take): a column that holds
    an address (``address``, or the first: a serial over its address) folds anywhere and takes the width the
    others leave; the others (serial alone, kind, state, counts: short) stay whole, a size wraps at its
    space.  Cells go through ``kvgate.statview.cell``."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title_justify="left")
    for i, col in enumerate(columns):
        folds = col == "address" or "/" in col
        # A ratio, not a min_width: rich widens a min_width column after fitting the table, past the terminal.
        t.add_column(col, no_wrap=not folds and col != "capacity", overflow="fold" if folds else "ellipsis",
                     ratio=1 if folds else None, min_width=len(col))
    return t


def _show_view(view: View, as_json: bool) -> None:
    if as_json:
        print(json.dumps(msgspec.to_builtins(view), indent=2))
        return
    from rich.console import Console

    shares: Counter[Any] = Counter(view.owners)
    t = _table(f"view {view.epoch} ({view.slots} slots)", ("serial", "address", "state", "slots"))
    for r in view.cards:
        t.add_row(cell(r.serial), cell(r.address), cell(r.state.value), str(shares.get(r.serial, 0)))
    Console().print(t)
