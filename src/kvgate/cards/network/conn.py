"""The client side of one connection to a card server (``kvgate.cards.network.card``), and its read path.

``Conn`` sends requests and reads replies with every failure of the socket
or the framing turned into ``CardUnavailable`` (the connection closed
first); ``receive_object`` takes one streamed object off it into this
thread's scratch, verifies it there and delivers the payload through the
caller's guard, reading every byte the server announced whatever the
verdict, so the stream stays in step for the next object.  Into memory the
gateway owns (``guard.own``: RAM-tier pages, reply buffers; never client
memory, never over TLS) the payload is received straight into the
destination and hashed there as each piece lands (``guard.recv_nowait``),
saving the second pass of the copy out of the scratch.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from kvgate.cards.network import wire as w
from kvgate.cards.base import CardInUse, CardUnavailable
from kvgate.cards.objectformat import (
    FIXED_SIZE,
    BufferTooSmall,
    Header,
    ObjectCorrupt,
    ObjectTooNew,
    check_read_header,
    header_size,
    padded_size,
)
from kvgate.keys import key_digest, payload_hasher
from kvgate.memcopy import Abandon, ReadAbandoned, in_client_memory

# A payload arrives into a scratch piece this large, is hashed and copied out
# while still in the CPU cache, then the next piece lands in the same memory:
# the kernel's write, the hash and the copy all hit L2 (1 MiB here).
# Measured here (kvgate bench --network with PIECE changed, 2 MiB objects over loopback, 2
# shared cores, noisy): card/raw 0.85-1.08 in 256 KiB pieces, 0.92 in 128
# KiB, 0.74 in 512 KiB and in 1 MiB.
PIECE = 256 << 10


class _Scratch(threading.local):
    """Per-thread memory reads land in: a thread reads one object at a time, whatever its card."""

    def __init__(self) -> None:
        self.head = bytearray(4096)
        self.piece = bytearray(PIECE)

    def head_view(self, n: int) -> memoryview:
        if len(self.head) < n:
            self.head = bytearray(n)  # a long key's header: at most padded_size(MAX_HEADER)
        return memoryview(self.head)[:n]


_scratch = _Scratch()


class Conn:
    """One connection to the card server; used by one thread at a time.  Closed on any transport failure."""

    def __init__(self, card: Any, sock: socket.socket):
        """``card``: the NetworkCard, for ``lost``, ``location`` and ``max_object_bytes``."""
        self.card, self.sock = card, sock
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    def stale(self) -> bool:
        """Whether the server closed this idle connection (or sent something unasked: equally unusable).

        A zero-timeout poll: ``recv(MSG_PEEK)`` on a socket with a timeout would wait that long first."""
        p = select.poll()
        p.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(p.poll(0))

    @contextmanager
    def transport(self) -> Iterator[None]:
        """Socket and framing failures close the connection and leave as ``CardUnavailable``."""
        try:
            yield
        except (CardUnavailable, ReadAbandoned):
            self.close()
            raise
        except (OSError, w.WireError) as e:
            self.close()
            raise self.card.lost(e) from e

    def send(self, msg: w.Msg, *body: Any, body_len: int | None = None) -> None:
        """``msg`` and its body; with ``body_len``, only the frame's start: the caller sends that many bytes next."""
        n = sum(len(b) for b in body) if body_len is None else body_len
        with self.transport():
            w.send_all(self.sock, [w.frame(msg, n), *body])

    def recv(self, max_body: int = 0) -> tuple[w.Msg, int]:
        """The next reply's header and the length of its body (left unread)."""
        prefix = bytearray(w.PREFIX.size)
        with self.transport():
            w.recv_exact(self.sock, memoryview(prefix))
            hlen, blen = w.parse_prefix(prefix, w.MAX_REPLY_HEADER, max_body)
            return w.decode_reply(w.recv_body(self.sock, hlen)), blen

    def recv_into(self, view: memoryview) -> None:
        with self.transport():
            w.recv_exact(self.sock, view)

    def drain(self, n: int) -> None:
        piece = memoryview(_scratch.piece)
        while n:
            k = min(n, len(piece))
            self.recv_into(piece[:k])
            n -= k

    def call(self, msg: w.Msg, *body: Any, max_body: int = 0) -> tuple[Any, bytes]:
        """One request, one reply: ``(Ok.value or the Results, body)``; an ``Err`` is raised as its exception."""
        self.send(msg, *body)
        return self.reply(msg, max_body)

    def reply(self, msg: w.Msg, max_body: int = 0) -> tuple[Any, bytes]:
        """The reply to ``msg``, sent already (see ``call``)."""
        reply, blen = self.recv(max_body)
        data = b""
        if blen:
            with self.transport():
                data = bytes(w.recv_body(self.sock, blen))
        if isinstance(reply, w.Err):
            raise w.from_err(reply, self.card.location)
        if isinstance(reply, w.Ok):
            return reply.value, data
        if isinstance(reply, w.Results):
            return reply, data
        self.close()
        raise self.card.lost(w.WireError(f"unexpected reply {type(reply).__name__} to {type(msg).__name__}"))

    def receive_object(self, full_key: bytes, view: memoryview, guard: Abandon,
                       corrupt: list[tuple[bytes, bytes, int]]) -> Header | BaseException:
        """Take one ``Item`` off the connection; the object's bytes are always read whole, whatever the verdict,
        so the stream stays in step.  Errors of this object are returned, those of the connection raised."""
        card = self.card
        reply, blen = self.recv(card.max_object_bytes)
        if not isinstance(reply, w.Item):
            self.close()
            raise card.lost(w.WireError(f"expected an item, got {type(reply).__name__}"))
        if reply.err is not None:
            if blen:
                self.drain(blen)
            return w.from_err(reply.err, card.location)
        hsize = header_size(full_key)
        head_n = min(blen, padded_size(hsize))
        head = _scratch.head_view(head_n)
        self.recv_into(head)
        try:
            header = check_read_header(head, head_n, full_key, len(view), blen)
        except (ObjectCorrupt, ObjectTooNew, BufferTooSmall) as e:
            if isinstance(e, ObjectCorrupt):
                corrupt.append((full_key, bytes(head[:FIXED_SIZE]), blen))
                e.add_note(f"deleted corrupt object {key_digest(full_key).hex()} on {card.location}")
            self.drain(blen - head_n)
            return e
        try:
            self._deliver(header, head, blen - head_n, view, guard)
        except ObjectCorrupt as e:
            corrupt.append((full_key, bytes(head[:FIXED_SIZE]), blen))
            e.add_note(f"deleted corrupt object {key_digest(full_key).hex()} on {card.location}")
            return e
        except (CardUnavailable, ReadAbandoned):
            raise
        except OSError as e:  # MemoryFault: this destination is gone, the stream is still in step
            return e
        return header

    def _deliver(self, header: Header, head: memoryview, rest: int, view: memoryview,
                 guard: Abandon) -> None:
        """Receive the payload piece by piece, hash each and copy it out while it is in the CPU cache."""
        hasher = payload_hasher()
        off = 0
        early = head[header.payload_offset :]  # an unpadded (older) object: its first payload bytes came with the head
        fault: BaseException | None = None
        if len(early):
            hasher.update(early)
            try:
                guard.copy(view[: len(early)], early)
            except ReadAbandoned:
                raise
            except OSError as e:  # MemoryFault: this destination is gone; read on to keep the stream in step
                fault = e
            off = len(early)
        if rest and fault is None and guard.own and off + rest <= len(view) and self._in_place(view):
            self._receive_in_place(view[off : off + rest], hasher, guard)
            rest = 0
        piece = memoryview(_scratch.piece)
        while rest:
            k = min(rest, len(piece))
            self.recv_into(piece[:k])
            hasher.update(piece[:k])
            if fault is None:
                try:
                    guard.copy(view[off : off + k], piece[:k])
                except ReadAbandoned:
                    raise
                except OSError as e:
                    fault = e
            off += k
            rest -= k
        if hasher.intdigest() != header.payload_hash:
            raise ObjectCorrupt("payload checksum mismatch")
        if fault is not None:
            raise fault

    def _in_place(self, view: memoryview) -> bool:
        """Whether a payload may be received straight into ``view``: gateway memory (checked beside the
        caller's ``own``), a plain socket that does not block (its timeout set: TLS decrypts in user space,
        through the scratch)."""
        sock = self.sock
        timeout = sock.gettimeout()
        return (not isinstance(sock, ssl.SSLSocket) and timeout is not None and timeout > 0
                and not in_client_memory(view))

    def _receive_in_place(self, view: memoryview, hasher: Any, guard: Abandon) -> None:
        """Fill ``view`` from the socket, hashing each piece as it lands; each receive takes what has arrived
        (``guard.recv_nowait``), the wait for more is a poll outside the guard's lock, bounded by the socket's
        timeout as a receive through the scratch is."""
        fd = self.sock.fileno()
        wait_ms = int(self.sock.gettimeout() * 1000) + 1
        poll = select.poll()
        poll.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        off, n = 0, len(view)
        with self.transport():
            while off < n:
                k = guard.recv_nowait(fd, view[off : min(n, off + PIECE)], hasher)
                if k is None:
                    if not poll.poll(wait_ms):
                        raise TimeoutError("timed out")
                    continue
                if k == 0:
                    raise ConnectionResetError(f"peer closed the connection after {off} of {n} bytes")
                off += k


def copies(exc: BaseException, n: int) -> list[BaseException]:
    """A fresh exception like ``exc`` for each of ``n`` items (never one instance shared by a batch)."""
    out: list[BaseException] = []
    for _ in range(n):
        if isinstance(exc, CardInUse):
            new: BaseException = exc
        elif isinstance(exc, OSError):
            new = type(exc)(exc.errno, exc.strerror, exc.filename)
        else:
            new = type(exc)(*exc.args)
        new.__cause__ = exc.__cause__
        out.append(new)
    return out
