"""How payload bytes get to and from the gateway: the transport interface, and the inline transport.

A transport carries the three calls that move objects (a put, a get into
buffers, a packed get) as steps over the session's ``Wire``:

- ``InlineTransport``: the bytes travel in the frames.  All of them over
  TCP; results are received straight into the destination buffers.
- ``SharedMemoryTransport`` (``kvgate.client.regions``): over the Unix socket,
  through the session's shared-memory region and the regions the client
  registers, and inline for what fits in neither.

``kvgate.client.core.Session`` picks one per connection; both clients use it
the same way.
"""

from __future__ import annotations

from typing import Any

from kvgate.client.args import Scatter
from kvgate.client.wire import Copy, GatewayError, ObjectTooLarge, Op, Wire
from kvgate.protocol import INLINE, MAX_HEADER_BYTES, NOT_DONE, TOO_SMALL, ErrorCode, Get, GetReply, HelloReply, Put

# Upper bounds of an encoded Put header (MessagePack): 63 bytes measured for every field at its widest
# but the keys, sizes and dialog; each key adds its bytes, a bin header (<= 5) and its size (<= 9).
_PUT_HEADER_BYTES = 128
_PUT_KEY_BYTES = 16


class Transport:
    """How one session's payload bytes travel.  Part of the client's ``Session``.

    Its methods run in the call that holds the client (the caller's thread,
    or the event loop), one at a time; the ``Op`` ones yield their I/O as
    steps and never block.  Arguments arrive checked: keys as bytes, buffers
    as flat byte views (or, for ``get_scattered``, ``Scatter`` pieces of
    them), one per key, never an empty batch.
    """

    def open(self, hello: HelloReply) -> None:
        """Take what the gateway's hello offered (a shared-memory region), before any other call."""

    def close(self) -> None:
        """Let go of what ``open`` took; no call runs any more."""

    def put(self, keys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
            position: int) -> Op:
        """Store each view under its key; returns, per key, whether it was stored."""
        raise NotImplementedError

    def get_into(self, keys: list[bytes], views: list[memoryview], dialog: bytes | None, *,
                 source: str | None = None) -> Op:
        """Fill each view with its object; returns, per key, a view of the filled part or None.  ``source``:
        where the KV was computed, which chooses the gateway's peers asked (``Get.source``)."""
        raise NotImplementedError

    def get_packed(self, keys: list[bytes], dialog: bytes | None, *, source: str | None = None) -> Op:
        """Read each object; returns, per key, its bytes or None."""
        raise NotImplementedError

    def get_scattered(self, keys: list[bytes], views: list[memoryview | Scatter], dialog: bytes | None, *,
                      source: str | None = None) -> Op:
        """``get_into`` where some destinations are ``Scatter`` (pieces filled in order; their entry is
        ``Scatter.result``: the filled pieces, or for a ``Pieces`` row the bytes written).  Here: each
        received into one buffer, then copied into its pieces (a ``Copy`` step: ``AsyncClient`` moves a
        large one off its event loop)."""
        whole = [memoryview(bytearray(v.nbytes)) if isinstance(v, Scatter) else v for v in views]
        got = yield from self.get_into(keys, whole, dialog, source=source)
        hits = [i for i, (v, g) in enumerate(zip(views, got)) if isinstance(v, Scatter) and g is not None]
        if hits:
            yield Copy(lambda: [spread(views[i], got[i]) for i in hits], sum(got[i].nbytes for i in hits))
            for i in hits:
                got[i] = views[i].result(got[i].nbytes)
        return got


def spread(dest: Scatter, got: memoryview) -> None:
    """Copy ``got`` into ``dest``'s pieces, in order."""
    at = 0
    for p in dest.filled(got.nbytes):
        p[:] = got[at:at + p.nbytes]
        at += p.nbytes


def stalled(todo: list[int], again: list[int], before: bool) -> bool:
    """Whether a round of a get stalled (``before``: the round before did).

    One round of a packed get that made no progress may be a size that changed under the
    gateway (another gateway rewrote the key on a shared card): ask once more.  Two in a row
    means the object keeps changing size, or is larger than any reply can hold."""
    if len(again) < len(todo):
        return False
    if before:
        raise GatewayError(ErrorCode.TOO_LARGE, "an object changed size under two reads in a row, or is larger "
                                                "than the shared-memory region and the frame limit")
    return True


