"""Configuration, namespaces, dialog marks and key-stability checks for the vLLM tier.

Nothing here imports vLLM, so it can be used (and tested) without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvgate.integrations.settings import (  # noqa: F401 - the vLLM tier's names for the shared settings
    SETTING_KEYS,
    ConfigError,
    TierSettings,
    dialog_mark,
    parse_bool,
    parse_retention,
)

#: kv_transfer_params key that chooses a request's retention class.
RETENTION_PARAM = "kvgate_retention"
#: kv_transfer_params key naming where a request's KV was computed (llm-d's router, ``kvgate router``):
#: ``{"kv_request_id": ..., "remote_host": HOST, "remote_port": PORT}``.
SOURCE_PARAM = "remote_kv_source"

#: ``kv_connector_extra_config`` key -> KvgateTier keyword argument: every shared key.
EXTRA_CONFIG_KEYS: dict[str, str] = dict(SETTING_KEYS)

TIER_TYPE = "KvgateTier"
TIER_MODULE = "kvgate.integrations.vllm"

_MAX_READABLE_MODEL = 96


def tier_config_from_extra(extra: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``secondary_tiers`` entry that the ``kvgate.*`` keys of ``extra`` describe, or None.

    Unknown ``kvgate.*`` keys are errors (a typo must not silently disable a setting).
    """
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("kvgate.") and k not in EXTRA_CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(EXTRA_CONFIG_KEYS)}")
    cfg = {arg: extra[key] for key, arg in EXTRA_CONFIG_KEYS.items() if key in extra}
    if not cfg:
        return None
    return {"type": TIER_TYPE, "module_path": TIER_MODULE, **cfg}


def request_retention(params: Mapping[str, Any] | None, default: str) -> tuple[str, str | None]:
    """(retention, warning) from a request's kv_transfer_params."""
    if not params:
        return default, None
    raw = params.get(RETENTION_PARAM)
    if raw is None:
        return default, None
    try:
        return parse_retention(RETENTION_PARAM, raw), None
    except ConfigError as e:
        return default, f"{e}; using {default!r}"


