"""The client of a kvgate gateway.

    c = Client.connect("/tmp/kvgate-5557.sock", namespace="my-model|tp1|bf16")
    c.put_many(keys, buffers)            # -> [True, ...]
    c.lookup(keys)                       # leading keys present
    c.get_many(keys, into=buffers)       # fills buffers; None for a miss

Over the Unix socket bulk bytes never cross the socket: they move through a
shared-memory region the gateway gives each session, or, with no copy at
all, through regions the client registers (``register_region``): any buffer
that lies inside a registered file mapping is read or written in place by
the gateway.  Over TCP the bytes travel inline in the frames.

A ``Client`` is safe to share between threads (one request at a time).
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kvgate.keys import as_keys
from kvgate.protocol import (
    INLINE,
    KIND_REPLY,
    MISS,
    NOT_DONE,
    PREAMBLE_SIZE,
    SESSION_REGION,
    TOO_SMALL,
    Clean,
    CountReply,
    Delete,
    Error,
    Exists,
    Get,
    GetReply,
    Hello,
    Lookup,
    Prewarm,
    Put,
    RegisterRegion,
    Stats,
    decode_reply,
    encode_frame,
    parse_preamble,
)

Buffer = Any  # anything exporting a contiguous buffer: bytes, bytearray, memoryview, numpy array, mmap
_SCRATCH_BYTES = 64 << 10  # gaps between packed results are received into this much, and dropped


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
    means an object too large for the region or frame."""
    if len(again) < len(todo):
        return False
    if stalled:
        raise GatewayError("TOO_LARGE", "an object is larger than the shared-memory region or frame limit")
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


