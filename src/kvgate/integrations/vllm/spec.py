"""KvgateOffloadingSpec: vLLM's tiering offloading spec with a kvgate secondary tier.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvgateOffloadingSpec",
        "spec_module_path": "kvgate.integrations.vllm", "cpu_bytes_to_use": 268435456,
        "kvgate.socket": "/run/kvgate.sock"}}'

Unlike vLLM's own spec, decoded tokens' blocks are stored too (``offload_prompt_only`` defaults to
false here; set it to true to store prompts only).

The ``kvgate.*`` keys add one ``KvgateTier`` after any configured
``secondary_tiers``; without them, and without a ``KvgateTier`` entry there,
one on the gateway's default socket (``kvgate.config.default_socket_path``,
where a bare ``kvgate serve`` listens) is added.  On CUDA/XPU the stock worker moves pages between the
GPU and the CPU tier; on the CPU platform (where the stock worker refuses to
start) a host-copy worker does, so one config works on both.
"""

from __future__ import annotations

import logging

from kvgate.integrations.vllm import compat
from kvgate.integrations.vllm.compat import (
    CanonicalKVCaches,
    OffloadingConfig,
    OffloadingManager,
    OffloadingWorker,
    TieringOffloadingSpec,
)
from kvgate.integrations.vllm.engine import install_salt_probe
from kvgate.integrations.vllm.settings import TIER_MODULE, TIER_TYPE, key_stability, tier_config_from_extra

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")


class KvgateOffloadingSpec(TieringOffloadingSpec):
    """TieringOffloadingSpec + a kvgate tier (``kvgate.*`` keys, or the default socket) + a CPU-platform worker.

    vLLM's OffloadingConnector builds one in the scheduler process and one in
    each worker process, at engine start; ``get_manager`` (scheduler, which
    builds the tiers) and ``get_worker`` (workers) are called once there, so
    nothing here is on a request's path.
    """

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        # vLLM offloads a request's prompt blocks only unless told otherwise (offload_prompt_only, default
        # true).  kvgate stores the blocks the answer fills too: the next turn of a conversation sends the
        # answer back as part of its prompt, and with prefill and decode on different engines the decode
        # engine is the only one that ever computed it.  An explicit offload_prompt_only is kept.
        if "offload_prompt_only" not in self.extra_config:
            self.offload_prompt_only = False
        self._kvgate_vllm_config = compat.current_vllm_config()
        tier_cfg = tier_config_from_extra(self.extra_config)
        configured = [t for t in self.secondary_tier_configs if t.get("type") == TIER_TYPE]
        if tier_cfg is None and not configured:
            # No kvgate.* key and no KvgateTier entry: the gateway's default socket (a bare `kvgate serve`).
            tier_cfg = {"type": TIER_TYPE, "module_path": TIER_MODULE}
        if tier_cfg is not None:
            bp = self.extra_config.get("backpressure")
            if bp:
                tier_cfg["backpressure"] = dict(bp)
            # a new list: never modify the user's config object
            self.secondary_tier_configs = [*self.secondary_tier_configs, tier_cfg]
        install_salt_probe()

    def get_manager(self) -> OffloadingManager:
        if not compat.manager_built(self):
            ks = key_stability(compat.block_hash_algo(self._kvgate_vllm_config))
            if ks.stable:
                logger.info("kvgate: block hash settings: %s", ks.message)
            else:
                logger.warning("kvgate: KEYS ARE NOT STABLE ACROSS PROCESSES: %s", ks.message)
        return super().get_manager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if compat.stock_worker_supported():
            return super().get_worker(kv_caches)
        worker = compat.built_worker(self)
        if worker is None:
            worker = compat.keep_worker(self, self._create_host_copy_worker(kv_caches))
        return worker

    def _create_host_copy_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from kvgate.integrations.vllm.worker import HostCopyOffloadingWorker  # noqa: PLC0415

        if self.config.canonical_layout:
            raise RuntimeError("canonical_layout is not supported by the CPU-platform host-copy worker; remove "
                               "canonical_layout from kv_connector_extra_config")
        region = compat.open_worker_region(self, 0 if self.replicated_layout else self.config.parallel.rank)
        try:
            return HostCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
