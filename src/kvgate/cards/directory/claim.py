"""A directory card's claim: an advisory lock on its lock file, and who took it last.

``take`` takes an open file description lock (``F_OFD_SETLK``) on
``kvgate-card.lock``, a write lock for a gateway alone on the card and a read
lock for ``shared_storage``, held until ``release``.  The kernel drops it when
the process dies, however it dies, so a killed gateway can restart at once;
these locks work across hosts on NFSv4 too.  A filesystem without locks
(some FUSE ones) is used without, and says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct

from kvgate.cards.base import CardInUse, CardUnavailable, describe_holder
from kvgate.cards.directory.layout import LOCK_NAME
from kvgate.cards.directory.write import pwrite_all

# The directory card's logger: these warnings are about the card.
log = logging.getLogger("kvgate.cards.directory")

# struct flock on Linux (64-bit off_t): l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhqqi4x")
_HOLDER_MAX = 4096
# A filesystem without advisory locks answers with one of these.
_NO_LOCK_ERRNOS = frozenset(
    e for e in (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", None),
                getattr(errno, "EOPNOTSUPP", None))
    if e is not None
)


class LockFileClaim:
    """The lock on one card directory's lock file, held while ``fd`` is open."""

    def __init__(self, location: str):
        self.location = location
        self.path = os.path.join(location, LOCK_NAME)
        self.fd: int | None = None

    def take(self, shared: bool) -> bool:
        """Lock the lock file, or lock it again; False where the card is used without a lock (said why).

        Raises ``CardInUse`` when another holder's lock does not mix with ``shared``.
        """
        fd = self.fd
        if fd is None:
            try:
                fd = self._open_lock_file(shared)
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    # A card that takes no writes cannot be cleaned or written by this gateway either.
                    log.warning("card %s: cannot open its lock file (%s); used without a claim, so another "
                                "gateway on it is not detected", self.location, exc.strerror)
                    return False
                raise CardUnavailable(exc.errno, f"cannot open card lock file: {exc.strerror}",
                                      self.path) from exc
        want = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(want, os.SEEK_SET, 0, 0, 0))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                held_shared = self._held_shared(fd)
                holder = self._read_holder(fd)
                if fd != self.fd:
                    os.close(fd)
                raise CardInUse(self.location, holder, held_shared, shared) from None
            if fd != self.fd:
                os.close(fd)
            if exc.errno in _NO_LOCK_ERRNOS:
                log.warning("card %s: its filesystem has no advisory locks (%s); used without a claim, so "
                            "another gateway on it is not detected", self.location, exc.strerror)
                return False
            raise CardUnavailable(exc.errno, f"cannot lock card: {exc.strerror}", self.path) from exc
        self.fd = fd
        return True

    def note_holder(self, doc: dict) -> None:
        """Say in the lock file who holds the claim (only a hint: the lock itself says nothing)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            pwrite_all(self.fd, (json.dumps(doc) + "\n").encode()[:_HOLDER_MAX], 0)
        except OSError:
            pass  # only a hint

    def _open_lock_file(self, shared: bool) -> int:
        """Read-write (a write lock needs it, and the holder is noted); a read lock also takes read-only."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if not shared or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            return os.open(self.path, os.O_RDONLY)

    @staticmethod
    def _held_shared(fd: int) -> bool:
        """Whether the lock that conflicts with a write lock is a read lock (holders with shared_storage)."""
        try:
            got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:
            return False
        return _FLOCK.unpack(got)[0] == fcntl.F_RDLCK

    @staticmethod
    def _read_holder(fd: int) -> str:
        try:
            return describe_holder(json.loads(os.pread(fd, _HOLDER_MAX, 0)))
        except (OSError, ValueError):
            return "holder unknown"

    def release(self) -> None:
        """The lock goes with the file description."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
