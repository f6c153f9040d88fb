"""Shared heads: the leading blocks many dialogs share, and the dialog mark past them.

Chat and agent traffic puts the same system prompt (often thousands of
tokens) in front of every conversation.  A dialog mark taken from a prompt's
first blocks would then be the same for every conversation: one card would
hold them all, and eviction would see one endless dialog.  So the gateway
learns which leading blocks are *shared heads* and takes the mark from the
first block past them.

Learning.  Block keys chain (an engine's block hash covers every token
before it), so the prompts seen form a tree.  A block after which
``BRANCHES`` different next blocks have been seen is a branch point: it and
every block before it are shared heads.  A conversation alone never
branches that way (each turn extends the last), a system prompt does after
three conversations.  Only the first ``DEPTH`` blocks of a prompt count.

Agreement.  Every gateway must compute the same mark for the same prompt, or
a conversation's blocks would be looked for on one card and stored on
another.  Gateways share what they learn through their cards (each card's
``heads`` channel, ``kvgate.cards.heads``: every card holds the union, up
to ``CARD_MAX_HEADS``), so gateways on the same cards converge within one
sync period and a restarted gateway starts from what the cards hold.
While two gateways disagree, a lookup may miss a block stored under the
other mark: a recompute, never a wrong byte.

Bounds.  System prompts change (a new version, a new tool list) and every
version's blocks are heads, so a set that only grew would fill in normal
use, and a full set that stopped learning would mark every conversation
behind the next system prompt alike, on every gateway of those cards, for
good.  So the set is bounded by use: a head is used whenever a prompt's
shared prefix runs through it, and when a new head needs room it takes
the place of one unused for ``IDLE_S``.  A head in use is never pushed
out, so an engine sending thousands of made-up system prompts cannot
displace the ones real traffic runs on; if every head is in use, the new
one waits (``refused`` counts it) until some go idle.  Heads read from a
card only fill free room and come in as idle, so what other gateways
learned never displaces what this one uses.

Identities are 63-bit hashes of full keys (namespace included): heads of
one namespace never shape another's marks.  On a card each is a u64; the
top bit set marks a branch point.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvgate.keys import MARK_KEYS

log = logging.getLogger("kvgate.heads")

BRANCHES = 3  # distinct next blocks after a block that make it a branch point
DEPTH = MARK_KEYS  # leading blocks of a prompt looked at
MAX_PARENTS = 1 << 16  # blocks whose next blocks are being counted (least recently seen dropped)
MAX_HEADS = 1 << 16  # shared-head identities kept; past that a new head takes an idle one's place
CARD_MAX_HEADS = 2 * MAX_HEADS  # ids a card's list keeps (8 bytes each): past that the oldest go
IDLE_S = 600.0  # a head no prompt ran through for this long may give its place to a new one
_TOUCH_S = 1.0  # a head's last use is refreshed at most this often (a mark runs through up to DEPTH heads)


_BRANCH = 1 << 63  # on a card, an id with this bit set marks its block as a branch point
_ID_MASK = _BRANCH - 1


def block_id(full_key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(full_key) & _ID_MASK


class SharedHeads:
    """The shared-head set of one gateway, and what it learns from the prompts it sees.

    A shared prefix is cut into *segments* at its branch points: a system
    prompt, then a document several conversations ask about, each its own
    segment.  A segment is stored as one dialog (its mark: its first key),
    so eviction cuts it from its tail like any dialog and every gateway
    finds it on one card; the branch points travel with the heads.

    At most ``max_heads`` heads; a new one takes the place of the least
    recently used head, and only of one unused for ``idle_s`` (see Bounds
    in the module docstring).

    Loop only (no locks): ``shared_prefix`` is called for every ``dialog_mark``
    request, ``merge``/``take_new`` by the card sync.
    """

    def __init__(self, max_heads: int = MAX_HEADS, max_parents: int = MAX_PARENTS, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_heads = max_heads
        self.max_parents = max_parents
        self.idle_s = idle_s
        self._clock = clock
        self._heads: OrderedDict[int, float] = OrderedDict()  # id -> last use; least recently used first
        self._branches: set[int] = set()
        self._new: set[int] = set()  # learned here, not yet on the cards (branch points flagged)
        self._children: OrderedDict[int, set[int]] = OrderedDict()
        self._refused_logged = float("-inf")
        self.learned = 0  # heads this gateway found itself (a counter for status)
        self.replaced = 0  # idle heads that gave their place to new ones
        self.refused = 0  # heads not learned: every place held by a head in use

    def __len__(self) -> int:
        return len(self._heads)

    def __contains__(self, ident: object) -> bool:
        return ident in self._heads

    def shared_prefix(self, full_keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """(how many leading keys are shared heads, where their segments start), after learning from this prompt."""
        ids = [block_id(k) for k in full_keys[:DEPTH]]
        heads = self._heads
        now = self._clock()
        shared = 0
        while shared < len(ids):
            used = heads.get(ids[shared])
            if used is None:
                break
            if now - used >= _TOUCH_S:
                heads[ids[shared]] = now
                heads.move_to_end(ids[shared])
            shared += 1
        children = self._children
        for j in range(shared, len(ids) - 1):
            parent, child = ids[j], ids[j + 1]
            seen = children.get(parent)
            if seen is None:
                seen = children[parent] = set()
                if len(children) > self.max_parents:
                    children.popitem(last=False)
            else:
                children.move_to_end(parent)
            seen.add(child)
            if len(seen) >= BRANCHES and self._learn(ids[shared : j + 1], now):
                for i in ids[shared : j + 1]:
                    children.pop(i, None)
                shared = j + 1
        branches = self._branches
        starts = [j for j in range(shared) if j == 0 or ids[j - 1] in branches]
        return shared, starts

    def _learn(self, ids: list[int], now: float) -> bool:
        """``ids`` become heads; the last of them is a branch point."""
        heads = self._heads
        fresh = [i for i in dict.fromkeys(ids) if i not in heads]
        if not self._make_room(len(heads) + len(fresh) - self.max_heads, now):
            self.refused += len(fresh)
            if now - self._refused_logged >= self.idle_s:
                log.warning("the shared-head set is full of heads in use (%d blocks, each used in the last %.0f s): "
                            "a new shared head of %d blocks is not learned for now, so the dialog marks behind it "
                            "start at the prompt's first block", self.max_heads, self.idle_s, len(fresh))
                self._refused_logged = now
            return False
        for i in fresh:
            heads[i] = now
        self._new.update(fresh)
        if ids[-1] not in self._branches:
            self._branches.add(ids[-1])
            self._new.add(ids[-1] | _BRANCH)
        self.learned += len(fresh)
        return True

    def _make_room(self, need: int, now: float) -> bool:
        """Drop the ``need`` least recently used heads if every one of them is idle; False (nothing dropped) if not."""
        if need <= 0:
            return True
        heads = self._heads
        idle_before = now - self.idle_s
        for n, used in enumerate(heads.values()):
            if n >= need:
                break
            if used > idle_before:
                return False
        if need > len(heads):
            return False
        for _ in range(need):
            ident, _used = heads.popitem(last=False)
            self._branches.discard(ident)
        self.replaced += need
        return True

    def merge(self, ids: Iterable[int]) -> int:
        """Add heads and branch points other gateways found (read from a card), into free room only and as
        idle; returns how many heads were new."""
        heads, branches = self._heads, self._branches
        room = self.max_heads - len(heads)
        added = 0
        for i in ids:
            if i & _BRANCH:
                if len(branches) < self.max_heads:
                    branches.add(i & _ID_MASK)
            elif added < room and i not in heads:
                heads[i] = float("-inf")
                heads.move_to_end(i, last=False)
                added += 1
        return added

    def take_new(self) -> set[int]:
        """What was learned here since the last call, as cards store it (``put_back`` if that fails)."""
        new, self._new = self._new, set()
        return new

    def put_back(self, ids: Iterable[int]) -> None:
        self._new.update(ids)

    def all(self) -> set[int]:
        """Every head and branch point, as cards store them."""
        return set(self._heads) | {b | _BRANCH for b in self._branches}


def encode_ids(ids: Iterable[int]) -> bytes:
    """A head list as a card stores it: little-endian u64s, in the order given (a directory card's list is
    oldest first)."""
    return np.fromiter(ids, dtype="<u8").tobytes()


def decode_id_list(raw: bytes | bytearray | memoryview) -> list[int]:
    """The ids of a card's list in the order it holds them; a torn tail (a crash mid-write) is dropped."""
    n = len(raw) // 8
    return np.frombuffer(raw, dtype="<u8", count=n).tolist() if n else []


def decode_ids(raw: bytes | bytearray | memoryview) -> set[int]:
    """The inverse of ``encode_ids``, as a set."""
    return set(decode_id_list(raw))
