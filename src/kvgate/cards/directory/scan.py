"""What a directory card holds: its objects' names and headers, found by listing its directories.

A scan lists the leaf directories (``db<NN>/<hh>``) and tidies what it meets
on the way.  Temp names carry the writer's host, boot and pid
(``<digest>.tmp.<host>-<boot>.<pid>.<thread>``, ``kvgate.cards.directory.layout``),
so it knows which are leftovers: on a card this gateway holds exclusively,
every temp file not its own; on a shared card, those of this host whose
process is dead (or of an earlier boot), and those of other hosts once they
are ``STALE_TEMP_SECONDS`` old.  An object that another ``num_dbs`` put
elsewhere is moved to where reads look.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Callable, Iterator

from kvgate.cards.base import HOST_TAG, Card, StoredObject, pid_alive
from kvgate.cards.directory.claim import LockFileClaim
from kvgate.cards.directory.errors import CardErrors
from kvgate.cards.directory.layout import DB_RE, FANOUT_RE, OBJECT_RE, TEMP_MARK, TEMP_OWNER_RE, db_dir_names
from kvgate.cards.directory.write import ObjectFileWriter, discard_corrupt, unlink_quiet
from kvgate.cards.objectformat import FIXED_SIZE, ObjectCorrupt, ObjectTooNew, peek_header
from kvgate.keys import key_digest

# A temp file this old cannot belong to a write still in progress: it is the
# leftover of a crash.  Only for temp files of other hosts on a shared card,
# whose writers this gateway cannot see; the others are known dead or alive.
STALE_TEMP_SECONDS = 3600.0

# Scan reads this much in one go: the fixed header plus a generous key, so
# nearly every header needs one pread.  Longer keys get a second, exact read.
_SCAN_READ = FIXED_SIZE + 1024


class DirectoryScan:
    """The listing of one card directory: names in batches, headers by name, and ``clean``.

    ``card`` is the card scanned: its claim says which temp files are
    leftovers, and broken or newer objects are counted and reported on it.
    """

    def __init__(self, card: Card, named_path: Callable[[bytes], str], errors: CardErrors, claim: LockFileClaim,
                 writer: ObjectFileWriter):
        self.card = card
        self.location = card.location
        self.num_dbs = card.num_dbs
        self.named_place = card.named_place
        self.named_path = named_path
        self.errors = errors
        self.claim = claim
        self.writer = writer
        self._db_names = db_dir_names(card.num_dbs)
        self._card_errors = errors.around

    def _list(self, path: str) -> list[os.DirEntry[str]]:
        """Entries of one card directory; a sub-directory gone meanwhile is empty.

        Listing a whole leaf at once closes its handle before the caller
        (a generator that may be paused for long) resumes.
        """
        try:
            with self._card_errors("cannot list card directory" if path == self.location else None, path):
                with os.scandir(path) as it:
                    return sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _leaf_dirs(self) -> Iterator[str]:
        for _db, _fan, path in self._leaves():
            yield path

    def _leaves(self) -> Iterator[tuple[int | None, str, str]]:
        """(db index, or None for a db beyond ``num_dbs``; fan-out name; path) of every leaf directory."""
        for db in self._list(self.location):
            if not DB_RE.fullmatch(db.name) or not db.is_dir(follow_symlinks=False):
                continue
            i = int(db.name[2:])
            index = i if i < self.num_dbs and self._db_names[i] == db.name else None
            for fan in self._list(db.path):
                if FANOUT_RE.fullmatch(fan.name) and fan.is_dir(follow_symlinks=False):
                    yield index, fan.name, fan.path

    def names(self) -> Iterator[list[bytes]]:
        """One batch per leaf directory; removes leftover temp files, moves misplaced objects home.

        A name is turned into its digest in bulk (one ``bytes.fromhex`` per
        leaf): at a million objects the per-name Python work of a listing
        was most of a restart, on the GIL the event loop waits for.
        """
        now = time.time()
        relocated: set[str] = set()
        for db, fan, leaf in self._leaves():
            try:
                with self._card_errors(None, leaf):
                    listed = os.listdir(leaf)
            except (FileNotFoundError, NotADirectoryError):
                continue
            names = []
            for name in listed:
                if len(name) == 32:
                    names.append(name)
                elif TEMP_MARK in name:
                    self.reap_temp(os.path.join(leaf, name), name, now)
                # Anything else that is not ours (an NFS .nfsXXXX silly-rename,
                # an editor's backup) is left alone.
            try:
                raw = bytes.fromhex("".join(names))
            except ValueError:  # a foreign name of 32 characters: judge each
                names = [n for n in names if OBJECT_RE.fullmatch(n)]
                raw = bytes.fromhex("".join(names))
            batch = [raw[i : i + 16] for i in range(0, len(raw), 16)]
            if self.num_dbs == 1 and db == 0:
                home = [n[:2] == fan for n in names]
            else:
                home = [n[:2] == fan and db == self.named_place(d)[0] for n, d in zip(names, batch)]
            if relocated or not all(home):  # objects moved here already, or to be moved where reads look
                keep = []
                for n, d, at_home in zip(names, batch, home):
                    path = os.path.join(leaf, n)
                    if at_home:
                        if path not in relocated:
                            keep.append(d)
                    elif self._relocate(path, self.named_path(d), relocated):
                        keep.append(d)
                batch = keep
            if batch:
                yield batch

    def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        """Header-only checks; payload hashes are left to reads (reading every payload at start would take
        as long as reading the card)."""
        return [self._scan_one(self.named_path(d), d.hex()) for d in digests]

    def reap_temp(self, path: str, name: str, now: float) -> None:
        """Remove a temp file whose write is known to be over (see the module doc)."""
        owner = TEMP_OWNER_RE.fullmatch(name.rpartition(TEMP_MARK)[2])
        mine = owner is not None and int(owner[3]) == os.getpid() and f"{owner[1]}-{owner[2]}" == HOST_TAG
        if mine:
            return  # a write of this process, in progress
        if self.card.claimed is False and self.claim.fd is not None:  # locked alone: no one else writes here
            unlink_quiet(path)
            return
        this_host, this_boot = HOST_TAG.split("-")
        if owner is not None and owner[1] == this_host and (owner[2] != this_boot or not pid_alive(int(owner[3]))):
            unlink_quiet(path)  # this host's, of an earlier boot or a dead process
            return
        try:  # another host's (or a reused pid's): only age tells
            if now - os.lstat(path).st_mtime > STALE_TEMP_SECONDS:
                os.unlink(path)
        except OSError:
            pass

    def _scan_one(self, path: str, name: str) -> StoredObject | None:
        """Header-only check of one object file."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            self.errors.raise_if_card(exc)
            unlink_quiet(path)
            return None
        try:
            size = os.fstat(fd).st_size
            # A header is all scan wants: without this, readahead would pull ~128 KiB of
            # every object into the page cache at start.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            header = peek_header(os.pread(fd, _SCAN_READ, 0), size, lambda n: os.pread(fd, n, 0), "object file")
            if key_digest(header.full_key).hex() != name:
                raise ObjectCorrupt("object file name does not match the key inside")
        except ObjectTooNew as exc:
            self.card._skip_newer(path, exc)
            return None
        except ObjectCorrupt:
            discard_corrupt(path, fd)
            self.card.scan_corrupt += 1
            return None
        except OSError as exc:
            self.errors.raise_if_card(exc)
            discard_corrupt(path, fd)
            return None
        finally:
            os.close(fd)
        return StoredObject(header.full_key, header.payload_len, size, header.meta)

    def _relocate(self, path: str, home: str, relocated: set[str]) -> bool:
        """Move an object written under another ``num_dbs`` to where reads look.

        Without this, scan would report objects that ``read_into`` can never
        find.  When the right place already holds the key, that copy wins.
        """
        try:
            if os.path.lexists(home):
                unlink_quiet(path)
                return False
            try:
                os.rename(path, home)
            except FileNotFoundError:
                self.writer.make_dirs(os.path.dirname(home))
                os.rename(path, home)
        except OSError as exc:
            self.errors.raise_if_card(exc)
            return False
        relocated.add(home)
        return True

    def clean(self) -> int:
        """Delete objects and temp files; keeps the directories.

        Keeping them means a concurrent writer's lazy ``mkdir`` never races
        an ``rmdir`` here.
        """
        deleted = 0
        for leaf in self._leaf_dirs():
            for entry in self._list(leaf):
                name = entry.name
                is_object = OBJECT_RE.fullmatch(name) is not None
                if not is_object and TEMP_MARK not in name:
                    continue
                try:
                    os.unlink(entry.path)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        self.errors.raise_if_card(exc)
                    continue
                deleted += is_object
        return deleted
