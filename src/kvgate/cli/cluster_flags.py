"""The flags of ``kvgate cluster`` (the registry commands and ``serve``, the agent): argparse only.

``kvgate``'s command line is built whole for every command, ``serve`` and ``stat`` included, so this
module imports nothing of etcd3aio: its generated gRPC code refuses to load under a grpcio older
than the one it was generated with (etcd3aio 0.3.0: ``grpcio>=1.78.1``), and LMCache 0.5.6 pins
grpcio 1.78.0 (through ``grpcio-observability==1.78.0``).  The commands themselves
(``kvgate.cli.cluster``, ``kvgate.cli.agent``) import etcd3aio when they run;
``etcd_missing`` says what to do where it cannot load.
"""

from __future__ import annotations

import argparse
import socket

from kvgate.cluster.liveness import INTERVAL_S, LIVENESS_TTL_S
from kvgate.config import Config

ACTIONS = ("status", "cards", "view", "register", "drain", "undrain", "retire", "relocate", "publish", "leader",
           "serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, nargs="?", default="cards")
    p.add_argument("card", nargs="?", default="",
                   help="register: a directory, Redis URL or kvgate:// URL; otherwise a serial")
    p.add_argument("--etcd-endpoints", nargs="+", metavar="HOST:PORT",
                   help="etcd client endpoints (default 127.0.0.1:2379; serve with --etcd-member: its own)")
    p.add_argument("--cluster-name", default="default")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds each etcd call may take (default 2)")
    p.add_argument("--slots", type=int, default=Config().storage_slots,
                   help="publish, serve: storage_slots of the gateways (default %(default)s)")
    p.add_argument("--tls-ca-file", metavar="FILE",
                   help="register: the PEM CA file a kvgates:// card's certificate is checked against (the "
                        "gateways' card_tls_ca_file; default: the system's trusted CAs)")
    p.add_argument("--address", metavar="PATH|GLOB|URL",
                   help="register: where gateways reach a directory card when that is not where this host has "
                        "it (a shared filesystem mounted elsewhere: a glob under which each gateway finds it by "
                        "serial); relocate: where gateways reach the card from now on")
    p.add_argument("--force", action="store_true",
                   help="drain: even the last card in service (every gateway's puts then answer False until a "
                        "card joins)")
    p.add_argument("--json", action="store_true")
    add_serve_arguments(p.add_argument_group("serve (the agent)"))


def add_serve_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--name", default=socket.gethostname(), help="this agent's name (default: the host name)")
    g.add_argument("--cards", nargs="+", default=[], metavar="PATH|GLOB|URL",
                   help="the cards this host serves (none on a witness host); a glob is looked at again each round")
    g.add_argument("--liveness-ttl", type=int, default=LIVENESS_TTL_S, metavar="SECONDS",
                   help="TTL of the lease its alive/ keys are under, renewed every third (default %(default)s)")
    g.add_argument("--interval", type=float, default=INTERVAL_S, metavar="SECONDS",
                   help="how often it looks at its cards and, leading, at the registry (default %(default)s)")
    g.add_argument("--etcd-member", metavar="NAME", help="run an etcd member of this name as a child")
    g.add_argument("--etcd-peer-url", metavar="URL", help="the member's peer URL (http://host:2380)")
    g.add_argument("--etcd-client-url", metavar="URL", help="the member's client URL (http://host:2379)")
    g.add_argument("--etcd-initial-cluster", metavar="NAME=URL,...", help="every member's peer URL")
    g.add_argument("--etcd-data-dir", metavar="DIR", help="the member's data (default ./var/kvgate/etcd-NAME)")
    g.add_argument("--export", metavar="HOST:PORT",
                   help="serve this host's directory cards to gateways on other hosts on this address (a fixed "
                        "port: it is part of each card's registered kvgate://HOST:PORT/SERIAL address)")
    g.add_argument("--tls-cert", metavar="FILE",
                   help="serve: a PEM certificate chain for --export; every connection is TLS and the cards are "
                        "registered as kvgates:// (gateways check it against their card_tls_ca_file)")
    g.add_argument("--tls-key", metavar="FILE", help="serve: the PEM private key of --tls-cert (if not in it)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--token-file", metavar="FILE",
                   help="serve: the token gateways must present to --export (their card_token_file; needed beyond "
                        "loopback); register: the token a kvgate:// card's server requires")


def etcd_missing(what: str, error: BaseException) -> str:
    """One line for a cluster command (or cluster mode) whose etcd client cannot be imported here.

    ``error``: what importing ``kvgate.cli.cluster`` (or ``kvgate.cluster.follower``) raised: ImportError when
    etcd3aio is not installed, RuntimeError from its generated gRPC code when grpcio is older than it
    wants (the LMCache environment)."""
    return (f"{what} needs etcd3aio, which cannot be loaded in this environment ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else 'no detail'}). Run the cluster "
            f"commands from an environment with etcd3aio and grpcio>=1.78.1 (`pip install kvgate`); LMCache "
            f"0.5.6 pins grpcio 1.78.0, so its environment runs the gateway and every command but these")
