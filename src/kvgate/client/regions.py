"""The shared-memory transport: payload bytes through memory the gateway maps, over the Unix socket.

Two kinds of region.  The session region is one buffer the gateway gives
each session: a put's bytes are copied into it and the gateway reads them
there, a get's bytes wait there until the client copies them out.  A
registered region is a ``/dev/shm`` file the client has mapped too
(``register_region``): a buffer inside it is read and written by the gateway
in place, with no copy at all.  An object in no registered region that the
session region cannot hold travels inline, in the frames.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np

from kvgate.client.args import Buffer, Scatter, writable_address
from kvgate.client.transport import InlineTransport, Transport, packed_hits, stalled
from kvgate.client.wire import Copy, ObjectTooLarge, Op, Wire, not_permitted
from kvgate.client import crossmem
from kvgate.protocol import (LENT, MISS, NOT_DONE, SESSION_REGION, TOO_SMALL, Get, GiveBack, HelloReply, Put,
                             RegisterRegion)

# A get of plain buffers this large is read out of the gateway's memory: one copy instead of two, for
# a second round trip (the loan given back), which costs more than it saves below about a MiB.
LEND_MIN_BYTES = 1 << 20
_LENT = (LENT, 0)  # placed: done by a lent get


@dataclass
class _Region:
    rid: int
    base: int
    size: int
    view: memoryview | None = None  # our own mapping (the session region)


def _address(buf: Buffer) -> tuple[int, int]:
    """(address, length) of any contiguous buffer, read-only ones too (a put's sources, a region's mapping)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def _u8(buf: Buffer) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> Copy:
    def run() -> None:
        for dst, src in pairs:
            np.copyto(dst, src)

    return Copy(run, sum(d.nbytes for d, _ in pairs))


