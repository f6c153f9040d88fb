"""``kvgate cluster``: the card registry from the command line (until agents keep it: cluster mode is in progress).

    kvgate cluster cards                  the registered cards
    kvgate cluster view                   the published view: epoch, cards, slots per card
    kvgate cluster register PATH|URL      label the card if it has no label yet and register it (joining)
    kvgate cluster drain|undrain|retire SERIAL
    kvgate cluster publish                the next view from the registry (joining cards become active), as
                                          the leader will; nothing when the layout would not change

Every command takes ``--etcd-endpoints`` and ``--cluster-name`` and answers
within ``--timeout`` per etcd call; ``--json`` prints what it read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from typing import Any

import msgspec
from etcd3aio import Etcd3Client, EtcdError

from kvgate.cards import is_network, is_redis, make_card
from kvgate.cluster.registry import CardRecord, CardState, Registry, RegistryConflict, RegistryUnavailable, View
from kvgate.config import Config

ACTIONS = ("cards", "view", "register", "drain", "undrain", "retire", "publish")
CONNECT_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, nargs="?", default="cards")
    p.add_argument("card", nargs="?", default="",
                   help="register: a directory, Redis URL or kvgate:// URL; otherwise a serial")
    p.add_argument("--etcd-endpoints", nargs="+", default=["127.0.0.1:2379"], metavar="HOST:PORT")
    p.add_argument("--cluster-name", default="default")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds each etcd call may take (default 2)")
    p.add_argument("--slots", type=int, default=Config().storage_slots,
                   help="publish: storage_slots of the gateways (default %(default)s)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except (RegistryUnavailable, RegistryConflict, ValueError, OSError) as e:
        print(f"kvgate cluster {args.action}: {e}", file=sys.stderr)
        return 1 if isinstance(e, RegistryConflict) else 2


async def _run(args: argparse.Namespace) -> int:
    if args.action in ("register", "drain", "undrain", "retire") and not args.card:
        raise ValueError("name the card (register: a directory, Redis URL or kvgate:// URL; otherwise its serial)")
    client = Etcd3Client(args.etcd_endpoints, rpc_max_attempts=1)
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
    if args.action == "cards":
        _show_cards(await reg.cards(), args.json)
    elif args.action == "view":
        view = await reg.view()
        if view is None:
            print("no view published yet (kvgate cluster publish)", file=sys.stderr)
            return 1
        _show_view(view, args.json)
    elif args.action == "register":
        record = await asyncio.to_thread(_label, args.card)
        if not await reg.register(record):
            raise RegistryConflict(f"card {record.serial} ({args.card}) is registered already")
        print(f"card {record.serial} at {record.address} registered (joining; `kvgate cluster publish`)")
    elif args.action in ("drain", "undrain", "retire"):
        state = {"drain": CardState.DRAINING, "undrain": CardState.ACTIVE, "retire": CardState.RETIRED}[args.action]
        record = await reg.set_state(args.card, state)
        print(f"card {record.serial}: {record.state.value}")
    elif args.action == "publish":
        return await _publish(reg, args.slots, args.json)
    return 0


def _label(location: str) -> CardRecord:
    """The card's serial (labelling a new card), read where it is: a gateway will find the same label."""
    card = make_card(location, Config(storage_devices=[location], create_card_dirs=False))
    try:
        serial = card.open()
    finally:
        card.close()
    kind = "kvgate" if is_network(location) else "redis" if is_redis(location) else "directory"
    return CardRecord(serial=serial, kind=kind, address=location)


async def _publish(reg: Registry, slots: int, as_json: bool) -> int:
    records = await reg.cards()
    for r in records:
        if r.state is CardState.JOINING:
            await reg.set_state(r.serial, CardState.ACTIVE)
    records = await reg.cards()
    current = await reg.view()
    view = View.of((current.epoch if current else 0) + 1, records, slots)
    if current is not None and current.slots == slots and current.same_layout(view):
        print(f"view {current.epoch} is current: nothing to publish")
        return 0
    await reg.publish(view)
    _show_view(view, as_json)
    return 0


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
