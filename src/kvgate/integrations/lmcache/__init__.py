"""kvgate for LMCache (0.5.6): two plugins, one per way LMCache runs.

- ``KvgateL2Adapter``: an L2 adapter for ``lmcache server`` (multiprocess mode)::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvgate.integrations.lmcache",
        "class_name": "KvgateL2Adapter",
        "adapter_params": {"kvgate.socket": "/tmp/kvgate-5557.sock"}}'

  LMCache's plugin factory finds ``KvgateL2AdapterConfig`` as ``<class_name>Config``.
- ``KvgateRemoteConnector``: a remote storage plugin of in-process LMCache
  (``remote_storage_plugins``; see ``kvgate.integrations.lmcache.remote``).

The classes are loaded on first access, so importing this package, and
``kvgate.integrations.lmcache.settings``, needs no LMCache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.integrations.lmcache.adapter import KvgateL2Adapter, KvgateL2AdapterConfig
    from kvgate.integrations.lmcache.remote import KvgateRemoteConnector

__all__ = ["KvgateL2Adapter", "KvgateL2AdapterConfig", "KvgateRemoteConnector"]

_HOMES = {"KvgateL2Adapter": "adapter", "KvgateL2AdapterConfig": "adapter", "KvgateRemoteConnector": "remote"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{home}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
