"""The RESP command packer a Redis card's connections use: big arguments go to the socket as they are.

A write's value is header + payload; the only pass over the payload before
the kernel should be its hash.  redis-py's packer, with hiredis installed,
turns a memoryview into bytes and then copies it again into one packed
command, so this packer replaces it where redis-py takes one
(``ZERO_COPY``), and ``ArgumentParts`` lets the header and the caller's
payload buffer travel as separate buffers of one argument.
"""

from __future__ import annotations

import inspect
from typing import Any

import redis

# Command arguments longer than this are sent as their own buffers (never
# joined into a bigger bytes object); redis-py uses the same cutoff.
BUFFER_CUTOFF = 6000


class ArgumentParts:
    """One bulk-string argument sent as several buffers, never joined.

    The value of a SET is header + payload; joining them would copy the
    whole payload once more (and redis-py's hiredis packer copies it twice).
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, *parts: bytes | memoryview):
        self.parts = parts
        self.nbytes = sum(len(p) for p in parts)


class ZeroCopyPacker:
    """RESP command packer that sends big arguments as they are.

    The same idea as redis-py's ``PythonRespSerializer`` (large arguments go
    to the socket as separate buffers), plus ``ArgumentParts``.  redis-py's
    default packer when hiredis is installed turns memoryviews into bytes
    and then copies them again into one packed command.  Stateless, so one
    instance serves every connection of the pool.
    """

    def __init__(self) -> None:
        self._encode = redis.connection.Encoder("utf-8", "strict", False).encode

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if isinstance(args[0], str):
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        out: list[bytes | memoryview] = []
        buf = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, ArgumentParts):
                buf += b"$%d\r\n" % arg.nbytes
                for part in arg.parts:
                    if len(part) > BUFFER_CUTOFF:
                        out.append(buf)
                        out.append(part)
                        buf = b""
                    else:
                        buf += part
                buf += b"\r\n"
                continue
            arg = self._encode(arg)
            n = len(arg)
            if n > BUFFER_CUTOFF:
                out.append(buf + b"$%d\r\n" % n)
                out.append(arg)
                buf = b"\r\n"
            else:
                buf += b"$%d\r\n" % n + bytes(arg) + b"\r\n"
        out.append(buf)
        return out


def packer_supported() -> bool:
    """Whether this redis-py's connections take a ``command_packer``."""
    cls = getattr(redis.connection, "AbstractConnection", None)
    if cls is None:
        return False
    try:
        return "command_packer" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


ZERO_COPY = packer_supported()
