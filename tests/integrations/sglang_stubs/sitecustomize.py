"""Test scaffolding for SGLang's CPU engine on a machine without CUDA (PYTHONPATH of engine tests only).

Runs in every Python process of the server (SGLang spawns its schedulers), and
after SGLang's own modules load, patches two things they bind at import:
- ``pool_host.mha.transfer_kv_direct``: bound only on CUDA/HIP/XPU; the stand-in
  from ``sgl_kernel.kvcacheio`` here;
- ``pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]``: pins the HiCache host pool with
  cudaHostRegister; plain unpinned memory here.
"""

from __future__ import annotations

import importlib.abc
import sys


def _patch_common(module) -> None:
    import torch

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


def _patch_mha(module) -> None:
    from sgl_kernel.kvcacheio import transfer_kv_direct

    module.transfer_kv_direct = transfer_kv_direct


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module, run=run, patch=patch):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
