"""Objects sessions asked the gateway to keep on their cards until they release them.

LMCache looks keys up and locks what it found, then loads some of them a
little later, then unlocks: a lock must keep eviction from removing an
object in between, or the load finds it gone and the engine recomputes what
the lookup promised.  A session ``hold``s keys (the ``hold`` op); a card's
eviction passes over held objects; ``release``, the session's end or
``HOLD_S`` without a word from it ends the hold.

What a hold covers: the object's copy on its card.  A ``long`` object is on
its card whenever it is present at all (puts are write-through), so the
RAM tier, which is a cache of the cards, is left to evict as it likes; a
``short`` object lives in RAM only and a hold does not keep it.  An explicit
``delete`` still deletes.

Bounded, since any session may ask: at most ``MAX_PER_SESSION`` keys per
session and ``MAX_TOTAL`` in all (past that, ``hold`` holds no more and says
so per key), and a hold lapses after ``HOLD_S``.  A card whose every
eviction candidate is held stays over its capacity until holds end: by at
most the held objects, and only for as long as they are held.

Loop only, like the tiers: no locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from kvgate.keys import key_digest

MAX_PER_SESSION: Final = 4096
MAX_TOTAL: Final = 32768
HOLD_S: Final = 60.0


class Holds:
    def __init__(self, max_per_session: int = MAX_PER_SESSION, max_total: int = MAX_TOTAL,
                 hold_s: float = HOLD_S) -> None:
        self.max_per_session = max_per_session
        self.max_total = max_total
        self.hold_s = hold_s
        self._count: dict[bytes, int] = {}  # full key -> sessions holding it
        # key digest -> held keys with that digest: a card's index knows its objects by digest only
        self._digests: dict[bytes, int] = {}
        # session -> full key -> when its hold lapses, oldest first
        self._sessions: dict[int, OrderedDict[bytes, float]] = {}
        self._total = 0
        self.refused = 0  # keys not held because a cap was reached (a counter for status)

    def __contains__(self, fkey: object) -> bool:
        return fkey in self._count

    def __len__(self) -> int:
        return len(self._count)

    def holds_digest(self, digest: bytes) -> bool:
        """Whether a held key has this digest (what a card's eviction asks)."""
        return digest in self._digests

    def hold(self, session: int, fkeys: Iterable[bytes], now: float | None = None) -> list[bool]:
        """Hold each key for ``session`` (again: its hold is renewed); False where a cap was reached."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        mine = self._sessions.setdefault(session, OrderedDict())
        until = now + self.hold_s
        out = []
        for k in fkeys:
            if k in mine:
                mine.move_to_end(k)
            elif len(mine) >= self.max_per_session or self._total >= self.max_total:
                self.refused += 1
                out.append(False)
                continue
            else:
                c = self._count.get(k, 0)
                self._count[k] = c + 1
                if not c:
                    d = key_digest(k)
                    self._digests[d] = self._digests.get(d, 0) + 1
                self._total += 1
            mine[k] = until
            out.append(True)
        if not mine:
            del self._sessions[session]
        return out

    def release(self, session: int, fkeys: Iterable[bytes]) -> int:
        """End ``session``'s holds on these keys; how many it held."""
        mine = self._sessions.get(session)
        if not mine:
            return 0
        n = 0
        for k in fkeys:
            if mine.pop(k, None) is not None:
                self._drop(k)
                n += 1
        if not mine:
            del self._sessions[session]
        return n

    def release_all(self, session: int) -> int:
        """The session ended: every hold it had ends."""
        mine = self._sessions.pop(session, None)
        if not mine:
            return 0
        for k in mine:
            self._drop(k)
        return len(mine)

    def expire(self, now: float | None = None) -> int:
        """End the holds that lapsed (each session's are in the order they lapse)."""
        now = time.monotonic() if now is None else now
        n = 0
        for session in list(self._sessions):
            mine = self._sessions[session]
            while mine:
                k, until = next(iter(mine.items()))
                if until > now:
                    break
                del mine[k]
                self._drop(k)
                n += 1
            if not mine:
                del self._sessions[session]
        return n

    def _drop(self, k: bytes) -> None:
        self._total -= 1
        c = self._count[k] - 1
        if c:
            self._count[k] = c
            return
        del self._count[k]
        d = key_digest(k)
        n = self._digests[d] - 1
        if n:
            self._digests[d] = n
        else:
            del self._digests[d]
