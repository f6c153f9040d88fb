"""Putting a directory card's object files in place whole, or not at all.

Atomicity comes from ``rename``: an object is written whole under a temporary
name in its final directory and only then renamed over its final name.  A
reader that opened the old file keeps reading the old inode, so it sees one
whole object or the other, never a mix; a crash leaves only a ``.tmp.`` file
that no lookup ever opens.  Temp names carry the writer's host, boot and pid
(``<digest>.tmp.<host>-<boot>.<pid>.<thread>``, ``kvgate.cards.directory.layout``),
so ``scan`` knows which are leftovers (``kvgate.cards.directory.scan``).

The file primitives here (a whole ``pwrite``, a directory ``fsync``, a quiet
``unlink``, deleting a corrupt object but not its replacement) are shared by
every part of the card that writes or removes files.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from kvgate.cards.base import HOST_TAG, WriteAbandoned
from kvgate.cards.directory.errors import CardErrors
from kvgate.cards.directory.layout import TEMP_MARK
from kvgate.cards.objectformat import CHECKSUM_PIECE, ObjectMeta, header_size, pack_header, padded_size
from kvgate.keys import payload_hasher
from kvgate.memcopy import Abandon, in_client_memory
from kvgate.memguard import hash_with, region_gone


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """``pwrite`` until all of ``data`` is written: a short write is legal."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # never for a regular file, but a loop must not spin
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]
        offset += n


