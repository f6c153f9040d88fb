"""kvgate: KV-cache storage below the GPU for vLLM, SGLang and LMCache.

The public API is the client:

    from kvgate import Client
    # no target: the socket a bare `kvgate serve` listens on; or a path, or "host:port"
    with Client.connect(namespace="llama-3-8b|tp1|bf16") as c:
        c.put_many([b"k1", b"k2"], [buf1, buf2])
        c.lookup([b"k1", b"k2", b"k3"])   # -> 2

and, for asyncio, the same operations awaited:

    from kvgate import AsyncClient
    async with AsyncClient.connect(namespace="llama-3-8b|tp1|bf16") as c:
        await c.lookup([b"k1", b"k2", b"k3"])

Every exception kvgate raises is a ``KvgateError`` (the tree: ``kvgate.errors``).
"""

try:  # written at install from git: "0.1.dev330+g1a2b3c4" names the commit a build was made from
    from kvgate._version import version as __version__
except ImportError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

from kvgate.client import (  # noqa: E402
    AsyncClient,
    Client,
    DialogMark,
    GatewayError,
    GatewayTimeout,
    GatewayUnavailable,
    InvalidArgument,
    KvgateError,
    ObjectTooLarge,
)
from kvgate.errors import ConfigError  # noqa: E402

__all__ = [
    "AsyncClient",
    "Client",
    "ConfigError",
    "DialogMark",
    "GatewayError",
    "GatewayTimeout",
    "GatewayUnavailable",
    "InvalidArgument",
    "KvgateError",
    "ObjectTooLarge",
    "__version__",
]
