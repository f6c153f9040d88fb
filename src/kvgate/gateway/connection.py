"""Client connections on raw sockets: bulk bytes are never copied on the way.

The gateway does not use asyncio transports and streams for its clients: a
``StreamReader`` copies every byte it receives (socket -> its buffer -> a new
``bytes``), and Python 3.11's transports copy whatever part of a write the
socket did not take at once into their own buffer, which for a get reply of
many MiB is nearly all of it.  ``Connection`` reads and writes the accepted
socket itself, as a ``BufferedProtocol`` would be fed, but with no transport
in between:

- the socket stays registered for reading (``loop.add_reader``), and each
  time it is readable one ``recv_into`` goes where the bytes belong: a small
  staging buffer for preambles and headers (one ``recv`` often brings several
  pipelined frames), or, while a body is being read, the body's own buffer;
  only the few bytes that came in with the header pass through the staging
  buffer.  A full staging buffer stops the reading until it is consumed;
- a reply is sent from the caller's buffers with gather writes (``sendmsg``)
  each time the socket has room; ``send`` returns once the socket took all
  of it; replies of concurrent requests go out one whole frame at a time.

Every read and send may take a deadline (``loop.time()`` based): the wait
past it raises ``TimeoutError`` (a send past it gives up and sends no more).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from collections.abc import Callable, Sequence

from kvgate.memcopy import IOV_MAX

log = logging.getLogger("kvgate.gateway")

STAGE_BYTES = 64 << 10  # preambles and headers are read through this much
SMALL_REPLY_BYTES = 64 << 10  # a reply body up to this size goes out in one send with its header
LISTEN_BACKLOG = 100  # what asyncio.start_server used
_ACCEPT_RETRY_S = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_SCRATCH = memoryview(bytearray(STAGE_BYTES))  # bytes read to be dropped go here (never read back: one is enough)

Buffer = bytes | bytearray | memoryview
Body = Buffer | Sequence[Buffer]


def body_segments(body: Body | None) -> list[memoryview]:
    """A frame body as byte views, in order (empty ones left out)."""
    if body is None:
        return []
    if isinstance(body, (bytes, bytearray, memoryview)):
        body = [body]
    out = []
    for b in body:
        v = memoryview(b)
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")
        if v.nbytes:
            out.append(v)
    return out


def body_length(body: Body | None) -> int:
    """The bytes of a frame body (one buffer or a list of them)."""
    return sum(v.nbytes for v in body_segments(body))


class Connection:
    """One accepted socket; owned by one ``Gateway._serve`` call, the only one that reads it."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._stage = memoryview(bytearray(STAGE_BYTES))
        self._lo = 0  # unread staged bytes are self._stage[_lo:_hi]
        self._hi = 0
        self._need = 0  # staged bytes the reader waits for (0: none)
        self._target: memoryview | None = None  # the body being read: the socket fills it directly
        self._filled = 0  # bytes of _target filled
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._error: OSError | None = None
        self._reading = False
        self._send_lock = asyncio.Lock()
        self._send_failed = False
        self._closed = False
        self._heard = False  # a byte has come from the peer
        self._resume()

    # ---- reading --------------------------------------------------------------------------

    def _resume(self) -> None:
        if not self._reading and not self._closed and not self._eof and self._error is None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_readable(self) -> None:
        target = self._target
        if target is not None:
            buf = target[self._filled :]
        else:
            if self._hi == len(self._stage):
                if not self._lo:  # full: read on once the reader took some
                    self._pause()
                    return
                self._compact()
            buf = self._stage[self._hi :]
        try:
            n = self.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._error = e
            self._pause()
            self._wake()
            return
        if n == 0:
            self._eof = True
            self._pause()
            self._wake()
            return
        self._heard = True
        if target is not None:
            self._filled += n
            if self._filled == len(target):
                self._target = None  # the bytes after the body go to the staging buffer
                self._wake()
        else:
            self._hi += n
            if self._need and self._hi - self._lo >= self._need:
                self._wake()
            if self._hi == len(self._stage) and not self._lo:
                self._pause()

    async def _wait(self, deadline: float | None) -> None:
        """Until ``_on_readable`` wakes us; raises at end of stream, on a socket error, or past ``deadline``."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise asyncio.IncompleteReadError(b"", None)
        if self._closed:
            raise ConnectionAbortedError("the connection was closed")
        self._resume()
        self._waiter = self._loop.create_future()
        try:
            if deadline is None:
                await self._waiter
            else:
                async with asyncio.timeout_at(deadline):
                    await self._waiter
        finally:
            self._waiter = None

    async def readexactly(self, n: int, deadline: float | None = None) -> bytes | bytearray:
        """The next ``n`` bytes; raises ``asyncio.IncompleteReadError`` at end of stream, OSError on a broken one,
        TimeoutError past ``deadline``.  Over ``STAGE_BYTES`` it allocates ``n`` bytes: the caller bounds them."""
        if n > len(self._stage):
            buf = bytearray(n)
            await self.readinto(memoryview(buf), deadline)
            return buf
        while self._hi - self._lo < n:
            if self._lo + n > len(self._stage):  # no room for the rest behind the unread bytes
                self._compact()
            self._need = n
            try:
                await self._wait(deadline)
            finally:
                self._need = 0
        out = bytes(self._stage[self._lo : self._lo + n])
        self._consume(n)
        return out

    async def readinto(self, view: memoryview, deadline: float | None = None) -> None:
        """Fill ``view`` (a byte view): first from the staging buffer, then straight from the socket."""
        n = len(view)
        done = min(n, self._hi - self._lo)
        if done:
            view[:done] = self._stage[self._lo : self._lo + done]
            self._consume(done)
        if done == n:
            return
        self._target, self._filled = view, done
        try:
            while self._target is not None:
                await self._wait(deadline)
        finally:
            self._target = None

    async def discard(self, n: int, deadline: float | None = None) -> None:
        """Read and drop the next ``n`` bytes through a fixed scratch buffer: nothing of their size is allocated."""
        while n:
            chunk = min(n, len(_SCRATCH))
            await self.readinto(_SCRATCH[:chunk], deadline)
            n -= chunk

    def _compact(self) -> None:
        """Move the unread staged bytes to the front (at most a staging buffer's worth)."""
        kept = self._hi - self._lo
        self._stage[:kept] = self._stage[self._lo : self._hi]
        self._lo, self._hi = 0, kept

    def _consume(self, n: int) -> None:
        self._lo += n
        if self._lo == self._hi:
            self._lo = self._hi = 0
        self._resume()  # there is room again

    # ---- writing --------------------------------------------------------------------------

    @property
    def send_failed(self) -> bool:
        """A send failed or passed its deadline: nothing more goes out on this connection."""
        return self._send_failed

    async def send(self, head: bytes, body: Body | None = None, deadline: float | None = None) -> None:
        """Send one frame whole, from the callers' buffers (``body``: one buffer, or a list of them sent
        as one gather write each time the socket has room, as the RAM tier's pages of a get reply are).

        A peer that went away is not an error here: the frame is dropped, and
        so is every later one, and the reader sees the connection end.  So is
        a peer that does not take the frame by ``deadline`` (it is not reading).
        """
        segments = body_segments(body)
        if sum(map(len, segments)) <= SMALL_REPLY_BYTES:
            head, segments = b"".join([head, *segments]), []  # one segment; copying a little is cheaper
        async with self._send_lock:
            if self._send_failed or self._closed:
                return
            try:
                if deadline is None:
                    await self._sendall([memoryview(head), *segments])
                else:
                    async with asyncio.timeout_at(deadline):
                        await self._sendall([memoryview(head), *segments])
            except (OSError, TimeoutError):
                self._send_failed = True

    async def _sendall(self, segments: list[memoryview]) -> None:
        """Gather writes until every segment is out; waits for room on the loop, never blocks it."""
        i = 0
        while i < len(segments):
            try:
                n = self.sock.sendmsg(segments[i : i + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            while n:
                seg = segments[i]
                if n >= len(seg):
                    n -= len(seg)
                    i += 1
                else:
                    segments[i] = seg[n:]
                    n = 0
            while i < len(segments) and not len(segments[i]):
                i += 1

    async def _writable(self) -> None:
        ready = self._loop.create_future()

        def on_writable() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_writer(self._fd, on_writable)
        try:
            await ready
        finally:
            self._loop.remove_writer(self._fd)

    def heard_from(self) -> bool:
        """Whether the peer has sent a byte yet, read or still in the socket (a hello on its way).  One
        non-blocking peek: on the loop."""
        if self._heard:
            return True
        if self._closed:
            return False
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing there yet (BlockingIOError), or a broken connection
            return False

    def close(self) -> None:
        if not self._closed:
            self._pause()
            self._closed = True
            self._wake()
            self.sock.close()


# ---- listening ---------------------------------------------------------------------------


def unix_listener(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (a socket file left there is replaced, as asyncio did)."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def tcp_listeners(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on every address ``host`` resolves to ("" for all interfaces), as asyncio binds them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for af, kind, proto, _name, addr in dict.fromkeys(infos):
            sock = socket.socket(af, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if af == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


async def accept_loop(listener: socket.socket, on_connection: Callable[[socket.socket], None]) -> None:
    """Accept connections until cancelled; ``on_connection`` takes over each socket."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock, _addr = await loop.sock_accept(listener)
        except (ConnectionAbortedError, InterruptedError):
            continue  # the client gave up before we took it
        except OSError as e:
            # out of file descriptors or memory, or worse: keep serving the connections there are, try again later
            level = logging.ERROR if e.errno in _OUT_OF_RESOURCES else logging.WARNING
            log.log(level, "cannot accept a connection: %s; accepting again in %.0f s", e, _ACCEPT_RETRY_S)
            await asyncio.sleep(_ACCEPT_RETRY_S)
            continue
        on_connection(sock)
