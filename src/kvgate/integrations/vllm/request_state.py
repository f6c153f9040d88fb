"""What the vLLM tier keeps per request: whether it is cached, its retention, its dialog mark, its source.

The scheduler thread fixes, once per request, whether the request is cached and what its
dialog mark comes from (``RequestStates.of``, ``RequestStates.mark``); the tier's I/O threads
then ask the gateway for the mark if it is the gateway's (``RequestStates.dialog``) and split
each batch into runs of one dialog (``RequestStates.runs``).  Imports no vLLM (only compat),
and not the tier.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from kvgate.client import MARK_KEYS, Client, DialogMark, GatewayError
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.vllm import compat
from kvgate.integrations.vllm.compat import OffloadKey, ReqContext
from kvgate.integrations.vllm.engine import RequestSalt
from kvgate.integrations.vllm.settings import (
    TierSettings,
    dialog_mark,
    first_chunk_keys,
    request_retention,
    request_source,
)

# the tier's logger (vLLM's logging configuration applies under "vllm.")
logger = logging.getLogger("vllm.kvgate")


@dataclass
class ReqState:
    retention: str
    enabled: bool  # False: this request is neither looked up nor stored (unsalted, switched off)
    mark: bytes | None = None
    mark_known: bool = False
    # Gateway marks (affinity_chunks not set): the prompt's leading (key, end token) pairs of
    # the first KV group, taken on the scheduler thread; the DialogMark, asked for once by
    # whichever I/O thread needs it first (every thread would get the same answer).
    leading: list[tuple[bytes, int]] | None = None
    dialog: DialogMark | None = None
    shared_tokens: int = 0  # tokens covered by the shared head: chunks ending at or before it are heads
    head_bounds: list[tuple[int, bytes]] = field(default_factory=list)  # (last end token, mark) per head segment
    # Where the request's KV was computed (kv_transfer_params.remote_kv_source, as HOST:PORT): its lookups and
    # loads name it, so the gateway asks only its peers on that host (None: every peer).
    source: str | None = None


class RequestStates:
    """The tier's per-request state, kept in vLLM's request context (``ReqContext.get_state``).

    ``of``, ``mark`` and ``position`` run on the scheduler thread (they read the request
    context, which the scheduler owns); ``dialog`` and ``runs`` on the I/O threads, with what
    the scheduler thread fixed.
    """

    def __init__(self, settings: TierSettings, log: RateLimitedLog, tokens_per_chunk: dict[int, int]):
        self.settings = settings
        self._log = log
        self._tokens_per_chunk = tokens_per_chunk  # KV group -> tokens per chunk

    def of(self, ctx: ReqContext) -> ReqState:
        """The request's state, made on first sight: its retention, and whether it is cached at all."""
        st = ctx.get_state(ReqState)
        if st is None:
            retention, warning = request_retention(ctx.kv_transfer_params, self.settings.retention)
            if warning:
                self._log.warning("retention", "kvgate: request %s: %s", ctx.req_id, warning)
            source, warning = request_source(ctx.kv_transfer_params)
            if warning:
                self._log.warning("source", "kvgate: request %s: %s", ctx.req_id, warning)
            enabled = True
            if self.settings.salted_only:
                salt = ctx.get_state(RequestSalt)
                if salt is None or not salt.salted:
                    enabled = False
                    if self.settings.refuse_unsalted:
                        self._log.warning("unsalted", "kvgate: request %s has no cache_salt: refused (neither "
                                          "looked up nor stored in kvgate; refuse_unsalted is set)", ctx.req_id)
                    else:
                        logger.debug("kvgate: request %s has no cache_salt: not cached (skip_unsalted)", ctx.req_id)
            st = ReqState(retention=retention, enabled=enabled, source=source)
            ctx.set_state(st)
        return st

    def mark(self, ctx: ReqContext, st: ReqState) -> bytes | None:
        """Fix what the request's dialog mark comes from (scheduler thread, once per request).

        With ``affinity_chunks`` set: a digest of that many first chunk keys.
        Otherwise the gateway's mark (``dialog``), from the leading keys
        taken here; this returns None and the I/O threads ask the gateway.
        """
        if st.mark_known:
            return st.mark
        positions = compat.offload_key_positions(ctx)
        if not positions:
            return None
        by_group: dict[int, list[tuple[bytes, int]]] = {}
        for key, end_token in positions.items():
            by_group.setdefault(int.from_bytes(key[-4:], "big"), []).append((bytes(key), end_token))
        first = by_group[min(by_group)]
        if self.settings.affinity_chunks is not None:
            st.mark = dialog_mark(first_chunk_keys(first, self.settings.affinity_chunks))
        else:
            st.leading = sorted(first, key=lambda kv: kv[1])[:MARK_KEYS]
        st.mark_known = True
        return st.mark

    def dialog(self, st: ReqState | None, client: Client) -> DialogMark:
        """The request's DialogMark (I/O threads): fixed by affinity_chunks, or asked of the gateway once."""
        if st is None:
            return DialogMark(None, 0)
        if st.leading is None:
            return DialogMark(st.mark, 0)
        dm = st.dialog
        if dm is None:
            try:
                dm = client.dialog_mark([k for k, _ in st.leading])
            except GatewayError as e:
                if e.code != "UNKNOWN_OP":
                    raise
                # A gateway from before dialog_mark: the first chunk marks the dialog, as it used to.
                self._log.warning("no-marks", "kvgate: the gateway has no dialog_mark (an older version): dialog "
                                  "marks come from the first chunk; upgrade the gateway")
                dm = DialogMark(dialog_mark([st.leading[0][0]]), 0)
            # Each head segment as the end token of its last chunk: chunks of any KV group ending
            # inside it go with its mark (groups chunk the same tokens differently).
            ends = [p for p, _ in dm.heads[1:]] + [dm.shared]
            st.head_bounds = [(st.leading[end - 1][1], mark) for end, (_, mark) in zip(ends, dm.heads)]
            st.shared_tokens = st.leading[dm.shared - 1][1] if dm.shared else 0
            st.dialog = dm
        return dm

    @staticmethod
    def runs(st: ReqState | None, dm: DialogMark, end_tokens: Sequence[int | None]) -> list[tuple[int, int, bytes | None]]:
        """Split a batch into runs of one dialog: chunks inside the shared head go with their segment's mark."""
        shared = st.shared_tokens if st is not None else 0
        runs: list[tuple[int, int, bytes | None]] = []
        for i, end in enumerate(end_tokens):
            dialog = dm.mark
            if shared and end is not None and 0 < end <= shared:
                dialog = next(mark for upper, mark in st.head_bounds if end <= upper)  # type: ignore[union-attr]
            if runs and runs[-1][2] == dialog and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1, dialog)
            else:
                runs.append((i, i + 1, dialog))
        return runs

    def position(self, ctx: ReqContext, key: OffloadKey) -> int:
        """The chunk's index in its KV group's sequence (-1: unknown)."""
        end = ctx.get_offload_key_position(key)
        tpc = self._tokens_per_chunk.get(int.from_bytes(key[-4:], "big"))
        if end is None or not tpc:
            return -1
        return max(-1, end // tpc - 1)
