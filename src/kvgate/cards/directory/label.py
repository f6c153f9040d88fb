"""A directory card's label: the file that makes a directory a card, and names it by its serial.

Read on every health probe (``check``), so a read is one open and one read;
created once, by whichever of several racing processes publishes it first,
and every other one reads the winner's (``create``).
"""

from __future__ import annotations

import errno
import os
import time
import uuid

from kvgate.cards.base import LABEL_MAX, CardUnavailable, new_label, parse_label
from kvgate.cards.directory.errors import CardErrors
from kvgate.cards.directory.layout import LABEL_NAME, TEMP_MARK
from kvgate.cards.directory.write import fsync_dir, pwrite_all, unlink_quiet

# Filesystems without hard links answer os.link with one of these.
_NO_LINK_ERRNOS = frozenset(
    e
    for e in (errno.EPERM, errno.ENOSYS, errno.EXDEV, errno.EMLINK, getattr(errno, "ENOTSUP", None),
              getattr(errno, "EOPNOTSUPP", None))
    if e is not None
)


class CardLabel:
    """The label file of one card directory: read it, or create it once."""

    def __init__(self, location: str, errors: CardErrors):
        self.location = location
        self.path = os.path.join(location, LABEL_NAME)
        self.errors = errors

    def read(self, missing_ok: bool) -> str | None:
        """One open + read: the health probe runs often, on every card."""
        path = self.path
        with self.errors.around("cannot open card label", path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise CardUnavailable(errno.ENOENT, "card label is missing (card gone or not a kvgate card)",
                                      path) from None
        try:
            with self.errors.around("cannot read card label", path):
                raw = b""
                while len(raw) <= LABEL_MAX:
                    chunk = os.read(fd, LABEL_MAX + 1 - len(raw))
                    if not chunk:
                        break
                    raw += chunk
        finally:
            os.close(fd)
        return parse_label(raw, self.path)

    def create(self) -> str:
        """Publish a complete label with ``link``, so racing processes agree.

        ``link`` fails if the name exists, and the file it publishes is already
        whole, so whichever process links first wins and every other one reads
        the winner's label; no process ever sees a half-written one.
        """
        data = new_label()
        tmp = f"{self.path}{TEMP_MARK}{uuid.uuid4().hex}"
        try:
            with self.errors.around("cannot create card label", self.path):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    pwrite_all(fd, data, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    pass
                except OSError as exc:
                    if exc.errno not in _NO_LINK_ERRNOS:
                        raise
                    return self._create_without_link(data)
        finally:
            unlink_quiet(tmp)
        fsync_dir(self.location)
        serial = self.read(missing_ok=False)
        assert serial is not None
        return serial

    def _create_without_link(self, data: bytes) -> str:
        """Fallback for filesystems without hard links: O_EXCL, then wait out a racing writer.

        Here the winner's label is visible before it is written, so a loser
        may briefly read it empty or partial; it retries for a short while.
        """
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    serial = self.read(missing_ok=False)
                    assert serial is not None
                    return serial
                except CardUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.location)
        serial = self.read(missing_ok=False)
        assert serial is not None
        return serial
