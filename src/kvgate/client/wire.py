"""A session's frames as steps of I/O, and the errors of a call: the bottom of both clients.

Every client operation is written once, as a generator that yields the I/O
it needs one step at a time and is sent each step's result:

    Send(views)       send these bytes, in order                  -> None
    Recv(view)        fill ``view`` from the socket, whole        -> None
    Copy(fn, nbytes)  copy ``nbytes`` into or out of a region     -> fn()

``Client`` performs the steps with blocking socket calls, ``AsyncClient``
with the event loop (a large copy on a worker thread).  A step that fails is
thrown back into its generator, so what a failure does to the connection
(broken mid-frame, usable when nothing was sent) is decided here, once, for
both: ``Wire.call`` sends one request and reads its reply as such steps.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Any, Callable, Generator, Sequence

from kvgate.client.args import Buffer
from kvgate.errors import (
    GatewayError,
    GatewayTimeout,
    GatewayUnavailable,
    KvgateError,
    NotPermitted,
    ObjectTooLarge,
)
from kvgate.protocol import (
    KIND_REPLY,
    MAX_HEADER_BYTES,
    PREAMBLE_SIZE,
    TOO_SMALL,
    Error,
    ErrorCode,
    GetReply,
    decode_reply,
    encode_frame,
    parse_preamble,
)

_SCRATCH_BYTES = 64 << 10  # gaps between packed results are received into this much, and dropped
CLOSED_BY_GATEWAY = "the gateway closed the connection"
SEND_PARTS = 512  # buffers per sendmsg call (IOV_MAX is 1024)


def call_failure(err: BaseException) -> BaseException:
    """What a call raises for ``err``, raised inside it: kvgate's own errors as they are, a timeout as
    ``GatewayTimeout``, a refused, reset or closed connection as ``GatewayUnavailable`` (the caller
    raises it ``from err``); anything else (a cancellation, a bug) unchanged."""
    if isinstance(err, KvgateError):
        return err
    if isinstance(err, TimeoutError):
        return GatewayTimeout(f"the gateway did not answer within the client's timeout ({err or 'timed out'}); "
                              "if the call had sent anything the client is broken: connect again")
    if isinstance(err, ConnectionError):
        said = str(err) or type(err).__name__
        return GatewayUnavailable(said if "connect again" in said else f"{said}; connect again")
    return err


def connect_failure(err: OSError, target: str) -> KvgateError:
    """What ``connect`` raises when the socket could not be reached (``err``): named with the target
    and what to do."""
    if isinstance(err, KvgateError):
        return err
    if isinstance(err, TimeoutError):
        return GatewayTimeout(f"no answer from a gateway at {target} within the connect timeout")
    what = "no such socket" if isinstance(err, FileNotFoundError) else (err.strerror or str(err))
    return GatewayUnavailable(f"no gateway at {target}: {what}; start one (kvgate serve) or pass the socket "
                              "path or host:port it listens on")


def not_permitted(path: str, what: str, fix: str) -> NotPermitted:
    """Say who owns ``path`` (or the directory that hides it) and who we are, and how to fix it."""
    me = f"this process runs as uid {os.getuid()} (gid {os.getgid()})"
    try:
        st = os.stat(path)
        owner = f"it belongs to uid {st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"
    except OSError:
        parent = os.path.dirname(os.path.abspath(path))
        try:
            st = os.stat(parent)
            owner = (f"its directory {parent} (uid {st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}) "
                     "does not let this process reach it")
        except OSError:
            owner = f"its directory {parent} does not let this process reach it"
    return NotPermitted(errno.EACCES, f"cannot {what} {path}: {owner}, and {me}; {fix}")


# ---- the steps an operation yields ------------------------------------------------------


class Send:
    """Send ``views`` (flat byte views, none empty) in order; ``advance`` drops what a send took."""

    __slots__ = ("views",)

    def __init__(self, parts: Sequence[Buffer]):
        self.views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]

    def advance(self, sent: int) -> None:
        views = self.views
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class Recv:
    """Fill ``view`` from the socket, every byte of it (the gateway closing first is a ``ConnectionError``)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview):
        self.view = view


class Copy:
    """Run ``fn`` (a memory copy of ``nbytes`` bytes, no I/O) and send its result back."""

    __slots__ = ("fn", "nbytes")

    def __init__(self, fn: Callable[[], Any], nbytes: int):
        self.fn = fn
        self.nbytes = nbytes


Op = Generator[Any, Any, Any]  # yields Send, Recv and Copy steps; returns the operation's result


class Steps:
    """The steps of an operation, for the client that performs them, in the call that holds the client.

    After each step set ``value`` (its result) or ``error`` (what it raised:
    thrown back into the operation, which decides what it means for the
    connection); once they end, ``result`` is what the operation returned.
    """

    __slots__ = ("_op", "value", "error", "result")

    def __init__(self, op: Op):
        self._op = op
        self.value: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> "Steps":
        return self

    def __next__(self) -> Any:
        try:
            step = self._op.send(self.value) if self.error is None else self._op.throw(self.error)
        except StopIteration as done:
            self.result = done.value
            raise
        self.value = self.error = None
        return step


def done(value: Any) -> Op:
    """An operation with nothing to send (an empty batch)."""
    return value
    yield  # pragma: no cover  (makes this a generator)


# ---- one connection ---------------------------------------------------------------------


