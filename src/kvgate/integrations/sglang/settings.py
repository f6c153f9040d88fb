"""Configuration, namespace and key handling of the SGLang HiCache backend.

Nothing here imports SGLang, so it can be used (and tested) without it.  The
``kvgate.*`` keys mean what they mean for the vLLM tier and go through the
same parser (``TierSettings.build``); what SGLang cannot support is refused
here, at construction, with the key named.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kvgate.integrations.settings import ConfigError, TierSettings, keys_without

__all__ = [
    "BACKEND_CLASS",
    "BACKEND_MODULE",
    "EXTRA_CONFIG_KEYS",
    "ConfigError",
    "NamespaceInputs",
    "derive_namespace",
    "page_key",
    "pool_page_key",
    "pool_tag",
    "settings_from_extra",
]

BACKEND_MODULE = "kvgate.integrations.sglang"
BACKEND_CLASS = "KvgateHiCacheStorage"


#: Keys of the vLLM tier that SGLang cannot honour, and why (the error tells the user).
UNSUPPORTED_KEYS: dict[str, str] = {
    "kvgate.refuse_unsalted": (
        "SGLang folds a request's cache_salt into its page hashes and tells a storage backend nothing "
        "else about the request, so the backend cannot know whether a request is salted. Salted "
        "requests already get keys of their own; remove the key"),
    "kvgate.skip_unsalted": (
        "SGLang folds a request's cache_salt into its page hashes and tells a storage backend nothing "
        "else about the request, so the backend cannot know whether a request is salted. Salted "
        "requests already get keys of their own; remove the key"),
}

#: ``--hicache-storage-backend-extra-config`` key -> ``TierSettings.build`` keyword.
EXTRA_CONFIG_KEYS: dict[str, str] = keys_without(*UNSUPPORTED_KEYS)

#: Common misspellings, answered with the right key.
_HINTS: dict[str, str] = {
    "kvgate.io_timeout_ms": "kvgate.io_timeout (seconds, e.g. 0.5)",
    "kvgate.lookup_timeout_ms": "kvgate.lookup_timeout (seconds)",
    "kvgate.connect_timeout_ms": "kvgate.connect_timeout (seconds)",
}

# Keys of the extra config that SGLang itself reads (the factory's, and interface_v1); SGLang strips
# its prefetch and prefix-key switches before a backend sees the config, so they are not listed.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

_MAX_READABLE_MODEL = 96


def settings_from_extra(extra: Mapping[str, Any] | None) -> TierSettings:
    """Validated settings from SGLang's ``storage_config.extra_config``.

    Raises ``ConfigError`` naming the key and the fix: an unknown ``kvgate.*``
    key (a typo must not silently disable a setting), a salt switch SGLang
    cannot support, a doubled target, a malformed value.
    """
    extra = dict(extra or {})
    for key, why in UNSUPPORTED_KEYS.items():
        if key in extra:
            raise ConfigError(f"{key}: not supported with SGLang: {why}")
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("kvgate.") and k not in EXTRA_CONFIG_KEYS)
    if unknown:
        hints = "; ".join(f"{k}: did you mean {_HINTS[k]}?" for k in unknown if k in _HINTS)
        raise ConfigError(f"unknown hicache_storage_backend_extra_config key(s) {unknown}"
                          f"{'; ' + hints if hints else ''}; known: {sorted(EXTRA_CONFIG_KEYS)}")
    kwargs = {arg: extra[key] for key, arg in EXTRA_CONFIG_KEYS.items() if key in extra}
    return TierSettings.build(**kwargs)  # neither kvgate.socket nor kvgate.address: the default socket


@dataclass(frozen=True)
class NamespaceInputs:
    """What makes one SGLang engine's pages interchangeable with another's.

    Replicas of one model with the same parallel layout share every field, so
    they share the namespace and each other's pages.  MLA models (SGLang's
    ``is_mla_model``, i.e. rank-replicated KV) keep the same bytes on every
    TP rank: the TP part is dropped so all ranks share one namespace.
    """

    model: str
    tp_rank: int | None  # None: rank-replicated (MLA) KV
    tp_size: int | None
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    dcp_rank: int
    dcp_size: int
    should_split_heads: bool
    page_size: int  # tokens per page
    layout: str
    dtype: str
    page_bytes: int  # bytes of one page, all of its fragments (catches head count/dim/layer differences)
    fragments: int  # fragments per page (2 x layers for layer_first MHA)

    @classmethod
    def build(cls, config: Any, *, page_size: int, layout: str, dtype: str, page_bytes: int,
              fragments: int) -> "NamespaceInputs":
        """From a ``HiCacheStorageConfig`` (read by attribute name, with defaults for fields an
        older or newer SGLang lacks) and the registered host pool's geometry."""
        mla = bool(getattr(config, "is_mla_model", False))
        return cls(
            model=str(getattr(config, "model_name", None) or "unknown-model"),
            tp_rank=None if mla else int(getattr(config, "tp_rank", 0)),
            tp_size=None if mla else int(getattr(config, "tp_size", 1)),
            pp_rank=int(getattr(config, "pp_rank", 0)),
            pp_size=int(getattr(config, "pp_size", 1)),
            attn_cp_rank=int(getattr(config, "attn_cp_rank", 0) or 0),
            attn_cp_size=int(getattr(config, "attn_cp_size", 1) or 1),
            dcp_rank=int(getattr(config, "dcp_rank", 0) or 0),
            dcp_size=int(getattr(config, "dcp_size", 1) or 1),
            should_split_heads=bool(getattr(config, "should_split_heads", False)),
            page_size=int(page_size),
            layout=str(layout),
            dtype=str(dtype).removeprefix("torch."),
            page_bytes=int(page_bytes),
            fragments=int(fragments),
        )


