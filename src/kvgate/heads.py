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
another.  The set only grows, and gateways share it through their cards
(``Card.merge_heads``: every card holds the union), so gateways on the same
cards converge within one sync period and a restarted gateway starts from
what the cards hold.  While two gateways disagree, a lookup may miss a
block stored under the other mark: a recompute, never a wrong byte.

Identities are 63-bit hashes of full keys (namespace included): heads of
one namespace never shape another's marks.  On a card each is a u64; the
top bit set marks a branch point.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

from kvgate.keys import MARK_KEYS

log = logging.getLogger("kvgate.heads")

BRANCHES = 3  # distinct next blocks after a block that make it a branch point
DEPTH = MARK_KEYS  # leading blocks of a prompt looked at
MAX_PARENTS = 1 << 16  # blocks whose next blocks are being counted (least recently seen dropped)
MAX_HEADS = 1 << 16  # shared-head identities kept (8 bytes each on a card); full: learning stops


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

    Loop only (no locks): ``shared_prefix`` is called for every ``dialog_mark``
    request, ``merge``/``take_new`` by the card sync.
    """

    def __init__(self, max_heads: int = MAX_HEADS, max_parents: int = MAX_PARENTS) -> None:
        self.max_heads = max_heads
        self.max_parents = max_parents
        self._heads: set[int] = set()
        self._branches: set[int] = set()
        self._new: set[int] = set()  # learned here, not yet on the cards (branch points flagged)
        self._children: OrderedDict[int, set[int]] = OrderedDict()
        self._full_logged = False
        self.learned = 0  # heads this gateway found itself (a counter for status)

    def __len__(self) -> int:
        return len(self._heads)

    def __contains__(self, ident: object) -> bool:
        return ident in self._heads

    def shared_prefix(self, full_keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """(how many leading keys are shared heads, where their segments start), after learning from this prompt."""
        ids = [block_id(k) for k in full_keys[:DEPTH]]
        heads = self._heads
        shared = 0
        while shared < len(ids) and ids[shared] in heads:
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
            if len(seen) >= BRANCHES and self._learn(ids[shared : j + 1]):
                for i in ids[shared : j + 1]:
                    children.pop(i, None)
                shared = j + 1
        branches = self._branches
        starts = [j for j in range(shared) if j == 0 or ids[j - 1] in branches]
        return shared, starts

    def _learn(self, ids: list[int]) -> bool:
        """``ids`` become heads; the last of them is a branch point."""
        fresh = [i for i in ids if i not in self._heads]
        if len(self._heads) + len(fresh) + 1 > self.max_heads:
            if not self._full_logged:
                log.warning("the shared-head set is full (%d blocks): no more heads are learned; dialog marks of "
                            "prompts with new shared heads start at their first block", self.max_heads)
                self._full_logged = True
            return False
        self._heads.update(fresh)
        self._new.update(fresh)
        if ids[-1] not in self._branches:
            self._branches.add(ids[-1])
            self._new.add(ids[-1] | _BRANCH)
        self.learned += len(fresh)
        return True

    def merge(self, ids: Iterable[int]) -> int:
        """Add heads and branch points other gateways found (read from a card); returns how many heads were new."""
        before = len(self._heads)
        for i in ids:
            if len(self._heads) + len(self._branches) >= self.max_heads:
                break
            if i & _BRANCH:
                self._branches.add(i & _ID_MASK)
            else:
                self._heads.add(i)
        return len(self._heads) - before

    def take_new(self) -> set[int]:
        """What was learned here since the last call, as cards store it (``put_back`` if that fails)."""
        new, self._new = self._new, set()
        return new

    def put_back(self, ids: Iterable[int]) -> None:
        self._new.update(ids)

    def all(self) -> set[int]:
        """Every head and branch point, as cards store them."""
        return self._heads | {b | _BRANCH for b in self._branches}


def encode_ids(ids: Iterable[int]) -> bytes:
    """A head set as a card stores it: sorted little-endian u64s."""
    return b"".join(i.to_bytes(8, "little") for i in sorted(ids))


def decode_ids(raw: bytes | memoryview) -> set[int]:
    """The inverse of ``encode_ids``; a torn tail (a crash mid-write) is dropped."""
    n = len(raw) // 8
    mv = memoryview(raw)
    return {int.from_bytes(mv[i * 8 : i * 8 + 8], "little") for i in range(n)}