def pwritev_all(fd: int, bufs: list[memoryview | bytes], offset: int) -> None:
    """``pwritev`` until every buffer is written, in order from ``offset``: a short write is legal."""
    views = [memoryview(b) for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(path: str) -> None:
    """Make a new directory entry durable; some filesystems refuse, which is fine."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def discard_corrupt(path: str, fd: int | None) -> None:
    """Delete a corrupt object, but not a good one renamed over it meanwhile."""
    try:
        if fd is not None:
            mine = os.fstat(fd)
            now = os.stat(path)
            if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
                return
        os.unlink(path)
    except OSError:
        pass


class _ReadBack(threading.local):
    """Per-thread buffer that a piece written out of client memory is read back into, to be hashed."""

    def __init__(self) -> None:
        self.piece = memoryview(mmap.mmap(-1, CHECKSUM_PIECE))


class ObjectFileWriter:
    """Writes one card directory's object files: under a temp name, then renamed over the final one.

    A payload the gateway may load itself (its own memory, or an unguarded
    region of a client that could stop the gateway anyway,
    ``kvgate.gateway.shm``) is hashed whole, then written with its header
    in one ``pwritev``, as a raw write of the file is.  A payload in guarded client
    memory is written straight from there with ``pwrite`` (the kernel reads
    it: a region shrunk under us is ``MemoryFault``, never SIGBUS), then
    each piece is read back from the page cache and hashed: the hash is of
    what landed in the file, and the gateway never loads a guarded page
    itself.  Either way the file is published only if the caller had not
    given up when its last piece was written, and no lock is held, so
    ``abandon`` on the event loop never waits for a ``pwrite`` the device
    holds up.  A client that rewrites an unguarded buffer during its own
    put can leave a file whose hash does not match it: that object reads
    as corrupt and is deleted, never served.  Either way saves the staging
    copy the store makes for other cards (one thread, 32 x 2 MiB puts from
    a /dev/shm mapping into the page cache, same run: staged 0.40-0.45 of a
    raw write + rename, read back 0.64-0.74).
    """

    def __init__(self, location: str, errors: CardErrors, sync: bool):
        self.location = location
        self.errors = errors
        self.sync = sync  # fsync each file and each new directory entry
        # Bound once: write enters it for every object.
        self._card_errors = errors.around
        self._read_back = _ReadBack()

    def write(self, final: str, full_key: bytes, view: memoryview, meta: ObjectMeta, guard: Abandon | None) -> int:
        """Publish ``view`` as the object of ``full_key`` at ``final``; the bytes it takes on the card."""
        # host + boot + pid + thread: concurrent writers of one key, in this
        # process or another on a shared card, each get their own temp file,
        # and a scan can tell a dead writer's leftover from a write in progress.
        tmp = f"{final}{TEMP_MARK}{HOST_TAG}.{os.getpid()}.{threading.get_ident()}"
        # Padded: the payload at a block-aligned offset, for direct reads
        poff = padded_size(header_size(full_key))
        plen = len(view)
        client = in_client_memory(view)
        with self._card_errors():
            try:
                fd = self._create_temp(tmp)
                try:
                    if client:
                        digest = self._write_payload(fd, view, poff, guard)
                        pwrite_all(fd, self._header(full_key, plen, digest, meta, poff), 0)
                    else:
                        # Hashed whole, then header and payload in one call, as a raw write is: one thread,
                        # 32 x 2 MiB into the page cache, 0.95 of a raw pwritev + rename (median,
                        # benchmarks/card_paths.py), against 0.74 for
                        # 256 KiB pieces hashed while in the CPU cache (page-cache writes are slow: 4 GiB/s).
                        if guard is not None and guard.abandoned:
                            raise WriteAbandoned(self.location)
                        # (hash_with: a client's in-place region is hashed under the guard, kvgate.memguard)
                        header = self._header(full_key, plen, hash_with(view, payload_hasher), meta, poff)
                        try:
                            pwritev_all(fd, [header, view], 0)
                        except OSError as e:
                            if e.errno == errno.EFAULT:  # the kernel met a page of the region that is gone
                                raise region_gone() from None
                            raise
                    if self.sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if guard is not None and guard.abandoned:
                    raise WriteAbandoned(self.location)
                os.rename(tmp, final)
            except BaseException:
                unlink_quiet(tmp)
                raise
        if self.sync:
            fsync_dir(os.path.dirname(final))
        return poff + plen

    @staticmethod
    def _header(full_key: bytes, plen: int, payload_hash: int, meta: ObjectMeta, poff: int) -> bytes:
        header = pack_header(full_key, plen, payload_hash, meta, padded=True)
        if len(header) != poff:  # pack_header and padded_size must agree
            raise AssertionError(f"header is {len(header)} bytes, expected {poff}")
        return header

    def _write_payload(self, fd: int, view: memoryview, poff: int, guard: Abandon | None) -> int:
        """Guarded client memory written at ``poff`` piece by piece, never loaded here: each piece is read
        back and hashed; the hash."""
        hasher = payload_hasher()
        back = self._read_back.piece
        for off in range(0, len(view), CHECKSUM_PIECE):
            if guard is not None and guard.abandoned:  # (a piece read after it would land in a deleted file)
                raise WriteAbandoned(self.location)
            piece = view[off : off + CHECKSUM_PIECE]
            try:
                pwrite_all(fd, piece, poff + off)  # the kernel reads the client's pages: EFAULT, never SIGBUS
            except OSError as e:
                if e.errno == errno.EFAULT:
                    raise region_gone() from None
                raise
            n = len(piece)
            got = os.preadv(fd, [back[:n]], poff + off)
            if got != n:
                raise OSError(errno.EIO, f"read back {got} of the {n} bytes just written")
            hasher.update(back[:n])
        return hasher.intdigest()

    def _create_temp(self, tmp: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_TRUNC  # RDWR: a piece from client memory is read back
        for _ in range(3):
            try:
                return os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                self.make_dirs(os.path.dirname(tmp))
            except FileExistsError:
                # Same pid and thread id as ours, so it belongs to a process
                # that died: this thread is not writing it.
                unlink_quiet(tmp)
        return os.open(tmp, flags, 0o600)

    def make_dirs(self, obj_dir: str) -> None:
        """Create ``db<NN>/<hh>`` lazily, but never re-create a vanished card directory.

        ``os.makedirs`` would happily rebuild the location itself, turning an
        unmounted card into writes on the root filesystem; ``mkdir`` of each
        level fails with ENOENT instead.
        """
        db_dir = os.path.dirname(obj_dir)
        for path in (db_dir, obj_dir):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except FileNotFoundError:
                missing = self.errors.location_missing()
                if missing is not None:
                    raise missing from None
                raise
            if self.sync:
                fsync_dir(os.path.dirname(path))
