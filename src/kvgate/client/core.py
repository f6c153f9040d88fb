"""What ``Client`` and ``AsyncClient`` share: the session behind a lock, and every operation on it as steps.

Both clients run the same operations: the same argument checks
(``kvgate.client.args``), the same requests and replies (``kvgate.client.wire``),
the same paths for the bytes (a transport: ``kvgate.client.transport``,
``kvgate.client.regions``).  Only the waiting differs: ``Client`` performs an
operation's steps with blocking socket calls, ``AsyncClient`` on the event
loop.

An operation is made in two halves.  The ``*_op`` functions check their
arguments when called, in the caller's thread or task, before the call waits
for its client: a wrong one raises at once and nothing is sent.  They return
what to run on the ``Session`` once the call holds the client.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any, Callable

from kvgate.client.args import (
    Buffer,
    Scatter,
    byte_views,
    check_dialog,
    check_keys,
    check_position,
    check_retention,
    check_source,
)
from kvgate.client.regions import SharedMemoryTransport
from kvgate.client.transport import InlineTransport
from kvgate.config import default_socket_path
from kvgate.errors import InvalidArgument
from kvgate.client.wire import GatewayError, Link, ObjectTooLarge, Op, Wire, done  # noqa: F401  (ObjectTooLarge: imported from here)
from kvgate.keys import MARK_KEYS, DialogMark, parse_namespace_inputs
from kvgate.protocol import (
    CARD_ACTIONS,
    Cards,
    Clean,
    CountReply,
    Delete,
    ErrorCode,
    Exists,
    Hello,
    HelloReply,
    Hold,
    Lookup,
    Mark,
    Prewarm,
    Release,
    Stats,
)
from kvgate.types import split_host_port


def parse_target(target: str | None) -> tuple[str, Any]:
    """``target`` as (kind, address): a Unix socket path, or a TCP (host, port); None: the gateway's default
    socket (``kvgate.config.default_socket_path``, where a bare ``kvgate serve`` listens)."""
    if target is None:
        return "unix", default_socket_path()
    if target.startswith("unix://"):
        return "unix", target[len("unix://"):]
    if target.startswith("tcp://"):
        target = target[len("tcp://"):]
    elif "/" in target or target.endswith(".sock"):
        return "unix", target
    try:
        return "tcp", split_host_port(target, default_host="127.0.0.1")
    except ValueError as e:
        raise InvalidArgument(f"gateway address {target!r}: expected a socket path or host:port ({e})") from None


class Session:
    """Everything a call needs of its connection: the socket, its frames (``wire``), its payload path (``transport``).

    Reached only through the client's ``Guarded``, so only by the one call
    that holds the client, on the caller's thread (``Client``) or the event
    loop (``AsyncClient``).  Its operations yield steps and never block.
    """

    __slots__ = ("sock", "wire", "transport")

    def __init__(self, link: Link, local: bool):
        self.sock = link.sock
        self.wire = Wire(link)
        # The one place a transport is chosen: over the Unix socket the gateway can map this process's memory.
        self.transport = SharedMemoryTransport(self.wire) if local else InlineTransport(self.wire)

    def hello(self, msg: Hello) -> Op:
        reply, _ = yield from self.wire.call(msg)
        self.wire.max_frame_bytes = reply.max_frame_bytes
        self.transport.open(reply)
        return reply

    def ask(self, msg, answer: Callable[[Any], Any]) -> Op:
        reply, _ = yield from self.wire.call(msg)
        return answer(reply)

    def close(self) -> None:
        """Let go of the transport's regions and close the socket; no operation runs any more."""
        self.transport.close()
        self.sock.close()


class Guarded:
    """A client's ``Session``, handed out only to whoever holds the client's lock.

    The client keeps no other reference to its session, so every use of it
    holds the lock: ``with guarded as session`` (a ``threading.Lock``, for
    ``Client``) or ``async with guarded as session`` (an ``asyncio.Lock``).
    """

    __slots__ = ("_lock", "_session")

    def __init__(self, session: Session, lock):
        self._lock = lock
        self._session = session

    def __enter__(self) -> Session:
        self._lock.acquire()
        return self._session

    def __exit__(self, *exc) -> None:
        self._lock.release()

    async def __aenter__(self) -> Session:
        await self._lock.acquire()
        return self._session

    async def __aexit__(self, *exc) -> None:
        self._lock.release()


Operation = Callable[[Session], Op]  # what a call runs once it holds its client


class ClientCore:
    """The state both clients keep: the session behind its lock, and what any thread may touch at any time.

    A subclass makes the lock (one call holds the client from its first step
    to its last) and performs the steps of the ``Operation`` a call runs on
    the session its ``Guarded`` hands out.  Outside the lock it touches only
    the ``Link`` (``broken``, ``abort``) and what the hello told, which does
    not change after ``connect``.
    """

    def __init__(self, sock: socket.socket, local: bool, lock):
        self.local = local
        self._link = Link(sock)
        self._session = Guarded(Session(self._link, local), lock)
        self._hello = HelloReply()

    @property
    def broken(self) -> bool:
        """True once a call failed mid-frame: the client must not be used again."""
        return self._link.broken

    @property
    def session_id(self) -> int:
        return self._hello.session

    @property
    def fingerprint(self) -> str:
        """The gateway's key layout fingerprint."""
        return self._hello.fingerprint

    @property
    def max_frame_bytes(self) -> int:
        """The gateway's frame limit, learnt in hello (0: not known, no frame is refused here)."""
        return self._hello.max_frame_bytes

    def abort(self) -> None:
        """Wake any caller blocked in a call (it gets an error) and refuse new calls.

        Unlike ``close`` it does not wait for the call in progress, so it can
        be called from anywhere at any time (another thread, a signal handler's
        callback, shutdown).
        """
        self._link.abort()


