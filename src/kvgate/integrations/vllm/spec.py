"""KvgateOffloadingSpec: vLLM's tiering offloading spec with a kvgate secondary tier.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvgateOffloadingSpec",
        "spec_module_path": "kvgate.integrations.vllm", "cpu_bytes_to_use": 268435456,
        "kvgate.socket": "/run/kvgate.sock"}}'

The ``kvgate.*`` keys add one ``KvgateTier`` after any configured
``secondary_tiers``.  On CUDA/XPU the stock worker moves pages between the
GPU and the CPU tier; on the CPU platform (where the stock worker refuses to
start) a host-copy worker does, so one config works on both.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvgate.integrations.vllm.settings import (
    TIER_TYPE,
    NamespaceInputs,
    derive_namespace,
    key_stability,
    tier_config_from_extra,
)

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")

_SALT_PATCHED = False


def _install_salt_probe() -> bool:
    """Let tiers see whether a request carries a cache_salt.

    vLLM's ReqContext does not carry the salt (it is only inside the block
    hashes), so the connector's ReqContext factory is wrapped to attach a
    ``RequestSalt`` state.  Returns False when this vLLM has no such factory.
    """
    global _SALT_PATCHED
    if _SALT_PATCHED:
        return True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched  # noqa: PLC0415

        from kvgate.integrations.vllm.tier import RequestSalt  # noqa: PLC0415

        original = sched._create_req_context
    except (ImportError, AttributeError):
        return False

    def create_req_context(req):
        ctx = original(req)
        try:
            ctx.set_state(RequestSalt(salted=bool(getattr(req, "cache_salt", None))))
        except Exception:
            pass
        return ctx

    create_req_context.__wrapped__ = original  # type: ignore[attr-defined]
    sched._create_req_context = create_req_context
    _SALT_PATCHED = True
    return True


@dataclass
class EngineInfo:
    engine_id: str
    namespace: str
    namespace_description: str
    tokens_per_chunk: dict[int, int]
    salt_detection: bool
    hash_algo: str | None


def _vllm_config():
    """The engine's VllmConfig, for what OffloadingConfig lacks (model revision, hash algorithm).

    vLLM does not hand it to specs: use the current config when one is set,
    else the ``vllm_config`` of the connector that is constructing this spec
    (a caller frame).  None when neither is found.
    """
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none  # noqa: PLC0415

        cfg = get_current_vllm_config_or_none()
        if cfg is not None:
            return cfg
        frame = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                break
            cand = frame.f_locals.get("vllm_config")
            if isinstance(cand, VllmConfig):
                return cand
            frame = frame.f_back
    except Exception:
        pass
    return None


def describe_engine(spec: Any) -> EngineInfo:
    """Namespace inputs and key geometry from an OffloadingSpec's normalized config."""
    cfg: OffloadingConfig = spec.config
    vcfg = getattr(spec, "_kvgate_vllm_config", None) or _vllm_config()
    revision = None
    algo = None
    if vcfg is not None:
        revision = getattr(vcfg.model_config, "revision", None)
        algo = getattr(vcfg.cache_config, "prefix_caching_hash_algo", None)
    bpc = cfg.cache.blocks_per_chunk
    inputs = NamespaceInputs(
        model=cfg.model.name,
        revision=revision,
        dtype=cfg.model.dtype,
        platform=str(getattr(current_platform, "device_type", "unknown")),
        kv_cache_layout=cfg.kv_cache_layout,
        canonical_layout=cfg.canonical_layout,
        replicated_layout=cfg.replicated_layout,
        tokens_per_hash=cfg.cache.tokens_per_hash,
        blocks_per_chunk=bpc,
        worker_kv_bytes_per_block=cfg.worker_kv_bytes_per_block,
        chunk_bytes=int(getattr(spec, "kv_bytes_per_chunk", 0)),
        tp_size=cfg.parallel.tp_size,
        pp_size=cfg.parallel.pp_size,
        pcp_size=cfg.parallel.pcp_size,
        dcp_size=cfg.parallel.dcp_size,
        world_size=cfg.parallel.world_size,
        groups=[{"group_id": g.group_id, "tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
                for g in cfg.groups],
    )
    namespace, desc = derive_namespace(inputs)
    return EngineInfo(
        engine_id=cfg.engine_id,
        namespace=namespace,
        namespace_description=desc,
        tokens_per_chunk={g.group_id: g.tokens_per_block * bpc for g in cfg.groups},
        salt_detection=_SALT_PATCHED,
        hash_algo=algo,
    )


class KvgateOffloadingSpec(TieringOffloadingSpec):
    """TieringOffloadingSpec + a kvgate tier from ``kvgate.*`` keys + a CPU-platform worker."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self._kvgate_vllm_config = _vllm_config()
        tier_cfg = tier_config_from_extra(self.extra_config)
        configured = [t for t in self.secondary_tier_configs if t.get("type") == TIER_TYPE]
        if tier_cfg is not None:
            bp = self.extra_config.get("backpressure")
            if bp:
                tier_cfg["backpressure"] = dict(bp)
            # a new list: never modify the user's config object
            self.secondary_tier_configs = [*self.secondary_tier_configs, tier_cfg]
        elif not configured:
            others = [str(t.get("type")) for t in self.secondary_tier_configs]
            logger.warning("KvgateOffloadingSpec: no kvgate.socket / kvgate.address in kv_connector_extra_config "
                           "and no KvgateTier in secondary_tiers: offloading to the CPU tier%s only",
                           f" and secondary tiers {others}" if others else "")
        self._uses_kvgate = tier_cfg is not None or bool(configured)
        if self._uses_kvgate:
            _install_salt_probe()

    def get_manager(self) -> OffloadingManager:
        if self._manager is None and self._uses_kvgate:
            algo = getattr(getattr(self._kvgate_vllm_config, "cache_config", None), "prefix_caching_hash_algo", None)
            ks = key_stability(algo)
            if ks.stable:
                logger.info("kvgate: block hash settings: %s", ks.message)
            else:
                logger.warning("kvgate: KEYS ARE NOT STABLE ACROSS PROCESSES: %s", ks.message)
        return super().get_manager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self._create_host_copy_worker(kv_caches)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]

    def _create_host_copy_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from kvgate.integrations.vllm.worker import HostCopyOffloadingWorker  # noqa: PLC0415

        if self.config.canonical_layout:
            raise RuntimeError("canonical_layout is not supported by the CPU-platform host-copy worker; remove "
                               "canonical_layout from kv_connector_extra_config")
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HostCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
