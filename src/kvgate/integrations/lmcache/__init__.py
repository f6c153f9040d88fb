"""kvgate for LMCache (0.5.6, multiprocess mode): an L2 adapter plugin for ``lmcache server``.

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvgate.integrations.lmcache",
        "class_name": "KvgateL2Adapter",
        "adapter_params": {"kvgate.socket": "/tmp/kvgate-5557.sock"}}'

``KvgateL2Adapter`` and ``KvgateL2AdapterConfig`` (found by LMCache's plugin
factory as ``<class_name>Config``) are loaded on first access, so
``kvgate.integrations.lmcache.settings`` stays usable without LMCache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.integrations.lmcache.adapter import KvgateL2Adapter, KvgateL2AdapterConfig

__all__ = ["KvgateL2Adapter", "KvgateL2AdapterConfig"]


def __getattr__(name: str) -> Any:
    if name in ("KvgateL2Adapter", "KvgateL2AdapterConfig"):
        from kvgate.integrations.lmcache import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
