"""The half of a kvgate client that never touches a socket, shared by ``Client`` and ``AsyncClient``.

Both clients run the same operations: the same argument checks
(``kvgate.clientargs``), the same requests, the same reading and checking
of replies, the same split of buffers between registered regions, the
session region and inline frames.
Each operation is written once, here, as a generator that yields the I/O it
needs one step at a time and is sent each step's result:

    Send(views)       send these bytes, in order                  -> None
    Recv(view)        fill ``view`` from the socket, whole        -> None
    Copy(fn, nbytes)  copy ``nbytes`` into or out of a region     -> fn()

``Client`` performs the steps with blocking socket calls, ``AsyncClient``
with the event loop (a large copy on a worker thread).  A step that fails is
thrown back into its generator, so what a failure does to the connection
(broken mid-frame, usable when nothing was sent) is decided here, once, for
both.  The ``*_op`` methods check their arguments when called, before any
step: a wrong one raises at once and nothing is sent.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import numpy as np

from kvgate.clientargs import (  # noqa: F401  (RETENTIONS is imported from here)
    RETENTIONS,
    Buffer,
    byte_views,
    check_dialog,
    check_keys,
    check_position,
    check_retention,
)
from kvgate.keys import MARK_KEYS, DialogMark
from kvgate.protocol import (
    INLINE,
    KIND_REPLY,
    MAX_HEADER_BYTES,
    MISS,
    NOT_DONE,
    PREAMBLE_SIZE,
    SESSION_REGION,
    TOO_SMALL,
    Clean,
    CountReply,
    Delete,
    Error,
    ErrorCode,
    Exists,
    Get,
    GetReply,
    Hello,
    Hold,
    Lookup,
    Mark,
    Prewarm,
    Put,
    RegisterRegion,
    Release,
    Stats,
    decode_reply,
    encode_frame,
    parse_preamble,
)

_SCRATCH_BYTES = 64 << 10  # gaps between packed results are received into this much, and dropped
# Upper bounds of an encoded Put header (MessagePack): 63 bytes measured for every field at its widest
# but the keys, sizes and dialog; each key adds its bytes, a bin header (<= 5) and its size (<= 9).
_PUT_HEADER_BYTES = 128
_PUT_KEY_BYTES = 16


class GatewayError(RuntimeError):
    """The gateway refused a request; ``code`` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ObjectTooLarge(ValueError):
    """A destination buffer given to ``get_many(into=...)`` is smaller than the object."""

    def __init__(self, index: int, needed: int):
        super().__init__(f"object {index} is {needed} bytes, larger than its destination buffer")
        self.index = index
        self.needed = needed


@dataclass
class _Region:
    rid: int
    base: int
    size: int
    view: memoryview | None = None  # our own mapping (the session region)


def _address(buf: Buffer) -> tuple[int, int]:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def _u8(buf: Buffer) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _stalled(todo: list[int], again: list[int], stalled: bool) -> bool:
    """One round of a packed get that made no progress may be a size that changed under the
    gateway (another gateway rewrote the key on a shared card): ask once more.  Two in a row
    means the object keeps changing size, or is larger than any reply can hold."""
    if len(again) < len(todo):
        return False
    if stalled:
        raise GatewayError(ErrorCode.TOO_LARGE, "an object changed size under two reads in a row, or is larger "
                                                "than the shared-memory region and the frame limit")
    return True


def _parse_target(target: str) -> tuple[str, Any]:
    if target.startswith("unix://"):
        return "unix", target[len("unix://"):]
    if target.startswith("tcp://"):
        target = target[len("tcp://"):]
    elif "/" in target or target.endswith(".sock"):
        return "unix", target
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"gateway address {target!r}: expected a socket path or host:port")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


def _not_permitted(path: str, what: str, fix: str) -> PermissionError:
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
    return PermissionError(errno.EACCES, f"cannot {what} {path}: {owner}, and {me}; {fix}")


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
CLOSED_BY_GATEWAY = "the gateway closed the connection"
SEND_PARTS = 512  # buffers per sendmsg call (IOV_MAX is 1024)


def _result(value: Any) -> Op:
    """An operation with nothing to send (an empty batch)."""
    return value
    yield  # pragma: no cover  (makes this a generator)


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> Copy:
    def run() -> None:
        for dst, src in pairs:
            np.copyto(dst, src)

    return Copy(run, sum(d.nbytes for d, _ in pairs))


