"""Which OSErrors of a directory card say the card, not one object, is in trouble.

The long tier takes a card out of service on ``CardUnavailable`` and counts a
plain ``OSError`` against one object, so every file operation of a directory
card sorts its errors the same way: a missing or unreadable card directory,
a read-only or vanished mount, a stale NFS handle are the card's; one file
another user wrote on a shared card is that object's.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import Iterator

from kvgate.cards.base import CardUnavailable
from kvgate.cards.directory.layout import LABEL_NAME

# Errors that say the card (its filesystem or mount), not one object, is in
# trouble.  Everything else is left as a plain OSError for the caller to count.
_CARD_ERRNOS = frozenset(
    e
    for e in (
        errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENODEV, errno.ENXIO,
        getattr(errno, "ESTALE", None), getattr(errno, "ENOTCONN", None), getattr(errno, "ENOMEDIUM", None),
    )
    if e is not None
)


class CardErrors:
    """The error rule of one card directory: ``around`` a block, ``raise_if_card`` for one error."""

    def __init__(self, location: str):
        self.location = location
        self.label_path = os.path.join(location, LABEL_NAME)

    @contextmanager
    def around(self, failed: str | None = None, where: str | None = None) -> Iterator[None]:
        """Let the OSErrors of the block that say the card is in trouble leave as ``CardUnavailable``.

        Without ``failed``, ``raise_if_card`` tells which: one about a
        single object leaves as it came, for the caller to judge (a miss, a
        file to skip).  With it, the block's work is the card's own (its
        label, its directory), so every one does, as "<failed>: <strerror>"
        naming ``where`` (the card directory when None).  A
        ``CardUnavailable`` raised in the block leaves as it is.
        """
        try:
            yield
        except CardUnavailable:
            raise
        except OSError as exc:
            if failed is not None:
                raise CardUnavailable(exc.errno, f"{failed}: {exc.strerror}", where or self.location) from exc
            self.raise_if_card(exc)
            raise

    def raise_if_card(self, exc: OSError) -> None:
        """Raise the CardUnavailable that ``exc`` stands for; return when it is about one object.

        A ``CardUnavailable`` already says so: it is left to the caller.
        """
        if isinstance(exc, CardUnavailable):
            return
        if exc.errno == errno.ENOENT:
            missing = self.location_missing()
            if missing is not None:
                raise missing from exc
        elif exc.errno in (errno.EACCES, errno.EPERM) and self._label_readable():
            # One file another user wrote (a shared card): that object's
            # problem, not a reason to take the whole card out of service.
            return
        elif exc.errno in _CARD_ERRNOS:
            raise CardUnavailable(exc.errno, f"card is not usable: {exc.strerror}",
                                  exc.filename or self.location) from exc

    def location_missing(self) -> CardUnavailable | None:
        """Tell "no such object" from "no such card" after an ENOENT.

        Only called on the miss path, so hits cost no extra stat.
        """
        try:
            st = os.stat(self.location)
        except OSError as exc:
            return CardUnavailable(exc.errno, f"card directory is not accessible: {exc.strerror}", self.location)
        if not stat.S_ISDIR(st.st_mode):
            return CardUnavailable(errno.ENOTDIR, "card location is not a directory", self.location)
        return None

    def _label_readable(self) -> bool:
        try:
            os.close(os.open(self.label_path, os.O_RDONLY))
        except OSError:
            return False
        return True
