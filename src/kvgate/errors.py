"""Every exception kvgate raises derives from ``KvgateError``; the ones a client's user meets are here.

Each also derives from the builtin exception that code written without kvgate in mind would catch
(a refused connection is a ``ConnectionError``, a wrong argument a ``ValueError``), so adopting
``except KvgateError`` changes nothing for code that already catches those.  The tree a user of
``kvgate.client`` and of the engine integrations meets::

    KvgateError
    ├── ConfigError            (ValueError)       a setting is wrong; the message names its key
    ├── InvalidArgument        (ValueError, TypeError)  a call's argument, refused before anything is sent
    │   └── BadKey                                 a key or namespace the gateway would refuse
    ├── ObjectTooLarge         (ValueError)       a get's destination buffer is smaller than the object
    ├── GatewayError           (RuntimeError)     the gateway refused a request; ``code`` says why
    ├── GatewayUnavailable     (ConnectionError)  no session: the gateway is not there, closed the
    │                                              connection, or this client broke earlier; connect again
    ├── GatewayTimeout         (TimeoutError)     a call ran past its deadline (the client is broken
    │                                              if anything had been sent)
    └── NotPermitted           (PermissionError)  a socket or region of another user; says who owns what

Errors of other layers (cards, the gateway's start, cluster mode, benchmarks) derive from
``KvgateError`` where they are defined, beside the part that raises them; tests/test_errors.py walks
the source and checks that every exception class does.  This module is the bottom layer: it
imports nothing of kvgate.
"""

from __future__ import annotations


class KvgateError(Exception):
    """The root of every exception kvgate raises."""


class ConfigError(KvgateError, ValueError):
    """A config value or key is wrong (the gateway's config, or an engine's kvgate settings); the
    message names the key."""


class InvalidArgument(KvgateError, ValueError, TypeError):
    """An argument of a client call is wrong: its message names the argument and what to pass.

    Raised before anything is sent, so the client stays usable.  It is both a ``ValueError`` and a
    ``TypeError``: a wrong value and a wrong type are one kind of mistake to a caller."""


class BadKey(InvalidArgument):
    """A key or namespace the gateway refuses (too long, empty, wrong type)."""


class ObjectTooLarge(KvgateError, ValueError):
    """A destination buffer given to ``get_many(into=...)`` is smaller than the object."""

    def __init__(self, index: int, needed: int):
        super().__init__(f"object {index} is {needed} bytes, larger than its destination buffer")
        self.index = index
        self.needed = needed


class GatewayError(KvgateError, RuntimeError):
    """The gateway refused a request; ``code`` is one of ``kvgate.protocol.ErrorCode``
    (``NOT_AUTHORIZED``, ``ENGINE_BUSY``, ``TOO_LARGE``, ...) and ``message`` says why."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class GatewayUnavailable(KvgateError, ConnectionError):
    """No session with the gateway: nothing listens where the client looked, the gateway closed the
    connection (it stopped, or ended the session), the stream is out of step, or this client broke
    in an earlier call.  Connect again (the engine integrations do, after a back-off)."""


class GatewayTimeout(KvgateError, TimeoutError):
    """A call or a connect ran past its deadline.  If the call had sent anything the client is
    broken (the late reply would be misread as the next one's): connect again."""


class NotPermitted(KvgateError, PermissionError):
    """The gateway's socket or a shared-memory region belongs to another user; the message says who
    owns what, who this process is, and how to fix it."""
