"""A directory card's heads list: ``kvgate-heads`` in the card's directory (``HeadsChannel``)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Collection

from kvgate.cards.directory.layout import HEADS_NAME
from kvgate.cards.directory.write import pwrite_all
from kvgate.cards.heads import HeadsChannel
from kvgate.heads import CARD_MAX_HEADS, decode_id_list, encode_ids


class DirectoryHeads(HeadsChannel):
    """The list as a file of little-endian u64s, oldest first, in the card directory ``location``.

    Appended under an exclusive ``flock``: gateways on other hosts append
    too, and a crash mid-append loses at most the ids of that append (its
    torn tail is dropped on read and written over by the next append).
    Past ``CARD_MAX_HEADS`` the list is rewritten without its oldest ids (a
    crash mid-rewrite leaves a mix of old and new ids, each whole: a
    gateway re-learns what is missing).  A read takes a shared lock and
    creates nothing.
    """

    def __init__(self, location: str) -> None:
        self.path = os.path.join(location, HEADS_NAME)

    def merge(self, ids: Collection[int]) -> set[int]:
        try:
            fd = os.open(self.path, (os.O_RDWR | os.O_CREAT if ids else os.O_RDONLY) | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            return set()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if ids else fcntl.LOCK_SH)
            size = os.fstat(fd).st_size
            raw = bytearray(size)
            got = os.preadv(fd, [raw], 0) if size else 0
            held = decode_id_list(memoryview(raw)[:got])
            have = set(held)
            missing = sorted(set(ids) - have)
            if missing:
                if len(held) + len(missing) > CARD_MAX_HEADS:
                    held = (held + missing)[-CARD_MAX_HEADS:]
                    data, at, have = encode_ids(held), 0, set(held)
                else:
                    data, at = encode_ids(missing), got - got % 8  # a torn tail is written over
                    have.update(missing)
                pwrite_all(fd, data, at)
                if at + len(data) < size:
                    os.ftruncate(fd, at + len(data))
            return have
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"DirectoryHeads({self.path!r})"
