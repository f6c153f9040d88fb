"""``kvgate router``: an OpenAI-compatible front for N engine endpoints (``kvgate.routing.front``).

    kvgate router --endpoint http://10.0.0.1:8000 --endpoint http://10.0.0.2:8000 --port 8000
    kvgate router --config router.yaml --policy least-loaded

Runs in the foreground until Ctrl-C or SIGTERM, which stop it cleanly (the server closes, the endpoint
poller stops, the client session closes).  Bad flags or config: one line naming the key, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvgate.errors import ConfigError, InvalidArgument
from kvgate.routing.settings import HASH_ALGOS, POLICIES, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", action="append", metavar="URL",
                   help="an engine's base URL (http://host:port); repeat for each engine")
    p.add_argument("--config", metavar="FILE", help="YAML file of router keys (endpoints with their events and "
                   "stated hash settings: docs/router.md); flags given override its keys")
    p.add_argument("--host", help="address to serve on (0.0.0.0)")
    p.add_argument("--port", type=int, help="port to serve on (8000; 0: a free one, printed at start)")
    p.add_argument("--policy", choices=POLICIES, help="how to choose an endpoint (cache-aware)")
    p.add_argument("--block-size", type=int, help="the engines' block size in tokens, as in vLLM's --block-size (16)")
    p.add_argument("--hash-algo", choices=HASH_ALGOS,
                   help="the engines' --prefix-caching-hash-algo (sha256)")
    p.add_argument("--hash-seed", metavar="SEED", help="the engines' PYTHONHASHSEED (default: they run without one)")
    p.add_argument("--poll-interval", type=float, metavar="SECONDS", help="health and load poll period (1)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {"endpoints": args.endpoint, "host": args.host, "port": args.port, "policy": args.policy,
                 "block_size": args.block_size, "hash_algo": args.hash_algo, "hash_seed": args.hash_seed,
                 "poll_interval": args.poll_interval}
    try:
        settings = load(args.config, overrides)
    except ConfigError as e:
        print(f"kvgate router: {e}", file=sys.stderr)
        return 2
    from kvgate.routing.front import serve  # aiohttp only when the router runs

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(router) -> None:
            print(f"kvgate router: serving on {settings.host}:{router.port} ({router.policy.name}, "
                  f"{len(router.pool.routable())} of {len(router.pool.endpoints)} endpoints routable)", flush=True)

        try:
            await serve(settings, stop, ready)
        except InvalidArgument as e:
            print(f"kvgate router: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"kvgate router: cannot serve on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
            return 2
        return 0

    return asyncio.run(main())
