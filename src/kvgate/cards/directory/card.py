"""A card that is a directory on any POSIX filesystem (local disk, NFS, FUSE).

``DirectoryCard`` reads its objects itself (``read_into``, with
``kvgate.cards.directory.directio`` for ``O_DIRECT``) and leaves each other job to one
module:

- ``dirlayout``: the names of its files and directories, and why objects
  are named by the digest of their key;
- ``dirwrite``: an object written whole under a temp name, then renamed over
  its final name, so a reader sees one whole object or the other;
- ``dirscan``: what it holds (names, headers), leftover temp files reaped and
  misplaced objects moved home on the way;
- ``dirlabel``: its label; ``dirclaim``: its claim, a lock on
  ``kvgate-card.lock`` held until ``close``; ``dirsnapshot``: the index
  snapshot's writer; ``heads``: the shared-heads list, the card's
  ``heads`` channel (``kvgate.cards.heads``);
- ``direrrors``: which OSErrors say the card, not one object, is in trouble.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from typing import Iterator, NamedTuple

from kvgate.cards.base import (
    HOST_TAG,
    CachedObjectFile,
    Card,
    CardUnavailable,
    NotACardLocation,
    NotCached,
    SnapshotWriter,
    StoredObject,
    byte_view,
    holder_doc,
)
from kvgate.cards.directory.directio import (
    IN_PLACE_FIRST,
    PAGE,
    READ_PIECE,
    SUPPORTED,
    CachedReadChoice,
    DeviceReaders,
    Scratch,
    align_up,
    cached_pages,
    direct_pieces,
    fully_cached,
    set_direct,
)
from kvgate.cards.directory.claim import LockFileClaim
from kvgate.cards.directory.errors import CardErrors
from kvgate.cards.directory.heads import DirectoryHeads
from kvgate.cards.directory.label import CardLabel
from kvgate.cards.directory.layout import SNAPSHOT_NAME, TEMP_MARK, db_dir_names
from kvgate.cards.directory.scan import DirectoryScan
from kvgate.cards.directory.snapshot import FileSnapshotWriter
from kvgate.cards.directory.write import ObjectFileWriter, discard_corrupt, unlink_quiet
from kvgate.cards.objectformat import (
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    check_read_header,
    header_size,
    padded_size,
)
from kvgate.keys import key_digest, payload_hasher
from kvgate.memcopy import Abandon, in_client_memory
from kvgate.memguard import hasher_for

log = logging.getLogger("kvgate.cards.directory")


class _Plan(NamedTuple):
    """How one open object is read (``DirectoryCard._plan``)."""

    file_size: int
    cached: bool  # the page cache holds the whole file
    direct: bool  # read from the device (O_DIRECT is on for its descriptor)


class DirectoryCard(Card):
    """One directory as a card.  Holds no open file but its claim's lock file, so it needs no locking.

    ``create_missing``: ``open`` creates a directory that does not exist.
    Off, a missing directory is ``CardUnavailable`` (ENOENT) until someone
    creates it or mounts its filesystem: a card whose mount is missing would
    otherwise fill the filesystem underneath.
    """

    kind = "directory"
    prepares_reads = True
    writes_client_memory = True  # ObjectFileWriter: through the kernel, hashed as read back from the file
    lends_files = True

    def __init__(self, location: str, num_dbs: int = 1, sync_writes: bool = False, direct_reads: bool = True,
                 create_missing: bool = True):
        super().__init__(location, num_dbs)
        # Turned off for good the first time the filesystem refuses O_DIRECT (tmpfs on old
        # kernels, some FUSE filesystems); reads then all go through the page cache.
        self.direct_reads = direct_reads and SUPPORTED
        self.cached_reads = CachedReadChoice()
        self._scratch = Scratch()
        self._devices = DeviceReaders(f"kvgate-dev-{os.path.basename(location.rstrip('/'))[:6]}")
        self._errors = CardErrors(location)
        # Bound once: a read enters it twice for every object.
        self._card_errors = self._errors.around
        self._writer = ObjectFileWriter(location, self._errors, sync_writes)
        self._label = CardLabel(location, self._errors)
        self._claim = LockFileClaim(location)
        self.create_missing = create_missing
        self._db_names = db_dir_names(num_dbs)
        self._scan = DirectoryScan(self, self.named_path, self._errors, self._claim, self._writer)
        self.heads = DirectoryHeads(location)

    @property
    def sync_writes(self) -> bool:
        """Whether each write is fsynced, file and directory entry, before it counts as done."""
        return self._writer.sync

    @sync_writes.setter
    def sync_writes(self, on: bool) -> None:
        self._writer.sync = on

    # ------------------------------------------------------------------ label

    def open(self) -> str:
        if os.path.exists(self.location) and not os.path.isdir(self.location):
            what = "a regular file" if os.path.isfile(self.location) else "something else"
            raise NotACardLocation(errno.ENOTDIR, f"this is {what}, not a directory: a card is a directory (or a "
                                   "redis:// or kvgate:// URL); name the directory its objects go in",
                                   self.location)
        if not os.path.lexists(self.location) and not self.create_missing:
            raise CardUnavailable(errno.ENOENT, "card directory does not exist and is not created (it would fill "
                                  "the filesystem underneath a missing mount): create the directory or mount its "
                                  "filesystem, or set create_card_dirs: true", self.location)
        with self._card_errors("cannot create card directory"):
            os.makedirs(self.location, exist_ok=True)
        serial = self._label.read(missing_ok=True)
        if serial is None:
            serial = self._label.create()
        self.serial = serial
        return serial

    def check(self) -> str:
        serial = self._label.read(missing_ok=False)
        assert serial is not None
        return serial

    def check_writable(self) -> None:
        probe = f"{self._label.path}{TEMP_MARK}probe-{uuid.uuid4().hex}"  # scans skip temp names
        with self._card_errors("card takes no writes"):
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        unlink_quiet(probe)

    # ------------------------------------------------------------------ claim

    def claim(self, shared: bool) -> None:
        locked = self._claim.take(shared)
        self.claimed = shared
        if locked:
            # Who holds it, for the message of a gateway that is refused (the lock itself says nothing).
            self._claim.note_holder(holder_doc(shared))

    def note_holder(self, doc: dict) -> None:
        """Say in the lock file who holds the claim, when it is held for someone else (a card server's
        remote gateway): a refused gateway then names that one, not the server process."""
        self._claim.note_holder(doc)

    def close(self) -> None:
        """Release the claim: the lock goes with the file description."""
        self.claimed = None
        self._claim.release()
        self._devices.close()

    # ------------------------------------------------------------------ paths

    def object_path(self, full_key: bytes) -> str:
        """Where the object for ``full_key`` lives (whether or not it exists)."""
        return self.named_path(key_digest(full_key))

    def named_path(self, digest: bytes) -> str:
        """Where the object named ``digest`` lives."""
        db, name = self.named_place(digest)
        return os.path.join(self.location, self._db_names[db], name[:2], name)

    # ------------------------------------------------------------------- I/O

    def read_into(self, full_key: bytes, dest: memoryview, guard: Abandon | None = None) -> Header:
        fd, path = self._open_object(full_key)
        try:
            plan = self._plan(fd)
        except BaseException:
            os.close(fd)
            raise
        return self._read_opened(fd, path, full_key, byte_view(dest), guard or Abandon(), plan)

    def read_many_into(self, items: list[tuple[bytes, memoryview]],
                       guard: Abandon | None = None) -> list[Header | BaseException]:
        """``read_into`` of each item, the device's reads all at once.

        Each file is opened and its read planned first; the reads that go to
        the device (``O_DIRECT``) are handed to the card's device readers
        (``DeviceReaders``, up to ``DEVICE_READS`` at a time, every one at this
        thread's scheduling class) while this thread copies the cached ones,
        then it waits for them all.  One thread reading cold objects one after
        the other keeps one piece in flight, and the device wants many.
        """
        guard = guard or Abandon()
        out: list[Header | BaseException | None] = [None] * len(items)
        later: list[tuple[int, int, str, bytes, memoryview, _Plan]] = []
        for i, (full_key, dest) in enumerate(items):
            try:
                fd, path = self._open_object(full_key)
            except (LookupError, ValueError, OSError) as e:
                out[i] = e
                continue
            try:
                plan = self._plan(fd)
            except BaseException as e:
                os.close(fd)
                if not isinstance(e, (LookupError, ValueError, OSError)):
                    raise
                out[i] = e
                continue
            if plan.direct and len(items) > 1:
                later.append((i, fd, path, full_key, dest, plan))
            else:
                out[i] = self._read_one(fd, path, full_key, dest, guard, plan)
        if later:
            for (i, *_), res in zip(later, self._devices.run([
                    (self._read_one, fd, path, full_key, dest, guard, plan)
                    for _i, fd, path, full_key, dest, plan in later])):
                out[i] = res
        return out  # type: ignore[return-value]

    def _read_one(self, fd: int, path: str, full_key: bytes, dest: memoryview, guard: Abandon,
                  plan: "_Plan") -> Header | BaseException:
        try:
            return self._read_opened(fd, path, full_key, byte_view(dest), guard, plan)
        except (LookupError, ValueError, OSError) as e:
            return e

    def _open_object(self, full_key: bytes) -> tuple[int, str]:
        path = self.object_path(full_key)
        try:
            with self._card_errors():
                return os.open(path, os.O_RDONLY), path
        except FileNotFoundError:
            raise ObjectMissing(f"no object {key_digest(full_key).hex()}") from None

    def _plan(self, fd: int) -> "_Plan":
        """How the open object ``fd`` is read: from the device (``O_DIRECT``, now on) or through the page cache."""
        with self._card_errors():
            file_size = os.fstat(fd).st_size
            if not self.direct_reads:
                return _Plan(file_size, False, False)
            cached = fully_cached(fd, file_size)
            direct = (not cached or self.cached_reads.direct_for_cached()) and self._set_direct(fd)
            return _Plan(file_size, cached, direct)

    def _read_opened(self, fd: int, path: str, full_key: bytes, view: memoryview, guard: Abandon,
                     plan: "_Plan") -> Header:
        """Read the object open as ``fd`` (closed here) as ``plan`` says; a corrupt one is deleted."""
        try:
            with self._card_errors():
                return self._read_verified(fd, full_key, view, guard, plan)
        except ObjectCorrupt as exc:
            exc.add_note(f"deleted corrupt object {path}")
            discard_corrupt(path, fd)
            raise
        finally:
            os.close(fd)

    def _read_verified(self, fd: int, full_key: bytes, view: memoryview, guard: Abandon, plan: "_Plan") -> Header:
        t0 = time.perf_counter()
        if plan.direct:
            header = self._read_direct(fd, full_key, view, plan.file_size, guard)
            self.cached_reads.note(True, header.payload_len, time.perf_counter() - t0)
        else:
            header = self._read_cached(fd, full_key, view, plan.file_size, guard)
            if plan.cached:
                self.cached_reads.note(False, header.payload_len, time.perf_counter() - t0)
        return header

    def _read_cached(self, fd: int, full_key: bytes, view: memoryview, file_size: int, guard: Abandon) -> Header:
        """Through the page cache: straight into ``view`` where the gateway may load it, else via the scratch."""
        if in_client_memory(view):
            return self._read_buffered(fd, full_key, view, file_size, guard)
        return self._read_in_place(fd, full_key, view, file_size, guard)

    def _read_buffered(self, fd: int, full_key: bytes, view: memoryview, file_size: int, guard: Abandon) -> Header:
        """Header and first piece in one ``preadv``, then the rest piece by piece, all into the scratch.

        Each piece is checksummed right after it lands, while it is still in
        the CPU cache, then handed to ``view`` through ``guard``: the way into
        memory the gateway must not load itself (``kvgate.memcopy``).
        """
        hsize = header_size(full_key)
        poff = padded_size(hsize)  # where our writes put the payload
        head = self._scratch.head(poff)
        piece = self._scratch.piece
        n = os.preadv(fd, [head, piece[: min(len(view), READ_PIECE)]], 0)
        header = check_read_header(head, n, full_key, len(view), file_size)
        plen = header.payload_len
        # An unpadded object (written before objects were padded): what landed in the piece is not its payload.
        got = min(max(0, n - poff), plen) if header.payload_offset == poff else 0
        hasher = payload_hasher()
        if got:
            hasher.update(piece[:got])
            guard.copy(view[:got], piece[:got])
        off = got
        while off < plen:
            k = os.preadv(fd, [piece[: min(READ_PIECE, plen - off)]], header.payload_offset + off)
            if k <= 0:
                raise ObjectCorrupt("object shorter than its header says")
            hasher.update(piece[:k])
            guard.copy(view[off : off + k], piece[:k])
            off += k
        if hasher.intdigest() != header.payload_hash:
            raise ObjectCorrupt("payload checksum mismatch")
        return header

    def _read_in_place(self, fd: int, full_key: bytes, view: memoryview, file_size: int, guard: Abandon) -> Header:
        """Header and payload read straight into ``view`` and hashed there: one copy where the scratch costs two.

        For memory the gateway may load itself: its own (a reply buffer,
        RAM-tier pages) or a region of a client that could stop the gateway
        anyway (``kvgate.gateway.shm``).  The first call reads the header
        and up to ``IN_PLACE_FIRST`` bytes of payload, a whole 2 MiB object
        in one ``preadv`` as a raw read of the file does; a piece the page
        cache has lost meanwhile goes through the scratch.  Every read is a
        ``guard.read_cached``, so ``abandon`` never waits on the device.
        (kvgate bench, warm card get into a registered region: 0.45-0.48 of
        ``preadv`` through the scratch, 0.54-0.65 this way, best passes; alone,
        ``benchmarks/card_paths.py``: 0.84 of the raw read on one thread, the
        rest being mostly the hash.)

        A checksum mismatch in client memory is not yet corruption: the
        client may have rewritten its buffer under the hash (a get it gave
        up on), so the object is read again through the scratch, which
        decides.  Only that read can call it corrupt and have it deleted.
        """
        hsize = header_size(full_key)
        poff = padded_size(hsize)
        head = self._scratch.head(poff)
        n = guard.read_cached(fd, [head, view[: min(len(view), max(0, file_size - poff), IN_PLACE_FIRST)]], 0)
        if n is None or n < poff:  # the page cache lost it meanwhile
            return self._read_buffered(fd, full_key, view, file_size, guard)
        header = check_read_header(head, n, full_key, len(view), file_size)
        if header.payload_offset != poff:  # unpadded (written before objects were padded): not its payload
            return self._read_buffered(fd, full_key, view, file_size, guard)
        plen = header.payload_len
        off = min(n - poff, plen)
        hasher = hasher_for(view, payload_hasher)  # a client's in-place region: under the guard (kvgate.memguard)
        hasher.update(view[:off])
        piece = self._scratch.piece
        while off < plen:
            want = min(READ_PIECE, plen - off)
            dst = view[off : off + want]
            k = guard.read_cached(fd, [dst], poff + off)
            if k is None:
                k = os.preadv(fd, [piece[:want]], poff + off)
                if k > 0:
                    guard.copy(dst[:k], piece[:k])
            if k <= 0:
                raise ObjectCorrupt("object shorter than its header says")
            hasher.update(dst[:k])
            off += k
        if hasher.intdigest() != header.payload_hash:
            if guard.own:
                raise ObjectCorrupt("payload checksum mismatch")
            return self._read_buffered(fd, full_key, view, file_size, guard)
        return header

    def open_cached_many(self, full_keys: list[bytes], guard: Abandon) -> list[CachedObjectFile | BaseException]:
        out: list[CachedObjectFile | BaseException] = []
        for k in full_keys:
            try:
                out.append(self._open_cached(k, guard))
            except (LookupError, ValueError, OSError, NotCached) as e:
                out.append(e)
        return out

    def _open_cached(self, full_key: bytes, guard: Abandon) -> CachedObjectFile:
        """The object's file, open, if the page cache holds all of it; its header read from the cache.

        A kernel that cannot say what it caches (no ``cachestat``) lends the
        file anyway: the client reads it with ``RWF_NOWAIT`` and asks us for
        whatever it could not read that way.
        """
        path = self.object_path(full_key)
        try:
            with self._card_errors():
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectMissing(f"no object {key_digest(full_key).hex()}") from None
        try:
            with self._card_errors():
                file_size = os.fstat(fd).st_size
            pages = cached_pages(fd)
            if pages is not None and pages < -(-file_size // PAGE):
                raise NotCached()
            poff = padded_size(header_size(full_key))
            head = self._scratch.head(poff)
            n = guard.read_cached(fd, [head], 0)
            if n is None:
                raise NotCached()
            return CachedObjectFile(fd, check_read_header(head, n, full_key, file_size, file_size))
        except BaseException:
            os.close(fd)
            raise

    def _read_direct(self, fd: int, full_key: bytes, view: memoryview, file_size: int, guard: Abandon) -> Header:
        """Header block and payload from the device (``fd`` has ``O_DIRECT`` on), piece by piece.

        The device writes one aligned piece of the process's ring at a time
        (``direct_pieces``; whole blocks, the last one reads short at the end
        of the file); each piece is hashed there and handed to ``view``
        through ``guard``, so no byte of ``view`` past the payload is touched.
        """
        hsize = header_size(full_key)
        poff = padded_size(hsize)
        head = self._scratch.head(poff)
        pieces = direct_pieces()
        first = align_up(min(len(view), max(0, file_size - poff), READ_PIECE))
        hasher = payload_hasher()
        with pieces.take() as piece:
            try:
                n = os.preadv(fd, [head, piece[:first]], 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_refused(f"O_DIRECT read: {exc.strerror}")
                set_direct(fd, False)
                return self._read_buffered(fd, full_key, view, file_size, guard)
            header = check_read_header(head, n, full_key, len(view), file_size)
            if header.payload_offset != poff:  # unpadded: not at an aligned offset
                set_direct(fd, False)
                return self._read_buffered(fd, full_key, view, file_size, guard)
            plen = header.payload_len
            got = min(n - poff, plen)
            self._deliver(piece, got, 0, plen, hasher, view, guard)
        off = got
        while off < plen:
            with pieces.take() as piece:
                # off is a whole number of pieces here, so the file offset stays aligned
                got = min(os.preadv(fd, [piece[: align_up(min(READ_PIECE, plen - off))]], poff + off), plen - off)
                self._deliver(piece, got, off, plen, hasher, view, guard)
            off += got
        if hasher.intdigest() != header.payload_hash:
            raise ObjectCorrupt("payload checksum mismatch")
        return header

    @staticmethod
    def _deliver(piece: memoryview, got: int, off: int, plen: int, hasher, view: memoryview, guard: Abandon) -> None:
        """Hash ``got`` bytes read into ``piece`` (payload offset ``off``) and hand them to ``view``."""
        if got < min(READ_PIECE, plen - off):
            raise ObjectCorrupt("object shorter than its header says")
        if got:
            hasher.update(piece[:got])
            guard.copy(view[off : off + got], piece[:got])

    def _set_direct(self, fd: int) -> bool:
        if set_direct(fd, True):
            return True
        self._direct_refused("fcntl(O_DIRECT) refused")
        return False

    def _direct_refused(self, why: str) -> None:
        if self.direct_reads:
            self.direct_reads = False
            log.warning("card %s: direct reads are off (%s); reading through the page cache", self.location, why)

    def write(self, full_key: bytes, payload: memoryview, meta: ObjectMeta,
              guard: Abandon | None = None) -> int:
        view = byte_view(payload)
        return self._writer.write(self.object_path(full_key), full_key, view, meta, guard)

    def prepare_reads(self, full_keys: list[bytes]) -> None:
        """Look the files up: a read opens a file by a path walk, and on a cold
        dentry and inode cache (or an NFS mount) each step of that walk waits
        for the device or the server.  Done here, at lookup time, those waits
        are out of the way by the time the engine's load arrives."""
        for k in full_keys:
            try:
                os.stat(self.object_path(k))
            except OSError:
                pass  # gone or unreachable: the read will find out and say so

    def exists(self, full_key: bytes, not_before_ns: int | None = None) -> bool:
        """``not_before_ns`` is compared with the file's mtime: the rename that published it, just after the
        object's creation time, so an object a few milliseconds past a ``ttl`` may still count."""
        try:
            with self._card_errors():
                st = os.stat(self.object_path(full_key))
        except FileNotFoundError:
            return False
        return not_before_ns is None or st.st_mtime_ns >= not_before_ns

    def delete(self, full_key: bytes) -> bool:
        return self.delete_named(key_digest(full_key))

    def delete_named(self, digest: bytes) -> bool:
        try:
            with self._card_errors():
                os.unlink(self.named_path(digest))
        except FileNotFoundError:
            return False
        return True

    # --------------------------------------------------------- whole-card ops

    def names(self) -> Iterator[list[bytes]]:
        return self._scan.names()

    def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        return self._scan.stored_objects(digests)

    def clean(self) -> int:
        return self._scan.clean()

    def snapshot_writer(self) -> SnapshotWriter:
        path = os.path.join(self.location, SNAPSHOT_NAME)
        now = time.time()
        with self._card_errors("cannot list card directory"), os.scandir(self.location) as it:
            for entry in it:  # a snapshot a dead gateway was writing
                if entry.name.startswith(SNAPSHOT_NAME + TEMP_MARK):
                    self._scan.reap_temp(entry.path, entry.name, now)
        return FileSnapshotWriter(path, f"{path}{TEMP_MARK}{HOST_TAG}.{os.getpid()}.{threading.get_ident()}",
                                   self.sync_writes)

    def read_snapshot(self) -> bytes | None:
        try:
            with self._card_errors(), open(os.path.join(self.location, SNAPSHOT_NAME), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def drop_snapshot(self) -> None:
        unlink_quiet(os.path.join(self.location, SNAPSHOT_NAME))

    def read_rates(self) -> dict[str, float]:
        return {"cached_copy_bytes_per_second": self.cached_reads.copy_rate or 0.0,
                "direct_read_bytes_per_second": self.cached_reads.direct_rate or 0.0}

    def free_bytes(self) -> int:
        with self._card_errors("cannot stat card filesystem"):
            st = os.statvfs(self.location)
        return st.f_bavail * st.f_frsize

    def reserve_bytes(self, card_reserve: int) -> int:
        return card_reserve

    def why_empty(self, free: int, used: int, card_reserve: int) -> str:
        return (f"its filesystem has {free} bytes free beside the {used} bytes of objects it holds, and "
                f"card_reserve keeps {card_reserve} bytes free; make room on the filesystem or lower card_reserve")
