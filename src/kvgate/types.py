"""The words every layer shares: full keys, retention, what a get answers in place of a size, HOST:PORT.

Each is defined here once.  The wire (``kvgate.protocol``) carries retention
by its name and the size codes by their values; the tiers work with the
enums; the clients and the integrations take retention by name
(``"long"``, ``"short"``, ``"none"``) and check it with ``Retention.parse``.
Imports nothing of kvgate: every layer may import it.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final, TypeAlias

FullKey: TypeAlias = bytes
"""A namespaced key as the gateway stores it (``kvgate.keys.full_key``: a length byte, the namespace, the key)."""


class Retention(IntEnum):
    """How a put keeps an object.  The stored classes are evicted lowest first: every ``SHORT`` object
    before any ``LONG`` one.

    ``LONG``: in the RAM tier and on its card, acknowledged once on the card.
    ``SHORT``: in the RAM tier only.  ``NONE``: not stored at all.
    """

    NONE = -1
    SHORT = 0
    LONG = 1

    @classmethod
    def parse(cls, value: str | int, what: str = "retention") -> Retention:
        """A name (any case: ``"long"``, ``"short"``, ``"none"``) or a value -> ``Retention``.

        Raises ValueError naming ``what`` and the choices.
        """
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{what} must be one of {', '.join(map(repr, RETENTION_NAMES))}, not {value!r}")

    @property
    def wire(self) -> str:
        """The name the wire and the client API use."""
        return self.name.lower()


RETENTION_NAMES: Final = ("long", "short", "none")
STORED_CLASSES: Final = (Retention.SHORT, Retention.LONG)  # the classes a tier's eviction orders, by value


class SizeCode(IntEnum):
    """What a get answers in place of an object's size (sizes are >= 0, these < 0)."""

    MISS = -1
    NOT_DONE = -2  # did not fit in this reply or region: ask again
    TOO_SMALL = -3  # the destination is smaller than the object; the size needed comes beside it


# The longest ``source`` a lookup, exists or get may name (``"HOST:PORT"`` or ``"HOST"``: the peer a request's
# KV was computed beside, kvgate.protocol): what a client refuses to send and what the store reads of one.
MAX_SOURCE_CHARS: Final = 300


def split_host_port(address: str, default_host: str | None = None, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 address as ``[ADDR]:PORT``) as (host without brackets, port).

    ``default_host``: the host of a bare ``:PORT``; ``any_port``: port 0 (the system picks one) is allowed.
    Raises ValueError saying what is wrong; each caller names the setting or argument it came from.
    Nothing is resolved.
    """
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep:
        raise ValueError("no ':PORT'")
    if not host:
        if default_host is None:
            raise ValueError("no host before ':'")
        host = default_host
    if not port.isdigit() or not (0 if any_port else 1) <= int(port) <= 65535:
        raise ValueError(f"port {port!r} is not a number from {0 if any_port else 1} to 65535")
    return host, int(port)
