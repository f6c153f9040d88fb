"""The host pools the SGLang backend stores, as page geometry: what one page of a pool is.

SGLang hands the backend host pools (the KV pool, and for a hybrid model its Mamba, SWA,
indexer... pools) and, per call, host indices.  The backend moves whole pages, so it needs
each pool's page as fragments (pointer, size), their total, the staging slot that holds one
page, and the key each pool's part of a page is stored under.  That is learned once per pool
from the pool's own page description (``get_page_buffer_meta``) and checked on every call, so
a pool that describes its pages unexpectedly is a miss, never a copy past a slot.

Two rules make the pools of one hybrid call agree: ``restorable_prefixes`` (which prefixes a
lookup may report, per SGLang's hit policies) and ``all_or_none`` (a page moved for every pool
of a call, or for none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

from kvgate.integrations.sglang.settings import pool_page_key, pool_tag

_SLOT_ALIGN = 64  # cache-line aligned slots


def as_pool_name(name: Any) -> str:
    """SGLang names pools with ``PoolName`` members (a ``str`` enum) or plain strings."""
    return str(getattr(name, "value", name))


@dataclass
class RegisteredPool:
    """One registered host pool, as the backend moves its pages.

    ``tag`` None: the KV (anchor) pool, whose pages are the v1 objects under their plain page
    keys; otherwise an extra pool of a hybrid model, whose part of a page is stored under
    ``pool_page_key(tag, page key)`` in the same namespace.  ``error``: why this pool's pages
    cannot be moved (its transfers are misses; '' when they can)."""

    name: str
    host: Any
    page_size: int = 1  # host pool indices per page (tokens; 1 for a Mamba state slot)
    fragments: int = 0
    page_bytes: int = 0
    slot_bytes: int = 0
    tag: bytes | None = None
    error: str = ""

    def key(self, page: bytes) -> bytes:
        return page if self.tag is None else pool_page_key(self.tag, page)

    def fragments_of(self, host_indices: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(pointers, sizes) of ``n`` pages at ``host_indices``, int64 arrays of ``n`` x ``fragments``;
        ValueError when they do not add up."""
        if self.error:
            raise ValueError(f"host pool {self.name!r} cannot be stored: {self.error}")
        if host_indices is None or int(host_indices.numel()) != n * self.page_size:
            got = None if host_indices is None else int(host_indices.numel())
            raise ValueError(f"host pool {self.name!r}: {got} indices for {n} pages of {self.page_size}")
        ptrs, sizes = self.host.get_page_buffer_meta(host_indices)
        if len(ptrs) != n * self.fragments or len(sizes) != len(ptrs):
            raise ValueError(f"host pool {self.name!r} gave {len(ptrs)} fragments for {n} pages of "
                             f"{self.fragments}")
        ptrs, sizes = np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
        if (sizes < 0).any() or int(sizes.sum()) != n * self.page_bytes:  # a slot holds page_bytes: never past it
            raise ValueError(f"host pool {self.name!r} gave {int(sizes.sum())} bytes for {n} pages of "
                             f"{self.page_bytes}")
        return ptrs.reshape(n, self.fragments), sizes.reshape(n, self.fragments)


def describe_pool(name: str, host: Any, tag_extra: Optional[dict]) -> RegisteredPool:
    """A pool's page geometry from its own page description (``get_page_buffer_meta``).

    ``tag_extra`` None: the KV pool (plain page keys); otherwise what, besides the geometry,
    keeps this pool's objects apart (the TP rank of a TP-sharded state)."""
    page_size = int(getattr(host, "page_size", 1) or 1)
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    if not ptrs or len(ptrs) != len(sizes):
        raise ValueError(f"the host pool describes a page as {len(ptrs)} pointers and {len(sizes)} sizes")
    sizes = [int(x) for x in sizes]
    page_bytes = sum(sizes)
    tag = None
    if tag_extra is not None:
        tag = pool_tag(name, {"class": type(host).__name__, "page_size": page_size, "sizes": sizes,
                              "layout": str(getattr(host, "layout", "unknown")),
                              "dtype": str(getattr(host, "dtype", "unknown")).removeprefix("torch."),
                              **tag_extra})
    return RegisteredPool(name, host, page_size, len(ptrs), page_bytes,
                          -(-page_bytes // _SLOT_ALIGN) * _SLOT_ALIGN, tag)


def restorable_prefixes(kv: int, transfers: Sequence[Any], present: Sequence[list[bool]]) -> tuple[dict, set[int]]:
    """(pages per pool, prefix lengths every pool allows) of a lookup whose first ``kv`` KV pages are
    stored; ``present[j][i]``: whether ``transfers[j]``'s pool has its part of page ``i``.

    ``TRAILING_PAGES`` needs the last ``len(transfer.keys)`` pages of a prefix, any other policy
    every page of it (see ``KvgateHiCacheStorage.batch_exists_v2``)."""
    restorable = set(range(1, kv + 1))
    hits: dict = {PoolName.KV: kv} if kv else {}
    for t, have in zip(transfers, present):
        if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(t.keys or ()))
            ok, run = set(), 0
            for length in range(1, kv + 1):
                run = run + 1 if have[length - 1] else 0
                if run >= min(window, length):
                    ok.add(length)
        else:
            lead = have.index(False) if False in have else kv
            ok = set(range(1, lead + 1))
        if ok:
            hits[t.name] = max(ok)
        restorable &= ok
    return hits, restorable


def all_or_none(transfers: Sequence[Any], out: dict) -> None:
    """Make one v2 call's per-pool results agree: a page counts for no pool unless every pool
    of the call has its part, and nothing after such a page counts either.

    SGLang's transfers of one call all end on the same page (the span's last: trailing
    windows of Mamba/SWA states, KV-derived pools over the whole span), so pages are aligned
    on their distance from the end.  A key reported missing by any pool is also missing for
    every other pool that lists it, whatever the alignment."""
    cut: int | None = None  # distance from the end (negative) of the earliest page some pool lacks
    bad: set = set()
    for t in transfers:
        keys = list(t.keys or ())
        for i, ok in enumerate(out.get(t.name, ())):
            if not ok:
                cut = i - len(keys) if cut is None else min(cut, i - len(keys))
                if i < len(keys):
                    bad.add(keys[i])
    if cut is None:
        return
    for t in transfers:
        keys = list(t.keys or ())
        r = out.get(t.name)
        if r is None:
            continue
        for i in range(len(r)):
            if i - len(keys) >= cut or (i < len(keys) and keys[i] in bad):
                r[i] = False
