"""The order a mover copies a card's rows in, worked out from a moment's copy of its policy's columns.

``SampledPolicy`` (kvgate.tiers.sampled) keeps its eviction order in columns
beside the index rows; ``rank_rows`` is how a row's place is read from them
(the policy ranks its samples with it).  ``OrderColumns`` is those columns
as of one moment (``SampledPolicy.order_columns``): views on the loop, or a
copy that the mover (kvgate.tiers.mover) sorts on a pool thread while the
loop goes on changing the index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvgate.tiers.eviction import NEW, REUSED


def rank_rows(prefix: bool, seg: np.ndarray, tick: np.ndarray, dlg: np.ndarray, pos: np.ndarray, gtick: np.ndarray,
          young_after: int, rows_: np.ndarray, recency: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(phase, group tick) of rows, from a policy's columns (``SampledPolicy._rank``).

    ``recency``: the prefix policy's other order, LRU by dialog: one phase, and a listed row's tick is its
    dialog's last use (the latest of its groups' ticks)."""
    gt = tick[rows_]
    if not prefix:
        return np.zeros(len(rows_), np.int64), gt
    if recency:
        listed = pos[rows_] >= 0
        if listed.any():
            gt = np.where(listed, gtick[np.where(listed, dlg[rows_], 0)].max(axis=1), gt)
        return np.zeros(len(rows_), np.int64), gt
    seg_ = seg[rows_].astype(np.int64)
    listed = pos[rows_] >= 0
    if listed.any():
        gt = np.where(listed, gtick[np.where(listed, dlg[rows_], 0), seg_], gt)
    young = (seg_ != REUSED) & (gt > young_after)
    phase = np.where(young, seg_ + 3, np.where(seg_ == REUSED, 2, seg_))
    return phase, gt


@dataclass(frozen=True)
class OrderColumns:
    """A policy's columns as of one moment (``SampledPolicy.order_columns``): what the copy order of its
    rows is worked out from, on the loop (views) or on a pool thread (a copy)."""

    prefix: bool
    seg: np.ndarray
    tick: np.ndarray
    dlg: np.ndarray
    pos: np.ndarray
    gtick: np.ndarray  # per dialog
    dialog_lo: np.ndarray  # per dialog
    dialog_hi: np.ndarray  # per dialog
    young_after: int

    def dialog_digests(self, rows_: np.ndarray) -> np.ndarray:
        """``(n, 2)`` uint64 dialog digests of rows (zeros: none)."""
        d = self.dlg[rows_]
        out = np.zeros((len(rows_), 2), np.uint64)
        has = d >= 0
        out[has, 0] = self.dialog_lo[d[has]]
        out[has, 1] = self.dialog_hi[d[has]]
        return out

    def hottest_first(self, rows_: np.ndarray) -> np.ndarray:
        """``rows_`` in the order a mover copies them: dialogs used again (most recent first), then new
        ones, then tails; each dialog once, from its head, in the place of its hottest group.

        Not the reverse of the eviction order: eviction shields young new
        dialogs for a while, which would put one-off dialogs ahead of the
        ones being reused.  O(n log n) over the rows at once, for the rare
        moves between cards.
        """
        sel = np.asarray(rows_, np.int64)
        if not sel.size:
            return sel
        _phase, gt = rank_rows(self.prefix, self.seg, self.tick, self.dlg, self.pos, self.gtick, self.young_after, sel)
        if not self.prefix:
            return sel[np.argsort(-gt, kind="stable")]
        seg = self.seg[sel].astype(np.int64)
        worth = np.where(seg == REUSED, 0, np.where(seg == NEW, 1, 2))
        key = np.lexsort((-gt, worth)).argsort()  # each row's place in copy order, on its own
        listed = self.pos[sel] >= 0
        group = np.where(listed, self.dlg[sel].astype(np.int64), -1 - sel)  # unlisted rows are groups of their own
        _, inv = np.unique(group, return_inverse=True)
        inv = inv.ravel()
        group_key = np.full(inv.max() + 1, len(sel), np.int64)
        np.minimum.at(group_key, inv, key)
        order = np.lexsort((self.pos[sel], inv, group_key[inv]))
        return sel[order]
