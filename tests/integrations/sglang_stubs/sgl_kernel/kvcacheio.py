"""Pure-torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct`` (see the package docstring)."""

from __future__ import annotations

from typing import Sequence

import torch


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """dst[dst_indices] = src[src_indices] for each (src, dst) layer buffer pair (token rows)."""
    si = src_indices.to(torch.int64)
    di = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, di.to(dst.device), src.index_select(0, si.to(src.device)).to(dst.device))
