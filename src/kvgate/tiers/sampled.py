"""A card's eviction order, kept in a few columns of its index rows and chosen by ranked sampling.

``PrefixPolicy`` (kvgate.tiers.eviction) keeps its order exactly, in Python
objects per key: ordered dicts of dialogs per segment, a sorted position list
per dialog.  On a card of millions of objects that bookkeeping was most of
the index's 1.1 KiB per object.  ``SampledPolicy`` keeps the same rules in
numpy columns beside the card index's rows (``ROW_COLUMNS``, 25 bytes a row)
and a table of dialogs (about 70 bytes a dialog), and instead of an exact
order it ranks a random sample of rows when it needs a victim (as Redis
approximates LRU): the coldest of ``SAMPLE`` rows is almost always among the
coldest percent or two of the card.  ``kind`` "lru" needs no sampling: the
same columns hold one exact list of all rows, oldest first.  ``kind``
"adaptive" keeps the prefix rules and ranks in whichever of two orders its
``Referee`` finds winning (kvgate.tiers.adaptive): the segments, or each
dialog by its last use.

The rules are ``PrefixPolicy``'s:

- Segments: ``TAIL`` (the last block of a write, not read since), ``NEW``
  (seen once), ``REUSED`` (read, or written again while ``RecentKeys``
  remembers it).  Old ``TAIL`` groups go first, then old ``NEW`` ones, then
  ``REUSED``, then the young ``TAIL``/``NEW`` groups (those that took a
  block in the last ``young_adds`` adds, or 1/64 of the rows, whichever is
  more).  ``REUSED`` holds at most ``reused_share`` of the rows; past that
  its coldest blocks are demoted to the cold end of ``NEW``.
- A group is (dialog, segment); its recency is the last time a block was
  placed in it (or, for ``REUSED``, read).  A sampled row is ranked by its
  group's place; the victim is the *last resident block of its dialog*,
  whatever that block's segment, so what stays of every dialog is a prefix.
- Held (``skip``) blocks shield the blocks below them in their dialog; only
  when every sampled dialog is shielded is any unheld block taken.
- Rows without a dialog, or with an unknown position, are one-block dialogs.

Replayed on the Mooncake trace (tests/tiers/test_trace_replay.py) it
restores within a point of ``PrefixPolicy`` and well above LRU.

Cards hold long objects only, so there are no retention classes here.

Row numbers belong to the owner's ``DigestRows``: the owner calls ``add``
after adding a row, ``removing`` before removing one, and routes the rows'
``on_move`` to ``moved``.  Loop only, like its owner (``CardIndex``).
``kvgate.tiers.sampled_ids`` wraps it in the ``EvictionPolicy`` interface,
by identity, for the trace replay and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np

from kvgate.keys import NO_DIALOG
from kvgate.tiers.eviction import LONG, NEW, REUSED, TAIL, RecentKeys, Segment
from kvgate.tiers.referee import OrderTally, Referee
from kvgate.tiers.copyorder import OrderColumns, rank_rows
from kvgate.tiers.rows import DigestRows, split_digest, unique_digests

_FAR_PAST: Final = -(1 << 62)

RowSkip = Callable[[int], bool]


class SampledPolicy:
    """See the module docstring.  ``rows``: the owner's rows, with ``ROW_COLUMNS`` among their columns.

    Called by its ``CardIndex`` (``add``, ``touch``, ``removing``,
    ``moved``) and its ``ManagedCard`` (``choose_victim``) on the event loop;
    a victim costs one ranked sample of numpy operations (tens of
    microseconds), ``hottest_first`` a sort of the rows (the mover, rarely).

    Every row of an object with a dialog names it (``dlg``, an id into
    ``dialogs``, whatever the kind: a card's mover places objects by it);
    under "prefix" the rows with a known position are also in their dialog's
    list, ordered by position (``prev``/``next``; the dialog knows its last
    row), and the rest are groups of their own.  Dialog ids are stable (a
    released one is reused by a later dialog), so no row ever needs a new one.
    """

    ROW_COLUMNS: Final = {"seg": np.uint8, "tick": np.int64, "dlg": np.int32, "pos": np.int32, "prev": np.int32,
                          "next": np.int32}
    SAMPLE = 64  # rows ranked per victim (see the module docstring for how close this comes)
    reused_share = 0.98
    reserve_from = 100  # rows
    young_adds = 64  # or 1/64 of the rows, if more

    KINDS: Final = ("adaptive", "prefix", "lru")

    def __init__(self, rows: DigestRows, kind: str = "prefix", seed: int | None = None,
                 referee: Referee | None = None) -> None:
        """``referee``: for "adaptive", the one its owner's cards share (``CardSet.referee``); else one
        of its own."""
        if kind not in self.KINDS:
            raise ValueError(f"unknown sampled policy {kind!r}; choose one of {', '.join(self.KINDS)}")
        self.kind = kind
        self.prefix = kind != "lru"
        # "adaptive": the prefix rules, in whichever order a referee finds winning (kvgate.tiers.adaptive).
        self.referee = None if kind != "adaptive" else referee if referee is not None else Referee(lambda: rows.n)
        self.tally = OrderTally()  # evictions chosen under each order (adaptive; zeros under the others)
        self.rows = rows
        rows.on_move = self.moved
        # Per dialog: the rows naming it, its last listed row, and per segment its group's recency and size.
        self.dialogs = DigestRows({"refs": np.uint32, "head": np.int32, "tail": np.int32, "gtick": (np.int64, 3),
                                   "count": (np.uint32, 3)}, stable=True)
        self._clock = 0  # rises with every placement and read
        self._cold = 0  # falls with every placement at the cold end
        self._adds = 0
        self._add_clock = np.full(256, _FAR_PAST, np.int64)  # clock of recent adds, by add number (a ring)
        self._reused = 0
        self._recent = RecentKeys(4096)
        self._rng = np.random.default_rng(seed)
        # The group the last victim came from: (dialog id, segment, clock then).
        self._sticky: tuple[int, int, int] | None = None
        self._lru_head = self._lru_tail = -1

    def __len__(self) -> int:
        return self.rows.n

    # ---- keeping the order -----------------------------------------------------------

    def add(self, row: int, dialog: bytes, position: int, tail: bool = False, again: bool = False) -> None:
        """Row ``row`` was just added; ``again``: its key was resident until this add replaced it."""
        rows = self.rows
        lo = rows.lo.item(row)
        d = self._dialog_id(dialog) if dialog and dialog != NO_DIALOG else -1
        self._adds += 1
        if not self.prefix:
            self._clock += 1
            rows.seg[row] = NEW
            rows.dlg[row] = d
            rows.pos[row] = position
            rows.tick[row] = self._clock
            self._lru_append(row)
        else:
            again = self._seen(lo) or again
            self._place(row, REUSED if again else TAIL if tail else NEW, d, position if d >= 0 else -1)
        self._note_add()
        if self.referee is not None:
            self._referee_saw(row, tail)

    def _dialog_id(self, dialog: bytes) -> int:
        """The id of a dialog, made when new; counts one more row naming it."""
        dialogs = self.dialogs
        lo, hi = split_digest(dialog)
        d = dialogs.find1(lo, hi)
        if d < 0:
            d = dialogs.add1(lo, hi)
            dialogs.refs[d] = 0
            dialogs.head[d] = dialogs.tail[d] = -1
            dialogs.gtick[d] = 0
            dialogs.count[d] = 0
        dialogs.refs[d] += 1
        return d

    def _note_add(self) -> None:
        ring = self._add_clock
        if self.young_window() * 2 > len(ring):
            # Keep twice the window, so the window's far end is always recorded.
            grown = np.full(len(ring) * 2, _FAR_PAST, np.int64)
            for a in range(max(1, self._adds - len(ring)), self._adds):
                grown[a % len(grown)] = ring[a % len(ring)]
            self._add_clock = ring = grown
        ring[self._adds % len(ring)] = self._clock

    def young_window(self) -> int:
        return max(self.young_adds, self.rows.n // 64)

    def _young_after(self) -> int:
        """Groups placed after this clock took a block in the last ``young_window`` adds."""
        start = self._adds - self.young_window()
        if start < 1:
            return _FAR_PAST
        return int(self._add_clock[start % len(self._add_clock)])

    def _place(self, row: int, seg: int, d: int, position: int, cold: bool = False) -> None:
        """Put a row in a segment: in its dialog's list when it has a position (``position`` >= 0)."""
        rows = self.rows
        if cold:
            self._cold -= 1
            tick = self._cold
        else:
            self._clock += 1
            tick = self._clock
        rows.seg[row] = seg
        rows.dlg[row] = d
        rows.pos[row] = position
        if position < 0:
            rows.tick[row] = tick
            rows.prev[row] = rows.next[row] = -1
        else:
            dialogs = self.dialogs
            count = dialogs.count.item(d, seg)
            if not cold or count == 0:
                # A demoted block joins its group where it is; a new group made cold starts at the cold end.
                dialogs.gtick[d, seg] = tick
            dialogs.count[d, seg] = count + 1
            self._link(row, d, position)
        if seg == REUSED:
            self._reused += 1
            self._demote()

    def _link(self, row: int, d: int, position: int) -> None:
        """Into the dialog's list, ordered by position (after equal ones).

        Blocks mostly arrive in position order: O(1) at the tail.  Otherwise
        (a scan meets them in name order) the walk starts from the nearer
        end of the list.
        """
        rows, dialogs = self.rows, self.dialogs
        pos, prev, nxt = rows.pos, rows.prev, rows.next
        t = dialogs.tail.item(d)
        if t < 0 or pos.item(t) <= position:
            after, before = t, -1
        else:
            h = dialogs.head.item(d)
            if position - pos.item(h) < pos.item(t) - position:  # from the head: the first row past it
                before = h
                while before >= 0 and pos.item(before) <= position:
                    before = nxt.item(before)
                after = prev.item(before)
            else:  # from the tail: the last row not past it
                before = t
                after = prev.item(t)
                while after >= 0 and pos.item(after) > position:
                    before, after = after, prev.item(after)
        prev[row] = after
        nxt[row] = before
        if after >= 0:
            nxt[after] = row
        else:
            dialogs.head[d] = row
        if before >= 0:
            prev[before] = row
        else:
            dialogs.tail[d] = row

    def _unlink(self, row: int) -> None:
        """Out of its list (its dialog's, or LRU's)."""
        rows = self.rows
        p, n = rows.prev.item(row), rows.next.item(row)
        if n < 0:
            self._ends(row, last=p)
        else:
            rows.prev[n] = p
        if p < 0:
            self._ends(row, first=n)
        else:
            rows.next[p] = n

    def _ends(self, of_row: int, first: int | None = None, last: int | None = None) -> None:
        """Set the first and/or last row of the list ``of_row`` is in (its dialog's, or LRU's one list)."""
        if self.prefix:
            d = self.rows.dlg.item(of_row)
            if first is not None:
                self.dialogs.head[d] = first
            if last is not None:
                self.dialogs.tail[d] = last
            return
        if first is not None:
            self._lru_head = first
        if last is not None:
            self._lru_tail = last

    def touch(self, row: int) -> None:
        """The row's object was read."""
        rows = self.rows
        self._clock += 1
        if not self.prefix:
            rows.tick[row] = self._clock
            self._unlink(row)
            self._lru_append(row)
            return
        seg = rows.seg.item(row)
        if rows.pos.item(row) < 0:
            rows.tick[row] = self._clock
        else:
            d = rows.dlg.item(row)
            if seg != REUSED:
                self.dialogs.count[d, seg] -= 1
                self.dialogs.count[d, REUSED] += 1
            self.dialogs.gtick[d, REUSED] = self._clock
        if seg != REUSED:
            rows.seg[row] = REUSED
            self._reused += 1
            self._demote()
        self._seen(rows.lo.item(row))
        if self.referee is not None:
            self._referee_saw(row, False)

    @property
    def order(self) -> str:
        """The order victims are ranked in: "prefix", or for "adaptive" its referee's leader."""
        return "prefix" if self.referee is None else self.referee.leader

    def _referee_saw(self, row: int, tail: bool) -> None:
        """Tell the referee of an add or read, if the row's dialog is in its sample (a test of int bits, the
        digest's first four bytes: ``sample_bits``)."""
        rows, referee = self.rows, self.referee
        assert referee is not None
        position = rows.pos.item(row)
        lo = rows.lo.item(row) if position < 0 else self.dialogs.lo.item(rows.dlg.item(row))
        if lo & referee.mask:
            return
        dkey = (lo,) if position < 0 else lo.to_bytes(8, "little")
        referee.referenced(rows.lo.item(row), dkey, max(position, 0), LONG, tail)

    def removing(self, row: int) -> None:
        """Row ``row`` is about to be removed from the owner's rows."""
        rows = self.rows
        self.tally.removed(row)
        d = rows.dlg.item(row)
        if not self.prefix:
            self._unlink(row)
        else:
            seg = rows.seg.item(row)
            if seg == REUSED:
                self._reused -= 1
            if rows.pos.item(row) >= 0:
                self.dialogs.count[d, seg] -= 1
                self._unlink(row)
        if d >= 0:
            refs = self.dialogs.refs.item(d) - 1
            self.dialogs.refs[d] = refs
            if not refs:
                self.dialogs.remove(d)

    def moved(self, src: int, dst: int) -> None:
        """The owner moved row ``src`` into ``dst`` (its columns are copied already): repoint its neighbours."""
        rows = self.rows
        self.tally.moved(src, dst)
        if self.prefix and rows.pos.item(dst) < 0:
            return
        p, n = rows.prev.item(dst), rows.next.item(dst)
        if p >= 0:
            rows.next[p] = dst
        else:
            self._ends(dst, first=dst)
        if n >= 0:
            rows.prev[n] = dst
        else:
            self._ends(dst, last=dst)

    def _lru_append(self, row: int) -> None:
        """LRU keeps one exact list over every row, oldest first."""
        rows = self.rows
        t = self._lru_tail
        rows.prev[row] = t
        rows.next[row] = -1
        if t >= 0:
            rows.next[t] = row
        else:
            self._lru_head = row
        self._lru_tail = row

    def _seen(self, lo: int) -> bool:
        """Remember the row's key; whether it was remembered already.  As PrefixPolicy: a filter sized at 3x the
        rows when it starts, so the pair remembers 3-6x what is resident."""
        self._recent.span = 3 * max(self.rows.n, 1024)
        return self._recent.add(lo)

    def _demote(self) -> None:
        """Keep REUSED within its share: the coldest sampled REUSED group's last block goes to the cold end of NEW."""
        n = self.rows.n
        limit = max(1, int(n * self.reused_share)) if n >= self.reserve_from else n
        tries = 0
        while self._reused > limit and tries < 8:
            sample = self._sample()
            sample = sample[self.rows.seg[sample] == REUSED]
            if not sample.size:
                tries += 1
                continue
            _phase, gt = self._rank(sample)
            row = int(sample[np.argmin(gt)])
            if self.rows.pos.item(row) >= 0:  # its dialog's last REUSED block
                row = self.dialogs.tail.item(self.rows.dlg.item(row))
                while self.rows.seg.item(row) != REUSED:
                    row = self.rows.prev.item(row)
            self._demote_one(row)

    def _demote_one(self, row: int) -> None:
        rows = self.rows
        self._reused -= 1
        self._cold -= 1
        rows.seg[row] = NEW
        if rows.pos.item(row) < 0:
            rows.tick[row] = self._cold
            return
        d = rows.dlg.item(row)
        dialogs = self.dialogs
        dialogs.count[d, REUSED] -= 1
        if dialogs.count.item(d, NEW) == 0:
            dialogs.gtick[d, NEW] = self._cold
        dialogs.count[d, NEW] += 1

    # ---- choosing ---------------------------------------------------------------------

    def _sample(self) -> np.ndarray:
        n = self.rows.n
        if n <= self.SAMPLE:
            return np.arange(n)
        return self._rng.integers(0, n, self.SAMPLE)

    def _rank(self, rows_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(phase, group tick) per row: evicted in order of phase, then of tick (see the module docstring)."""
        rows = self.rows
        return rank_rows(self.prefix, rows.seg, rows.tick, rows.dlg, rows.pos, self.dialogs.gtick, self._young_after(),
                         rows_, self.order == "recency")

    def _tail_of(self, row: int, skip: RowSkip | None) -> int:
        """The victim ``row``'s dialog offers: its last block not held; -1 when a held block shields it."""
        if self.rows.pos.item(row) < 0:
            return row if skip is None or not skip(row) else -1
        t = self.dialogs.tail.item(self.rows.dlg.item(row))
        if skip is None:
            return t
        pos, prev = self.rows.pos, self.rows.prev
        last = pos.item(t)
        while t >= 0 and pos.item(t) == last:  # blocks sharing the last position (ranks, fragments)
            if not skip(t):
                return t
            t = prev.item(t)
        return -1

    def choose_victim(self, skip: RowSkip | None = None) -> int:
        """The row to evict next, left in place; -1 when there is none (empty, or everything held)."""
        victim = self._choose(skip)
        if self.referee is not None:
            self.tally.chose(victim if victim >= 0 else None, self.order)
        return victim

    def _choose(self, skip: RowSkip | None) -> int:
        rows = self.rows
        if rows.n == 0:
            return -1
        if not self.prefix:
            r = self._lru_head
            while r >= 0 and skip is not None and skip(r):
                r = rows.next.item(r)
            return r
        if skip is None and self._sticky is not None and self._sticky[2] == self._clock and self.order == "prefix":
            # Nothing was placed or read since the last choice: its group is still the coldest
            # one found, and the next victim is its dialog's new last block (as PrefixPolicy does).
            d, seg, _clock = self._sticky
            if self.dialogs.count.item(d, seg) and self.dialogs.tail.item(d) >= 0:
                return self.dialogs.tail.item(d)
        self._sticky = None
        for _ in range(4):
            sample = self._sample()
            phase, gt = self._rank(sample)
            ranked = sample[np.lexsort((gt, phase))]
            for row in ranked.tolist():
                victim = self._tail_of(row, skip)
                if victim >= 0:
                    if skip is None and rows.pos.item(row) >= 0:
                        self._sticky = (rows.dlg.item(row), rows.seg.item(row), self._clock)
                    return victim
            if skip is None:
                return -1
            # Every sampled dialog is shielded: any unheld block of theirs, in the same order.
            for row in ranked.tolist():
                listed = rows.pos.item(row) >= 0
                r = self.dialogs.tail.item(rows.dlg.item(row)) if listed else row
                while r >= 0:
                    if not skip(r):
                        return r
                    r = rows.prev.item(r) if listed else -1
            if len(sample) >= rows.n:
                return -1
        return -1

    def hottest_first(self, which: np.ndarray | None = None) -> np.ndarray:
        """Rows (all, or ``which``) in the order a mover copies them (``OrderColumns.hottest_first``)."""
        return self.order_columns().hottest_first(np.arange(self.rows.n) if which is None else which)

    def order_columns(self, copy: bool = False) -> OrderColumns:
        """The columns the copy order is worked out from: views of the live ones, or (``copy``) a copy that
        another thread may read while the loop changes the index (a memcpy of about 30 bytes a row)."""
        rows, dialogs = self.rows, self.dialogs
        n, nd = rows.n, dialogs.n

        def take(col: np.ndarray) -> np.ndarray:
            return col.copy() if copy else col

        return OrderColumns(self.prefix, take(rows.seg[:n]), take(rows.tick[:n]), take(rows.dlg[:n]),
                            take(rows.pos[:n]), take(dialogs.gtick[:nd]), take(dialogs.lo[:nd]),
                            take(dialogs.hi[:nd]), self._young_after())

    def segment_of(self, row: int) -> Segment:
        return Segment(self.rows.seg.item(row))

    # ---- whole tables ---------------------------------------------------------------------

    def group_ticks(self, rows_: np.ndarray) -> np.ndarray:
        """Each row's group recency (what a snapshot keeps to rebuild the order)."""
        return self._rank(rows_)[1]

    def dialog_digests(self, rows_: np.ndarray) -> np.ndarray:
        """``(n, 2)`` uint64 dialog digests of rows (zeros: none)."""
        return self.order_columns().dialog_digests(rows_)

    def restore(self, rows_: np.ndarray, dialogs: np.ndarray, positions: np.ndarray, segs: np.ndarray,
                ticks: np.ndarray) -> None:
        """Order rows just added in bulk as a snapshot recorded them (a fresh policy: no row placed before).

        ``dialogs``: (n, 2) uint64 digests (zeros: none); ``ticks``: each
        row's group recency as ``group_ticks`` gave it.
        """
        rows = self.rows
        n = len(rows_)
        segs = np.minimum(segs, REUSED).astype(np.uint8) if self.prefix else np.full(n, NEW, np.uint8)
        has = (dialogs[:, 0] != 0) | (dialogs[:, 1] != 0)
        positions = np.where(has, positions, -1).astype(np.int32)
        rows.seg[rows_] = segs
        rows.pos[rows_] = positions
        rows.tick[rows_] = ticks
        rows.prev[rows_] = -1
        rows.next[rows_] = -1
        dlg = np.full(n, -1, np.int32)
        if has.any():
            uniq, inv = unique_digests(dialogs[has])
            ids = self.dialogs.add_many(uniq[:, 0], uniq[:, 1])
            self.dialogs.refs[ids] = np.bincount(inv.ravel(), minlength=len(ids))
            self.dialogs.head[ids] = self.dialogs.tail[ids] = -1
            self.dialogs.gtick[ids] = _FAR_PAST
            self.dialogs.count[ids] = 0
            dlg[has] = ids[inv.ravel()]
        rows.dlg[rows_] = dlg
        listed = np.flatnonzero(has & (positions >= 0)) if self.prefix else np.empty(0, np.int64)
        if listed.size:
            d, s = dlg[listed], segs[listed].astype(np.int64)
            np.maximum.at(self.dialogs.gtick, (d, s), ticks[listed])
            np.add.at(self.dialogs.count, (d, s), 1)
            # Each dialog's rows by position: each points to the one before and after it; the last is the tail.
            order = listed[np.lexsort((rows_[listed], positions[listed], dlg[listed]))]
            r, od = rows_[order].astype(np.int32), dlg[order]
            same = np.zeros(len(order), bool)
            same[1:] = od[1:] == od[:-1]
            prev = np.full(len(order), -1, np.int32)
            prev[1:] = r[:-1]
            rows.prev[r] = np.where(same, prev, -1)
            last = np.ones(len(order), bool)
            last[:-1] = ~same[1:]
            nxt = np.full(len(order), -1, np.int32)
            nxt[:-1] = r[1:]
            rows.next[r] = np.where(last, -1, nxt)
            self.dialogs.tail[od[last]] = r[last]
            self.dialogs.head[od[~same]] = r[~same]
        if not self.prefix and n:
            order = rows_[np.argsort(ticks, kind="stable")].astype(np.int32)
            rows.prev[order[1:]] = order[:-1]
            rows.next[order[:-1]] = order[1:]
            self._lru_head, self._lru_tail = int(order[0]), int(order[-1])
        self._reused = int(np.count_nonzero(rows.seg[: rows.n] == REUSED)) if self.prefix else 0
        if n:
            self._clock = max(self._clock, int(ticks.max()))
            self._cold = min(self._cold, int(ticks.min()))
        # What was written before the restart is not young: the window starts now.
        self._adds = len(self._add_clock)
        self._add_clock.fill(self._clock)
