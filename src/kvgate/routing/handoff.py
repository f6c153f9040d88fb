"""Prefill on one engine, decode on another: the hand-off of a prompt's KV through kvgate.

With endpoints given a ``role`` (``prefill``, ``decode``; ``both`` is the default) the router splits each
completion or chat request in two:

1. **Prefill.** The request, cut to one output token (``max_tokens`` 1, not streamed), goes to the best
   endpoint that prefills (the policy's choice among ``prefill`` and ``both``).  Its engine computes the
   prompt and, as every vLLM engine with kvgate's offloading spec does, stores the prompt's full blocks
   through its gateway once the request ends.
2. **Hand-off.** The router waits until its KV index (the gateways' events) shows the prompt's blocks
   where the decode endpoint can restore them: its own gateway's RAM tier, a card its gateway mounts, or
   (``peer_pulls``) any endpoint's gateway, which the decode's gateway then pulls from as a peer.  At most
   ``handoff_timeout``: past it the decode is sent anyway and recomputes what it lacks (slower, never wrong).
3. **Decode.** The original request goes to the best endpoint that decodes; it restores the prompt's full
   blocks through kvgate, decodes, and the answer goes to the client
   as the engine sends it, streamed or not.  When the request ends, its engine stores the blocks its
   decoded tokens filled, so the next turn of the conversation, prefilled on any engine, restores the
   whole history: the prompt and the answer.

No prefill is sent when the decode endpoint can already restore every block the decode would load (the
KV is there: a pull or a read costs less than computing it again), nor for a prompt shorter than one
block (nothing to hand off), nor when the prompt's tokens cannot be had (a batch of
prompts, ``/tokenize`` failing): the decode endpoint then does it all.  A prefill that fails (cannot
connect, or an error status) is logged and the decode does it all too: a split request is never failed by
its prefill.

The answer carries ``x-kvgate-prefill`` (the prefill endpoint, when one ran), ``x-kvgate-prefill-cached``
(the prompt tokens its engine did not compute: its ``usage.prompt_tokens_details.cached_tokens``, when
the engine reports them) and ``x-kvgate-handoff``
(``stored``: the KV was in place before the decode; ``timeout``; ``present``: no prefill needed;
``short``; ``untokenized``; ``prefill-failed``).  Metrics: ``kvgate_router_handoffs_total{outcome}`` and
``kvgate_router_handoff_wait_seconds``.

Why the router waits on events rather than the engines on each other: the prefill engine answers before
its KV is stored (vLLM stores a finished request's blocks in the steps after it answers), and the events
of the gateway that stored them are the first place anyone can know they are there; the decode engine's
lookup then finds them at once, on any engine, with no engine-to-engine protocol.

Runs on the router's event loop; nothing here blocks (the wait polls the index every ``POLL_S``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from kvgate.routing.index import KvIndex
from kvgate.routing.score import Endpoint, Scorer

__all__ = ["POLL_S", "prefill_body", "prompt_cached", "handoff_blocks", "Handoff"]

# how often the wait looks at the index: events are applied on the same loop as they arrive, and a
# prompt's blocks come in one or two batches, so 5 ms adds at most 5 ms to a hand-off that takes tens
POLL_S = 0.005
# what a prefill needs of a request's sampling: one token, not streamed (the keys a one-token answer
# would otherwise refuse or stream)
_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "echo", "best_of")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request for ``body``: the same prompt and sampling, one output token, not streamed."""
    out = {k: v for k, v in body.items() if k not in _DROP}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    return out


def prompt_cached(answer: bytes) -> int | None:
    """The cached prompt tokens an OpenAI-style answer reports (vLLM with --enable-prompt-tokens-details),
    or None where it says nothing of them."""
    try:
        usage = json.loads(answer).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def handoff_blocks(tokens: int, block_size: int, hashes: int) -> int:
    """Blocks of a ``tokens``-token prompt that the decode restores and the prefill stores: its full blocks
    (vLLM 0.32 loads the last full block too and computes the last token again), at most the ``hashes``
    the router has."""
    return min(hashes, tokens // block_size)


class Handoff:
    """Where a prompt's blocks are restorable from, for a decode endpoint (module docstring).

    ``restorable(hashes, decode_gateway, others)``: the blocks of the prompt's prefix the decode endpoint's
    gateway can serve (its RAM tier and its cards; with ``peer_pulls`` also what the ``others`` gateways
    hold in theirs, which it pulls).  ``wait`` polls that until ``need`` blocks or the timeout.  Gateways
    are named by their index source ids (None: an endpoint without gateway events, which holds nothing
    the router can see)."""

    def __init__(self, index: KvIndex, scorer: Scorer, timeout: float, peer_pulls: bool) -> None:
        self.index = index
        self.scorer = scorer
        self.timeout = timeout
        self.peer_pulls = peer_pulls

    def restorable(self, hashes: Sequence[bytes], decode_gateway: str | None,
                   others: Sequence[str | None] = ()) -> int:
        if decode_gateway is None or not hashes:
            return 0
        peers = tuple(g for g in others if g is not None and g != decode_gateway) if self.peer_pulls else ()
        (score,) = self.scorer.score(hashes, [Endpoint(name=decode_gateway, gateway=decode_gateway, peers=peers)])
        return score.cpu + score.storage

    async def wait(self, hashes: Sequence[bytes], need: int, decode_gateway: str | None,
                   others: Sequence[str | None] = ()) -> tuple[bool, float]:
        """(whether ``need`` blocks became restorable within the timeout, seconds waited)."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        while True:
            if self.restorable(hashes, decode_gateway, others) >= need:
                return True, time.monotonic() - t0
            if time.monotonic() >= deadline:
                return False, time.monotonic() - t0
            await asyncio.sleep(POLL_S)
