"""AsyncClient against real gateway processes, over the Unix socket and TCP.

Every operation round-trips bytes (checked byte for byte, and against what
the sync Client reads); tasks share one client; calls cancelled at any
moment never leave a reply to be misread; a gateway SIGKILLed mid-call, or
stopped, is reported within the deadline; wrong arguments are named and the
client goes on.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import signal
import time
import uuid

import numpy as np
import pytest

from kvgate import AsyncClient, Client, GatewayError, ObjectTooLarge

from kvgate.client import async_client as asyncclient
from kvgate.keys import BadKey
from tests.gateway.test_client_sharing import check, content
from tests.helpers import free_port, freeze

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE = "async"
NS = "async-ns"
KIB, MIB = 1 << 10, 1 << 20
REGION = 4 * MIB  # the session region: objects larger than it travel inline over the Unix socket too
TRANSPORTS = ["unix", "tcp"]


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def gw(gateway_factory):
    port = free_port()
    g = gateway_factory(["--port", str(port), "--shared-memory-size", "4M", "--max-bytes", "96M"])
    g.tcp_target = f"127.0.0.1:{port}"
    return g


def target(g, transport: str) -> str:
    return g.socket if transport == "unix" else g.tcp_target


def connect(g, transport: str, **kw):
    kw.setdefault("timeout", 30)
    return AsyncClient.connect(target(g, transport), namespace=NS, engine_id=ENGINE, **kw)


@pytest.mark.parametrize("transport,offload", [("unix", 0), ("unix", 1 << 62), ("tcp", None)],
                         ids=["unix-copies-on-a-thread", "unix-copies-on-the-loop", "tcp"])
def test_every_operation_round_trips(gw, transport: str, offload: int | None, monkeypatch) -> None:
    off_loop = []
    if offload is not None:
        monkeypatch.setattr(asyncclient, "OFFLOAD_BYTES", offload)
        real = asyncclient._off_loop
        monkeypatch.setattr(asyncclient, "_off_loop", lambda loop, fn: off_loop.append(fn) or real(loop, fn))
    # sizes from one byte (an empty object is refused) to larger than the session region (inline over the
    # Unix socket too)
    sizes = [1, 2, 4095, 64 * KIB + 3, MIB, 3 * MIB + 1, REGION + 12345]
    keys = [f"obj-{i}".encode() for i in range(len(sizes))]
    wants = [content(1, 0, i, s) for i, s in enumerate(sizes)]

    async def main() -> None:
        async with connect(gw, transport) as c:
            assert c.local == (transport == "unix")
            mark = await c.dialog_mark(keys)
            assert mark.mark == keys[0] and mark.shared == 0
            assert await c.put_many(keys, wants, dialog=mark.mark, position=0) == [True] * len(keys)
            assert await c.lookup(keys + [b"absent"], dialog=mark.mark) == len(keys)
            assert await c.lookup([b"absent"] + keys) == 0
            assert await c.exists_many([keys[0], b"absent", keys[-1]]) == [True, False, True]
            dests = [np.zeros(s + 100, np.uint8) for s in sizes] + [bytearray(10)]
            got = await c.get_many(keys + [b"absent"], into=dests, dialog=mark.mark)
            assert got[-1] is None
            for i, w in enumerate(wants):
                assert isinstance(got[i], memoryview) and got[i].nbytes == w.nbytes
                check(got[i], w, f"object {i} into a buffer")
                assert not dests[i][w.nbytes :].any()  # nothing past the object
            got = await c.get_many([b"absent"] + keys)
            assert got[0] is None
            for i, w in enumerate(wants):
                assert isinstance(got[i + 1], bytes)
                check(got[i + 1], w, f"object {i} packed")
            # what the sync client reads is the same
            with Client.connect(target(gw, transport), namespace=NS, engine_id=ENGINE, timeout=30) as s:
                for g, w in zip(s.get_many(keys), wants):
                    check(g, w, "read by Client")
                assert s.put_many([b"from-sync"], [b"s" * 5000]) == [True]
            assert await c.get_many([b"from-sync"]) == [b"s" * 5000]
            with pytest.raises(ObjectTooLarge) as ei:
                await c.get_many([keys[4]], into=[bytearray(MIB - 1)])
            assert ei.value.index == 0 and ei.value.needed in (MIB, -1)
            assert await c.prewarm(keys[:3]) == 3
            assert (await c.stats())["gateway"]["pid"] == gw.pid
            assert await c.delete_many(keys[:2] + [b"absent"]) == 2
            assert await c.lookup(keys) == 0
            assert await c.get_many(keys[:3]) == [None, None, wants[2].tobytes()]
            assert await c.put_many([], []) == [] and await c.get_many([]) == []
            with pytest.raises(GatewayError) as refused:
                await c.put_many([b"empty", b"one"], [b"", b"1"])
            assert refused.value.code == "BAD_REQUEST" and "buffers[0] is empty" in refused.value.message
            assert not c.broken
        async with AsyncClient.connect(gw.socket, role="admin", want_shm=False, timeout=30) as admin:
            assert await admin.clean() >= 1
        async with connect(gw, transport) as c:
            assert await c.lookup(keys[2:]) == 0

    run(main())
    assert bool(off_loop) == (offload == 0)  # the copies ran where they were sent
    assert gw.alive() and "Traceback" not in gw.log()


def test_buffers_in_a_registered_region_move_in_place(gw) -> None:
    path = f"/dev/shm/kvgtest-async-{uuid.uuid4().hex[:12]}"
    size = 8 * MIB
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    sizes = [MIB, 2 * MIB + 5, 3]
    wants = [content(2, 0, i, s) for i, s in enumerate(sizes)]
    keys = [f"reg-{i}".encode() for i in range(len(sizes))]

    async def main() -> None:
        async with connect(gw, "unix") as c:
            assert await c.register_region(path, mm) >= 1
            srcs, dsts, off = [], [], 0
            for w in wants:
                arr[off : off + w.nbytes] = w
                srcs.append(arr[off : off + w.nbytes])
                dsts.append(arr[4 * MIB + off : 4 * MIB + off + w.nbytes])
                off += w.nbytes
            assert await c.put_many(keys, srcs) == [True] * len(keys)
            got = await c.get_many(keys, into=dsts)
            for g, d, w in zip(got, dsts, wants):
                check(g, w, "in place")
                check(d, w, "the region itself")
        async with connect(gw, "tcp") as t:
            with pytest.raises(Exception, match="local"):
                await t.register_region(path, mm)
            assert not t.broken

    try:
        run(main())
    finally:
        del arr
        mm.close()
        os.unlink(path)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tasks_sharing_one_client_each_get_their_own_bytes(gw, transport: str) -> None:
    tasks, rounds, objects = 6, 5, 6

    async def worker(c: AsyncClient, t: int) -> int:
        keys = [f"t{t}/o{o}".encode() for o in range(objects)]
        checked = 0
        for r in range(rounds):
            # 1 KiB to 1.5 MiB: a task's batch may need several rounds of the 4 MiB session region
            sizes = [KIB + ((t * 3 + r * 5 + o * 7) % 8) * 200 * KIB + o for o in range(objects)]
            wants = [content(t, r, o, s) for o, s in enumerate(sizes)]
            assert await c.put_many(keys, wants, retention="short") == [True] * objects
            await asyncio.sleep(0)  # let the other tasks' calls in between this task's
            dests = [np.zeros(2 * MIB, np.uint8) for _ in range(objects)]
            got = await c.get_many(keys, into=dests)
            for o in range(objects):
                check(got[o], wants[o], f"task {t} round {r} object {o} (into)")
            got = await c.get_many(keys)
            for o in range(objects):
                check(got[o], wants[o], f"task {t} round {r} object {o} (packed)")
            assert await c.lookup(keys) == objects
            checked += 2 * objects
        return checked

    async def main() -> None:
        async with connect(gw, transport) as c:
            done = await asyncio.gather(*(worker(c, t) for t in range(tasks)))
            assert done == [2 * rounds * objects] * tasks
            assert not c.broken

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_cancelled_at_any_moment_never_leaves_a_reply_to_misread(gw, transport: str) -> None:
    """Cancel gets of 16 MiB after random delays: each ends whole, or cancelled; the client is then
    either broken (and says so) or in step, and the next read is exact either way."""
    n = 16
    keys = [f"c{i}".encode() for i in range(n)]
    wants = [content(3, 0, i, MIB) for i in range(n)]
    rng = random.Random(7)
    outcomes = {"completed": 0, "cancelled, in step": 0, "cancelled, broken": 0}

    async def main() -> None:
        c = await connect(gw, transport)
        assert await c.put_many(keys, wants, retention="short") == [True] * n
        t0 = time.monotonic()
        await c.get_many(keys, into=[np.zeros(MIB, np.uint8) for _ in range(n)])
        took = time.monotonic() - t0  # cancels are spread over the call as this machine runs it
        rounds = 0
        # At least 25 rounds, and on until a cancel has landed mid-call (a fast machine may need more).
        while rounds < 25 or (outcomes["cancelled, broken"] == 0 and rounds < 200):
            rounds += 1
            dests = [np.zeros(MIB, np.uint8) for _ in range(n)]
            task = asyncio.ensure_future(c.get_many(keys, into=dests))
            await asyncio.sleep(rng.uniform(0, 1.2 * took))  # the point: a cancel at a random moment of the call
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                if c.broken:
                    outcomes["cancelled, broken"] += 1
                    with pytest.raises(ConnectionError, match="connect again"):
                        await c.lookup(keys)
                    await c.close()
                    c = await connect(gw, transport)
                else:
                    outcomes["cancelled, in step"] += 1
            else:
                outcomes["completed"] += 1
                for g, w in zip(got, wants):
                    check(g, w, "a get that completed")
            got = await c.get_many(keys, into=[np.zeros(MIB, np.uint8) for _ in range(n)])
            for g, w in zip(got, wants):
                check(g, w, "the get after")
        await c.close()

    run(main())
    assert outcomes["cancelled, broken"] > 0, outcomes  # some cancellations did land mid-call
    assert gw.alive() and "Traceback" not in gw.log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_cancelled_while_the_gateway_is_busy_closes_the_connection(gw, transport: str) -> None:
    async def main() -> None:
        async with connect(gw, transport) as c:
            assert await c.put_many([b"k"], [b"v" * 1000]) == [True]
            freeze(gw.pid)
            try:
                task = asyncio.ensure_future(c.get_many([b"k"]))
                await asyncio.sleep(0.3)  # sent; no reply can come
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                os.kill(gw.pid, signal.SIGCONT)
            assert c.broken
            with pytest.raises(ConnectionError, match="connect again"):
                await c.get_many([b"k"])
        async with connect(gw, transport) as c:
            assert await c.get_many([b"k"]) == [b"v" * 1000]

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_gateway_killed_mid_call_raises_connectionerror_within_the_deadline(gw, transport: str) -> None:
    keys = [f"k{i}".encode() for i in range(8)]

    async def main() -> None:
        c = await connect(gw, transport, timeout=20)
        assert await c.put_many(keys, [content(4, 0, i, MIB) for i in range(8)], retention="short") == [True] * 8
        freeze(gw.pid)  # the request goes out and waits: the call is mid-way when it dies
        t0 = time.monotonic()
        task = asyncio.ensure_future(c.get_many(keys, into=[bytearray(MIB) for _ in keys]))
        await asyncio.sleep(0.3)  # time for the request to go out; the stopped gateway cannot answer it
        assert not task.done()
        await asyncio.get_running_loop().run_in_executor(None, gw.kill, signal.SIGKILL)
        with pytest.raises(ConnectionError):
            await task
        assert time.monotonic() - t0 < 10  # the connection's end, not the 20 s deadline
        assert c.broken
        with pytest.raises(ConnectionError, match="connect again"):
            await c.lookup(keys)
        await c.close()

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stopped_gateway_raises_timeouterror_at_the_deadline(gw, transport: str) -> None:
    async def main() -> None:
        c = await connect(gw, transport)
        freeze(gw.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await c.lookup([b"k"], timeout=1.0)
            assert 1.0 <= time.monotonic() - t0 < 4
        finally:
            os.kill(gw.pid, signal.SIGCONT)
        assert c.broken
        await c.close()
        async with connect(gw, transport) as c:
            assert await c.lookup([b"k"]) == 0

    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_call_is_named_and_leaves_the_client_usable(gw, transport: str) -> None:
    keys, bufs = [b"k0", b"k1"], [b"v0" * 100, b"v1" * 100]
    refused = [
        (lambda c: c.put_many(keys, bufs, position=2**70), ValueError, "position"),
        (lambda c: c.put_many(keys, bufs, retention="forever"), ValueError, "retention"),
        (lambda c: c.put_many(keys, bufs, dialog="chat"), TypeError, "dialog"),
        (lambda c: c.put_many(keys, [b"x", np.arange(8, dtype=np.uint8)[::2]]), ValueError, "buffers[1]"),
        (lambda c: c.put_many(keys, bufs[:1]), ValueError, "2 keys but 1 buffers"),
        (lambda c: c.put_many("k0", bufs), TypeError, "keys"),
        (lambda c: c.get_many(keys, into=[bytearray(200), b"\0" * 200]), TypeError, "destination buffers[1]"),
        (lambda c: c.lookup("abc"), TypeError, "keys"),
        (lambda c: c.exists_many([b"k0", 1]), TypeError, "keys[1]"),
        (lambda c: c.delete_many([b""]), BadKey, "keys[0]"),
        (lambda c: c.prewarm(b"k0"), TypeError, "keys"),
        (lambda c: c.dialog_mark([b"a", None]), TypeError, "keys[1]"),
        (lambda c: c.register_region(b"/dev/shm/x"), TypeError, "path"),
    ]

    async def main() -> None:
        async with connect(gw, transport) as c:
            for n, (call, exc, words) in enumerate(refused):
                with pytest.raises(exc, match=words.replace("[", r"\[")):
                    await call(c)
                assert not c.broken
                key = f"after-{n}".encode()
                assert await c.put_many([key], [key * 10], dialog=b"d", position=n) == [True]
                assert await c.get_many([key], dialog=b"d") == [key * 10]
            assert await c.put_many(keys, bufs, position=2**63 - 2) == [True, True]
            assert await c.get_many(keys) == bufs

    run(main())
    assert gw.alive() and "Traceback" not in gw.log()
