"""What the vLLM integration learns of the engine it runs in: the spec and the tier both need it.

``describe_engine``: the namespace inputs and key geometry of an offloading
spec; ``install_salt_probe`` / ``RequestSalt``: whether a request carries a
``cache_salt``, which vLLM does not tell a tier.  It reaches vLLM only
through ``compat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.integrations.vllm import compat
from kvgate.integrations.vllm.settings import NamespaceInputs, derive_namespace, model_identity

_SALT_PROBE_INSTALLED = False


@dataclass(frozen=True)
class RequestSalt:
    """Attached to a ReqContext by the salt probe: whether the request carries a cache_salt."""

    salted: bool


def _attach_salt(ctx: compat.ReqContext, request: Any) -> None:
    ctx.set_state(RequestSalt(salted=bool(compat.request_cache_salt(request))))


def install_salt_probe() -> bool:
    """Let tiers see whether a request carries a cache_salt (once per process; the spec and the tier
    both ask, since the tier may be an entry of vLLM's own TieringOffloadingSpec).

    vLLM's ReqContext does not carry the salt (it is only inside the block
    hashes), so every new ReqContext gets a ``RequestSalt`` state.  Returns
    False when this vLLM has no ReqContext factory to hook.
    """
    global _SALT_PROBE_INSTALLED
    if _SALT_PROBE_INSTALLED:
        return True
    if not compat.install_req_context_hook(_attach_salt):
        return False
    _SALT_PROBE_INSTALLED = True
    return True


@dataclass
class EngineInfo:
    """What ``describe_engine`` found: the tier's engine id, derived namespace and chunk geometry."""

    engine_id: str
    namespace: str
    namespace_description: str
    tokens_per_chunk: dict[int, int]
    salt_detection: bool
    hash_algo: str | None


def describe_engine(spec: Any) -> EngineInfo:
    """Namespace inputs and key geometry from an OffloadingSpec's normalized config."""
    cfg: compat.OffloadingConfig = spec.config
    vcfg = getattr(spec, "_kvgate_vllm_config", None) or compat.current_vllm_config()
    revision = None
    algo = None
    if vcfg is not None:
        revision = compat.model_revision(vcfg)
        algo = compat.block_hash_algo(vcfg)
    bpc = cfg.cache.blocks_per_chunk
    model, content = model_identity(cfg.model.name)  # what the model is, not where it is mounted
    inputs = NamespaceInputs(
        model=model,
        model_content=content,
        revision=revision,
        dtype=cfg.model.dtype,
        platform=compat.platform_name(),
        kv_cache_layout=cfg.kv_cache_layout,
        canonical_layout=cfg.canonical_layout,
        replicated_layout=cfg.replicated_layout,
        tokens_per_hash=cfg.cache.tokens_per_hash,
        blocks_per_chunk=bpc,
        worker_kv_bytes_per_block=cfg.worker_kv_bytes_per_block,
        chunk_bytes=compat.chunk_bytes(spec),
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
        salt_detection=_SALT_PROBE_INSTALLED,
        hash_algo=algo,
    )
