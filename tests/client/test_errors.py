"""What both clients raise when the gateway is not there, goes away, or stops answering: kvgate's
errors (``GatewayUnavailable``, ``GatewayTimeout``), which are also the builtin exceptions code
written without kvgate catches.  Against real gateway processes and real signals."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from kvgate import AsyncClient, Client, GatewayTimeout, GatewayUnavailable, InvalidArgument, KvgateError
from kvgate.errors import BadKey
from tests.helpers import free_port

pytestmark = [pytest.mark.timeout(60)]

NS = "errors-ns"


async def _async_connect(target: str, **kw) -> None:
    client = await AsyncClient.connect(target, **kw)
    await client.close()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_gateway_at_the_target_is_gateway_unavailable_naming_it(tmp_path) -> None:
    missing = str(tmp_path / "kvgate-nobody.sock")
    port = _closed_port()
    for target, named in ((missing, missing), (f"127.0.0.1:{port}", f"127.0.0.1:{port}")):
        with pytest.raises(GatewayUnavailable) as sync_err:
            Client.connect(target, namespace=NS, timeout=5)
        with pytest.raises(GatewayUnavailable) as async_err:
            asyncio.run(_async_connect(target, namespace=NS, timeout=5))
        for err in (sync_err.value, async_err.value):
            assert isinstance(err, KvgateError) and isinstance(err, ConnectionError)
            assert named in str(err) and "kvgate serve" in str(err), err
            assert isinstance(err.__cause__, OSError)  # the socket's own error, kept as the cause
    # a socket file nobody listens on (a gateway killed with SIGKILL leaves one)
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    with pytest.raises(GatewayUnavailable, match="stale.sock"):
        Client.connect(str(stale), namespace=NS, timeout=5)


@pytest.mark.slow
def test_a_gateway_that_dies_or_stops_answering(gateway_factory) -> None:
    """SIGKILL mid-session: the next call of either client is GatewayUnavailable, and so is every
    call after it.  SIGSTOP: a call past its deadline is GatewayTimeout (a TimeoutError)."""
    port = free_port()
    gw = gateway_factory(["--port", str(port)])
    # stopped: the kernel still accepts connections, nobody answers
    with Client.connect(gw.socket, namespace=NS, engine_id="e1", timeout=10) as c:
        assert c.put_many([b"k"], [b"v" * 64]) == [True]
        gw.kill(signal.SIGSTOP)
        try:
            c.set_timeout(0.5)
            with pytest.raises(GatewayTimeout) as timed_out:
                c.lookup([b"k"])
            assert isinstance(timed_out.value, TimeoutError) and "connect again" in str(timed_out.value)

            async def async_timeout() -> None:
                async with AsyncClient.connect(f"127.0.0.1:{port}", namespace=NS, engine_id="e2", timeout=0.5):
                    pass

            with pytest.raises(GatewayTimeout):  # its hello gets no answer
                asyncio.run(async_timeout())
        finally:
            gw.kill(signal.SIGCONT)
    # killed under open sessions
    sync_client = Client.connect(gw.socket, namespace=NS, engine_id="e3", timeout=10)

    async def async_calls() -> list[BaseException]:
        async with AsyncClient.connect(f"127.0.0.1:{port}", namespace=NS, engine_id="e3", timeout=10) as a:
            assert await a.lookup([b"k"]) == 1
            gw.kill(signal.SIGKILL)
            sync_errors = []
            for _ in range(2):
                with pytest.raises(GatewayUnavailable) as e:
                    sync_client.lookup([b"k"])
                sync_errors.append(e.value)
            errors = []
            for _ in range(2):
                try:
                    await a.lookup([b"k"])
                except BaseException as e:  # noqa: BLE001  (what it is is the test)
                    errors.append(e)
            return sync_errors + errors

    try:
        errors = asyncio.run(async_calls())
    finally:
        sync_client.close()
    assert len(errors) == 4
    for err in errors:
        assert isinstance(err, GatewayUnavailable) and isinstance(err, ConnectionError), repr(err)
    assert sync_client.broken


def test_a_wrong_argument_is_invalid_argument_and_both_builtin_kinds(tmp_path) -> None:
    """Refused before anything is sent (no gateway needed): a wrong type and a wrong value are one
    kvgate error that ``except TypeError`` and ``except ValueError`` both still catch."""
    a, b = socket.socketpair()
    with a, b:
        c = Client(a, local=False)
        for call, builtin in ((lambda: c.lookup(b"one key"), TypeError), (lambda: c.lookup([b""]), ValueError),
                              (lambda: c.put_many([b"k"], [b"v"], retention="forever"), ValueError),
                              (lambda: c.put_many([b"k"], [b"v"], position=2**70), ValueError),
                              (lambda: c.lookup([b"k"], source=b"10.0.0.7:8200"), TypeError),
                              (lambda: c.get_many([b"k"], source="h" * 301), ValueError)):
            with pytest.raises(builtin) as e:
                call()
            assert isinstance(e.value, InvalidArgument), repr(e.value)
        with pytest.raises(BadKey, match="keys\\[0\\] is empty"):
            c.lookup([b""])
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # nothing was sent