class Client:
    def __init__(self, sock: socket.socket, local: bool):
        self._sock = sock
        self.local = local
        self._lock = threading.Lock()
        self._ids = 0
        self._pre = bytearray(PREAMBLE_SIZE)
        self._scratch: memoryview | None = None
        self._regions: list[_Region] = []
        self._session: _Region | None = None
        self._session_mm: mmap.mmap | None = None
        self._broken = False
        self.session_id = 0
        self.fingerprint = ""
        self.max_frame_bytes = 0

    # ---- connecting -----------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        target: str,
        namespace: str = "",
        *,
        token: str | None = None,
        engine_id: str = "",
        role: str = "engine",
        salted: bool = False,
        timeout: float | None = 60.0,
        want_shm: bool = True,
    ) -> "Client":
        """Connect and open a session.

        ``target``: a Unix socket path (``/tmp/kvgate-5557.sock``, ``unix://...``)
        or ``host:port`` (``tcp://`` optional).  ``engine_id`` names the engine
        (all processes of one engine share it); a gateway serves one engine.
        ``role="admin"`` opens a session for stats and clean only.
        """
        kind, addr = _parse_target(target)
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.create_connection(addr, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        try:
            if kind == "unix":
                sock.connect(addr)
            client = cls(sock, local=kind == "unix")
            client._hello(namespace, token, engine_id, role, salted, want_shm and kind == "unix")
        except BaseException:
            sock.close()
            raise
        return client

    def _hello(self, namespace, token, engine_id, role, salted, want_shm) -> None:
        reply, _ = self._call(Hello(namespace=namespace, token=token, engine_id=engine_id, role=role,
                                    pid=os.getpid(), salted=salted, want_shm=want_shm))
        self.session_id = reply.session
        self.fingerprint = reply.fingerprint
        self.max_frame_bytes = reply.max_frame_bytes
        if reply.shm_path:
            fd = os.open(reply.shm_path, os.O_RDWR)
            try:
                self._session_mm = mmap.mmap(fd, reply.shm_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            view = memoryview(self._session_mm)
            base, size = _address(view)
            self._session = _Region(SESSION_REGION, base, size, view)

    def set_timeout(self, seconds: float | None) -> None:
        """Deadline of each later call (None: wait forever).

        A call that runs past it raises ``TimeoutError`` and leaves the client
        broken (the reply may still arrive and would be misread as the next
        one's), so callers reconnect after a timeout.
        """
        self._sock.settimeout(seconds)

    @property
    def broken(self) -> bool:
        """True once a call failed mid-frame: the client must not be used again."""
        return self._broken

    def abort(self) -> None:
        """Wake any thread blocked in a call (it gets an error) and refuse new calls.

        Unlike ``close`` it does not wait for the call in progress, so another
        thread can use it at shutdown.
        """
        self._broken = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        with self._lock:
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

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- framing --------------------------------------------------------------------

    def _call(self, msg, body: Sequence[Buffer] = (), into: Sequence[memoryview] | None = None) -> tuple[Any, Any]:
        """Send ``msg`` (and ``body``), return (reply, reply body).

        The reply body is a ``bytearray``, or None when there is none; with
        ``into`` (one byte view per key of a packed inline get) the results are
        received straight into those views and the second value is what
        ``_recv_packed_into`` returns.
        """
        with self._lock:
            if self._broken:
                raise ConnectionError("this client's connection is broken or closed; connect again")
            self._ids += 1
            msg.id = self._ids
            body_len = sum(memoryview(b).nbytes for b in body)
            try:
                self._send([encode_frame(msg, body_len), *body])
                reply, rbody = self._recv(msg.id, into)
            except BaseException:
                self._broken = True  # the stream is out of step: never read another reply from it
                raise
            if reply.id != msg.id:
                self._broken = True
                raise ConnectionError(f"reply {reply.id} to request {msg.id}: stream out of step")
        if isinstance(reply, Error):
            raise GatewayError(reply.code, reply.message)
        return reply, rbody

    def _send(self, parts: list[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        while views:
            sent = self._sock.sendmsg(views[:512])
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the gateway closed the connection")
            got += n

    def _skip(self, n: int) -> None:
        """Receive ``n`` bytes and drop them."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        while n:
            k = min(n, len(self._scratch))
            self._recv_into(self._scratch[:k])
            n -= k

    def _recv(self, want_id: int, into: Sequence[memoryview] | None = None) -> tuple[Any, Any]:
        self._recv_into(memoryview(self._pre))
        kind, hlen, blen = parse_preamble(self._pre, 1 << 62)
        if kind != KIND_REPLY:
            raise ConnectionError("the gateway sent a request frame")
        header = bytearray(hlen)
        self._recv_into(memoryview(header))
        reply = decode_reply(header)
        if into is not None and isinstance(reply, GetReply) and reply.id == want_id:
            return reply, self._recv_packed_into(reply, blen, into)
        body = None
        if blen:
            body = bytearray(blen)
            self._recv_into(memoryview(body))
        return reply, body

    def _recv_packed_into(self, reply: GetReply, blen: int, into: Sequence[memoryview]) -> list[int]:
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
            self._skip(off - pos)
            if s > len(into[j]):
                self._skip(s)
                sizes[j] = TOO_SMALL
            else:
                self._recv_into(into[j][:s])
            pos = off + s
        self._skip(blen - pos)
        return sizes

    # ---- regions --------------------------------------------------------------------

    def register_region(self, path: str, mapping: Buffer | None = None) -> int:
        """Let the gateway map a /dev/shm file this process has mapped too.

        Buffers inside ``mapping`` (the client's own mapping of the same file)
        are then transferred in place, with no copy at all.
        """
        if not self.local:
            raise GatewayError("BAD_REQUEST", "regions need a local (Unix socket) connection")
        reply, _ = self._call(RegisterRegion(path=path))
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

    # ---- operations --------------------------------------------------------------------

    def put_many(self, keys: Sequence[bytes | str], buffers: Sequence[Buffer], retention: str = "long",
                 dialog: bytes | None = None, position: int = -1) -> list[bool]:
        """Store each buffer under its key.  Returns, per key, whether it was stored.

        ``retention``: ``long`` (RAM tier and cards), ``short`` (RAM only),
        ``none`` (not stored).  ``dialog``: the dialog mark (placement and
        prefix-aware eviction); ``position``: index of keys[0] in its dialog.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        bkeys = as_keys(keys)
        if not bkeys:
            return []
        if not self.local:
            return self._put_inline(bkeys, buffers, retention, dialog, position)
        out: list[bool] = []
        for start, end in self._batches([memoryview(b).nbytes for b in buffers], placed=[self._locate(b) for b in buffers]):
            out += self._put_local(bkeys[start:end], buffers[start:end], retention, dialog,
                                   position + start if position >= 0 else -1)
        return out

    def _put_inline(self, keys, buffers, retention, dialog, position) -> list[bool]:
        out: list[bool] = []
        sizes = [memoryview(b).nbytes for b in buffers]
        limit = max(1, self.max_frame_bytes - (1 << 20))
        start = 0
        while start < len(keys):
            end, total = start, 0
            while end < len(keys) and (end == start or total + sizes[end] <= limit):
                total += sizes[end]
                end += 1
            reply, _ = self._call(Put(keys=keys[start:end], sizes=sizes[start:end], region=INLINE, retention=retention,
                                      dialog=dialog, position=position + start if position >= 0 else -1),
                                  body=buffers[start:end])
            out += reply.stored
            start = end
        return out

    def _batches(self, sizes: list[int], placed: list) -> Iterable[tuple[int, int]]:
        """Split a batch so the bytes staged in the session region fit in it."""
        cap = self._session.size if self._session else 0
        start, staged = 0, 0
        for i, (s, p) in enumerate(zip(sizes, placed)):
            if p is None:
                if self._session is None:
                    raise GatewayError("BAD_REQUEST", "buffer outside any registered region and no session region")
                if s > cap:
                    raise ValueError(f"object {i} is {s} bytes, larger than the shared-memory region ({cap})")
                if staged + s > cap:
                    yield start, i
                    start, staged = i, 0
                staged += s
        yield start, len(sizes)

    def _put_local(self, keys, buffers, retention, dialog, position) -> list[bool]:
        region_ids, offsets, sizes = [], [], []
        cursor = 0
        sess = self._session
        for b in buffers:
            size = memoryview(b).nbytes
            loc = self._locate(b)
            if loc is None:
                np.copyto(_u8(sess.view[cursor : cursor + size]), _u8(b))
                loc = (SESSION_REGION, cursor)
                cursor += size
            region_ids.append(loc[0])
            offsets.append(loc[1])
            sizes.append(size)
        out: list[bool | None] = [None] * len(keys)
        # one request per region named: the wire carries one region per request
        for rid in dict.fromkeys(region_ids):
            idx = [i for i, r in enumerate(region_ids) if r == rid]
            contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
            reply, _ = self._call(Put(keys=[keys[i] for i in idx], sizes=[sizes[i] for i in idx], region=rid,
                                      offsets=[offsets[i] for i in idx], retention=retention, dialog=dialog,
                                      position=position + idx[0] if position >= 0 and contiguous else -1))
            for i, ok in zip(idx, reply.stored):
                out[i] = ok
        return out  # type: ignore[return-value]

    def get_many(self, keys: Sequence[bytes | str], into: Sequence[Buffer] | None = None,
                 dialog: bytes | None = None) -> list:
        """Read objects.  Returns one entry per key, None for a miss.

        With ``into`` (one writable buffer per key), each hit is written into
        its buffer and the entry is a memoryview of the filled part; buffers
        inside a registered region are filled by the gateway in place, and
        over TCP each hit is received from the socket straight into its
        buffer.  Without, each hit is returned as ``bytes``.
        """
        bkeys = as_keys(keys)
        if not bkeys:
            return []
        if into is None:
            return self._get_packed(bkeys, dialog)
        if len(into) != len(bkeys):
            raise ValueError(f"{len(bkeys)} keys but {len(into)} destination buffers")
        if not self.local:
            views = [memoryview(b).cast("B") for b in into]
            for i, v in enumerate(views):
                if v.readonly:
                    raise TypeError(f"destination buffer {i} is read-only")
            return self._get_inline_into(bkeys, views, dialog)
        out = []
        placed = [self._locate(b) for b in into]
        for start, end in self._batches([memoryview(b).nbytes for b in into], placed):
            out += self._get_local(bkeys[start:end], into[start:end], placed[start:end], dialog, start)
        return out

    def _get_local(self, keys, into, placed, dialog, index_base: int) -> list:
        region_ids, offsets, caps, staged = [], [], [], []
        cursor = 0
        for b, loc in zip(into, placed):
            size = memoryview(b).nbytes
            if loc is None:
                loc = (SESSION_REGION, cursor)
                staged.append(True)
                cursor += size
            else:
                staged.append(False)
            region_ids.append(loc[0])
            offsets.append(loc[1])
            caps.append(size)
        sizes = [MISS] * len(keys)
        for rid in dict.fromkeys(region_ids):
            idx = [i for i, r in enumerate(region_ids) if r == rid]
            reply, _ = self._call(Get(keys=[keys[i] for i in idx], region=rid, offsets=[offsets[i] for i in idx],
                                      capacities=[caps[i] for i in idx], dialog=dialog))
            for j, (i, s) in enumerate(zip(idx, reply.sizes)):
                if s == TOO_SMALL:
                    raise ObjectTooLarge(index_base + i, reply.needed[j] if reply.needed else -1)
                sizes[i] = s
        out = []
        for i, s in enumerate(sizes):
            if s < 0:
                out.append(None)
                continue
            dst = memoryview(into[i]).cast("B")
            if staged[i]:
                np.copyto(_u8(dst[:s]), _u8(self._session.view[offsets[i] : offsets[i] + s]))
            out.append(dst[:s])
        return out

    def _get_inline_into(self, keys: list[bytes], into: list[memoryview], dialog: bytes | None) -> list:
        """``get_many(into=...)`` over TCP: each hit is received straight into its buffer, never copied."""
        out: list[memoryview | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        stalled = False
        while todo:
            reply, sizes = self._call(Get(keys=[keys[i] for i in todo], region=INLINE, dialog=dialog),
                                      into=[into[i] for i in todo])
            again = []
            for j, (i, s) in enumerate(zip(todo, sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s == TOO_SMALL:
                    raise ObjectTooLarge(i, reply.sizes[j])
                elif s >= 0:
                    out[i] = into[i][:s]
            stalled = _stalled(todo, again, stalled)
            todo = again
        return out

    def _get_packed(self, keys: list[bytes], dialog: bytes | None) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        stalled = False
        while todo:
            region = SESSION_REGION if self._session is not None else INLINE
            reply, body = self._call(Get(keys=[keys[i] for i in todo], region=region, dialog=dialog))
            src = self._session.view if region == SESSION_REGION else memoryview(body or b"")
            again = []
            for j, (i, s) in enumerate(zip(todo, reply.sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s >= 0:
                    off = reply.offsets[j]
                    out[i] = bytes(src[off : off + s])
            stalled = _stalled(todo, again, stalled)
            todo = again
        return out

    def lookup(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> int:
        """How many leading keys are stored (a prefix restores up to its first miss)."""
        reply, _ = self._call(Lookup(keys=as_keys(keys), dialog=dialog))
        return reply.count

    def exists_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> list[bool]:
        reply, _ = self._call(Exists(keys=as_keys(keys), dialog=dialog))
        return list(reply.present)

    def delete_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> int:
        reply, _ = self._call(Delete(keys=as_keys(keys), dialog=dialog))
        return reply.count

    def prewarm(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> int:
        """Pull the stored leading keys from cards into the RAM tier; returns how many are in RAM."""
        reply, _ = self._call(Prewarm(keys=as_keys(keys), dialog=dialog))
        return reply.count

    def stats(self) -> dict:
        reply, _ = self._call(Stats())
        return reply.stats

    def clean(self) -> int:
        """Delete every object (refused with CLEAN_REFUSED when the cards are shared)."""
        reply, _ = self._call(Clean())
        assert isinstance(reply, CountReply)
        return reply.count
