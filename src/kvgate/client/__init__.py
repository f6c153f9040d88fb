"""The client of a kvgate gateway: ``Client`` (blocking, thread-safe) and ``AsyncClient`` (asyncio).

    from kvgate.client import Client
    with Client.connect(namespace="my-model|tp1|bf16") as c:
        c.put_many(keys, buffers)

What is public is what this package exports (pinned by tests/client/test_public_api.py); the modules
under it are the client's parts, each with its contract in its docstring:

- ``sync_client`` / ``async_client``: the two front ends, the same operations;
- ``core``: what both share (argument checks, the operations as steps a front end drives);
- ``args``: checking and normalising what a caller passes;
- ``wire``: frames on the connection, the steps an operation yields;
- ``transport`` / ``regions``: how bulk bytes travel, inline in frames or through shared memory;
- ``crossmem``: a get's bytes copied straight out of the gateway's memory (Linux).

Every error a call raises is a ``KvgateError`` (``kvgate.errors``: the tree, and which builtin
exception each also is).
"""

from kvgate.client.args import Buffer, Pieces
from kvgate.client.async_client import AsyncClient
from kvgate.client.sync_client import Client
from kvgate.errors import (
    BadKey,
    GatewayError,
    GatewayTimeout,
    GatewayUnavailable,
    InvalidArgument,
    KvgateError,
    NotPermitted,
    ObjectTooLarge,
)
from kvgate.keys import MARK_KEYS, DialogMark

__all__ = [
    "AsyncClient",
    "BadKey",
    "Buffer",
    "Client",
    "DialogMark",
    "GatewayError",
    "GatewayTimeout",
    "GatewayUnavailable",
    "InvalidArgument",
    "KvgateError",
    "MARK_KEYS",
    "NotPermitted",
    "ObjectTooLarge",
    "Pieces",
]
