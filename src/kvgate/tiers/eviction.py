"""Eviction policies, shared by the RAM tier and each card's index.

A policy only orders identities; it owns no bytes.  Its owner tells it what is
resident (``add``), what was read (``touch``) and what is gone (``remove``),
and asks it which object to drop next (``choose_victim``).  The owner does the
dropping and then calls ``remove``: ``choose_victim`` never changes the policy,
so an owner may decide not to evict after all.

Why a prefix policy.  An engine restores a prompt prefix from its first block
and stops at the first block it does not find.  A block whose predecessor is
gone is worth nothing, however recently it was used, yet plain LRU evicts a
dialog head first (the head is written and read before the tail, so it is
always older).  ``PrefixPolicy`` orders whole dialogs by last use and cuts
the coldest one from its tail, so what stays is always a usable prefix.

Retention classes: every object is ``SHORT`` or ``LONG``.  All short objects
go before any long one, whatever their age, in both policies.

Policies are not thread-safe: their owner calls them from one thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from enum import IntEnum
from typing import Final

from kvgate.keys import NO_DIALOG

Ident = Hashable
SkipFn = Callable[[Ident], bool]


class Retention(IntEnum):
    """Retention class of an object; lower values are evicted first."""

    SHORT = 0
    LONG = 1

    @classmethod
    def parse(cls, value: str | int) -> Retention:
        """``"short"``/``"long"`` (any case) or 0/1 -> ``Retention``; ValueError otherwise."""
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"retention must be 'short' or 'long', got {value!r}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"retention class must be 0 (short) or 1 (long), got {value!r}") from None


SHORT: Final = Retention.SHORT
LONG: Final = Retention.LONG
_CLASSES: Final = len(Retention)


def _check_klass(klass: int) -> int:
    # Classes index a list: a bad value must fail loudly, not land in a wrong bucket.
    if not isinstance(klass, int) or isinstance(klass, bool) or not 0 <= klass < _CLASSES:
        raise ValueError(f"retention class must be 0 (short) or 1 (long), got {klass!r}")
    return int(klass)


class EvictionPolicy(ABC):
    """Orders resident objects for eviction.

    ``add``, ``touch`` and ``remove`` of unknown identities are tolerated:
    ``touch`` and ``remove`` do nothing, ``add`` of a known one replaces it.
    """

    name: str

    @abstractmethod
    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int) -> None:
        """A new resident object (re-adding an ident replaces it).

        ``size`` is there for policies that weigh objects by size; the two
        here count objects, since a tier's blocks are nearly all one size.
        """

    @abstractmethod
    def touch(self, ident: Ident) -> None:
        """The object was read (a hit)."""

    @abstractmethod
    def remove(self, ident: Ident) -> None:
        """The object is gone (deleted or evicted)."""

    @abstractmethod
    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        """The next object to evict, left in place; None if every object is skipped.

        ``skip(ident)`` True means the object is pinned (being read or
        written) and must not be chosen.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, ident: object) -> bool: ...


class LruPolicy(EvictionPolicy):
    """Least recently used object first; all short objects before long ones."""

    name = "lru"

    def __init__(self) -> None:
        self._order: list[OrderedDict[Ident, None]] = [OrderedDict() for _ in range(_CLASSES)]
        self._klass: dict[Ident, int] = {}

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int) -> None:
        k = _check_klass(klass)
        self.remove(ident)
        self._order[k][ident] = None
        self._klass[ident] = k

    def touch(self, ident: Ident) -> None:
        k = self._klass.get(ident)
        if k is not None:
            self._order[k].move_to_end(ident)

    def remove(self, ident: Ident) -> None:
        k = self._klass.pop(ident, None)
        if k is not None:
            del self._order[k][ident]

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        for order in self._order:
            if skip is None:
                if order:
                    return next(iter(order))
                continue
            for ident in order:
                if not skip(ident):
                    return ident
        return None

    def __len__(self) -> int:
        return len(self._klass)

    def __contains__(self, ident: object) -> bool:
        return ident in self._klass