class Link:
    """A session's socket and whether its stream is broken: the one part of a client any thread may touch.

    ``abort`` may come from any thread or task at any time (another thread,
    a signal handler's callback, shutdown) and never blocks: it marks the
    stream broken and shuts the socket down, which wakes a call blocked on
    it.  Everything else about the session is ``Wire``'s and the
    transport's, reached only under the client's lock.
    """

    __slots__ = ("sock", "broken")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.broken = False  # True once a call failed mid-frame: the client must not be used again

    def abort(self) -> None:
        self.broken = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Wire:
    """One session's frames: requests encoded and checked against the gateway's limits, replies read and matched.

    Part of the client's ``Session``: its generators run only in the call
    that holds the client, one at a time, on the caller's thread (``Client``)
    or the event loop (``AsyncClient``); they never block, they yield steps.
    """

    def __init__(self, link: Link):
        self.link = link
        self.max_frame_bytes = 0  # the gateway's, learnt in hello (0: not known, no frame is refused here)
        self._ids = 0
        self._pre = bytearray(PREAMBLE_SIZE)
        self._scratch: memoryview | None = None

    def out_of_step(self, what: str) -> GatewayUnavailable:
        """The error for a reply that cannot be right: the stream is broken from here on."""
        self.link.broken = True
        return GatewayUnavailable(what)

    def call(self, msg, body: Sequence[Buffer] = (), into: Sequence[memoryview] | None = None) -> Op:
        """Send ``msg`` (and ``body``); returns (reply, reply body).

        The reply body is a ``bytearray``, or None when there is none; with
        ``into`` (one byte view per key of a packed inline get) the results are
        received straight into those views and the second value is what
        ``_recv_packed_into`` returns.  The frame is encoded and checked
        against the gateway's limits before a byte is sent: a message that
        cannot go leaves the connection as it was.
        """
        if self.link.broken:
            raise GatewayUnavailable("this client's connection is broken or closed; connect again")
        self._ids += 1
        msg.id = self._ids
        body_len = sum(memoryview(b).nbytes for b in body)
        frame = encode_frame(msg, body_len)
        header_len = len(frame) - PREAMBLE_SIZE
        if header_len > MAX_HEADER_BYTES:
            raise GatewayError(ErrorCode.TOO_LARGE,
                               f"a {type(msg).__name__.lower()} request of {len(getattr(msg, 'keys', ()))} keys has a "
                               f"header of {header_len} bytes, more than a gateway reads ({MAX_HEADER_BYTES}): "
                               "pass fewer keys per call")
        if self.max_frame_bytes and header_len + body_len > self.max_frame_bytes:
            raise GatewayError(ErrorCode.TOO_LARGE,
                               f"a {type(msg).__name__.lower()} request of {header_len + body_len} bytes is larger "
                               f"than the gateway's max_frame_bytes ({self.max_frame_bytes})")
        try:
            try:
                yield Send([frame, *body])
            except (BrokenPipeError, ConnectionResetError):
                # a gateway that refuses a connection answers and closes it at once, maybe before we sent
                # this: its answer may be waiting
                self.link.broken = True
                refusal, _ = yield from self._recv(msg.id)
                if isinstance(refusal, Error):
                    raise GatewayError(refusal.code, refusal.message) from None
                raise
            reply, rbody = yield from self._recv(msg.id, into)
        except BaseException:  # a failed step, a cancelled task, an abandoned operation
            self.link.broken = True  # the stream is out of step: never read another reply from it
            raise
        if reply.id != msg.id:
            self.link.broken = True
            if isinstance(reply, Error) and reply.id == 0:
                # sent before the gateway read this request: it refused the connection (too many of them)
                # or could not read a frame, and closes the connection
                raise GatewayError(reply.code, reply.message)
            raise GatewayUnavailable(f"reply {reply.id} to request {msg.id}: stream out of step")
        if isinstance(reply, Error):
            raise GatewayError(reply.code, reply.message)
        return reply, rbody

    def _skip(self, n: int) -> Op:
        """Receive ``n`` bytes and drop them."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        while n:
            k = min(n, len(self._scratch))
            yield Recv(self._scratch[:k])
            n -= k

    def _recv(self, want_id: int, into: Sequence[memoryview] | None = None) -> Op:
        yield Recv(memoryview(self._pre))
        kind, hlen, blen = parse_preamble(self._pre, 1 << 62)
        if kind != KIND_REPLY:
            raise GatewayUnavailable("the gateway sent a request frame")
        header = bytearray(hlen)
        yield Recv(memoryview(header))
        reply = decode_reply(header)
        if into is not None and isinstance(reply, GetReply) and reply.id == want_id:
            return reply, (yield from self._recv_packed_into(reply, blen, into))
        body = None
        if blen:
            body = bytearray(blen)
            yield Recv(memoryview(body))
        return reply, body

    def _recv_packed_into(self, reply: GetReply, blen: int, into: Sequence[memoryview]) -> Op:
        """Receive a packed get reply's body straight into ``into`` (one byte view per key asked).

        Each hit's bytes land in its own view; the gaps between results (a
        slot the gateway reserved but did not fill) are dropped.  Returns the
        reply's sizes, with TOO_SMALL where a view was too small for its hit
        (those bytes are dropped too: the stream stays in step).
        """
        sizes = list(reply.sizes)
        offsets = reply.offsets
        if len(sizes) != len(into) or (offsets is None and any(s >= 0 for s in sizes)) or \
                (offsets is not None and len(offsets) != len(into)):
            raise GatewayUnavailable(f"get reply of {len(sizes)} results to a get of {len(into)} keys")
        pos = 0
        for off, j in sorted((offsets[j], j) for j, s in enumerate(sizes) if s >= 0):
            s = sizes[j]
            if off < pos or off + s > blen:
                raise GatewayUnavailable(f"get reply places {s} bytes at {off}, outside its {blen}-byte body")
            yield from self._skip(off - pos)
            if s > len(into[j]):
                yield from self._skip(s)
                sizes[j] = TOO_SMALL
            elif s:
                yield Recv(into[j][:s])
            pos = off + s
        yield from self._skip(blen - pos)
        return sizes