# ---- the operations: arguments checked now, the rest once the call holds its client ------------


BLOCK_KEY_FORMS = ("", "vllm")


def hello_op(namespace: str, token: str | None, engine_id: str, role: str, salted: bool,
             want_shm: bool, block_keys: str = "", block_size: int = 0,
             namespace_inputs: str | Mapping[str, Any] = "") -> Operation:
    if block_keys not in BLOCK_KEY_FORMS:
        raise InvalidArgument(f"block_keys must be one of {BLOCK_KEY_FORMS}, got {block_keys!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise InvalidArgument(f"block_size must be an int >= 0 (tokens per key; 0: not said), got {block_size!r}")
    if isinstance(namespace_inputs, Mapping):
        namespace_inputs = json.dumps(namespace_inputs, sort_keys=True, separators=(",", ":"), default=str)
    if not isinstance(namespace_inputs, str):
        raise InvalidArgument(f"namespace_inputs must be a JSON object (str or mapping), got "
                              f"{type(namespace_inputs).__name__}")
    if namespace_inputs:
        try:
            parse_namespace_inputs(namespace_inputs)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    msg = Hello(namespace=namespace, token=token, engine_id=engine_id, role=role, pid=os.getpid(), salted=salted,
                want_shm=want_shm, block_keys=block_keys, block_size=block_size, namespace_inputs=namespace_inputs)
    return lambda s: s.hello(msg)


def register_region_op(path: Any, mapping: Buffer | None, local: bool) -> Operation:
    if not isinstance(path, str):
        raise InvalidArgument(f"path must be a str, not {type(path).__name__}")
    if not local:
        raise GatewayError(ErrorCode.BAD_REQUEST, "regions need a local (Unix socket) connection")
    return lambda s: s.transport.register_region(path, mapping)


def put_many_op(keys: Any, buffers: Any, retention: Any, dialog: Any, position: Any) -> Operation:
    bkeys = check_keys(keys)
    views = byte_views(buffers, "buffers", len(bkeys), writable=False)
    retention = check_retention(retention)
    dialog = check_dialog(dialog)
    position = check_position(position, len(bkeys))
    if not bkeys:
        return lambda s: done([])
    empty = next((i for i, v in enumerate(views) if v.nbytes == 0), None)
    if empty is not None:  # the gateway refuses them too; here a put split over frames stores nothing either
        raise GatewayError(ErrorCode.BAD_REQUEST, f"buffers[{empty}] is empty: the gateway stores no empty "
                           "objects; nothing was sent")
    return lambda s: s.transport.put(bkeys, views, retention, dialog, position)


def get_many_op(keys: Any, into: Any, dialog: Any, source: Any = None) -> Operation:
    bkeys = check_keys(keys)
    views = None if into is None else byte_views(into, "destination buffers", len(bkeys), writable=True,
                                                 scatter=True)
    dialog = check_dialog(dialog)
    source = check_source(source)
    if not bkeys:
        return lambda s: done([])
    if views is None:
        return lambda s: s.transport.get_packed(bkeys, dialog, source=source)
    if any(isinstance(v, Scatter) for v in views):
        return lambda s: s.transport.get_scattered(bkeys, views, dialog, source=source)
    return lambda s: s.transport.get_into(bkeys, views, dialog, source=source)


def _asking(msg, answer: Callable[[Any], Any]) -> Operation:
    return lambda s: s.ask(msg, answer)


def lookup_op(keys: Any, dialog: Any, source: Any = None) -> Operation:
    return _asking(Lookup(keys=check_keys(keys), dialog=check_dialog(dialog), source=check_source(source)),
                   lambda r: r.count)


def exists_many_op(keys: Any, dialog: Any, source: Any = None) -> Operation:
    return _asking(Exists(keys=check_keys(keys), dialog=check_dialog(dialog), source=check_source(source)),
                   lambda r: list(r.present))


def delete_many_op(keys: Any, dialog: Any) -> Operation:
    return _asking(Delete(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: r.count)


def hold_many_op(keys: Any, dialog: Any) -> Operation:
    return _asking(Hold(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: list(r.present))


def release_many_op(keys: Any) -> Operation:
    return _asking(Release(keys=check_keys(keys)), lambda r: r.count)


def prewarm_op(keys: Any, dialog: Any) -> Operation:
    return _asking(Prewarm(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: r.count)


def dialog_mark_op(keys: Any) -> Operation:
    msg = Mark(keys=check_keys(keys)[: MARK_KEYS + 1])  # the gateway looks at no more (+1: the mark past them)
    return _asking(msg, lambda r: DialogMark(r.mark, r.shared, [(p, msg.keys[p]) for p in r.heads]))


def stats_op() -> Operation:
    return _asking(Stats(), lambda r: r.stats)


def cards_op(action: str, target: str, now: bool, force: bool = False) -> Operation:
    if action not in CARD_ACTIONS:
        raise InvalidArgument(f"card action must be one of {', '.join(map(repr, CARD_ACTIONS))}, not {action!r}")
    if action != "list" and not target:
        raise InvalidArgument(f"card action {action!r} needs a target: a directory or Redis URL to add, else a serial")
    return _asking(Cards(action=action, target=target, now=now, force=force), lambda r: r)


def clean_op(namespace: str | None = None) -> Operation:
    def count(reply) -> int:
        assert isinstance(reply, CountReply)
        return reply.count

    return _asking(Clean(namespace=namespace), count)
