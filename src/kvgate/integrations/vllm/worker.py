"""HostCopyOffloadingWorker: the engine <-> primary CPU tier copies on vLLM's CPU platform.

vLLM's ``CPUOffloadingWorker`` moves pages with CUDA/XPU streams and refuses
the CPU platform.  There the engine's KV cache is already host memory, so a
transfer is a plain (synchronous) torch copy between the engine's KV cache
tensors and the rows of the shared primary tier (same byte layout as the
stock worker: per chunk row, one slot per KV tensor, ``blocks_per_chunk``
pages each).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")


class HostCopyOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mmap_region: SharedOffloadRegion):
        self._region: SharedOffloadRegion | None = mmap_region
        self._bpc = blocks_per_chunk
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []  # (num_chunks, blocks_per_chunk, page) views of the region
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor
            if dev.dtype != torch.int8 or dev.dim() != 2 or dev.shape[1] != page:
                dev = dev.view(torch.int8).view(-1, page)
            if dev.device.type != "cpu":
                raise RuntimeError(f"HostCopyOffloadingWorker needs host KV caches, got {dev.device}")
            host = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            self._engine.append(dev)
            self._host.append(host.view(host.shape[0], blocks_per_chunk, page))
        self._refs = kv_caches.group_data_refs
        self._finished: list[TransferResult] = []
        logger.info("kvgate: host-copy offloading worker for the CPU platform: %d KV tensors, %d blocks per chunk",
                    len(self._engine), blocks_per_chunk)

    def _transfer(self, job_id: int, engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        block_ids = engine_spec.block_ids.astype(np.int64)
        chunk_ids = host_spec.block_ids.astype(np.int64)
        bpc = self._bpc
        e_off = c_off = 0
        nbytes = 0
        for g, (size, first_idx) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
            if size == 0:
                continue
            skip = first_idx % bpc
            n_chunks = -(-(size + skip) // bpc)
            blocks = torch.from_numpy(block_ids[e_off:e_off + size])
            chunks = chunk_ids[c_off:c_off + n_chunks]
            slots = (chunks[:, None] * bpc + np.arange(bpc)[None, :]).ravel()[skip:skip + size]
            c_idx = torch.from_numpy(slots // bpc)
            s_idx = torch.from_numpy(slots % bpc)
            for ref in self._refs[g]:
                dev = self._engine[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                n = ref.page_size_bytes
                if to_host:
                    host[c_idx, s_idx, :n] = dev[blocks, :n]
                else:
                    dev[blocks, :n] = host[c_idx, s_idx, :n]
                nbytes += size * n
            e_off += size
            c_off += n_chunks
        assert e_off == len(block_ids) and c_off == len(chunk_ids), "spec sizes do not add up"
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # transfers are synchronous

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None
