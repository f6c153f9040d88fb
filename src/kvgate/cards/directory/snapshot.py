"""Writing a directory card's index snapshot: all of it, or the last one stays.

The gateway writes its index snapshot (``kvgate.tiers.restart``) in pieces
as it walks the index, and a crash can stop it anywhere; so the pieces go to
a temp file beside ``kvgate-index`` that is renamed over it only on commit,
the same way objects are published (``kvgate.cards.directory.write``).
"""

from __future__ import annotations

import os

from kvgate.cards.base import SnapshotWriter
from kvgate.cards.directory.write import pwrite_all, unlink_quiet


class FileSnapshotWriter(SnapshotWriter):
    """A temp file beside the snapshot, renamed over it on commit (a crash leaves the old one whole)."""

    def __init__(self, final: str, tmp: str, sync: bool) -> None:
        self.final, self.tmp, self.sync = final, tmp, sync
        self.fd: int | None = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.offset = 0

    def write(self, data: bytes | memoryview) -> None:
        assert self.fd is not None
        pwrite_all(self.fd, data, self.offset)
        self.offset += len(data)

    def commit(self) -> None:
        assert self.fd is not None
        try:
            if self.sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None
        try:
            os.rename(self.tmp, self.final)
        except OSError:
            unlink_quiet(self.tmp)
            raise

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        unlink_quiet(self.tmp)
