"""The asyncio client of a kvgate gateway: ``Client``'s operations as coroutines.

    async with AsyncClient.connect(namespace="my-model|tp1|bf16") as c:
        await c.put_many(keys, buffers)              # -> [True, ...]
        await c.get_many(keys, into=buffers)         # fills buffers; None for a miss

Everything but the waiting is ``Client``'s own code (``kvgate.client.core``):
the same argument checks, requests, replies, errors and paths for the bytes.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Mapping, Sequence

from kvgate.client import core
from kvgate.client.args import Buffer
from kvgate.client.wire import (
    CLOSED_BY_GATEWAY,
    SEND_PARTS,
    Copy,
    Op,
    Recv,
    Send,
    Steps,
    call_failure,
    connect_failure,
    not_permitted,
)
from kvgate.errors import GatewayUnavailable
from kvgate.keys import DialogMark

# A copy into or out of the session region of at least this many bytes runs on a worker thread, so the
# event loop runs meanwhile; a smaller one runs on the loop.  Measured here (2 shared cores, the loop's
# longest stall under a 1 ms ticker, medians): copied on the loop, 4 MiB held it ~1 ms, 16 MiB ~4.5 ms,
# 64 MiB 16-22 ms; on a thread ~0.6-5 ms whatever the size (the copy takes the GIL back between
# objects, so the loop waits up to a GIL switch interval, 5 ms), and the hand-off costs ~0.1 ms.
OFFLOAD_BYTES = 4 << 20


class _Default:
    def __repr__(self) -> str:
        return "the client's timeout"


DEFAULT: Any = _Default()  # a call's ``timeout`` when not given: the one of ``connect`` / ``set_timeout``


class AsyncClient(core.ClientCore):
    """A kvgate client for asyncio: the operations of ``Client``, awaited.

    Same arguments, results and errors as ``Client``: a wrong argument
    raises ``TypeError``/``ValueError`` naming it when the call is awaited,
    before anything is sent, and the client stays usable; the gateway's
    refusals are ``GatewayError``; bulk bytes take the same paths (over the
    Unix socket the session's shared-memory region or a registered region,
    over TCP the frames, received straight into the destination buffers).

    **Concurrency.** Calls from several tasks are serialised per client, as
    ``Client`` serialises threads: a call holds the client (an
    ``asyncio.Lock``) from its first request to its last copy, and calls run
    in the order they asked; the session (its socket, request ids, regions)
    is reached only through that lock.  The protocol would let requests be pipelined
    (each carries an id), but the session's shared-memory region is one
    buffer per session: a get's results wait there until they are copied
    out, and a put's bytes until the gateway has read them, so two calls in
    flight would overwrite each other's bytes.  Serialised calls are exactly
    as correct as calls from a client each.  For transfers in parallel,
    open several clients (each has its own session; all may share the
    engine's ``engine_id``).

    **Timeouts.** Each call has a deadline: its ``timeout=`` argument, else
    the client's (``connect(timeout=...)``, ``set_timeout``; None: none).
    It covers waiting for the client too.  A call that runs past it raises
    ``TimeoutError``; if it had sent anything, the client is broken (the
    reply could be misread as the next call's), and every later call raises
    ``ConnectionError``: connect again.  A gateway that dies mid-call
    (closes the connection) raises ``ConnectionError``, as for ``Client``.

    **Cancellation.** A task cancelled while it waits for the client leaves
    it as it was.  Cancelled mid-call, after its request was sent, it leaves
    the connection half-read: the client then shuts the connection down and
    is broken (``broken`` is True, later calls raise ``ConnectionError``
    saying to connect again), so no reply is ever misread.  A copy into or
    out of the session region that runs on a worker thread is waited for
    before the cancellation goes on: no byte of the caller's buffers moves
    after the call has ended.  Cancelling ``asyncio.wait_for`` or
    ``asyncio.timeout`` around a call is the same thing.

    **The event loop** never waits on a socket.  Copies into and out of the
    session region of ``OFFLOAD_BYTES`` or more run on the loop's default
    executor; smaller ones, and copies into registered regions (none: the
    gateway fills them), run on the loop.

    ``close()`` (or ``async with``) ends the session; it waits for a call in
    progress, after waking it with an error.  ``abort()`` may be called at
    any time, from any thread.
    """

    def __init__(self, sock: socket.socket, local: bool, timeout: float | None = 60.0):
        super().__init__(sock, local, asyncio.Lock())  # held for a whole operation: see the class docstring
        sock.setblocking(False)
        self._timeout = timeout

    # ---- connecting -----------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        target: str | None = None,
        namespace: str = "",
        *,
        token: str | None = None,
        engine_id: str = "",
        role: str = "engine",
        salted: bool = False,
        timeout: float | None = 60.0,
        want_shm: bool = True,
        block_keys: str = "",
        block_size: int = 0,
        namespace_inputs: str | Mapping[str, Any] = "",
    ) -> "_Connecting":
        """Connect and open a session, as ``Client.connect`` (``block_keys``, ``block_size``,
        ``namespace_inputs`` included);
        ``timeout`` is also each call's default.

        Awaitable (``c = await AsyncClient.connect(...)``) or an async
        context manager (``async with AsyncClient.connect(...) as c``).
        """
        core.hello_op(namespace, token, engine_id, role, salted, want_shm, block_keys, block_size,
                      namespace_inputs)  # checks them now
        return _Connecting(cls._connect(target, namespace, token, engine_id, role, salted, timeout, want_shm,
                                        block_keys, block_size, namespace_inputs))

    @classmethod
    async def _connect(cls, target, namespace, token, engine_id, role, salted, timeout, want_shm,
                       block_keys="", block_size=0, namespace_inputs="") -> "AsyncClient":
        kind, addr = core.parse_target(target)
        where = addr if kind == "unix" else f"{addr[0]}:{addr[1]}"
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout):
                try:
                    if kind == "unix":
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.setblocking(False)
                        await loop.sock_connect(sock, addr)
                    else:
                        sock = await _tcp_connect(loop, addr)
                except PermissionError as e:
                    if kind != "unix":
                        raise connect_failure(e, where) from e
                    raise not_permitted(addr, "connect to the gateway socket",
                                        "run the engine as the gateway's user (a member of the "
                                        "socket's group also needs the gateway's token, auth_token_file)") from e
                except OSError as e:
                    raise connect_failure(e, where) from e
                client = cls(sock, local=kind == "unix", timeout=timeout)
                hello = core.hello_op(namespace, token, engine_id, role, salted, want_shm and kind == "unix",
                                      block_keys, block_size, namespace_inputs)
                async with client._session as session:
                    client._hello = await _drive(session.sock, hello(session))
        except BaseException as e:
            if sock is not None:
                sock.close()
            failure = call_failure(e)
            if failure is e:
                raise
            raise failure from e
        return client

    def set_timeout(self, seconds: float | None) -> None:
        """Deadline of each later call that passes no ``timeout`` (None: wait forever)."""
        self._timeout = seconds

    async def close(self) -> None:
        """Wake a call in progress (it raises ``ConnectionError``), wait for it, and end the session."""
        self.abort()
        async with self._session as session:
            session.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- performing the steps of an operation ------------------------------------------

    async def _run(self, operation: core.Operation, timeout: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout if timeout is DEFAULT else timeout):
                async with self._session as session:
                    try:
                        return await _drive(session.sock, operation(session))
                    finally:
                        if self.broken:
                            self.abort()  # mid-frame: the gateway ends the session now, not at close
        except (ConnectionError, TimeoutError) as e:
            failure = call_failure(e)
            if failure is e:
                raise
            raise failure from e

    # ---- operations (as Client's; ``timeout``: this call's deadline) ----------------------

    async def register_region(self, path: str, mapping: Buffer | None = None, *, timeout: Any = DEFAULT) -> int:
        """As ``Client.register_region``: buffers inside ``mapping`` are then moved in place."""
        return await self._run(core.register_region_op(path, mapping, self.local), timeout)

    async def put_many(self, keys: Sequence[bytes | str], buffers: Sequence[Buffer], retention: str = "long",
                       dialog: bytes | None = None, position: int = -1, *, timeout: Any = DEFAULT) -> list[bool]:
        """As ``Client.put_many``."""
        return await self._run(core.put_many_op(keys, buffers, retention, dialog, position), timeout)

    async def get_many(self, keys: Sequence[bytes | str], into: Sequence[Buffer] | None = None,
                       dialog: bytes | None = None, *, source: str | None = None, timeout: Any = DEFAULT) -> list:
        """As ``Client.get_many``: memoryviews of the filled part of ``into``, or bytes; None for a miss."""
        return await self._run(core.get_many_op(keys, into, dialog, source), timeout)

    async def lookup(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *, source: str | None = None,
                     timeout: Any = DEFAULT) -> int:
        """As ``Client.lookup``: how many leading keys are stored."""
        return await self._run(core.lookup_op(keys, dialog, source), timeout)

    async def exists_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *,
                          source: str | None = None, timeout: Any = DEFAULT) -> list[bool]:
        return await self._run(core.exists_many_op(keys, dialog, source), timeout)

    async def delete_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *,
                          timeout: Any = DEFAULT) -> int:
        return await self._run(core.delete_many_op(keys, dialog), timeout)

    async def hold_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *,
                        timeout: Any = DEFAULT) -> list[bool]:
        """As ``Client.hold_many``."""
        return await self._run(core.hold_many_op(keys, dialog), timeout)

    async def release_many(self, keys: Sequence[bytes | str], *, timeout: Any = DEFAULT) -> int:
        """As ``Client.release_many``."""
        return await self._run(core.release_many_op(keys), timeout)

    async def prewarm(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *,
                      timeout: Any = DEFAULT) -> int:
        """As ``Client.prewarm``."""
        return await self._run(core.prewarm_op(keys, dialog), timeout)

    async def dialog_mark(self, keys: Sequence[bytes | str], *, timeout: Any = DEFAULT) -> DialogMark:
        """As ``Client.dialog_mark``."""
        return await self._run(core.dialog_mark_op(keys), timeout)

    async def stats(self, *, timeout: Any = DEFAULT) -> dict:
        return await self._run(core.stats_op(), timeout)

    async def clean(self, namespace: str | None = None, *, timeout: Any = DEFAULT) -> int:
        """As ``Client.clean``."""
        return await self._run(core.clean_op(namespace), timeout)

    async def cards(self, action: str = "list", target: str = "", now: bool = False, force: bool = False, *,
                    timeout: Any = DEFAULT) -> Any:
        """As ``Client.cards``."""
        return await self._run(core.cards_op(action, target, now, force), timeout)


class _Connecting:
    """What ``AsyncClient.connect`` returns: await it for the client, or ``async with`` it."""

    def __init__(self, coro):
        self._coro = coro
        self._client: AsyncClient | None = None

    def __await__(self):
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._coro
        return self._client

    async def __aexit__(self, *exc) -> None:
        assert self._client is not None
        await self._client.close()


async def _drive(sock: socket.socket, op: Op) -> Any:
    """Perform the steps ``op`` yields on ``sock`` and the running loop (whose task holds the client)."""
    loop = asyncio.get_running_loop()
    steps = Steps(op)
    for step in steps:
        try:
            if type(step) is Recv:
                await _recv_into(loop, sock, step.view)
            elif type(step) is Send:
                await _send(loop, sock, step)
            else:
                assert type(step) is Copy
                steps.value = step.fn() if step.nbytes < OFFLOAD_BYTES else await _off_loop(loop, step.fn)
        except BaseException as e:  # cancellation too: the operation decides what it means
            steps.error = e
    return steps.result


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got, want = 0, len(view)
    while got < want:
        n = await loop.sock_recv_into(sock, view[got:] if got else view)
        if n == 0:
            raise GatewayUnavailable(CLOSED_BY_GATEWAY)
        got += n


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, step: Send) -> None:
    while step.views:
        try:
            step.advance(sock.sendmsg(step.views[:SEND_PARTS]))
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)


async def _tcp_connect(loop: asyncio.AbstractEventLoop, addr: tuple[str, int]) -> socket.socket:
    """A connected non-blocking TCP socket (each address of the name in turn, as socket.create_connection)."""
    host, port = addr
    error: OSError | None = None
    for family, type_, proto, _, sockaddr in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            error = e
        except BaseException:
            sock.close()
            raise
    raise error if error is not None else OSError(f"getaddrinfo found no address for {host}:{port}")


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, wake)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def _off_loop(loop: asyncio.AbstractEventLoop, fn) -> Any:
    """``fn()`` on the default executor.  Cancelled, it still waits for ``fn`` to end before it raises:
    ``fn`` moves bytes of the caller's buffers and of the session region, which the next call reuses."""
    fut = loop.run_in_executor(None, fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass
        raise
