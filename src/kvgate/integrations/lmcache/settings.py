"""Settings and key mappings of kvgate's two LMCache integrations.

- The L2 adapter of ``lmcache server`` (multiprocess mode): its
  ``adapter_params`` and the ObjectKey -> (namespace, key) mapping.
- The in-process remote connector plugin: its ``extra_config`` keys and the
  CacheEngineKey -> (namespace, key) mapping.

Both mappings share one head (``lmcache|<model>`` or ``kvgate.namespace``),
one way of digesting what must not reach the gateway as is (salts, tags) and
one chunk-hash -> key rule.  Nothing here imports LMCache: keys are read by
attribute, so the mappings are tested without it.
"""

from __future__ import annotations

import hashlib
import logging
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

# The shared keys LMCache can honour: its chunk hashes already carry the salt and the request, and
# the adapter takes the gateway's dialog mark at each lookup (``marks``): no digest of first chunks.
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


def _head(model_name: Any, base: str | None) -> str:
    """``base``, else ``lmcache|<model>`` (a very long model name keeps its tail and a digest of the whole)."""
    if base is not None:
        return base
    model = str(model_name).rstrip("/")
    if len(model) > _MAX_READABLE_MODEL:
        digest = hashlib.sha256(model.encode()).hexdigest()[:16]
        model = f"...{model[-(_MAX_READABLE_MODEL - 20):]}#{digest}"
    return f"lmcache|{model}"


def _digest(label: bytes, text: str) -> bytes:
    """SHA-256 of what must not be written to the gateway as is (a salt, request tags)."""
    return hashlib.sha256(label + b"\x00" + text.encode()).digest()


def _checked(ns: str) -> str:
    if len(ns.encode()) > _MAX_NAMESPACE:  # only a very long kvgate.namespace gets here
        raise ConfigError(f"kvgate.namespace: too long ({len(ns.encode())} bytes with the parts added to it)")
    return ns


#: The in-process remote connector's keys, each written ``remote_storage_plugin.<name>.<key>`` in LMCache's
#: ``extra_config``: the adapter's shared keys (L1 registration and load threads are the adapter's own).
CONNECTOR_KEYS: dict[str, str] = {k: PARAM_KEYS[k] for k in _SHARED}

PLUGIN_PREFIX = "remote_storage_plugin."
_PLUGIN_OWN = ("module_path", "class_name")


def connector_plugin_name(plugins: Any, extra_config: Mapping[str, Any] | None, class_name: str) -> str:
    """The name under which LMCache's ``remote_storage_plugins`` loads ``class_name``.

    LMCache builds a plugin's connector without telling it its name, so the
    name is the one plugin whose ``extra_config``
    ``remote_storage_plugin.<name>.class_name`` is ``class_name``.
    """
    extra = extra_config or {}
    names = [n for n in (plugins or []) if extra.get(f"{PLUGIN_PREFIX}{n}.class_name") == class_name]
    if len(names) != 1:
        raise ConfigError(
            f"LMCache config: expected exactly one of remote_storage_plugins whose extra_config "
            f"'{PLUGIN_PREFIX}<name>.class_name' is {class_name!r}, found {names or 'none'} "
            f"(LMCache does not tell a plugin its name, so one kvgate connector per LMCache config)")
    return str(names[0])


def parse_connector_config(extra_config: Mapping[str, Any] | None, plugin_name: str) -> TierSettings:
    """The remote connector's settings: the ``remote_storage_plugin.<name>.kvgate.*`` keys of ``extra_config``.

    A wrong value or an unknown ``kvgate.*`` key under the plugin's prefix raises ConfigError naming it.
    """
    prefix = f"{PLUGIN_PREFIX}{plugin_name}."
    ours = {k[len(prefix):]: v for k, v in (extra_config or {}).items() if k.startswith(prefix)}
    unknown = sorted(prefix + k for k in ours if k not in CONNECTOR_KEYS and k not in _PLUGIN_OWN)
    if unknown:
        raise ConfigError(f"unknown extra_config key(s) {unknown}; known: "
                          f"{sorted(prefix + k for k in CONNECTOR_KEYS)}")
    try:
        return TierSettings.build(**{arg: ours[key] for key, arg in _SHARED.items() if key in ours})
    except ConfigError as e:
        raise ConfigError(f"extra_config {prefix}...: {e}") from None


def namespace_for(key: Any, base: str | None = None) -> str:
    """The kvgate namespace of an LMCache ObjectKey: everything but its chunk hash.

    ``lmcache|<model>|r<kv_rank>|g<object_group_id>``, plus ``|s<digest of the
    salt>`` for a salted key (``base`` replaces ``lmcache|<model>``).  Salts are
    digested (SHA-256), so a salt is never written to the gateway as is, and
    the namespace stays under 255 bytes.  No Python ``hash()``: the same key
    gives the same namespace in every process.
    """
    ns = f"{_head(key.model_name, base)}|r{int(key.kv_rank)}|g{int(key.object_group_id)}"
    salt = getattr(key, "cache_salt", "") or ""
    if salt:
        ns += "|s" + _digest(b"kvgate-salt", salt).hex()[:32]
    return _checked(ns)


def engine_key_namespace(key: Any, base: str | None = None) -> str:
    """The kvgate namespace of an in-process LMCache CacheEngineKey: what is fixed per engine worker.

    ``lmcache|<model>|w<world_size>r<worker_id>|<dtype>`` (``base`` replaces
    ``lmcache|<model>``): a worker keeps one namespace whatever its requests
    (request tags go into the key, see ``engine_key_bytes``).  Deterministic
    across processes.
    """
    dtype = str(key.dtype).removeprefix("torch.")
    return _checked(f"{_head(key.model_name, base)}|w{int(key.world_size)}r{int(key.worker_id)}|{dtype}")


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


def engine_key_bytes(key: Any) -> bytes:
    """The kvgate key of a CacheEngineKey: its chunk hash, ``@l<layer>`` for a LayerCacheEngineKey, and
    ``@t<16-byte digest of the tags>`` when the request carried ``lmcache.tag.*`` configs (part of the key's
    identity in LMCache: other tags, another object; digested, so tag values never reach the gateway)."""
    raw = key_bytes(key)
    layer = getattr(key, "layer_id", None)
    if layer is not None:
        raw += b"@l%d" % int(layer)
    tags = getattr(key, "tags", None)
    if tags:
        raw += b"@t" + _digest(b"kvgate-tags", "\x00".join(f"{k}={v}" for k, v in tags))[:16]
    return raw


def split_by_namespace(keys: list[Any], base: str | None = None) -> dict[str, list[int]]:
    """Indices of ``keys`` grouped by namespace (insertion order)."""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(namespace_for(k, base), []).append(i)
    return groups


__all__ = ["AdapterSettings", "CONNECTOR_KEYS", "ConfigError", "PARAM_KEYS", "connector_plugin_name",
           "engine_key_bytes", "engine_key_namespace", "key_bytes", "namespace_for", "parse_connector_config",
           "parse_params", "parse_retention", "split_by_namespace"]


def plugin_logger() -> logging.Logger:
    """The plugins' logger.  LMCache configures only its own loggers, so without a handler of ours
    (or a root handler set by the host) kvgate's outage and reconnect lines would go nowhere."""
    log = logging.getLogger("kvgate.lmcache")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
