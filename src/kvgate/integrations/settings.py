"""The ``kvgate.*`` settings every engine integration shares, and their checks.

vLLM (``kv_connector_extra_config``), SGLang (the HiCache extra config) and
LMCache (the L2 adapter's params) take the same keys where they mean the
same thing: where the gateway is, the namespace, dialog marks, salting,
retention and timeouts.  Each integration maps its own config onto
``TierSettings.build``; this module imports no engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from kvgate.config import default_socket_path, read_token
from kvgate.errors import ConfigError
from kvgate.types import RETENTION_NAMES, Retention


#: Every shared ``kvgate.*`` key -> its ``TierSettings.build`` keyword.  An integration takes the
#: ones its engine can honour (``keys_without``) and says why for the others.
SETTING_KEYS: dict[str, str] = {
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


def keys_without(*dropped: str) -> dict[str, str]:
    """``SETTING_KEYS`` less the keys an engine cannot honour."""
    unknown = set(dropped) - set(SETTING_KEYS)
    if unknown:
        raise KeyError(f"not shared kvgate keys: {sorted(unknown)}")
    return {k: v for k, v in SETTING_KEYS.items() if k not in dropped}



def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def parse_retention(name: str, value: Any) -> str:
    """A retention name (any case) as the clients take it (``kvgate.types.Retention``)."""
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected one of {', '.join(RETENTION_NAMES)}, got {value!r}")
    try:
        return Retention.parse(value, name).wire
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
        if socket and address:
            raise ConfigError("kvgate tier: kvgate.socket and kvgate.address are both set: set exactly one of "
                              "kvgate.socket (a Unix socket path) or kvgate.address (host:port), or neither for "
                              "the gateway's default socket")
        if not socket and not address:
            # The gateway's own default (kvgate.config.default_socket_path): a bare `kvgate serve`
            # run with the same XDG_RUNTIME_DIR listens there.
            socket = default_socket_path()
        if socket is not None and not isinstance(socket, str):
            raise ConfigError(f"kvgate.socket: expected a path, got {socket!r}")
        if address is not None:
            if not isinstance(address, str) or ":" not in address:
                raise ConfigError(f"kvgate.address: expected host:port, got {address!r}")
        token = None
        if token_file:
            try:
                token = read_token(token_file, "kvgate.token_file")
            except ValueError as e:  # kvgate.config's ConfigError: the same words, in this module's error
                raise ConfigError(str(e)) from None
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


def dialog_mark(first_keys: Sequence[bytes]) -> bytes | None:
    """The dialog mark of a request: a digest of its first ``affinity_chunks`` chunk keys."""
    if not first_keys:
        return None
    h = hashlib.sha256(b"kvgate-dialog\x00")
    for k in first_keys:
        h.update(len(k).to_bytes(2, "big"))
        h.update(k)
    return h.digest()[:16]