def request_source(params: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(source, warning) from a request's kv_transfer_params: its ``remote_kv_source`` as ``HOST:PORT``
    (``[V6]:PORT``; ``HOST`` without a port), which the gateway takes to choose the peers it asks
    (``Client.exists_many(source=...)``, docs/peers.md).  None: no source, or one that is not a host (the
    warning says why; the request is looked up as any other)."""
    if not params:
        return None, None
    raw = params.get(SOURCE_PARAM)
    if raw is None:
        return None, None
    host = raw.get("remote_host") if isinstance(raw, Mapping) else None
    port = raw.get("remote_port") if isinstance(raw, Mapping) else None
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)
    if (not isinstance(host, str) or not host.strip() or len(host) > 255
            or not (port is None or (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536))):
        return None, (f"kv_transfer_params.{SOURCE_PARAM} is not {{remote_host, remote_port}} of a host "
                      f"({str(raw)[:80]!r}): every peer of the gateway is asked")
    host = host.strip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return (host if port is None else f"{host}:{port}"), None


def chunk_runs(positions: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split item indices into runs of consecutive positions: [(start, end, first_position)].

    A position < 0 (unknown) makes a run of its own with position -1.
    """
    runs: list[tuple[int, int, int]] = []
    i = 0
    n = len(positions)
    while i < n:
        j = i + 1
        if positions[i] >= 0:
            while j < n and positions[j] == positions[j - 1] + 1:
                j += 1
            runs.append((i, j, positions[i]))
        else:
            while j < n and positions[j] < 0:
                j += 1
            runs.append((i, j, -1))
        i = j
    return runs


#: Files of a model directory whose content is the model's weights (vLLM loads these formats).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Bytes read from each weight file for its identity: _SAMPLES reads of _SAMPLE_BYTES, spread evenly
#: (the first is the header).  Two fine-tunes of one base have the same config, names and sizes, and
#: differ in nearly every weight, so a few pages of each file tell them apart; reading a whole 16 GB
#: checkpoint at every engine start would not do.
_SAMPLES = 8
_SAMPLE_BYTES = 4096


def model_identity(model: str) -> tuple[str, str | None]:
    """(readable name, content digest) of the model an engine was started with.

    A local directory (or file) is identified by what it holds, never by where it is mounted, so
    replicas that mount one model at different paths share a namespace: the digest covers
    config.json's bytes, and for each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
    ``*.gguf``) and weight index (``*.index.json``) its name, its size and sampled pages of it
    (symlinks, as in the Hugging Face cache, are followed).  Its readable name is the
    architecture in config.json (the path is not shown: it differs between replicas).  Anything
    else (a hub id such as ``meta-llama/Llama-3.1-8B``) is its own readable name, with no digest;
    its revision is a namespace input of its own.  Called once at engine start, by the scheduler.
    """
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        return model.rstrip("/"), None
    h = hashlib.sha256(b"kvgate-model-identity-v1\x00")
    readable = "model"
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        files = [e for e in entries if e == "config.json" or e.endswith(_WEIGHT_SUFFIXES) or e.endswith(".index.json")]
        try:
            with open(os.path.join(path, "config.json"), "rb") as f:
                config = json.load(f)
            name = (config.get("architectures") or [None])[0] or config.get("model_type")
            if isinstance(name, str) and name:
                readable = name[:_MAX_READABLE_MODEL]
        except (OSError, ValueError, AttributeError, TypeError, IndexError):
            pass  # no readable name: the digest still covers config.json's bytes
    else:
        files = [os.path.basename(path)]
        path = os.path.dirname(path) or "."
    for name in files:
        full = os.path.join(path, name)
        try:
            with open(full, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\x00{size}\x00".encode())
                if name == "config.json" or name.endswith(".index.json"):
                    h.update(f.read())
                    continue
                step = max(size - _SAMPLE_BYTES, 0) // max(_SAMPLES - 1, 1)
                for i in range(_SAMPLES if size > _SAMPLE_BYTES else 1):
                    h.update(os.pread(f.fileno(), _SAMPLE_BYTES, i * step))
        except OSError as e:
            h.update(f"{name}\x00unreadable {e.errno}\x00".encode())
    return readable, h.hexdigest()[:32]


@dataclass
class NamespaceInputs:
    """What makes KV bytes interchangeable between two engines.

    ``model``: the readable name of ``model_identity``; ``model_content``: its digest of a local
    model's files (None for a hub id, which ``revision`` pins).
    """

    model: str
    revision: str | None
    dtype: str
    platform: str
    kv_cache_layout: str | None
    canonical_layout: bool
    replicated_layout: bool
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    chunk_bytes: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    world_size: int
    groups: list[dict[str, Any]] = field(default_factory=list)
    model_content: str | None = None

    def describe(self) -> dict[str, Any]:
        return dict(self.__dict__)


def derive_namespace(inputs: NamespaceInputs) -> tuple[str, str]:
    """(namespace, canonical description).  The namespace is short (well under 255 bytes):
    a readable model tail plus a digest of every input."""
    desc = json.dumps(inputs.describe(), sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(desc.encode()).hexdigest()[:24]
    model = inputs.model.rstrip("/")
    readable = model if len(model) <= _MAX_READABLE_MODEL else "..." + model[-(_MAX_READABLE_MODEL - 3):]
    return f"vllm|{readable}|{digest}", desc


@dataclass(frozen=True)
class KeyStability:
    algo: str | None
    pythonhashseed: str | None
    stable: bool
    message: str


def key_stability(algo: str | None, env: Mapping[str, str] | None = None) -> KeyStability:
    """Whether vLLM's block hashes (and so kvgate keys) are the same in every process.

    vLLM 0.32 seeds the chain with PYTHONHASHSEED when it is set, else with a fixed
    string for sha256 algorithms and with random bytes for xxhash algorithms.
    """
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    name = algo or "unknown"
    if seed is not None:
        return KeyStability(algo, seed, True,
                            f"prefix_caching_hash_algo={name}, PYTHONHASHSEED={seed!r}: keys are stable across "
                            f"processes that set the same PYTHONHASHSEED (a different value, or unset, "
                            f"gives different keys and no hits)")
    if algo is not None and algo.startswith("xxhash"):
        return KeyStability(algo, None, False,
                            f"prefix_caching_hash_algo={name} with PYTHONHASHSEED unset: vLLM seeds block hashes "
                            f"with random bytes in every process, so nothing stored in kvgate can be found after a "
                            f"restart or by another replica. Set PYTHONHASHSEED to one shared value on every "
                            f"engine, or use prefix_caching_hash_algo=sha256")
    if algo is None:
        return KeyStability(algo, None, True,
                            "prefix_caching_hash_algo unknown, PYTHONHASHSEED unset: keys are stable only if the "
                            "algorithm is sha256/sha256_cbor (vLLM's default)")
    return KeyStability(algo, None, True,
                        f"prefix_caching_hash_algo={name}, PYTHONHASHSEED unset: keys are stable across processes "
                        f"(vLLM's fixed seed); engines that set PYTHONHASHSEED get other keys")


def first_chunk_keys(positions: Iterable[tuple[bytes, int]], count: int) -> list[bytes]:
    """The ``count`` keys of lowest position among (key, end_token) pairs of one group."""
    return [k for k, _ in sorted(positions, key=lambda kv: kv[1])[:count]]
