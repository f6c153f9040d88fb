"""`kvgate` command line: serve, stat, fingerprint, clean, cards, cluster, export, bench."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
from typing import Any

from kvgate import config as config_mod
from kvgate.config import ConfigError
from kvgate.errors import KvgateError


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="gateway Unix socket (default: the one for --port)")
    p.add_argument("--address", help="gateway host:port instead of the socket")
    port = config_mod.FIELDS_BY_NAME["port"].default
    p.add_argument("--port", type=int, default=port, help=f"gateway port, to derive the default socket ({port})")
    p.add_argument("--token-file", help="file holding the token of a non-loopback TCP listener")


def _target(args) -> tuple[str, str | None]:
    token = config_mod.read_token(args.token_file, "--token-file") if args.token_file else None
    return args.address or args.socket or config_mod.default_socket_path(args.port), token


def build_parser() -> argparse.ArgumentParser:
    from kvgate import __version__

    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache storage gateway for LLM inference engines")
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway in the foreground")
    p.add_argument("--config", help="YAML config file; flags override its keys")
    config_mod.add_flags(p)

    p = sub.add_parser("stat", help="counters and card states of a running gateway")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON snapshot")
    p.add_argument("--namespaces", action="store_true", help="only the namespaces: objects, bytes, hits of each")
    p.add_argument("--watch", nargs="?", const=1.0, type=float, metavar="SECONDS",
                   help="redraw every SECONDS (default 1) with rates per second, until Ctrl-C or SIGTERM (into a "
                        "file or a pipe: each view below the last, as it is taken)")
    p.add_argument("--updates", type=int, metavar="N", help=argparse.SUPPRESS)  # --watch: stop after N redraws

    p = sub.add_parser("fingerprint", help="print the key layout fingerprint of a config without starting")
    p.add_argument("--config", help="YAML config file")
    config_mod.add_flags(p)

    p = sub.add_parser("clean", help="ask a running gateway to delete every object (over its Unix socket)")
    _add_target(p)
    p.add_argument("--namespace", help="delete only the objects of this namespace")
    p = sub.add_parser("cards", help="list a running gateway's cards, or add, drain, undrain or remove one",
                       description="Changes apply now, while the engine serves; they last until the gateway "
                                   "restarts (edit storage_devices and send SIGHUP to make them the config).")
    _add_target(p)
    p.add_argument("action", choices=["list", "add", "drain", "undrain", "remove"], nargs="?", default="list")
    p.add_argument("card", nargs="?", default="",
                   help="add: a directory, Redis URL or kvgate:// URL; otherwise a card's serial")
    p.add_argument("--now", action="store_true", help="drain: the card leaves at once, what it holds unread")
    p.add_argument("--force", action="store_true",
                   help="drain --now, remove: even if that leaves no card in service, or loses objects a running "
                        "drain is moving or has moved onto the card (refused otherwise, saying what would be lost)")
    p.add_argument("--json", action="store_true", help="print the reply as JSON")

    p = sub.add_parser("cluster", help="the card registry of a cluster in etcd: cards, view, register, drain, "
                                       "undrain, retire, publish, leader; serve: the agent of a host")
    from kvgate.cli.cluster_flags import add_arguments as add_cluster_arguments  # no etcd3aio: see there

    add_cluster_arguments(p)

    p = sub.add_parser("export", help="serve directory cards of this host to gateways on others (kvgate:// cards)",
                       description="Prints the kvgate:// (kvgates:// with --tls-cert) URL of each card; a gateway "
                                   "lists it in storage_devices.")
    p.add_argument("--cards", nargs="+", required=True, metavar="DIR", help="card directories (created beforehand)")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="TCP address to serve on")
    p.add_argument("--num-dbs", type=int, default=1, help="shards of the cards when a gateway names none (1)")
    p.add_argument("--max-object-bytes", type=config_mod.parse_size, default=256 << 20,
                   help="largest object file served or taken (256MiB)")
    p.add_argument("--sync-writes", action="store_true", help="fsync every object before acknowledging it")
    p.add_argument("--token-file", metavar="FILE",
                   help="a token gateways must present (their card_token_file); needed beyond loopback")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: every connection is TLS (kvgates:// "
                   "cards; gateways check it against their card_tls_ca_file)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (if not in the same file)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    p = sub.add_parser("router", help="an OpenAI-compatible front that routes requests to N engines "
                       "(cache-aware, least-loaded or round-robin)")
    from kvgate.cli.router import add_arguments as add_router_arguments

    add_router_arguments(p)

    try:  # optional: a missing bench module must not break serve/stat/clean
        from kvgate.bench.command import add_arguments
    except ImportError:
        add_arguments = None
    if add_arguments is not None:
        p = sub.add_parser("bench", help="measure the gateway against this machine's physical limits")
        add_arguments(p)
    return parser


def _config_from(args) -> config_mod.Config:
    overrides = {f.name: getattr(args, f.name, None) for f in config_mod.FIELDS}
    return config_mod.load(getattr(args, "config", None), overrides)


def cmd_serve(args) -> int:
    from kvgate.gateway.server import StartupError, run_gateway

    cfg = _config_from(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    card_source = None
    if cfg.cluster_mode:  # the cards come from the cluster's registry
        try:
            from kvgate.cluster.follower import ClusterCards
        except (ImportError, RuntimeError) as e:  # RuntimeError: etcd3aio's gRPC code under an older grpcio
            from kvgate.cli.cluster_flags import etcd_missing

            logging.getLogger("kvgate").error("cannot start: %s", etcd_missing("cluster mode (cluster_etcd_endpoints)", e))
            return 2
        card_source = functools.partial(ClusterCards, cfg)
    try:
        asyncio.run(run_gateway(cfg, reload=lambda: _config_from(args), card_source=card_source))
    except StartupError as e:
        logging.getLogger("kvgate").error("cannot start: %s", e)
        return 2
    return 0


def cmd_fingerprint(args) -> int:
    """The layout the gateway would compute: same card discovery (globs, Redis), labels only read."""
    from kvgate.cards import expand, make_card
    from kvgate.placement import SlotMap, fingerprint

    cfg = _config_from(args)
    serials = []
    for pattern in cfg.storage_devices:
        locations = expand(pattern)
        if not locations:
            print(f"kvgate: card {pattern}: nothing matches", file=sys.stderr)
            return 2
        for loc in locations:
            card = make_card(loc, cfg)
            try:
                serials.append(card.check())
            except OSError as e:
                print(f"kvgate: card {loc} has no readable label ({e}); a card gets its serial on first use",
                      file=sys.stderr)
                return 2
            finally:
                card.close()
    unique = sorted(set(serials))
    print(fingerprint(SlotMap(unique, cfg.storage_slots), cfg.num_dbs, cfg.key_placement))
    return 0


class Unreachable(KvgateError, Exception):
    """The gateway could not be reached at the address the command tried."""


def _admin_client(args):
    from kvgate.client import Client

    target, token = _target(args)
    try:
        return Client.connect(target, role="admin", token=token, want_shm=False, timeout=10)
    except (ConnectionError, FileNotFoundError, TimeoutError) as e:
        # The default socket depends on XDG_RUNTIME_DIR and --port: name the one tried.
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise Unreachable(f"cannot reach the gateway at {target}: {why} (is it running? pass --socket PATH "
                          "or --address HOST:PORT)") from None


def cmd_stat(args) -> int:
    from rich.console import Console

    from kvgate import statview

    if args.watch is not None and (args.json or args.watch <= 0):
        print("kvgate stat: --watch SECONDS (above 0) redraws tables; --json prints one snapshot", file=sys.stderr)
        return 2
    with _admin_client(args) as c:
        if args.watch is not None:
            statview.watch(c.stats, args.watch, args.updates, args.namespaces)
            return 0
        snap = c.stats()
    if args.json:
        print(json.dumps(snap.get("namespaces", {}) if args.namespaces else snap, indent=2, sort_keys=True))
    else:
        Console().print(statview.view(snap, args.namespaces))
    return 0


def cmd_clean(args) -> int:
    from kvgate.client import GatewayError
    from kvgate.statview import shown

    with _admin_client(args) as c:
        try:
            n = c.clean(args.namespace)
        except GatewayError as e:
            print(f"kvgate clean: {e.code}: {shown(e.message)}", file=sys.stderr)
            return 1
    print(f"deleted {n} objects")
    return 0


def cmd_cards(args) -> int:
    from kvgate.client import GatewayError
    from kvgate.statview import shown

    if args.action != "list" and not args.card:
        what = ("a directory, Redis URL or kvgate:// URL" if args.action == "add"
                else "its serial, from `kvgate cards list`")
        print(f"kvgate cards {args.action}: name the card ({what})", file=sys.stderr)
        return 2
    with _admin_client(args) as c:
        try:
            reply = c.cards(args.action, args.card, now=args.now, force=args.force)
        except GatewayError as e:
            print(f"kvgate cards {args.action}: {shown(e.message)}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"generation": reply.generation, "fingerprint": reply.fingerprint, "cards": reply.cards,
                          "message": reply.message}, indent=2, sort_keys=True))
        return 0
    if reply.message:
        print(shown(reply.message))
    print_cards(reply.cards, reply.generation, reply.fingerprint)
    return 0


def print_cards(cards: list[dict[str, Any]], generation: int, fingerprint: str) -> None:
    from rich.console import Console

    from kvgate.statview import card_list_table

    Console().print(card_list_table(cards, generation, fingerprint))


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader went away (then it is pointed at /dev/null, so the
    interpreter's last flush raises nothing)."""
    try:
        sys.stdout.flush()
        return False
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "fingerprint":
            return cmd_fingerprint(args)
        if args.command == "stat":
            return cmd_stat(args)
        if args.command == "clean":
            return cmd_clean(args)
        if args.command == "cards":
            return cmd_cards(args)
        if args.command == "router":
            from kvgate.cli.router import run as run_router

            return run_router(args)
        if args.command == "export":
            from kvgate.cards.network.server import serve

            logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            try:
                return serve(args.cards, args.listen, args.num_dbs, args.max_object_bytes, args.sync_writes,
                             args.token_file, args.tls_cert, args.tls_key)
            except (ValueError, OSError) as e:
                print(f"kvgate export: {e}", file=sys.stderr)
                return 2
        if args.command == "cluster":
            try:
                from kvgate.cli.cluster import run as run_cluster
            except (ImportError, RuntimeError) as e:  # RuntimeError: etcd3aio's gRPC code under an older grpcio
                from kvgate.cli.cluster_flags import etcd_missing

                print(f"kvgate: {etcd_missing('kvgate cluster ' + args.action, e)}", file=sys.stderr)
                return 2
            if args.action == "serve":  # the agent, with the card server it may run (kvgate.cli.agent)
                from kvgate.cli.agent import run_serve

                return run_serve(args)
            return run_cluster(args)
        if args.command == "bench":
            from kvgate.bench.command import run_bench

            return run_bench(args)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    except Unreachable as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if _stdout_gone():  # `kvgate stat --json | head`: the reader left, nothing is wrong with the gateway
            return 0
        print(f"kvgate: cannot reach the gateway: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, FileNotFoundError) as e:
        print(f"kvgate: cannot reach the gateway: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a refusal (NOT_AUTHORIZED, ...): one line, not a traceback
        from kvgate.client import GatewayError
        from kvgate.statview import shown  # a refusal may quote what a client chose (an engine id)

        if not isinstance(e, GatewayError):
            raise
        print(f"kvgate: {e.code}: {shown(e.message)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
