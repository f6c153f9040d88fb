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

from kvgate.integrations.vllm.compat import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    SharedOffloadRegion,
    TransferResult,
)

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")


def _copy_runs(blocks: np.ndarray, slots: np.ndarray, bpc: int) -> list[tuple[int, int, int, int]]:
    """Split a transfer into runs of consecutive engine blocks and consecutive primary-tier slots.

    ``slots`` are flat slot numbers (chunk * bpc + slot in the chunk).  Returns
    ``(first block, chunk, slot in the chunk, length)`` per run; with
    ``bpc > 1`` a run stays inside one chunk (one chunk's slots are adjacent
    in memory; the next chunk is a whole row further), with ``bpc == 1`` a run
    spans consecutive chunks (one strided copy).
    """
    if len(blocks) == 0:
        return []
    step = (np.diff(blocks) != 1) | (np.diff(slots) != 1)
    if bpc > 1:
        step |= (slots[1:] % bpc) == 0
    starts = np.concatenate(([0], np.flatnonzero(step) + 1))
    ends = np.append(starts[1:], len(blocks))
    return [(int(blocks[a]), int(slots[a]) // bpc, int(slots[a]) % bpc, int(b - a)) for a, b in zip(starts, ends)]


class HostCopyOffloadingWorker(OffloadingWorker):
    """The CPU platform's worker between the engine's KV cache and the primary CPU tier.

    Built by ``KvgateOffloadingSpec.get_worker`` in each vLLM worker process;
    the offloading connector calls ``submit_store`` / ``submit_load`` on the
    worker's thread between model steps, and each copies before it returns
    (host memory on both sides: there is nothing to wait for).
    """

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
            blocks = block_ids[e_off:e_off + size]
            chunks = chunk_ids[c_off:c_off + n_chunks]
            slots = (chunks[:, None] * bpc + np.arange(bpc)[None, :]).ravel()[skip:skip + size]
            runs = _copy_runs(blocks, slots, bpc)
            for ref in self._refs[g]:
                dev = self._engine[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                n = ref.page_size_bytes
                # Slice copies of runs of consecutive pages: an advanced-indexing copy of int8
                # tensors moves the bytes one element at a time (~8x slower here).
                for b0, c0, s0, length in runs:
                    e = dev[b0:b0 + length, :n]
                    h = host[c0:c0 + length, s0, :n] if bpc == 1 else host[c0, s0:s0 + length, :n]
                    if to_host:
                        h.copy_(e)
                    else:
                        e.copy_(h)
                nbytes += size * n
            e_off += size
            c_off += n_chunks
        assert e_off == len(block_ids) and c_off == len(chunk_ids), "spec sizes do not add up"
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # vLLM 0.33 passes expedited=True for loads under its sync_load_budget_bytes (0.32 never passes it);
        # a host copy runs at once either way.
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
