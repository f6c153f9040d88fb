"""The agent ``kvgate cluster serve``'s flags make (``kvgate.cluster.agent``; the flags: ``kvgate.cli.cluster_flags``),
with the card server of ``--export`` (``kvgate.cards.network.server``) it runs for its directory cards.

    kvgate cluster serve --cards /mnt/card* --etcd-endpoints 10.0.0.5:2379 10.0.0.6:2379
    kvgate cluster serve --etcd-member w1 --etcd-peer-url http://10.0.0.9:2380 \\
        --etcd-client-url http://10.0.0.9:2379 --etcd-initial-cluster s1=http://10.0.0.5:2380,...
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvgate.cluster.agent import AgentSettings, ClusterAgent, serve
from kvgate.cluster.member import EtcdMember
from kvgate.cards.network.server import CardExporter, tls_server_context
from kvgate.config import read_token
from kvgate.types import split_host_port

MEMBER_FLAGS = ("etcd_peer_url", "etcd_client_url", "etcd_initial_cluster")


def agent_from(args: argparse.Namespace) -> ClusterAgent:
    member = None
    if args.etcd_member:
        missing = [f"--{f.replace('_', '-')}" for f in MEMBER_FLAGS if not getattr(args, f)]
        if missing:
            raise ValueError(f"--etcd-member {args.etcd_member} needs {', '.join(missing)} as well")
        member = EtcdMember(args.etcd_member, args.etcd_peer_url, args.etcd_client_url, args.etcd_initial_cluster,
                            args.etcd_data_dir or f"./var/kvgate/etcd-{args.etcd_member}", token=args.cluster_name)
    elif any(getattr(args, f) for f in MEMBER_FLAGS) or args.etcd_data_dir:
        raise ValueError("--etcd-peer-url, --etcd-client-url, --etcd-initial-cluster and --etcd-data-dir go with "
                         "--etcd-member NAME (this host runs an etcd member); leave them out otherwise")
    endpoints = args.etcd_endpoints or ([] if member else ["127.0.0.1:2379"])
    export = None
    token = read_token(args.token_file, "--token-file") if args.token_file else None
    if args.export:
        try:
            export = split_host_port(args.export)
        except ValueError as e:
            raise ValueError(f"--export wants HOST:PORT with a fixed port (the cards' addresses name it), "
                             f"got {args.export!r} ({e})") from None
    tls = None
    if getattr(args, "tls_cert", None) or getattr(args, "tls_key", None):
        if not args.export or not args.tls_cert:
            raise ValueError("--tls-cert (and --tls-key) go with --export: they are the card server's certificate")
        tls = tls_server_context(args.tls_cert, args.tls_key)
    return ClusterAgent(AgentSettings(name=args.name, cards=args.cards, endpoints=endpoints, cluster=args.cluster_name,
                                      slots=args.slots, liveness_ttl_s=args.liveness_ttl, interval_s=args.interval,
                                      call_timeout_s=args.timeout, member=member,
                                      server=CardExporter([], *export, token=token, tls=tls) if export else None))


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        agent = agent_from(args)
    except ValueError as e:
        print(f"kvgate cluster serve: {e}", file=sys.stderr)
        return 2
    return serve(agent)