def derive_namespace(inputs: NamespaceInputs) -> tuple[str, str]:
    """(namespace, canonical description).

    The namespace is a readable head (model tail, TP part, page size, dtype)
    and a digest of every input, well under the gateway's 255 bytes.
    """
    desc = json.dumps(inputs.__dict__, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(desc.encode()).hexdigest()[:24]
    model = inputs.model.rstrip("/")
    readable = model if len(model) <= _MAX_READABLE_MODEL else "..." + model[-(_MAX_READABLE_MODEL - 3):]
    tp = "mla" if inputs.tp_rank is None else f"tp{inputs.tp_rank}of{inputs.tp_size}"
    return f"sglang|{readable}|{tp}|p{inputs.page_size}|{inputs.dtype}|{digest}", desc


def page_key(key: str) -> bytes:
    """kvgate key of an SGLang page hash.

    SGLang's page hashes are 64 hex digits (SHA-256): stored as their 32
    bytes.  Anything else (a future key scheme) is stored as UTF-8 behind a
    ``s`` byte, padded so that it is never 32 bytes long: the two forms
    cannot collide.
    """
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    raw = b"s" + key.encode()
    return raw + b"\x00" if len(raw) == 32 else raw


def page_keys(keys: Sequence[str]) -> list[bytes]:
    return [page_key(k) for k in keys]


def pool_tag(name: str, geometry: Mapping[str, Any]) -> bytes:
    """The key prefix of one extra host pool's pages (a hybrid model's Mamba, SWA, indexer... pool).

    ``0x00 name 0x00`` and 8 bytes of a digest of the pool's geometry (class, page size, layout,
    dtype, bytes per fragment): the namespace names the model and its KV pool, and this keeps
    two deployments whose extra pools differ (another state dtype, window, layer split) apart.
    """
    desc = json.dumps({"pool": name, **geometry}, sort_keys=True, separators=(",", ":"), default=str)
    return b"\x00" + name.encode() + b"\x00" + hashlib.sha256(desc.encode()).digest()[:8]


def pool_page_key(tag: bytes, key: bytes) -> bytes:
    """kvgate key of one extra pool's part of the page whose ``page_key`` is ``key``.

    It starts with a zero byte, which no ``page_key`` does in its string form, and is never 32
    bytes long (the raw form): an extra pool's object never shadows a KV page.
    """
    k = tag + key
    return k + b"\x00" if len(k) == 32 else k
