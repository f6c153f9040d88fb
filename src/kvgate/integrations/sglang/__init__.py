"""kvgate for SGLang (0.5.23): a HiCache storage backend (SGLang's L3 tier).

Load it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvgate","module_path":"kvgate.integrations.sglang",
      "class_name":"KvgateHiCacheStorage","interface_v1":1,
      "kvgate.socket":"/tmp/kvgate-5557.sock"}'

``KvgateHiCacheStorage`` is loaded on first access (SGLang resolves it with
getattr), so ``kvgate.integrations.sglang.settings`` stays usable without
SGLang installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.integrations.sglang.backend import KvgateHiCacheStorage

__all__ = ["KvgateHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvgateHiCacheStorage":
        from kvgate.integrations.sglang.backend import KvgateHiCacheStorage

        return KvgateHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
