"""Cross-memory gets: a local client reads lent objects out of the gateway's memory, in one copy.

Against a real gateway: the bytes are right (RAM tier and card, hits and misses mixed), the request
counts say the lent path was used, every loan is given back (nothing stays pinned), and with
``cross_memory_gets`` off the same call goes through the session region with the same result.
``crossmem.read`` itself is checked against a child process's memory, runs split and uneven.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from kvgate import crossmem
from kvgate.client import Client

pytestmark = pytest.mark.skipif(not crossmem.supported, reason="process_vm_readv is Linux only")


def _child(q, r) -> None:
    buf = np.frombuffer(bytes(range(256)) * (40 << 10), np.uint8).copy()  # 10 MiB
    q.put((os.getpid(), buf.ctypes.data, buf.nbytes))
    r.get()


@pytest.mark.slow
def test_read_copies_uneven_runs_out_of_another_process() -> None:
    ctx = mp.get_context("fork")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(q, r))
    p.start()
    try:
        pid, addr, n = q.get(timeout=20)
        want = np.frombuffer(bytes(range(256)) * (40 << 10), np.uint8)
        dst = np.zeros(n, np.uint8)
        # local runs of 3 MiB + 7 MiB, remote runs cut elsewhere, over the split threshold: two threads
        local = [(dst.ctypes.data, 3 << 20), (dst.ctypes.data + (3 << 20), n - (3 << 20))]
        remote = [(addr, 1000), (addr + 1000, (5 << 20) - 1000), (addr + (5 << 20), n - (5 << 20))]
        crossmem.read(pid, local, remote)
        assert np.array_equal(dst, want)
        many = [(addr + i * 64, 64) for i in range(3000)]  # more runs than one call takes
        small = np.zeros(3000 * 64, np.uint8)
        crossmem.read(pid, [(small.ctypes.data, small.nbytes)], many)
        assert np.array_equal(small, want[: small.nbytes])
        with pytest.raises(crossmem.CrossMemoryError):
            crossmem.read(pid, [(small.ctypes.data, 64)], [(8, 64)])  # an address nothing is mapped at
        with pytest.raises(ValueError):
            crossmem.read(pid, [(small.ctypes.data, 64)], [(addr, 63)])
    finally:
        r.put(1)
        p.join(10)


def _counts(gw) -> tuple[dict, int]:
    st = gw.stats()
    return st["get_paths"], st["tiers"]["ram"]["pinned_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("cross", [True, False])
def test_gets_of_plain_buffers_are_lent_and_given_back(gateway_factory, tmp_path, cross: bool) -> None:
    gw = gateway_factory(["--max-bytes", "16M", "--storage-devices", str(tmp_path / "card"),
                          "--cross-memory-gets", "true" if cross else "false"])
    datas = [os.urandom(n) for n in (1 << 20, 3 << 20, 5, 300 << 10, 2 << 20, 2 << 20)]
    keys = [f"lent-{i}".encode() for i in range(len(datas))]
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert all(c.put_many(keys, datas, retention="long"))
        for i in range(8):  # push the first ones out of the RAM tier: they come from the card
            c.put_many([f"push-{i}".encode()], [os.urandom(2 << 20)], retention="long")
        bufs = [np.zeros(len(d) + 11, np.uint8) for d in datas]
        got = c.get_many([keys[0], b"absent", *keys[1:]], into=[bufs[0], np.zeros(10, np.uint8), *bufs[1:]])
        assert got[1] is None
        assert [bytes(g) for g in [got[0], *got[2:]]] == datas
        paths, pinned = _counts(gw)
        assert pinned == 0, "a loan was not given back"
        if cross:
            assert paths["lent"] >= 1 and paths["session_region"] == 0, paths
        else:
            assert paths["lent"] == 0 and paths["session_region"] >= 1, paths
        # a destination too small is named, and its loan is given back all the same
        from kvgate.client import ObjectTooLarge
        with pytest.raises(ObjectTooLarge) as ei:
            c.get_many(keys[:2], into=[np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)])
        assert ei.value.index == 1
        assert _counts(gw)[1] == 0
        assert bytes(c.get_many(keys[1:2], into=[bufs[1]])[0]) == datas[1]  # still in step


@pytest.mark.slow
def test_card_reads_are_lent_in_one_round_from_reused_buffers(gateway_factory, tmp_path) -> None:
    """No RAM tier: every object is read from the card into reply buffers of the gateway's. A get of
    8 objects is one lent request (the RAM tier's lending share does not cut card reads into rounds),
    and buffers reused from one get to the next never show the last get's bytes."""
    gw = gateway_factory(["--max-bytes", "0", "--storage-devices", str(tmp_path / "card")])
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        batches = []
        for b in range(3):
            keys = [f"card-{b}-{i}".encode() for i in range(8)]
            datas = [os.urandom(2 << 20) for _ in keys]
            assert all(c.put_many(keys, datas, retention="long"))
            batches.append((keys, datas))
        before = _counts(gw)[0]["lent"]
        for _ in range(2):
            for keys, datas in batches:
                bufs = [np.zeros(2 << 20, np.uint8) for _ in keys]
                got = c.get_many(keys, into=bufs)
                assert [bytes(g) for g in got] == datas
        assert _counts(gw)[0]["lent"] - before == 6, "one lent request per get of 8 card objects"
        assert _counts(gw)[1] == 0


@pytest.mark.slow
def test_a_lent_get_cancelled_during_its_copy_gives_its_loan_back(gateway_factory) -> None:
    """An AsyncClient get cancelled while it reads lent objects ends after the copy, and the loan goes back:
    nothing stays pinned, and the session's next gets are neither blocked nor wrong."""
    import asyncio

    from kvgate.asyncclient import AsyncClient

    gw = gateway_factory(["--max-bytes", "256M"])
    n, size = 16, 4 << 20
    datas = [os.urandom(size) for _ in range(n)]
    keys = [f"cancel-{i}".encode() for i in range(n)]

    async def main() -> int:
        cancelled_in_copy = 0
        async with AsyncClient.connect(gw.socket, namespace="lent", engine_id="lent") as c:
            assert all(await c.put_many(keys, datas, retention="short"))
            for round_ in range(40):
                dests = [np.zeros(size, np.uint8) for _ in range(n)]
                task = asyncio.ensure_future(c.get_many(keys, into=dests))
                await asyncio.sleep(0.001 * (round_ % 8))
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    if c.broken:
                        await c.close()
                        c = await AsyncClient.connect(gw.socket, namespace="lent", engine_id="lent")
                    else:
                        cancelled_in_copy += 1
                got = await asyncio.wait_for(c.get_many(keys, into=[np.zeros(size, np.uint8) for _ in range(n)]),
                                             20)
                assert [bytes(g) for g in got] == datas
                assert _counts(gw)[1] == 0, f"round {round_}: pages still pinned"
        return cancelled_in_copy

    asyncio.run(main())
    assert gw.stats()["get_paths"]["lent"] > 0


@pytest.mark.slow
def test_loans_a_client_never_gives_back_end_with_its_connection(gateway_factory) -> None:
    """A peer that takes lent objects and goes away without giving them back: its pins and its share of
    the inline budget are released with its session; a lent get over TCP is refused, naming why."""
    import socket
    import time

    from kvgate import protocol as p
    from tests.gateway.test_inline_bytes import _frame, _read_reply

    from tests.helpers import free_port

    port = free_port()
    gw = gateway_factory(["--max-bytes", "64M", "--port", str(port)])
    keys = [f"kept-{i}".encode() for i in range(4)]
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert all(c.put_many(keys, [os.urandom(2 << 20) for _ in keys], retention="short"))
        for _ in range(3):  # more than the listener's budget would hold, were loans not given back
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(gw.socket)
            s.settimeout(20)
            s.sendall(_frame(p.Hello(id=1, namespace="lent", engine_id="lent", want_shm=False)))
            hello, _ = _read_reply(s)
            assert hello.lends and hello.pid == gw.pid
            s.sendall(_frame(p.Get(id=2, keys=keys, region=p.LENT, capacities=[2 << 20] * len(keys))))
            reply, _ = _read_reply(s)
            assert isinstance(reply, p.GetReply) and reply.loan and len(reply.segments) >= 2 * len(keys)
            assert _counts(gw)[1] == 4 * (2 << 20)
            s.close()
            deadline = time.monotonic() + 10
            while _counts(gw)[1] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _counts(gw)[1] == 0
        assert len(c.get_many(keys, into=[np.zeros(2 << 20, np.uint8) for _ in keys])) == len(keys)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as t:
        t.sendall(_frame(p.Hello(id=1, namespace="lent", engine_id="lent")))
        hello, _ = _read_reply(t)
        assert not hello.lends
        t.sendall(_frame(p.Get(id=2, keys=keys, region=p.LENT, capacities=[2 << 20] * len(keys))))
        reply, _ = _read_reply(t)
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST and "TCP" in reply.message
