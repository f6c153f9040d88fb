"""The public API: what ``kvgate`` and ``kvgate.client`` export, pinned.  A name added, removed or moved
fails here first, so a change to what users import is a decision, not an accident."""

from __future__ import annotations

import kvgate
import kvgate.client
import kvgate.errors

KVGATE = {
    "AsyncClient", "Client", "ConfigError", "DialogMark", "GatewayError", "GatewayTimeout", "GatewayUnavailable",
    "InvalidArgument", "KvgateError", "ObjectTooLarge", "__version__",
}
CLIENT = {
    "AsyncClient", "BadKey", "Buffer", "Client", "DialogMark", "GatewayError", "GatewayTimeout",
    "GatewayUnavailable", "InvalidArgument", "KvgateError", "MARK_KEYS", "NotPermitted", "ObjectTooLarge", "Pieces",
}
# each exported error, and the builtin exceptions it also is (code written without kvgate still catches it)
ERRORS = {
    "KvgateError": (Exception,),
    "ConfigError": (ValueError,),
    "InvalidArgument": (ValueError, TypeError),
    "BadKey": (ValueError, TypeError),
    "ObjectTooLarge": (ValueError,),
    "GatewayError": (RuntimeError,),
    "GatewayUnavailable": (ConnectionError,),
    "GatewayTimeout": (TimeoutError,),
    "NotPermitted": (PermissionError,),
}


def test_kvgate_exports_exactly_its_public_names() -> None:
    assert set(kvgate.__all__) == KVGATE
    for name in kvgate.__all__:
        assert hasattr(kvgate, name), name


def test_kvgate_client_exports_exactly_its_public_names() -> None:
    assert set(kvgate.client.__all__) == CLIENT
    for name in kvgate.client.__all__:
        assert hasattr(kvgate.client, name), name
    # one object under every name it is exported by
    for name in KVGATE & CLIENT:
        assert getattr(kvgate, name) is getattr(kvgate.client, name), name


def test_every_exported_error_is_a_kvgate_error_and_its_builtin_kind() -> None:
    exported = {n: getattr(kvgate.client, n, None) or getattr(kvgate, n) for n in (KVGATE | CLIENT)
                if isinstance(getattr(kvgate.client, n, getattr(kvgate, n, None)), type)
                and issubclass(getattr(kvgate.client, n, getattr(kvgate, n, None)), BaseException)}
    assert set(exported) == set(ERRORS)
    for name, cls in exported.items():
        assert cls is getattr(kvgate.errors, name), name  # defined once, in kvgate.errors
        assert issubclass(cls, kvgate.errors.KvgateError), name
        for builtin in ERRORS[name]:
            assert issubclass(cls, builtin), (name, builtin)


def test_the_client_classes_keep_their_calls() -> None:
    """The operations both clients offer, by name: one set for ``Client`` and ``AsyncClient``."""
    ops = {"connect", "close", "abort", "set_timeout", "register_region", "put_many", "get_many", "lookup",
           "exists_many", "delete_many", "hold_many", "release_many", "prewarm", "dialog_mark", "stats", "clean",
           "cards"}
    for cls in (kvgate.Client, kvgate.AsyncClient):
        public = {n for n in dir(cls) if not n.startswith("_")}
        assert ops <= public, (cls.__name__, ops - public)
