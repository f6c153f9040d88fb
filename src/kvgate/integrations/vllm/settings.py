"""Configuration, namespaces, dialog marks and key-stability checks for the vLLM tier.

Nothing here imports vLLM, so it can be used (and tested) without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

RETENTIONS = ("none", "short", "long")

#: kv_transfer_params key that chooses a request's retention class.
RETENTION_PARAM = "kvgate_retention"

#: ``kv_connector_extra_config`` key -> KvgateTier keyword argument.
EXTRA_CONFIG_KEYS: dict[str, str] = {
    "kvgate.socket": "socket",
    "kvgate.address": "address",
    "kvgate.token_file": "token_file",
    "kvgate.namespace": "namespace",
    "kvgate.affinity_chunks": "affinity_chunks",
    "kvgate.refuse_unsalted": "refuse_unsalted",
    "kvgate.skip_unsalted": "skip_unsalted",
    "kvgate.retention": "retention",
    "kvgate.connect_timeout": "connect_timeout",
    "kvgate.io_timeout": "io_timeout",
    "kvgate.lookup_timeout": "lookup_timeout",
}

TIER_TYPE = "KvgateTier"
TIER_MODULE = "kvgate.integrations.vllm"

_MAX_READABLE_MODEL = 96


class ConfigError(ValueError):
    """A kvgate setting in the vLLM config is missing or wrong (the message names the key)."""


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def parse_retention(name: str, value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in RETENTIONS:
        raise ConfigError(f"{name}: expected one of {', '.join(RETENTIONS)}, got {value!r}")
    return value.strip().lower()


@dataclass(frozen=True)
class TierSettings:
    """Validated settings of one kvgate tier."""

    target: str  # a socket path or host:port, as Client.connect takes it
    token: str | None = None
    namespace: str | None = None  # None: derived from the model config
    affinity_chunks: int | None = None  # None: the gateway's mark, past any shared head
    refuse_unsalted: bool = False
    skip_unsalted: bool = False
    retention: str = "long"
    connect_timeout: float = 2.0
    io_timeout: float = 10.0  # a store or load call
    lookup_timeout: float = 2.0  # a lookup call: past it the request goes on as a miss

    @property
    def salted_only(self) -> bool:
        """Only salted requests reach the gateway (either switch is on)."""
        return self.refuse_unsalted or self.skip_unsalted

    @classmethod
    def build(cls, *, socket: str | None = None, address: str | None = None, token_file: str | None = None,
              namespace: str | None = None, affinity_chunks: Any = None, refuse_unsalted: Any = False,
              skip_unsalted: Any = False, retention: Any = "long", connect_timeout: Any = 2.0,
              io_timeout: Any = 10.0, lookup_timeout: Any = 2.0) -> "TierSettings":
        if bool(socket) == bool(address):
            raise ConfigError("kvgate tier: set exactly one of kvgate.socket (a Unix socket path) "
                              "or kvgate.address (host:port)")
        if socket is not None and not isinstance(socket, str):
            raise ConfigError(f"kvgate.socket: expected a path, got {socket!r}")
        if address is not None:
            if not isinstance(address, str) or ":" not in address:
                raise ConfigError(f"kvgate.address: expected host:port, got {address!r}")
        token = None
        if token_file:
            try:
                with open(token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ConfigError(f"kvgate.token_file: cannot read {token_file!r}: {e}") from e
            if not token:
                raise ConfigError(f"kvgate.token_file: {token_file!r} is empty")
        if namespace is not None:
            if not isinstance(namespace, str) or not namespace or len(namespace.encode()) > 255:
                raise ConfigError(f"kvgate.namespace: expected a non-empty string of at most 255 bytes, "
                                  f"got {namespace!r}")
        affinity: int | None = None
        if affinity_chunks is not None and affinity_chunks != "auto":
            expected = f"kvgate.affinity_chunks: expected an integer >= 1 (or \"auto\"), got {affinity_chunks!r}"
            try:
                affinity = int(affinity_chunks)
            except (TypeError, ValueError):
                raise ConfigError(expected) from None
            if affinity < 1 or isinstance(affinity_chunks, bool):
                raise ConfigError(expected)
        timeouts = []
        for name, value in (("kvgate.connect_timeout", connect_timeout), ("kvgate.io_timeout", io_timeout),
                            ("kvgate.lookup_timeout", lookup_timeout)):
            try:
                t = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name}: expected seconds, got {value!r}") from None
            if t <= 0:
                raise ConfigError(f"{name}: expected seconds > 0, got {value!r}")
            timeouts.append(t)
        return cls(
            target=socket or address,  # type: ignore[arg-type]
            token=token,
            namespace=namespace,
            affinity_chunks=affinity,
            refuse_unsalted=parse_bool("kvgate.refuse_unsalted", refuse_unsalted),
            skip_unsalted=parse_bool("kvgate.skip_unsalted", skip_unsalted),
            retention=parse_retention("kvgate.retention", retention),
            connect_timeout=timeouts[0],
            io_timeout=timeouts[1],
            lookup_timeout=timeouts[2],
        )


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


def dialog_mark(first_keys: Sequence[bytes]) -> bytes | None:
    """The dialog mark of a request: a digest of its first ``affinity_chunks`` chunk keys."""
    if not first_keys:
        return None
    h = hashlib.sha256(b"kvgate-dialog\x00")
    for k in first_keys:
        h.update(len(k).to_bytes(2, "big"))
        h.update(k)
    return h.digest()[:16]


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


@dataclass
class NamespaceInputs:
    """What makes KV bytes interchangeable between two engines."""

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
