"""Adapter parameters and the ObjectKey -> (namespace, key) mapping of the LMCache L2 adapter.

Nothing here imports LMCache: ObjectKeys are read by attribute (chunk_hash,
model_name, kv_rank, object_group_id, cache_salt), so the mapping is tested
without it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

from kvgate.integrations.settings import ConfigError, TierSettings, keys_without, parse_bool, parse_retention
from kvgate.keys import MAX_KEY_BYTES

#: adapter_params key -> meaning.  The ones shared with the vLLM tier parse the same way.
PARAM_KEYS: dict[str, str] = {
    "kvgate.socket": "the gateway's Unix socket (zero-copy capable); or kvgate.address",
    "kvgate.address": "host:port of the gateway's TCP listener (bytes travel inline)",
    "kvgate.token_file": "a file holding the gateway's token (TCP listeners that require one)",
    "kvgate.namespace": "replaces 'lmcache|<model>' at the head of every namespace",
    "kvgate.retention": "long (RAM tier and cards, default), short (RAM only) or none",
    "kvgate.connect_timeout": "seconds to connect (default 2)",
    "kvgate.io_timeout": "seconds a store or load call may take (default 10)",
    "kvgate.lookup_timeout": "seconds a lookup call may take (default 2)",
    "kvgate.register_l1": "auto (default): register LMCache's L1 with the gateway when it is a /dev/shm "
                          "file mapping; false: never",
    "kvgate.load_workers": "threads (each with its own gateway session) running loads (default 1)",
}

# The shared keys LMCache can honour: its chunk hashes already carry the salt and the request,
# and no prefix reaches the adapter for a dialog mark.
_SHARED = keys_without("kvgate.affinity_chunks", "kvgate.refuse_unsalted", "kvgate.skip_unsalted")

_MAX_READABLE_MODEL = 96
_MAX_NAMESPACE = 255


@dataclass(frozen=True)
class AdapterSettings:
    tier: TierSettings
    register_l1: bool = True
    load_workers: int = 1

    @property
    def target(self) -> str:
        return self.tier.target


def parse_params(params: Mapping[str, Any]) -> AdapterSettings:
    """Validate LMCache's ``adapter_params``; a wrong or unknown key raises ConfigError naming it."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"adapter_params: expected a JSON object, got {params!r}")
    unknown = sorted(k for k in params if k not in PARAM_KEYS)
    if unknown:
        raise ConfigError(f"unknown adapter_params key(s) {unknown}; known: {sorted(PARAM_KEYS)}")
    tier = TierSettings.build(**{arg: params[key] for key, arg in _SHARED.items() if key in params})
    register = params.get("kvgate.register_l1", "auto")
    register_l1 = True if register == "auto" else parse_bool("kvgate.register_l1", register)
    raw = params.get("kvgate.load_workers", 1)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 16:
        raise ConfigError(f"kvgate.load_workers: expected an integer from 1 to 16, got {raw!r}")
    return AdapterSettings(tier=tier, register_l1=register_l1, load_workers=raw)


def namespace_for(key: Any, base: str | None = None) -> str:
    """The kvgate namespace of an LMCache ObjectKey: everything but its chunk hash.

    ``lmcache|<model>|r<kv_rank>|g<object_group_id>``, plus ``|s<digest of the
    salt>`` for a salted key (``base`` replaces ``lmcache|<model>``).  Salts are
    digested (SHA-256), so a salt is never written to the gateway as is, and
    the namespace stays under 255 bytes.  No Python ``hash()``: the same key
    gives the same namespace in every process.
    """
    if base is None:
        model = str(key.model_name).rstrip("/")
        if len(model) > _MAX_READABLE_MODEL:
            digest = hashlib.sha256(model.encode()).hexdigest()[:16]
            model = f"...{model[-(_MAX_READABLE_MODEL - 20):]}#{digest}"
        base = f"lmcache|{model}"
    ns = f"{base}|r{int(key.kv_rank)}|g{int(key.object_group_id)}"
    salt = getattr(key, "cache_salt", "") or ""
    if salt:
        ns += "|s" + hashlib.sha256(b"kvgate-salt\x00" + salt.encode()).hexdigest()[:32]
    if len(ns.encode()) > _MAX_NAMESPACE:  # only a very long kvgate.namespace gets here
        raise ConfigError(f"kvgate.namespace: too long ({len(ns.encode())} bytes with rank, group and salt)")
    return ns


def key_bytes(key: Any) -> bytes:
    """The kvgate key of an LMCache ObjectKey: its chunk hash bytes (digested if over the key limit)."""
    h = key.chunk_hash
    if isinstance(h, int):
        raw = h.to_bytes((max(h.bit_length(), 1) + 8) // 8, "big", signed=True)
    elif isinstance(h, str):
        raw = h.encode()
    else:
        raw = bytes(h)
    if not raw:
        raise ValueError("an ObjectKey with an empty chunk_hash")
    if len(raw) > MAX_KEY_BYTES:
        raw = b"sha256:" + hashlib.sha256(raw).digest()
    return raw


def split_by_namespace(keys: list[Any], base: str | None = None) -> dict[str, list[int]]:
    """Indices of ``keys`` grouped by namespace (insertion order)."""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(namespace_for(k, base), []).append(i)
    return groups


__all__ = ["AdapterSettings", "ConfigError", "PARAM_KEYS", "key_bytes", "namespace_for", "parse_params",
           "parse_retention", "split_by_namespace"]