class _Dialog:
    """The resident blocks of one dialog in one class, by position.

    Several objects may share a position (one per rank or fragment of the same
    block), so each position holds an insertion-ordered set.  Blocks arrive in
    position order, so ``insort`` almost always appends and removing the tail
    pops: both O(1) in the common case, O(dialog length) at worst.
    """

    __slots__ = ("positions", "at")

    def __init__(self) -> None:
        self.positions: list[int] = []  # sorted, unique
        self.at: dict[int, dict[Ident, None]] = {}

    def add(self, position: int, ident: Ident) -> None:
        idents = self.at.get(position)
        if idents is None:
            idents = self.at[position] = {}
            if not self.positions or position > self.positions[-1]:
                self.positions.append(position)
            else:
                insort(self.positions, position)
        idents[ident] = None

    def remove(self, position: int, ident: Ident) -> None:
        idents = self.at[position]
        del idents[ident]
        if not idents:
            del self.at[position]
            if self.positions[-1] == position:
                self.positions.pop()
            else:
                del self.positions[bisect_left(self.positions, position)]

    def __bool__(self) -> bool:
        return bool(self.positions)

    def from_tail(self) -> Iterator[tuple[int, dict[Ident, None]]]:
        for position in reversed(self.positions):
            yield position, self.at[position]


class PrefixPolicy(EvictionPolicy):
    """Coldest dialog first, from its tail; all short objects before long ones.

    Within a class, dialogs are kept in an ``OrderedDict`` by last use: adding
    or touching any block of a dialog makes the whole dialog most recently
    used, because an engine that reads block 5 has read blocks 0-4 too and will
    want them all again together.  The victim is the highest position of the
    coldest dialog, so eviction shortens prefixes and never cuts one in the
    middle; a whole cold dialog goes before any block of a warmer one.

    Pinned objects: a pinned block must not be orphaned either, so the first
    pass never chooses a block below a pinned one in its dialog (it moves on
    to the next dialog).  Only when that finds nothing does a second pass take
    any unpinned object, in the same order: a hole is better than refusing a
    write while something could still be freed.

    Objects without a dialog, or with an unknown position (-1), are each a
    one-block dialog of their own, so among themselves they behave as LRU.

    Costs: ``add``/``touch``/``remove`` O(1) for blocks arriving and leaving
    in position order (O(dialog length) at worst); ``choose_victim`` O(1)
    when nothing is pinned, otherwise proportional to the pinned objects it
    walks past.
    """

    name = "prefix"

    def __init__(self) -> None:
        self._dialogs: list[OrderedDict[Hashable, _Dialog]] = [OrderedDict() for _ in range(_CLASSES)]
        # ident -> (class, dialog key, position).  A lone object's dialog key
        # is a 1-tuple holding the ident: never equal to a 16-byte digest.
        self._where: dict[Ident, tuple[int, Hashable, int]] = {}

    def add(self, ident: Ident, size: int, dialog: bytes, position: int, klass: int) -> None:
        k = _check_klass(klass)
        self.remove(ident)
        if position < 0 or dialog == NO_DIALOG or not dialog:
            dkey: Hashable = (ident,)
            position = 0
        else:
            dkey = bytes(dialog)
        dialogs = self._dialogs[k]
        d = dialogs.get(dkey)
        if d is None:
            d = dialogs[dkey] = _Dialog()  # new keys go to the warm end
        else:
            dialogs.move_to_end(dkey)
        d.add(position, ident)
        self._where[ident] = (k, dkey, position)

    def touch(self, ident: Ident) -> None:
        where = self._where.get(ident)
        if where is not None:
            self._dialogs[where[0]].move_to_end(where[1])

    def remove(self, ident: Ident) -> None:
        where = self._where.pop(ident, None)
        if where is None:
            return
        k, dkey, position = where
        dialogs = self._dialogs[k]
        d = dialogs[dkey]
        d.remove(position, ident)
        if not d:
            del dialogs[dkey]

    def choose_victim(self, skip: SkipFn | None = None) -> Ident | None:
        if skip is None:
            for dialogs in self._dialogs:
                for d in dialogs.values():
                    return next(iter(d.at[d.positions[-1]]))
            return None
        # Pass 1: whole prefixes only; a pinned block shields the ones below it.
        for dialogs in self._dialogs:
            for d in dialogs.values():
                for _position, idents in d.from_tail():
                    shielded = False
                    for ident in idents:
                        if skip(ident):
                            shielded = True
                        else:
                            return ident
                    if shielded:
                        break
        # Pass 2: anything unpinned, same order.
        for dialogs in self._dialogs:
            for d in dialogs.values():
                for _position, idents in d.from_tail():
                    for ident in idents:
                        if not skip(ident):
                            return ident
        return None

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, ident: object) -> bool:
        return ident in self._where


POLICIES: Final[dict[str, type[EvictionPolicy]]] = {"prefix": PrefixPolicy, "lru": LruPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its config name (``eviction_policy``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
