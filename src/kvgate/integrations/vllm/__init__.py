"""kvgate for vLLM (0.32): a secondary tier of vLLM's tiering KV offloading.

``KvgateOffloadingSpec`` (spec_name / spec_module_path in
``kv_connector_extra_config``) adds a ``KvgateTier`` from the ``kvgate.*``
keys; ``KvgateTier`` also works as a ``secondary_tiers`` entry of vLLM's own
``TieringOffloadingSpec``.  Both are loaded on first access (vLLM resolves
them with getattr), so ``kvgate.integrations.vllm.settings`` stays usable
without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.integrations.vllm.spec import KvgateOffloadingSpec
    from kvgate.integrations.vllm.tier import KvgateTier

__all__ = ["KvgateOffloadingSpec", "KvgateTier"]


def __getattr__(name: str) -> Any:
    if name == "KvgateOffloadingSpec":
        from kvgate.integrations.vllm.spec import KvgateOffloadingSpec

        return KvgateOffloadingSpec
    if name == "KvgateTier":
        from kvgate.integrations.vllm.tier import KvgateTier

        return KvgateTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
