"""Listeners: accepting connections on the Unix socket and the TCP listeners, and reading their frames.

Runs on the event loop: an accept loop per listening socket, and a task per
connection that reads its frames, opens its session at the hello and starts
a task per request after it (``Operations.dispatch``).  Nothing here may
block the loop: every read and reply has a deadline, and a broken frame
closes only its own connection.

Nor can a peer hold what others need.  Until its hello is accepted a
connection holds only its staging buffer: frames without a body, headers
that fit the staging buffer, ``hello_timeout`` to be accepted, and at most
``PENDING_PER_PEER`` such connections per peer (a TCP source address, a
local process): past that a new one closes the peer's oldest that has sent
nothing (a full listener: its oldest), never a connection whose hello is on
its way or being answered, so idle connections never keep out a client that
says hello at once (``ListenerLimits.admit``).  Who may open a session is
``Sessions.admit``'s.  Each listener (the Unix socket; all TCP listeners)
has its own ``max_connections`` and its own inline byte budget, so TCP
peers never lock out a local engine.  Once announced, a header and body must arrive
within ``frame_timeout`` (plus their size at ``FRAME_MIN_RATE``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvgate.config import Config
from kvgate.gateway.connection import STAGE_BYTES, Connection, accept_loop
from kvgate.gateway.operations import Operations
from kvgate.gateway.peers import unix_peer
from kvgate.gateway.sessions import InlineBudget, InlineShare, Session, Sessions, reply
from kvgate.protocol import (
    MAX_HEADER_BYTES,
    PREAMBLE_SIZE,
    Error,
    ErrorCode,
    FrameError,
    FrameTooLarge,
    Hello,
    RequestError,
    decode_request,
    parse_preamble,
)

log = logging.getLogger("kvgate.gateway")

MAX_INFLIGHT_PER_CONNECTION = 64
# Connections one peer may have waiting for their hello on a listener: a client pool connecting at once
# gets in, one host or process holding idle connections does not fill the listener.
PENDING_PER_PEER = 16
# Past that, a new connection displaces the oldest that has sent nothing, else the oldest waiting this long:
# a client's hello is read within milliseconds of its connect, even on a loaded host.
HELLO_GRACE_S = 1.0
# A refused connection is answered to its hello (with the hello's id, so a client reads a clear refusal);
# a peer that sends nothing gets the refusal after this long.  At most MAX_REFUSING are waited on at once,
# the rest are answered at once.
REFUSAL_WAIT_S = 1.0
MAX_REFUSING = 64
FRAME_MIN_RATE = 4 << 20  # bytes/s an announced header and body must at least arrive at, beyond frame_timeout


@dataclass
class ListenerLimits:
    """Connections of one listener (the Unix socket, or all TCP listeners): open ones, and those still
    waiting for their hello, per peer and oldest first.  Used on the event loop only."""

    name: str
    limit: int
    budget: InlineBudget
    open: int = 0
    # every connection waiting for its hello, oldest first: (its peer, when it began to wait)
    waiting: dict[Connection, tuple[Any, float]] = field(default_factory=dict)
    pending: dict[Any, dict[Connection, None]] = field(default_factory=dict)  # the same, per peer

    def admit(self, peer: Any, conn: Connection, now: float) -> tuple[str | None, Connection | None]:
        """Count ``conn`` in, waiting for its hello: -> (why it is refused, or None; the connection it
        displaces, for the caller to close, or None).

        At ``PENDING_PER_PEER`` of the peer's connections waiting (or the listener full), the oldest of
        them (of the listener's) that has sent nothing is displaced, else the oldest that has waited
        ``HELLO_GRACE_S``; only when every one is younger and has sent something (hellos on their way) is
        the new one refused.  So idle connections never keep out a client that says hello at once.
        """
        mine = self.pending.get(peer, {})
        out = None
        if len(mine) >= PENDING_PER_PEER:
            out = self._displaceable(mine, now)
            if out is None:
                return (f"{peer} already has {PENDING_PER_PEER} connections to the {self.name} with a hello on its "
                        "way; try again in a moment"), None
        elif self.open >= self.limit:
            out = self._displaceable(self.waiting, now)
            if out is None:
                return (f"the {self.name} serves at most {self.limit} connections (max_connections); "
                        "try again later"), None
        if out is not None:
            self.done_waiting(out)
        self.open += 1
        self.wait_again(peer, conn, now)
        return None, out

    def _displaceable(self, conns, now: float) -> Connection | None:
        aged = None
        for c in conns:  # oldest first
            if not c.heard_from():
                return c
            if aged is None and now - self.waiting[c][1] >= HELLO_GRACE_S:
                aged = c
        return aged

    def wait_again(self, peer: Any, conn: Connection, since: float) -> None:
        """``conn`` (counted open already) waits for its hello, since ``since`` (again, after a refused one)."""
        self.waiting[conn] = (peer, since)
        self.pending.setdefault(peer, {})[conn] = None

    def done_waiting(self, conn: Connection) -> tuple[Any, float] | None:
        """The connection has its hello under way, was displaced, or left without: it no longer waits.
        -> its peer and since when it waited (None: it was not waiting)."""
        was = self.waiting.pop(conn, None)
        if was is not None:
            mine = self.pending[was[0]]
            mine.pop(conn, None)
            if not mine:
                del self.pending[was[0]]
        return was

    def leave(self) -> None:
        self.open -= 1


class Listeners:
    """The listening sockets, their limits, and the task of each connection they accepted.

    ``Gateway.start`` hands each bound socket to ``listen``; the accept loops and connection tasks are
    started through ``spawn`` so that ``Gateway.stop`` cancels them, then calls ``close``.  All on the event
    loop; a connection waits on its peer with a deadline, never blocks the loop.
    """

    def __init__(self, cfg: Config, sessions: Sessions, operations: Operations,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task]):
        self.cfg = cfg
        self.sessions = sessions
        self.operations = operations
        self._spawn = spawn
        self.limits: dict[bool, ListenerLimits] = {}  # by local: the Unix socket (True), the TCP listeners
        # a listener's sessions hold at most two frames' worth of inline bytes, one connection one frame's worth
        for local, name in ((True, "Unix socket"), (False, "TCP listener")):
            budget = InlineBudget(2 * cfg.max_frame_bytes, cfg.max_frame_bytes)
            self.limits[local] = ListenerLimits(name, cfg.max_connections, budget)
        self._sockets: list[socket.socket] = []
        self._refusing = 0
        self.refused_connections = 0
        self.displaced_connections = 0  # closed while waiting for their hello, to make room (ListenerLimits.admit)

    @property
    def open_connections(self) -> int:
        return sum(lim.open for lim in self.limits.values())

    def listen(self, sock: socket.socket, local: bool) -> None:
        self._sockets.append(sock)

        def on_connection(conn: socket.socket) -> None:
            self._spawn(self._on_connection(conn, local))

        self._spawn(accept_loop(sock, on_connection))

    def close(self) -> None:
        for s in self._sockets:
            s.close()

    async def _on_connection(self, sock: socket.socket, local: bool) -> None:
        tcp = None
        try:
            pid = uid = None
            if local:
                pid, uid = unix_peer(sock)
                peer: Any = f"process {pid}"
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                theirs = sock.getpeername()
                tcp = (sock.family, sock.getsockname(), theirs)
                peer = theirs[0]
        except OSError:  # the peer is already gone
            sock.close()
            return
        limits = self.limits[local]
        conn = Connection(sock)
        why, displaced = limits.admit(peer, conn, asyncio.get_running_loop().time())
        if why is not None:
            await self._refuse_connection(conn, why)
            return
        if displaced is not None:
            self._displace(limits, displaced, peer)
        try:
            await self._serve(conn, limits, local=local, pid=pid, uid=uid, tcp=tcp)
        finally:
            limits.leave()

    def _displace(self, limits: ListenerLimits, conn: Connection, peer: Any) -> None:
        self.displaced_connections += 1
        log.debug("%s: closed a connection still waiting for its hello to make room for one from %s",
                  limits.name, peer)
        conn.close()  # its task sees the connection closed and ends

    async def _refuse_connection(self, conn: Connection, why: str) -> None:
        """Answer TOO_MANY_CONNECTIONS to the connection's first request (its hello), with its id, and close."""
        self.refused_connections += 1
        rid = 0
        try:
            if self._refusing < MAX_REFUSING:
                self._refusing += 1
                try:
                    deadline = asyncio.get_running_loop().time() + REFUSAL_WAIT_S
                    pre = await conn.readexactly(PREAMBLE_SIZE, deadline)
                    _kind, hlen, blen = parse_preamble(pre, STAGE_BYTES)
                    rid = _request_id(await conn.readexactly(hlen, deadline))
                except (FrameError, asyncio.IncompleteReadError, OSError):
                    pass  # TimeoutError included: refused with id 0
                finally:
                    self._refusing -= 1
            deadline = asyncio.get_running_loop().time() + REFUSAL_WAIT_S
            await reply(conn, Error(id=rid, code=ErrorCode.TOO_MANY_CONNECTIONS, message=why), deadline=deadline)
        finally:
            conn.close()

    async def _serve(self, conn: Connection, limits: ListenerLimits, local: bool, pid: int | None,
                     uid: int | None, tcp: tuple | None) -> None:
        """Read requests until the client leaves; each one after hello runs as its own task.

        Before the hello is accepted the connection may send only frames without a body whose header fits
        the staging buffer, and must be accepted within ``hello_timeout``; a peer that does not read what
        it is answered is closed then too.  After it, a body (and a header over the staging buffer) is taken
        from the listener's inline byte budget, within the session's share, before a byte of it is read,
        and is received straight into a ``bytearray`` of its length.
        """
        loop = asyncio.get_running_loop()
        session: Session | None = None
        share = InlineShare(limits.budget)
        hello_deadline: float | None = loop.time() + self.cfg.hello_timeout
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(MAX_INFLIGHT_PER_CONNECTION)
        try:
            while True:
                if conn.send_failed:
                    return
                try:
                    pre = await conn.readexactly(PREAMBLE_SIZE, hello_deadline)
                except TimeoutError:
                    await reply(conn, Error(code=ErrorCode.NO_SESSION,
                                            message=f"no hello within {self.cfg.hello_timeout:g} s "
                                                    "(hello_timeout); closing"), deadline=loop.time() + 1.0)
                    return
                except (asyncio.IncompleteReadError, OSError):
                    return
                try:
                    _kind, hlen, blen = parse_preamble(pre, self.cfg.max_frame_bytes)
                except FrameTooLarge as e:
                    if session is None or e.header_len > min(MAX_HEADER_BYTES, self.cfg.max_frame_bytes):
                        await reply(conn, Error(code=e.code, message=str(e)), deadline=hello_deadline)
                        return
                    if not await self._skip_frame(conn, share, e):
                        return
                    continue
                except FrameError as e:
                    await reply(conn, Error(code=e.code, message=str(e)), deadline=hello_deadline)
                    return
                if session is None and hlen > STAGE_BYTES:
                    await reply(conn, Error(code=ErrorCode.TOO_LARGE, message=(
                        f"a {hlen}-byte header before hello (limit {STAGE_BYTES} until a hello is accepted)")),
                                deadline=hello_deadline)
                    return
                if session is None and blen:  # answered with its id (the header is in the staging buffer), closed
                    rid = _request_id(await conn.readexactly(hlen, hello_deadline))
                    await reply(conn, Error(id=rid, code=ErrorCode.NO_SESSION, message=(
                        f"a frame with a {blen}-byte body before hello: send hello first")), deadline=hello_deadline)
                    return
                # a header over the staging buffer is allocated for its length: it counts as inline bytes too
                big_header = hlen if hlen > STAGE_BYTES else 0
                await share.acquire(big_header + blen)
                deadline = hello_deadline or loop.time() + self.cfg.frame_timeout + (hlen + blen) / FRAME_MIN_RATE
                try:
                    header = await conn.readexactly(hlen, deadline)
                    body: bytes | bytearray = b""
                    if blen:
                        body = bytearray(blen)
                        await conn.readinto(memoryview(body), deadline)
                except TimeoutError:
                    await share.release(big_header + blen)
                    await reply(conn, Error(code=ErrorCode.BAD_FRAME,
                                            message=self._late_frame(hlen, blen, session is None)),
                                deadline=loop.time() + 1.0)
                    return
                except BaseException:
                    await share.release(big_header + blen)
                    raise
                try:
                    req = decode_request(header)
                except RequestError as e:
                    req = e
                del header  # not held past its budget
                await share.release(big_header)
                if isinstance(req, RequestError):
                    await share.release(blen)
                    await reply(conn, Error(id=req.request_id, code=req.code, message=str(req)),
                                deadline=hello_deadline)
                    continue
                if session is None:
                    if not isinstance(req, Hello):
                        await reply(conn, Error(id=req.id, code=ErrorCode.NO_SESSION, message="send hello first"),
                                    deadline=hello_deadline)
                        continue
                    # while its hello is answered (a uid looked up) it cannot be displaced: it said hello
                    waited = limits.done_waiting(conn)
                    session = await self.sessions.hello(req, conn, local, pid, uid, share, hello_deadline, tcp)
                    if session is not None:
                        hello_deadline = None
                    elif waited is not None:  # refused: it may try again until its hello deadline
                        limits.wait_again(waited[0], conn, waited[1])
                    continue
                await slots.acquire()
                task = loop.create_task(self.operations.dispatch(session, req, body, blen, conn))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                task.add_done_callback(lambda _t: slots.release())
        except (asyncio.IncompleteReadError, OSError):
            return  # the peer left mid-frame
        except asyncio.CancelledError:
            for t in inflight:  # the gateway is stopping: so are this connection's requests
                t.cancel()
            raise
        except Exception:  # noqa: BLE001 - one connection must never take the gateway down
            log.exception("connection handler failed")
        finally:
            if session is None:
                limits.done_waiting(conn)  # no longer waiting either way
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
            if session is not None:
                self.sessions.close(session)
            conn.close()

    def _late_frame(self, hlen: int, blen: int, pending: bool) -> str:
        if pending:
            return f"no hello within {self.cfg.hello_timeout:g} s (hello_timeout); closing"
        return (f"a frame of {hlen} + {blen} bytes did not arrive within frame_timeout ({self.cfg.frame_timeout:g} s) "
                f"plus 1 s per {FRAME_MIN_RATE >> 20} MiB; closing")

    async def _skip_frame(self, conn: Connection, share: InlineShare, e: FrameTooLarge) -> bool:
        """A session's frame over max_frame_bytes: answer TOO_LARGE with its id and drop its body, unallocated.

        -> whether the connection is still in step (False: it is to be closed).
        """
        loop = asyncio.get_running_loop()
        hlen, blen = e.header_len, e.body_len
        big_header = hlen if hlen > STAGE_BYTES else 0
        await share.acquire(big_header)
        deadline = loop.time() + self.cfg.frame_timeout + (hlen + blen) / FRAME_MIN_RATE
        try:
            rid = _request_id(await conn.readexactly(hlen, deadline))
        except TimeoutError:
            await reply(conn, Error(code=ErrorCode.BAD_FRAME, message=self._late_frame(hlen, blen, False)),
                        deadline=loop.time() + 1.0)
            return False
        finally:
            await share.release(big_header)
        await reply(conn, Error(id=rid, code=ErrorCode.TOO_LARGE, message=str(e)))
        try:
            await conn.discard(blen, deadline)
        except TimeoutError:
            await reply(conn, Error(code=ErrorCode.BAD_FRAME, message=self._late_frame(hlen, blen, False)),
                        deadline=loop.time() + 1.0)
            return False
        return True


def _request_id(header: bytes | bytearray) -> int:
    """The id of the request in ``header``, wrong or not (0 where it has none that can be read)."""
    try:
        return decode_request(header).id
    except RequestError as e:
        return e.request_id