def packed_hits(wire: Wire, reply: GetReply, todo: list[int], room: int) -> tuple[list[int], list[tuple[Any, ...]]]:
    """A packed get reply to the keys ``todo``, in ``room`` bytes: (the keys not done, (key, offset, size) per hit)."""
    again, hits = [], []
    for j, (i, s) in enumerate(zip(todo, reply.sizes)):
        if s == NOT_DONE:
            again.append(i)
        elif s >= 0:
            off = reply.offsets[j]
            if off < 0 or off + s > room:
                raise wire.out_of_step(f"get reply places {s} bytes at {off}, outside its {room} bytes")
            hits.append((i, off, s))
    return again, hits


class InlineTransport(Transport):
    """Every payload byte in the frames: the transport of TCP sessions, and the fallback of shared memory."""

    FRAME_FIX = ""  # what a refusal of an object too large for any frame offers besides a larger frame limit

    def __init__(self, wire: Wire):
        self.wire = wire

    def put(self, keys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
            position: int) -> Op:
        self.refuse_unframeable(keys, views, range(len(keys)), dialog, self.FRAME_FIX)
        return (yield from self.send_puts(keys, views, retention, dialog, position))

    def refuse_unframeable(self, keys: list[bytes], views: list[memoryview], index, dialog: bytes | None,
                           fix: str) -> None:
        """GatewayError TOO_LARGE for the first object of ``index`` that no frame of the gateway can carry."""
        limit = self.wire.max_frame_bytes
        if not limit:
            return
        fixed = _PUT_HEADER_BYTES + len(dialog or b"")
        for i in index:
            size = views[i].nbytes
            if fixed + len(keys[i]) + _PUT_KEY_BYTES + size > limit:
                raise GatewayError(ErrorCode.TOO_LARGE,
                                   f"object {i} is {size} bytes: with its request it is larger than the gateway's "
                                   f"frame limit (max_frame_bytes {limit}); nothing was sent. "
                                   f"Raise max_frame_bytes on the gateway{fix}")

    def send_puts(self, keys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
                  position: int) -> Op:
        """Puts with the bytes in the frames, as many objects a frame as the gateway's frame limit allows."""
        out: list[bool] = []
        limit = self.wire.max_frame_bytes  # 0: not known, one object a frame
        start = 0
        while start < len(keys):
            end = start
            header = _PUT_HEADER_BYTES + len(dialog or b"")
            total = header
            while end < len(keys):
                key_cost = len(keys[end]) + _PUT_KEY_BYTES
                if end > start and (not limit or total + key_cost + views[end].nbytes > limit
                                    or header + key_cost > MAX_HEADER_BYTES):
                    break
                header += key_cost
                total += key_cost + views[end].nbytes
                end += 1
            reply, _ = yield from self.wire.call(Put(keys=keys[start:end], sizes=[v.nbytes for v in views[start:end]],
                                                     region=INLINE, retention=retention, dialog=dialog,
                                                     position=position + start if position >= 0 else -1),
                                                 body=views[start:end])
            out += reply.stored
            start = end
        return out

    def get_into(self, keys: list[bytes], views: list[memoryview], dialog: bytes | None,
                 index: list[int] | None = None, *, source: str | None = None) -> Op:
        """Each hit is received straight into its buffer, never copied.

        ``index[i]`` is the caller's index of ``keys[i]`` (named by ``ObjectTooLarge``), when not ``i``.
        """
        out: list[memoryview | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        was_stalled = False
        while todo:
            reply, sizes = yield from self.wire.call(Get(keys=[keys[i] for i in todo], region=INLINE, dialog=dialog,
                                                         source=source), into=[views[i] for i in todo])
            again = []
            for j, (i, s) in enumerate(zip(todo, sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s == TOO_SMALL:
                    raise ObjectTooLarge(i if index is None else index[i], reply.sizes[j])
                elif s >= 0:
                    out[i] = views[i][:s]
            was_stalled = stalled(todo, again, was_stalled)
            todo = again
        return out

    def get_packed(self, keys: list[bytes], dialog: bytes | None, *, source: str | None = None) -> Op:
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        was_stalled = False
        while todo:
            again = yield from self.packed_round(keys, todo, dialog, out, source=source)
            was_stalled = stalled(todo, again, was_stalled)
            todo = again
        return out

    def packed_round(self, keys: list[bytes], todo: list[int], dialog: bytes | None, out: list, *,
                     source: str | None = None) -> Op:
        """One packed get of the keys ``todo`` in a frame (the gateway always sends the first object whole):
        sets ``out[i]`` per hit, returns the keys not done."""
        reply, body = yield from self.wire.call(Get(keys=[keys[i] for i in todo], region=INLINE, dialog=dialog,
                                                    source=source))
        src = memoryview(body or b"")
        again, hits = packed_hits(self.wire, reply, todo, len(src))
        for i, off, s in hits:
            out[i] = bytes(src[off : off + s])
        return again
