"""Which dialog each SGLang storage call belongs to: its ``DialogMark`` and its place in the prompt.

The gateway keeps a dialog's pages together (its placement follows the mark), but SGLang tells
a storage backend nothing about requests: only page hashes, and with
``hicache_storage_pass_prefix_keys`` every hash before the call's keys.  From those the mark is
derived here: a digest of the prompt's first pages (``kvgate.affinity_chunks``), or the
gateway's mark, cached per prompt lead because a request's calls (lookup, get, set, and the
extra pools of a hybrid model) would otherwise each ask the gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from kvgate.client import MARK_KEYS, DialogMark, GatewayError
from kvgate.integrations.markcache import MarkCache
from kvgate.integrations.settings import dialog_mark as digest_mark
from kvgate.integrations.sglang.failures import FailureLog, logger
from kvgate.integrations.sglang.settings import page_keys

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvgate.integrations.sglang.link import GatewayLink


class DialogMarks:
    """The dialog mark of each call, from SGLang's prefix keys; the gateway's marks cached per prompt lead.

    ``affinity_chunks``: ``kvgate.affinity_chunks`` (None: the gateway's mark).  ``counters`` is the
    backend's (``no_prefix_<method>``, ``mark_calls``)."""

    def __init__(self, affinity_chunks: Optional[int], counters: dict[str, int], log: FailureLog):
        self.affinity_chunks = affinity_chunks
        self.counters = counters
        self.log = log
        self._marks = MarkCache()
        self._warned_no_prefix = False

    def of_call(self, link: GatewayLink, bkeys: list[bytes], extra_info: Optional[HiCacheStorageExtraInfo],
                what: str) -> tuple[DialogMark, int]:
        """(DialogMark, position of keys[0]) of a call.

        SGLang passes every page hash before the call's keys in
        ``extra_info.prefix_keys`` when ``hicache_storage_pass_prefix_keys``
        is on; without it a call's place in its prompt is unknown, and pages
        go without a dialog.  With ``kvgate.affinity_chunks`` the mark is a
        digest of the prompt's first pages, as in the vLLM tier; otherwise the
        gateway's mark (``Client.dialog_mark``), cached per prompt lead (its first
        ``MARK_KEYS + 1`` pages, named by the last) so that the calls of one request ask once.
        """
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None:
            self.counters[f"no_prefix_{what}"] += 1
            # Only a get or a set says the switch is off: SGLang 0.5.23's hybrid controller (the one its
            # server runs) hands lookups ``prefix_keys.copy() if prefix_keys else None``, so the lookup
            # of every prompt from its first page (an empty prefix) arrives as None with the switch on.
            if not what.startswith("batch_exists") and not self._warned_no_prefix:
                self._warned_no_prefix = True
                logger.warning("kvgate backend: SGLang passed no prefix keys (%s), so pages go without dialog "
                               "marks (no dialog placement). Add \"hicache_storage_pass_prefix_keys\": true to "
                               "--hicache-storage-backend-extra-config", what)
            return DialogMark(None, 0), -1
        position = len(prefix)
        need = MARK_KEYS + 1 if self.affinity_chunks is None else self.affinity_chunks
        lead = page_keys(prefix[:need]) if position else []
        if len(lead) < need:
            lead += bkeys[: need - len(lead)]
        if self.affinity_chunks is not None:
            return DialogMark(digest_mark(lead), 0), position
        return self._gateway_mark(link, lead), position

    def _gateway_mark(self, link: GatewayLink, lead: list[bytes]) -> DialogMark:
        hit = self._marks.get(lead[-1])  # see kvgate.integrations.markcache for why the lead's last key
        if hit is not None:
            return hit
        self.counters["mark_calls"] += 1
        try:
            dm = link.budget().dialog_mark(lead)
        except GatewayError as e:
            if e.code != "UNKNOWN_OP":
                raise
            self.log.warn_once("no-marks", "kvgate backend: the gateway has no dialog_mark (an older version): "
                               "the first page marks the dialog; upgrade the gateway")
            dm = DialogMark(digest_mark(lead[:1]), 0)
        if dm.mark is not None:
            self._marks.put(lead[-1], dm)
        return dm