class ClientCore:
    """The state of one session and every operation on it, as steps; a subclass performs the steps.

    A subclass serialises operations (one runs at a time, from its first
    step to its last) and calls ``_release`` once none runs any more.
    """

    def __init__(self, sock: socket.socket, local: bool):
        self._sock = sock
        self.local = local
        self._ids = 0
        self._pre = bytearray(PREAMBLE_SIZE)
        self._scratch: memoryview | None = None
        self._regions: list[_Region] = []
        self._session: _Region | None = None
        self._session_mm: mmap.mmap | None = None
        self._broken = False
        self.session_id = 0
        self.fingerprint = ""
        self.max_frame_bytes = 0  # the gateway's, learnt in hello (0: not known, no frame is refused here)

    @property
    def broken(self) -> bool:
        """True once a call failed mid-frame: the client must not be used again."""
        return self._broken

    def abort(self) -> None:
        """Wake any caller blocked in a call (it gets an error) and refuse new calls.

        Unlike ``close`` it does not wait for the call in progress, so it can
        be called from anywhere at any time (another thread, a signal handler's
        callback, shutdown).
        """
        self._broken = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _release(self) -> None:
        """Unmap the session region and close the socket; no operation runs any more."""
        if self._session is not None and self._session.view is not None:
            self._session.view.release()
            self._session = None
        if self._session_mm is not None:
            try:
                self._session_mm.close()
            except BufferError:
                pass
            self._session_mm = None
        self._sock.close()

    # ---- framing -------------------------------------------------------------------------

    def _call(self, msg, body: Sequence[Buffer] = (), into: Sequence[memoryview] | None = None) -> Op:
        """Send ``msg`` (and ``body``); returns (reply, reply body).

        The reply body is a ``bytearray``, or None when there is none; with
        ``into`` (one byte view per key of a packed inline get) the results are
        received straight into those views and the second value is what
        ``_recv_packed_into`` returns.  The frame is encoded and checked
        against the gateway's limits before a byte is sent: a message that
        cannot go leaves the connection as it was.
        """
        if self._broken:
            raise ConnectionError("this client's connection is broken or closed; connect again")
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
                self._broken = True
                refusal, _ = yield from self._recv(msg.id)
                if isinstance(refusal, Error):
                    raise GatewayError(refusal.code, refusal.message) from None
                raise
            reply, rbody = yield from self._recv(msg.id, into)
        except BaseException:  # a failed step, a cancelled task, an abandoned operation
            self._broken = True  # the stream is out of step: never read another reply from it
            raise
        if reply.id != msg.id:
            self._broken = True
            if isinstance(reply, Error) and reply.id == 0:
                # sent before the gateway read this request: it refused the connection (too many of them)
                # or could not read a frame, and closes the connection
                raise GatewayError(reply.code, reply.message)
            raise ConnectionError(f"reply {reply.id} to request {msg.id}: stream out of step")
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
            raise ConnectionError("the gateway sent a request frame")
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
            raise ConnectionError(f"get reply of {len(sizes)} results to a get of {len(into)} keys")
        pos = 0
        for off, j in sorted((offsets[j], j) for j, s in enumerate(sizes) if s >= 0):
            s = sizes[j]
            if off < pos or off + s > blen:
                raise ConnectionError(f"get reply places {s} bytes at {off}, outside its {blen}-byte body")
            yield from self._skip(off - pos)
            if s > len(into[j]):
                yield from self._skip(s)
                sizes[j] = TOO_SMALL
            elif s:
                yield Recv(into[j][:s])
            pos = off + s
        yield from self._skip(blen - pos)
        return sizes

    # ---- the session and its regions -----------------------------------------------------

    def _hello_op(self, namespace: str, token: str | None, engine_id: str, role: str, salted: bool,
                  want_shm: bool) -> Op:
        reply, _ = yield from self._call(Hello(namespace=namespace, token=token, engine_id=engine_id, role=role,
                                               pid=os.getpid(), salted=salted, want_shm=want_shm))
        self.session_id = reply.session
        self.fingerprint = reply.fingerprint
        self.max_frame_bytes = reply.max_frame_bytes
        if reply.shm_path:
            try:
                fd = os.open(reply.shm_path, os.O_RDWR)
            except PermissionError as e:
                raise _not_permitted(reply.shm_path, "open this session's shared-memory region",
                                     "run the engine and the gateway as the same user (each session's region "
                                     "is readable by the gateway's user only)") from e
            try:
                self._session_mm = mmap.mmap(fd, reply.shm_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            view = memoryview(self._session_mm)
            base, size = _address(view)
            self._session = _Region(SESSION_REGION, base, size, view)

    def _register_region_op(self, path: Any, mapping: Buffer | None) -> Op:
        if not isinstance(path, str):
            raise TypeError(f"path must be a str, not {type(path).__name__}")
        if not self.local:
            raise GatewayError(ErrorCode.BAD_REQUEST, "regions need a local (Unix socket) connection")
        return self._register_region(path, mapping)

    def _register_region(self, path: str, mapping: Buffer | None) -> Op:
        reply, _ = yield from self._call(RegisterRegion(path=path))
        if mapping is not None:
            base, size = _address(mapping)
            self._regions.append(_Region(reply.region, base, min(size, reply.size)))
        return reply.region

    def _locate(self, buf: Buffer) -> tuple[int, int] | None:
        """(region, offset) when ``buf`` lies inside a registered region."""
        if not self._regions:
            return None
        addr, size = _address(buf)
        for r in self._regions:
            if r.base <= addr and addr + size <= r.base + r.size:
                return r.rid, addr - r.base
        return None

    def _inline_locally(self, views: list[memoryview], placed: list) -> list[bool]:
        """Which buffers of a local call travel inline: those in no registered region that the session
        region cannot hold (or all of those, for a session opened without one)."""
        cap = self._session.size if self._session is not None else -1
        return [p is None and v.nbytes > cap for v, p in zip(views, placed)]

    def _staged_batches(self, index: list[int], views: list[memoryview], placed: list) -> list[list[int]]:
        """Split ``index`` so the bytes staged in the session region fit in it (each one does alone)."""
        cap = self._session.size if self._session is not None else 0
        batches: list[list[int]] = [[]]
        staged = 0
        for i in index:
            if placed[i] is None:
                if staged + views[i].nbytes > cap and batches[-1]:
                    batches.append([])
                    staged = 0
                staged += views[i].nbytes
            batches[-1].append(i)
        return [b for b in batches if b]

    # ---- put -------------------------------------------------------------------------------

    def _put_many_op(self, keys: Any, buffers: Any, retention: Any, dialog: Any, position: Any) -> Op:
        bkeys = check_keys(keys)
        views = byte_views(buffers, "buffers", len(bkeys), writable=False)
        retention = check_retention(retention)
        dialog = check_dialog(dialog)
        position = check_position(position, len(bkeys))
        if not bkeys:
            return _result([])
        return self._put_many(bkeys, views, retention, dialog, position)

    def _put_many(self, bkeys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
                  position: int) -> Op:
        if not self.local:
            self._refuse_unframeable(bkeys, views, range(len(bkeys)), dialog)
            return (yield from self._put_inline(bkeys, views, retention, dialog, position))
        placed = [self._locate(v) for v in views]
        inline = self._inline_locally(views, placed)
        self._refuse_unframeable(bkeys, views, [i for i, x in enumerate(inline) if x], dialog)
        out: list[bool] = []
        start = 0
        while start < len(bkeys):  # runs of consecutive keys that go the same way keep their positions
            end = start + 1
            while end < len(bkeys) and inline[end] == inline[start]:
                end += 1
            if inline[start]:
                out += yield from self._put_inline(bkeys[start:end], views[start:end], retention, dialog,
                                                   position + start if position >= 0 else -1)
            else:
                for batch in self._staged_batches(list(range(start, end)), views, placed):
                    out += yield from self._put_local(bkeys, views, placed, batch, retention, dialog,
                                                      position + batch[0] if position >= 0 else -1)
            start = end
        return out

    def _refuse_unframeable(self, keys: list[bytes], views: list[memoryview], index, dialog: bytes | None) -> None:
        """GatewayError TOO_LARGE for the first object of ``index`` that no frame of the gateway can carry."""
        if not self.max_frame_bytes:
            return
        fixed = _PUT_HEADER_BYTES + len(dialog or b"")
        for i in index:
            size = views[i].nbytes
            if fixed + len(keys[i]) + _PUT_KEY_BYTES + size > self.max_frame_bytes:
                where = "; or put it from a registered region" if self.local else ""
                raise GatewayError(ErrorCode.TOO_LARGE,
                                   f"object {i} is {size} bytes: with its request it is larger than the gateway's "
                                   f"frame limit (max_frame_bytes {self.max_frame_bytes}); nothing was sent. "
                                   f"Raise max_frame_bytes on the gateway{where}")

    def _put_inline(self, keys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
                    position: int) -> Op:
        """Puts with the bytes in the frames, as many objects a frame as the gateway's frame limit allows."""
        out: list[bool] = []
        limit = self.max_frame_bytes  # 0: not known, one object a frame
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
            reply, _ = yield from self._call(Put(keys=keys[start:end], sizes=[v.nbytes for v in views[start:end]],
                                                 region=INLINE, retention=retention, dialog=dialog,
                                                 position=position + start if position >= 0 else -1),
                                             body=views[start:end])
            out += reply.stored
            start = end
        return out

    def _put_local(self, keys: list[bytes], views: list[memoryview], placed: list, batch: list[int],
                   retention: str, dialog: bytes | None, position: int) -> Op:
        """Put ``batch`` (indexes, consecutive): bytes in registered regions in place, the rest staged in
        the session region (the batch's staged bytes fit in it)."""
        region_ids, offsets = [], []
        staging = []
        cursor = 0
        sess = self._session
        for i in batch:
            loc = placed[i]
            if loc is None:
                size = views[i].nbytes
                staging.append((_u8(sess.view[cursor : cursor + size]), _u8(views[i])))
                loc = (SESSION_REGION, cursor)
                cursor += size
            region_ids.append(loc[0])
            offsets.append(loc[1])
        if staging:
            yield _copy_pairs(staging)
        out: list[bool | None] = [None] * len(batch)
        # one request per region named: the wire carries one region per request
        for rid in dict.fromkeys(region_ids):
            idx = [j for j, r in enumerate(region_ids) if r == rid]
            contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
            reply, _ = yield from self._call(Put(keys=[keys[batch[j]] for j in idx],
                                                 sizes=[views[batch[j]].nbytes for j in idx], region=rid,
                                                 offsets=[offsets[j] for j in idx], retention=retention,
                                                 dialog=dialog,
                                                 position=position + idx[0] if position >= 0 and contiguous else -1))
            for j, ok in zip(idx, reply.stored):
                out[j] = ok
        return out  # type: ignore[return-value]

    # ---- get -------------------------------------------------------------------------------

    def _get_many_op(self, keys: Any, into: Any, dialog: Any) -> Op:
        bkeys = check_keys(keys)
        views = None if into is None else byte_views(into, "destination buffers", len(bkeys), writable=True)
        dialog = check_dialog(dialog)
        if not bkeys:
            return _result([])
        return self._get_many(bkeys, views, dialog)

    def _get_many(self, bkeys: list[bytes], views: list[memoryview] | None, dialog: bytes | None) -> Op:
        if views is None:
            return (yield from self._get_packed(bkeys, dialog))
        if not self.local:
            return (yield from self._get_inline_into(bkeys, views, dialog, list(range(len(bkeys)))))
        out: list = [None] * len(bkeys)
        placed = [self._locate(v) for v in views]
        inline = self._inline_locally(views, placed)
        for batch in self._staged_batches([i for i, x in enumerate(inline) if not x], views, placed):
            yield from self._get_local(bkeys, views, placed, batch, dialog, out)
        index = [i for i, x in enumerate(inline) if x]
        if index:
            got = yield from self._get_inline_into([bkeys[i] for i in index], [views[i] for i in index], dialog,
                                                   index)
            for i, g in zip(index, got):
                out[i] = g
        return out

    def _get_local(self, keys: list[bytes], views: list[memoryview], placed: list, batch: list[int],
                   dialog: bytes | None, out: list) -> Op:
        """Get ``batch`` (indexes) into its views: in place in registered regions, the rest through the
        session region (the batch's staged bytes fit in it); sets ``out[i]``."""
        region_ids, offsets = [], []
        cursor = 0
        for i in batch:
            loc = placed[i]
            if loc is None:
                loc = (SESSION_REGION, cursor)
                cursor += views[i].nbytes
            region_ids.append(loc[0])
            offsets.append(loc[1])
        sizes = [MISS] * len(batch)
        for rid in dict.fromkeys(region_ids):
            idx = [j for j, r in enumerate(region_ids) if r == rid]
            reply, _ = yield from self._call(Get(keys=[keys[batch[j]] for j in idx], region=rid,
                                                 offsets=[offsets[j] for j in idx],
                                                 capacities=[views[batch[j]].nbytes for j in idx], dialog=dialog))
            for k, (j, s) in enumerate(zip(idx, reply.sizes)):
                if s == TOO_SMALL:
                    raise ObjectTooLarge(batch[j], reply.needed[k] if reply.needed else -1)
                if s > views[batch[j]].nbytes:
                    self._broken = True
                    raise ConnectionError(f"get reply of {s} bytes for a destination of {views[batch[j]].nbytes}")
                sizes[j] = s
        unstaging = []
        for j, s in enumerate(sizes):
            if s < 0:
                continue
            i = batch[j]
            if placed[i] is None:
                unstaging.append((_u8(views[i][:s]), _u8(self._session.view[offsets[j] : offsets[j] + s])))
            out[i] = views[i][:s]
        if unstaging:
            yield _copy_pairs(unstaging)

    def _get_inline_into(self, keys: list[bytes], into: list[memoryview], dialog: bytes | None,
                         index: list[int]) -> Op:
        """Inline gets into buffers: each hit is received straight into its buffer, never copied.

        ``index[i]`` is the caller's index of ``keys[i]`` (named by ``ObjectTooLarge``).
        """
        out: list[memoryview | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        stalled = False
        while todo:
            reply, sizes = yield from self._call(Get(keys=[keys[i] for i in todo], region=INLINE, dialog=dialog),
                                                 into=[into[i] for i in todo])
            again = []
            for j, (i, s) in enumerate(zip(todo, sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s == TOO_SMALL:
                    raise ObjectTooLarge(index[i], reply.sizes[j])
                elif s >= 0:
                    out[i] = into[i][:s]
            stalled = _stalled(todo, again, stalled)
            todo = again
        return out

    def _get_packed(self, keys: list[bytes], dialog: bytes | None) -> Op:
        """Packed gets: through the session region while what is left fits in it, inline otherwise.

        The gateway packs a region from its start and stops at the first
        object that does not fit; a round with no hit at all therefore means
        the next object is larger than the region (or changed size under the
        gateway), and the next round asks for the rest inline, where the
        gateway always sends the first object whole.
        """
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        stalled = False
        inline = self._session is None
        while todo:
            region = INLINE if inline else SESSION_REGION
            reply, body = yield from self._call(Get(keys=[keys[i] for i in todo], region=region, dialog=dialog))
            src = memoryview(body or b"") if inline else self._session.view
            again, hits = [], []
            for j, (i, s) in enumerate(zip(todo, reply.sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s >= 0:
                    off = reply.offsets[j]
                    if off < 0 or off + s > len(src):
                        self._broken = True
                        raise ConnectionError(f"get reply places {s} bytes at {off}, outside its {len(src)} bytes")
                    hits.append((i, off, s))
            if hits:
                if inline:
                    for i, off, s in hits:
                        out[i] = bytes(src[off : off + s])
                else:
                    def unstage(hits=hits, src=src) -> None:
                        for i, off, s in hits:
                            out[i] = bytes(src[off : off + s])

                    yield Copy(unstage, sum(s for _, _, s in hits))
            progress = len(again) < len(todo)
            if not progress and not inline:
                inline = True  # not a stall yet: the inline round decides
            else:
                stalled = _stalled(todo, again, stalled)
                if progress:
                    inline = self._session is None
            todo = again
        return out

    # ---- one request, one answer -------------------------------------------------------------

    def _ask(self, msg, answer: Callable[[Any], Any]) -> Op:
        reply, _ = yield from self._call(msg)
        return answer(reply)

    def _lookup_op(self, keys: Any, dialog: Any) -> Op:
        return self._ask(Lookup(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: r.count)

    def _exists_many_op(self, keys: Any, dialog: Any) -> Op:
        return self._ask(Exists(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: list(r.present))

    def _delete_many_op(self, keys: Any, dialog: Any) -> Op:
        return self._ask(Delete(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: r.count)

    def _hold_many_op(self, keys: Any, dialog: Any) -> Op:
        return self._ask(Hold(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: list(r.present))

    def _release_many_op(self, keys: Any) -> Op:
        return self._ask(Release(keys=check_keys(keys)), lambda r: r.count)

    def _prewarm_op(self, keys: Any, dialog: Any) -> Op:
        return self._ask(Prewarm(keys=check_keys(keys), dialog=check_dialog(dialog)), lambda r: r.count)

    def _dialog_mark_op(self, keys: Any) -> Op:
        msg = Mark(keys=check_keys(keys)[: MARK_KEYS + 1])  # the gateway looks at no more (+1: the mark past them)
        return self._ask(msg, lambda r: DialogMark(r.mark, r.shared, [(p, msg.keys[p]) for p in r.heads]))

    def _stats_op(self) -> Op:
        return self._ask(Stats(), lambda r: r.stats)

    def _clean_op(self) -> Op:
        def count(reply) -> int:
            assert isinstance(reply, CountReply)
            return reply.count

        return self._ask(Clean(), count)
