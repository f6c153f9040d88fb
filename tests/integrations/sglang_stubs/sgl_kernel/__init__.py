"""Pure-torch stand-ins for the CUDA-only ``sgl_kernel`` ops that SGLang's CPU engine calls.

Test scaffolding for a GPU-less machine without AMX (the CPU kernel package is
built from source for AMX Xeons and is not on PyPI); on PYTHONPATH only for the
SGLang engine tests.  The kvgate backend depends on none of this.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req, start:end] = the request's run of out_cache_loc, requests back to back."""
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer (base pointer, bytes per token row): row src_loc[i] -> row tgt_loc[i]."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(base + t * stride, base + s * stride, stride)


def __getattr__(name: str):
    """Every other op: importable (SGLang's CPU path imports many at module load), fails if called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no stand-in in the SGLang engine tests")

    missing.__name__ = name
    return missing