class SharedMemoryTransport(Transport):
    """Payload bytes through the session region and registered regions, inline for the rest: Unix socket sessions.

    Part of the client's ``Session`` (see ``Transport``).  Its copies into
    and out of the session region are ``Copy`` steps: the client decides
    where they run (``AsyncClient`` moves large ones off the event loop).
    """

    FRAME_FIX = "; or put it from a registered region"

    def __init__(self, wire: Wire):
        self.wire = wire
        self.inline = InlineTransport(wire)
        self.session_region: _Region | None = None  # None: a session opened without one (want_shm=False)
        self.registered: list[_Region] = []
        self._mm: mmap.mmap | None = None
        self.lends = False  # gets of plain buffers read lent objects out of the gateway (kvgate.client.crossmem)
        self.lend_error: str | None = None  # why they stopped, if they did
        self.lends_files = False  # ... and read card objects out of the files the gateway lends open
        self._pidfd: int | None = None  # of the gateway, for taking the files it lends (crossmem.read_files)
        self._pidfd_closer: weakref.finalize | None = None  # closes it: at close(), or when dropped without
        self.gateway_pid = 0
        self.arena: crossmem.MappedArena | None = None  # the gateway's RAM arena, mapped read-only here

    def open(self, hello: HelloReply) -> None:
        self.lends = hello.lends and crossmem.supported and hello.pid > 0
        self._close_pidfd()
        self._pidfd = crossmem.open_pidfd(hello.pid) if self.lends else None
        if self._pidfd is not None:
            self._pidfd_closer = weakref.finalize(self, os.close, self._pidfd)
        self.lends_files = self._pidfd is not None
        self.gateway_pid = hello.pid
        self.arena = None
        crossmem.stop_watching(self)
        if self._pidfd is not None and hello.arena is not None and len(hello.arena) == 3:
            self.arena = crossmem.map_arena(self._pidfd, hello.pid, *hello.arena)
            if self.arena is not None:  # a dead gateway's arena is not kept alive here until the next call
                crossmem.drop_arena_on_exit(self._pidfd, self)
        if not hello.shm_path:
            return
        try:
            fd = os.open(hello.shm_path, os.O_RDWR)
        except PermissionError as e:
            raise not_permitted(hello.shm_path, "open this session's shared-memory region",
                                "run the engine and the gateway as the same user (each session's region "
                                "is readable by the gateway's user only)") from e
        try:
            self._mm = mmap.mmap(fd, hello.shm_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = memoryview(self._mm)
        base, size = _address(view)
        self.session_region = _Region(SESSION_REGION, base, size, view)

    def _close_pidfd(self) -> None:
        if self._pidfd_closer is not None:
            self._pidfd_closer()  # (a finalizer runs once)
            self._pidfd_closer = None
        self._pidfd = None

    def close(self) -> None:
        self._close_pidfd()
        self.arena = None  # unmapped once no copy holds it
        crossmem.stop_watching(self)
        if self.session_region is not None and self.session_region.view is not None:
            self.session_region.view.release()
            self.session_region = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None

    def register_region(self, path: str, mapping: Buffer | None) -> Op:
        reply, _ = yield from self.wire.call(RegisterRegion(path=path))
        if mapping is not None:
            base, size = _address(mapping)
            self.registered.append(_Region(reply.region, base, min(size, reply.size)))
        return reply.region

    # ---- where each buffer goes ----------------------------------------------------------

    def _locate(self, buf: Buffer) -> tuple[int, int] | None:
        """(region, offset) when ``buf`` lies inside a registered region."""
        if not self.registered:
            return None
        addr, size = _address(buf)
        for r in self.registered:
            if r.base <= addr and addr + size <= r.base + r.size:
                return r.rid, addr - r.base
        return None

    def _inline_here(self, views: list[memoryview], placed: list) -> list[bool]:
        """Which buffers travel inline: those in no registered region that the session region cannot
        hold (or all of those, for a session opened without one)."""
        cap = self.session_region.size if self.session_region is not None else -1
        return [p is None and v.nbytes > cap for v, p in zip(views, placed)]

    def _staged_batches(self, index: list[int], views: list[memoryview], placed: list) -> list[list[int]]:
        """Split ``index`` so the bytes staged in the session region fit in it (each one does alone)."""
        cap = self.session_region.size if self.session_region is not None else 0
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

    def put(self, keys: list[bytes], views: list[memoryview], retention: str, dialog: bytes | None,
            position: int) -> Op:
        placed = [self._locate(v) for v in views]
        inline = self._inline_here(views, placed)
        self.inline.refuse_unframeable(keys, views, [i for i, x in enumerate(inline) if x], dialog, self.FRAME_FIX)
        out: list[bool] = []
        start = 0
        while start < len(keys):  # runs of consecutive keys that go the same way keep their positions
            end = start + 1
            while end < len(keys) and inline[end] == inline[start]:
                end += 1
            if inline[start]:
                out += yield from self.inline.send_puts(keys[start:end], views[start:end], retention, dialog,
                                                        position + start if position >= 0 else -1)
            else:
                for batch in self._staged_batches(list(range(start, end)), views, placed):
                    out += yield from self._put_here(keys, views, placed, batch, retention, dialog,
                                                     position + batch[0] if position >= 0 else -1)
            start = end
        return out

    def _put_here(self, keys: list[bytes], views: list[memoryview], placed: list, batch: list[int],
                  retention: str, dialog: bytes | None, position: int) -> Op:
        """Put ``batch`` (indexes, consecutive): bytes in registered regions in place, the rest staged in
        the session region (the batch's staged bytes fit in it)."""
        region_ids, offsets = [], []
        staging = []
        cursor = 0
        sess = self.session_region
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
            reply, _ = yield from self.wire.call(Put(keys=[keys[batch[j]] for j in idx],
                                                     sizes=[views[batch[j]].nbytes for j in idx], region=rid,
                                                     offsets=[offsets[j] for j in idx], retention=retention,
                                                     dialog=dialog,
                                                     position=position + idx[0] if position >= 0 and contiguous
                                                     else -1))
            for j, ok in zip(idx, reply.stored):
                out[j] = ok
        return out  # type: ignore[return-value]

    # ---- get -------------------------------------------------------------------------------

    def get_into(self, keys: list[bytes], views: list[memoryview], dialog: bytes | None, *,
                 source: str | None = None) -> Op:
        out: list = [None] * len(keys)
        placed = [None if isinstance(v, Scatter) else self._locate(v) for v in views]
        if self.lends:
            mine = [i for i, p in enumerate(placed) if p is None]
            if sum(views[i].nbytes for i in mine) >= LEND_MIN_BYTES:
                done = yield from self._get_lent(keys, views, mine, dialog, out, source)
                if done:  # only the registered regions' part is left
                    for i in mine:
                        placed[i] = _LENT
        inline = self._inline_here(views, placed)
        for batch in self._staged_batches([i for i, x in enumerate(inline) if not x and placed[i] is not _LENT],
                                          views, placed):
            yield from self._get_here(keys, views, placed, batch, dialog, out, source)
        index = [i for i, x in enumerate(inline) if x]
        if index:
            got = yield from self.inline.get_into([keys[i] for i in index], [views[i] for i in index], dialog, index,
                                                  source=source)
            for i, g in zip(index, got):
                out[i] = g
        return out

    def get_scattered(self, keys: list[bytes], views: list[memoryview | Scatter], dialog: bytes | None, *,
                      source: str | None = None) -> Op:
        """Each ``Scatter`` destination is read straight into its pieces where this session may read the
        gateway's memory (one copy: ``process_vm_readv`` takes a list of destinations); otherwise through
        the session region, copied out piece by piece (two), and one larger than the region is received
        into one buffer first.  Plain buffers beside them go as in ``get_into``."""
        scattered = [i for i, v in enumerate(views) if isinstance(v, Scatter)]
        out: list = [None] * len(keys)
        whole: list[int] = []
        if self.lends and (yield from self._get_lent(keys, views, scattered, dialog, out, source)):
            rest = [i for i, v in enumerate(views) if not isinstance(v, Scatter)]
        else:
            cap = self.session_region.size if self.session_region is not None else -1
            whole = [i for i in scattered if views[i].nbytes > cap]
            rest = sorted(set(range(len(keys))) - set(whole))
        for index, call in ((whole, super().get_scattered), (rest, self.get_into)):
            if not index:
                continue
            try:
                got = yield from call([keys[i] for i in index], [views[i] for i in index], dialog, source=source)
            except ObjectTooLarge as e:  # named by the caller's index
                raise ObjectTooLarge(index[e.index], e.needed) from None
            for i, g in zip(index, got):
                out[i] = g
        return out

    def _get_lent(self, keys: list[bytes], views: list[memoryview | Scatter], index: list[int],
                  dialog: bytes | None, out: list, source: str | None = None) -> Op:
        """Get ``index`` (indexes) into their views by reading them out of the gateway's memory, or out of
        card files it lends open (``kvgate.client.crossmem``); sets ``out[i]``.  False when this process may not
        read its memory (nothing was read then, and this session copies through its region from now on).
        A ``Scatter`` view is read into its pieces; the gateway reads its card objects into its own memory
        first (a lent file is read into one buffer)."""
        todo = list(index)
        was_stalled = False
        files_ok = self.lends_files and not any(isinstance(views[i], Scatter) for i in index)
        while todo:
            reply, _ = yield from self.wire.call(Get(keys=[keys[i] for i in todo], region=LENT,
                                                     capacities=[views[i].nbytes for i in todo], dialog=dialog,
                                                     files=files_ok, source=source))
            lent_files = reply.files or []
            if len(lent_files) % 4 or not all(0 <= j < len(todo) for j in lent_files[0::4]):
                raise self.wire.out_of_step("a lent get's files do not name its keys")
            as_file = {todo[j]: (fd, off, h) for j, fd, off, h in zip(*(iter(lent_files),) * 4)}
            runs: list[np.ndarray] = []  # per object read out of the gateway's memory, its pieces' iovecs
            lent_sizes: list[int] = []
            files: list[crossmem.LentFile] = []
            file_of: list[int] = []
            hits: list[tuple[int, int]] = []
            again: list[int] = []
            too_small: tuple[int, int] | None = None
            for j, (i, s) in enumerate(zip(todo, reply.sizes)):
                if s == NOT_DONE:
                    again.append(i)
                elif s == TOO_SMALL:
                    too_small = too_small or (i, reply.needed[j] if reply.needed else -1)
                elif s >= 0:
                    if s > views[i].nbytes:
                        raise self.wire.out_of_step(f"get reply of {s} bytes for a destination of {views[i].nbytes}")
                    hits.append((i, s))
                    if i in as_file:
                        fd, off, h = as_file[i]
                        files.append(crossmem.LentFile(fd, off, _u8(views[i])[:s].data, h))
                        file_of.append(i)
                        continue
                    v = views[i]
                    runs.append(v.iov(s) if isinstance(v, Scatter) else
                                np.array(((writable_address(v), s),), np.uint64))
                    lent_sizes.append(s)
            local = np.concatenate(runs) if runs else np.empty((0, 2), np.uint64)
            remote = self._lent_segments(reply.segments or [], lent_sizes)
            failed: crossmem.CrossMemoryError | None = None
            unread: list[int] = []
            if len(local) or files:
                pid, pidfd, arena = self.gateway_pid, self._pidfd, self.arena

                def read(local=local, remote=remote, files=files) -> list[int]:
                    if len(local):
                        crossmem.read(pid, local, remote, arena)
                    if not files or pidfd is None:  # (no files are asked for without a pidfd)
                        return list(range(len(files)))
                    try:
                        return crossmem.read_files(pidfd, pid, files)
                    except crossmem.CrossMemoryError as e:  # may not take its descriptors: all read again
                        self.lends_files = False
                        self.lend_error = str(e)
                        return list(range(len(files)))

                try:
                    unread = yield Copy(read, sum(lent_sizes) + sum(len(f.dest) for f in files))
                except crossmem.CrossMemoryError as e:
                    failed = e
                except BaseException:
                    # A cancelled call (its copy has ended: see AsyncClient) still gives the loan back,
                    # or the pages would stay pinned, and the session's share held, until it closes.
                    if reply.loan:
                        yield from self.wire.call(GiveBack(loan=reply.loan))
                    raise
            if reply.loan:
                yield from self.wire.call(GiveBack(loan=reply.loan))
            if failed is not None:
                # Not permitted here (another user, Yama, seccomp) or the gateway's pages were not where it
                # said: nothing of this call is trusted; the region path does it all again.
                self.lends = False
                self.lend_error = str(failed)
                return False
            if too_small is not None:
                raise ObjectTooLarge(*too_small)
            # Lent files not read from the cache, or not hashing right: the gateway reads those itself
            # (and removes a bad one), in the next round, which lends no files.
            redo = {file_of[k] for k in unread}
            for i, s in hits:
                if i not in redo:
                    v = views[i]
                    out[i] = v.result(s) if isinstance(v, Scatter) else v[:s]
            if redo:
                files_ok = False
                again += sorted(redo)
            was_stalled = stalled(todo, again, was_stalled)
            todo = again
        return True

    def _lent_segments(self, segments: list[int], sizes: list[int]) -> np.ndarray:
        """A lent get's ``segments`` (address, length, ...) as iovecs, checked against the ``sizes`` of
        the objects they hold, in order: each object is whole segments, none empty."""
        seg = np.asarray(segments, dtype=np.int64)
        if len(seg) % 2:
            raise self.wire.out_of_step("a lent get's segments are not (address, length) pairs")
        seg = seg.reshape(-1, 2)
        lengths = np.asarray(sizes, dtype=np.int64)
        ends, want = np.cumsum(seg[:, 1]), np.cumsum(lengths)[lengths > 0]
        # each object's end is a segment's end (ends rise: no segment is empty), and nothing is past the last
        total = int(want[-1]) if len(want) else 0
        if (seg[:, 1] <= 0).any() or (int(ends[-1]) if len(ends) else 0) != total \
                or (total and not (ends[np.minimum(np.searchsorted(ends, want), len(ends) - 1)] == want).all()):
            raise self.wire.out_of_step("a lent get's segments do not add up to its sizes")
        return seg.astype(np.uint64)

    def _get_here(self, keys: list[bytes], views: list[memoryview], placed: list, batch: list[int],
                  dialog: bytes | None, out: list, source: str | None = None) -> Op:
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
            reply, _ = yield from self.wire.call(Get(keys=[keys[batch[j]] for j in idx], region=rid,
                                                     offsets=[offsets[j] for j in idx],
                                                     capacities=[views[batch[j]].nbytes for j in idx], dialog=dialog,
                                                     source=source))
            for k, (j, s) in enumerate(zip(idx, reply.sizes)):
                if s == TOO_SMALL:
                    raise ObjectTooLarge(batch[j], reply.needed[k] if reply.needed else -1)
                if s > views[batch[j]].nbytes:
                    raise self.wire.out_of_step(f"get reply of {s} bytes for a destination of "
                                                f"{views[batch[j]].nbytes}")
                sizes[j] = s
        unstaging = []
        for j, s in enumerate(sizes):
            if s < 0:
                continue
            i = batch[j]
            v = views[i]
            if isinstance(v, Scatter):  # (never in a registered region)
                at = offsets[j]
                out[i] = v.result(s)
                for p in v.filled(s):
                    unstaging.append((_u8(p), _u8(self.session_region.view[at : at + p.nbytes])))
                    at += p.nbytes
                continue
            if placed[i] is None:
                unstaging.append((_u8(v[:s]), _u8(self.session_region.view[offsets[j] : offsets[j] + s])))
            out[i] = v[:s]
        if unstaging:
            yield _copy_pairs(unstaging)

    def get_packed(self, keys: list[bytes], dialog: bytes | None, *, source: str | None = None) -> Op:
        """Through the session region while what is left fits in it, inline otherwise.

        The gateway packs a region from its start and stops at the first
        object that does not fit; a round with no hit at all therefore means
        the next object is larger than the region (or changed size under the
        gateway), and the next round asks for the rest inline, where the
        gateway always sends the first object whole.
        """
        if self.session_region is None:
            return (yield from self.inline.get_packed(keys, dialog, source=source))
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        was_stalled = False
        inline = False
        while todo:
            if inline:
                again = yield from self.inline.packed_round(keys, todo, dialog, out, source=source)
            else:
                again = yield from self._packed_round_here(keys, todo, dialog, out, source)
            progress = len(again) < len(todo)
            if not progress and not inline:
                inline = True  # not a stall yet: the inline round decides
            else:
                was_stalled = stalled(todo, again, was_stalled)
                if progress:
                    inline = False
            todo = again
        return out

    def _packed_round_here(self, keys: list[bytes], todo: list[int], dialog: bytes | None, out: list,
                           source: str | None = None) -> Op:
        """One packed get of the keys ``todo`` into the session region: sets ``out[i]`` per hit, returns the
        keys not done."""
        reply, _ = yield from self.wire.call(Get(keys=[keys[i] for i in todo], region=SESSION_REGION, dialog=dialog,
                                                 source=source))
        src = self.session_region.view
        again, hits = packed_hits(self.wire, reply, todo, len(src))
        if hits:
            def unstage() -> None:
                for i, off, s in hits:
                    out[i] = bytes(src[off : off + s])

            yield Copy(unstage, sum(s for _, _, s in hits))
        return again
