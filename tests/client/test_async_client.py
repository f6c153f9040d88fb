"""AsyncClient against the other end of a socket pair: argument checks, timeouts, cancellation.

The peer answers like a gateway when the test says so (``answer`` from
test_client, in a thread), so a test decides exactly when a reply
arrives: before, during or after a cancellation or a deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time

import pytest

from kvgate import AsyncClient
from kvgate.client import async_client as ac
from kvgate import protocol as p
from tests.client.test_sync_client import KEYS, REFUSED, answer, pair, sent  # noqa: F401  (pair: a fixture)
from tests.helpers import wait_until_async


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def answered(peer: socket.socket, reply, awaitable):
    """Await ``awaitable`` while the peer answers its request with ``reply``."""
    t = threading.Thread(target=answer, args=(peer, reply))
    t.start()
    try:
        return await awaitable
    finally:
        t.join(10)


async def request_arrived(peer: socket.socket, timeout: float = 10.0) -> None:
    """Until the client's request is waiting at the peer (not read)."""
    def waiting() -> bool:
        try:
            return bool(peer.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False

    await wait_until_async(waiting, timeout, "a request at the peer", interval=0.005)


def peer_closed(peer: socket.socket) -> bool:
    """Whether the client shut the connection down (after what it sent is drained)."""
    peer.setblocking(True)
    peer.settimeout(5)
    try:
        while True:
            if not peer.recv(1 << 16):
                return True
    except (TimeoutError, ConnectionError):
        return False
    finally:
        peer.setblocking(False)


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("call,exc,words", REFUSED)
def test_a_wrong_argument_is_named_and_nothing_is_sent(pair, local, call, exc, words) -> None:  # noqa: F811
    """The same refusals, with the same words, as Client: the checks are the same code."""
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=local)
        with pytest.raises(exc) as ei:
            res = call(c)
            assert inspect.isawaitable(res)
            await res
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
        assert sent(b) == b""
        assert not c.broken
        assert await answered(b, p.CountReply(count=2), c.lookup(KEYS)) == 2  # and the connection goes on

    run(main())


def test_a_call_past_its_deadline_raises_timeouterror_and_breaks_the_client(pair) -> None:  # noqa: F811
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await c.lookup(KEYS, timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2
        assert c.broken
        with pytest.raises(ConnectionError, match="connect again"):
            await c.lookup(KEYS)
        assert peer_closed(b)  # the request went out, then the connection was shut down

    run(main())


def test_the_clients_timeout_applies_when_a_call_gives_none(pair) -> None:  # noqa: F811
    a, _b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=5)
        c.set_timeout(0.1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await c.stats()
        assert time.monotonic() - t0 < 2

    run(main())


def test_a_deadline_met_while_waiting_for_the_client_leaves_it_usable(pair) -> None:  # noqa: F811
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        first = asyncio.ensure_future(c.lookup(KEYS))
        await request_arrived(b)
        with pytest.raises(TimeoutError):
            await c.exists_many(KEYS, timeout=0.1)  # never got the client: nothing sent
        assert not c.broken
        assert await answered(b, p.CountReply(count=1), first) == 1
        assert await answered(b, p.ExistsReply(present=[True, False]), c.exists_many(KEYS)) == [True, False]

    run(main())


def test_a_task_cancelled_mid_call_leaves_the_client_broken_and_closed(pair) -> None:  # noqa: F811
    """The reply of a cancelled call may arrive later: it must never be read as another call's."""
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        task = asyncio.ensure_future(c.lookup(KEYS))
        await request_arrived(b)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert c.broken
        with pytest.raises(ConnectionError, match="broken or closed; connect again"):
            await c.lookup(KEYS)
        assert peer_closed(b)
        await c.close()

    run(main())


def test_a_task_cancelled_while_waiting_for_the_client_changes_nothing(pair) -> None:  # noqa: F811
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        first = asyncio.ensure_future(c.lookup(KEYS))
        await request_arrived(b)
        second = asyncio.ensure_future(c.delete_many(KEYS))
        await asyncio.sleep(0.05)  # it waits for the client now, behind the first
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert not c.broken
        assert await answered(b, p.CountReply(count=2), first) == 2
        assert await answered(b, p.CountReply(count=0), c.delete_many(KEYS)) == 0

    run(main())


def test_calls_from_several_tasks_run_one_at_a_time_in_order(pair) -> None:  # noqa: F811
    """Each call's request is sent only once the previous call has its reply."""
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        tasks = [asyncio.ensure_future(c.lookup([f"k{i}".encode()])) for i in range(5)]
        for i in range(5):
            await request_arrived(b)
            await asyncio.sleep(0.02)  # the point: time for a client that does not wait to send the next
            b.setblocking(True)
            _kind, hlen, _blen = p.parse_preamble(b.recv(p.PREAMBLE_SIZE, socket.MSG_WAITALL), 1 << 30)
            req = p.decode_request(b.recv(hlen, socket.MSG_WAITALL))
            b.setblocking(False)
            assert req.keys == [f"k{i}".encode()]
            assert sent(b) == b"", "a second request was sent before the first was answered"
            b.sendall(p.encode_frame(p.CountReply(id=req.id, count=i), 0, p.KIND_REPLY))
        assert await asyncio.gather(*tasks) == list(range(5))

    run(main())


def test_close_wakes_a_call_in_progress(pair) -> None:  # noqa: F811
    a, b = pair

    async def main() -> None:
        c = AsyncClient(a, local=False, timeout=None)
        task = asyncio.ensure_future(c.stats())
        await request_arrived(b)
        await asyncio.wait_for(c.close(), 5)
        with pytest.raises(ConnectionError):
            await task

    run(main())


def test_a_copy_on_a_worker_thread_ends_before_its_cancelled_caller_goes_on() -> None:
    """No byte of a caller's buffer may move after its cancelled call has returned."""
    started, done = threading.Event(), threading.Event()

    def slow_copy() -> int:
        started.set()
        time.sleep(0.3)  # the point: a copy still running when its caller is cancelled
        done.set()
        return 1

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(ac._off_loop(loop, slow_copy))
        await wait_until_async(started.is_set, 5, "the copy started on its thread")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set()

    run(main())


def test_connect_refuses_a_bad_address_by_name() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="expected a socket path or host:port"):
            await AsyncClient.connect("localhost")

    run(main())
