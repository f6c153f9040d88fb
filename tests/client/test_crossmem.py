"""Cross-memory gets: a local client reads lent objects out of the gateway's memory, in one copy.

Against a real gateway: the bytes are right (RAM tier and card, hits and misses mixed), the request
counts say the lent path was used, every loan is given back (nothing stays pinned), and with
``cross_memory_gets`` off the same call goes through the session region with the same result.
``crossmem.read`` itself is checked against a child process's memory, runs split and uneven, lists and arrays.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

import numpy as np
import pytest

from kvgate.client import crossmem
from kvgate.client import Client
from kvgate.client.regions import SharedMemoryTransport

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
        # as arrays, both sides in more runs than one call takes (a split between threads cuts a run)
        dst[:] = 0
        pages = np.arange(0, n, 4096, dtype=np.uint64)
        crossmem.read(pid, np.stack([pages + np.uint64(dst.ctypes.data), np.full(len(pages), 4096, np.uint64)], 1),
                      [(addr, 3 << 20), (addr + (3 << 20), n - (3 << 20))])
        assert np.array_equal(dst, want)
        dst[:] = 0
        crossmem.read(pid, np.array([(dst.ctypes.data + i * 48, 48) for i in range(2500)], np.uint64),
                      [(addr + i * 80, 80) for i in range(1500)])
        assert np.array_equal(dst[:120000], want[:120000]) and not dst[120000:].any()
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


def _sealed_memfd(size: int, seals: int) -> tuple[int, np.ndarray]:
    import fcntl
    import mmap

    fd = os.memfd_create("test-arena", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, np.frombuffer(mmap.mmap(fd, size), np.uint8)


@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
@pytest.mark.parametrize("compiled", [True, False])
def test_pieces_inside_a_mapped_arena_are_copied_out_of_the_mapping_and_the_rest_read_from_the_process(
        compiled: bool, monkeypatch) -> None:
    """The arena is this process's own memfd, said to lie at an address where nothing is mapped: a piece
    read with ``process_vm_readv`` from there would fail, so a right copy proves the mapping was read; the
    pieces outside it (a real buffer) are read from the process.  Runs uneven on both sides, over the
    two-thread threshold.  With the compiled span copy and with its Python fallback."""
    import fcntl

    if not compiled:
        monkeypatch.setattr(crossmem, "_copier", None)
    size = 12 << 20
    fd, mem = _sealed_memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mem[:] = np.frombuffer(os.urandom(size), np.uint8)
    elsewhere = np.frombuffer(os.urandom(1 << 20), np.uint8)
    pid, pidfd = os.getpid(), os.pidfd_open(os.getpid())
    try:
        fake = 1 << 45  # nothing is mapped there
        arena = crossmem.map_arena(pidfd, pid, fd, fake, size)
        assert arena is not None
        want = np.concatenate([mem[1000:(9 << 20)], elsewhere, mem[(10 << 20):]])
        remote = np.array([(fake + 1000, (3 << 20) - 1000), (fake + (3 << 20), 6 << 20),
                           (elsewhere.ctypes.data, 1 << 20), (fake + (10 << 20), 2 << 20)], np.uint64)
        dst = np.zeros(len(want), np.uint8)
        pages = np.arange(0, len(dst), 4096, dtype=np.uint64)
        cuts = np.minimum(np.full(len(pages), 4096, np.uint64), np.uint64(len(dst)) - pages)
        crossmem.read(pid, np.stack([pages + np.uint64(dst.ctypes.data), cuts], 1), remote, arena)
        assert np.array_equal(dst, want)
        dst[:] = 0  # small: one thread
        crossmem.read(pid, [(dst.ctypes.data, 100), (dst.ctypes.data + 100, 50)], [(fake + 1000, 150)], arena)
        assert np.array_equal(dst[:150], want[:150]) and not dst[150:].any()
        # past the arena's end: not the mapping's to copy, and nothing is mapped there in the process either
        with pytest.raises(crossmem.CrossMemoryError):
            crossmem.read(pid, [(dst.ctypes.data, 200)], [(fake + size - 100, 200)], arena)
    finally:
        os.close(pidfd)
        os.close(fd)


@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
def test_an_arena_that_could_shrink_or_is_short_is_not_mapped() -> None:
    import fcntl

    pid, pidfd = os.getpid(), os.pidfd_open(os.getpid())
    unsealed, _ = _sealed_memfd(1 << 20, 0)
    sealed, _ = _sealed_memfd(1 << 20, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    try:
        assert crossmem.map_arena(pidfd, pid, unsealed, 1 << 45, 1 << 20) is None
        assert crossmem.map_arena(pidfd, pid, sealed, 1 << 45, 2 << 20) is None  # says more than it holds
        assert crossmem.map_arena(pidfd, pid, 9999, 1 << 45, 1 << 20) is None  # no such descriptor
        assert crossmem.map_arena(pidfd, pid, sealed, 1 << 45, 1 << 20) is not None
    finally:
        for fd in (pidfd, unsealed, sealed):
            os.close(fd)


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
def test_ram_tier_gets_are_copied_out_of_the_arena_which_no_client_can_write_or_shrink(gateway_factory,
                                                                                      monkeypatch) -> None:
    """A local client of the gateway's user maps the RAM tier's arena read-only: its gets of RAM-tier
    objects into plain buffers and ``Pieces`` never call ``process_vm_readv``, bytes right, loans given
    back.  The descriptor the hello names is read-only and the memfd sealed: taken by a client, it can
    neither be mapped writable nor shrunk under the gateway."""
    import mmap
    import socket

    from kvgate import protocol as p
    from kvgate.client import Pieces
    from tests.gateway.test_inline_bytes import _frame
    from tests.helpers import read_reply as _read_reply

    gw = gateway_factory(["--max-bytes", "64M"])
    datas = [os.urandom(n) for n in (1 << 20, 3 << 20, 5, 300 << 10, 2 << 20, 6 << 20)]
    keys = [f"arena-{i}".encode() for i in range(len(datas))]
    processes = []
    real = crossmem._read_runs
    monkeypatch.setattr(crossmem, "_read_runs", lambda *a: processes.append(a) or real(*a))
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert all(c.put_many(keys, datas))
        bufs = [np.zeros(len(d) + 3, np.uint8) for d in datas]
        got = c.get_many(keys, into=bufs)
        assert [bytes(g) for g in got] == datas
        pool = np.zeros(4 << 20, np.uint8)  # keys 0 and 3 in two pieces each, the second before the first
        pieces = Pieces(pool, np.array([[2 << 20, 0], [3 << 20, 3 << 20 | 4096]]),
                        np.array([[512 << 10, 512 << 10], [4096, 300 << 10]]))
        assert c.get_many([keys[0], keys[3]], into=pieces) == [1 << 20, 300 << 10]
        assert bytes(pool[2 << 20:(2 << 20) + (512 << 10)]) + bytes(pool[:512 << 10]) == datas[0]
        assert bytes(pool[3 << 20:(3 << 20) + 4096]) + bytes(pool[(3 << 20) + 4096:][:(300 << 10) - 4096]) \
            == datas[3]
        assert processes == [], "RAM-tier pieces were read with process_vm_readv"
        assert gw.stats()["get_paths"]["lent"] >= 2 and _counts(gw)[1] == 0
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(gw.socket)
    s.settimeout(20)
    s.sendall(_frame(p.Hello(id=1, namespace="lent", engine_id="lent", want_shm=False)))
    hello, _ = _read_reply(s)
    fd, address, size = hello.arena
    pidfd = os.pidfd_open(gw.pid)
    try:
        mine = crossmem._take_fd(pidfd, gw.pid, fd)
    finally:
        os.close(pidfd)
    try:
        assert os.fstat(mine).st_size == size == 64 << 20
        with pytest.raises(OSError):
            os.ftruncate(mine, 0)
        with pytest.raises(PermissionError):
            mmap.mmap(mine, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(mine)
        s.close()
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:  # the gateway is fine
        assert [bytes(g) for g in c.get_many(keys, into=[np.zeros(len(d), np.uint8) for d in datas])] == datas


def _split_read_of_own_memory() -> None:
    src = np.frombuffer(os.urandom(crossmem.SPLIT_BYTES * 2), np.uint8)
    dst = np.zeros_like(src)
    crossmem.read(os.getpid(), [(dst.ctypes.data, dst.nbytes)], [(src.ctypes.data, src.nbytes)])
    assert np.array_equal(dst, src)


@pytest.mark.slow
def test_a_forked_child_reads_on_two_threads_of_its_own() -> None:
    """The helper thread is the parent's: a child forked after the parent used it starts its own (it would
    wait for ever on a thread it does not have)."""
    _split_read_of_own_memory()
    p = mp.get_context("fork").Process(target=_split_read_of_own_memory)
    p.start()
    try:
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()


IN_ANOTHER_PID_NAMESPACE = r"""
import sys
import numpy as np
from kvgate.client import Client
with Client.connect(sys.argv[1], namespace="lent", engine_id="lent") as c:
    print(bytes(c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0]).hex())
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not crossmem.supported, reason="needs root (unshare --pid)")
def test_a_client_in_another_pid_namespace_is_lent_nothing(gateway_factory) -> None:
    """The pid a hello names means another process (or none) in a container's PID namespace, and a read of
    that one's memory would hand the client its bytes: the gateway lends such a session nothing, not even to
    root, and its gets go through the session region, right."""
    import shutil
    import subprocess
    import sys

    from tests.helpers import kvgate_env

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    gw = gateway_factory(["--max-bytes", "16M"])
    data = os.urandom(1 << 20)
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert c.put_many([b"k"], [data]) == [True]
    before = _counts(gw)[0]
    run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", IN_ANOTHER_PID_NAMESPACE,
                          gw.socket], env=kvgate_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == data.hex()
    after = _counts(gw)[0]
    assert after["lent"] == before["lent"] and after["session_region"] == before["session_region"] + 1, after
    hello = _hello(gw)  # from this namespace it is lent
    assert hello.lends and hello.arena is not None


def _arena_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:kvgate-ram" in line for line in f)


def _own_fds() -> set[tuple[str, str]]:
    """This process's descriptors with what each points to. Compared as sets, so a descriptor an earlier test left
    to the garbage collector, closed while this one runs, is not mistaken for one this test leaked."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # (the descriptor listdir itself used, closed by now)
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
def test_a_client_lets_go_of_the_arena_when_it_closes_and_when_its_gateway_dies_while_it_idles(
        gateway_factory) -> None:
    """Sessions of one process share one mapping; closing the last unmaps the arena and leaves no descriptor
    behind; a gateway killed while its client makes no call is noticed all the same (its memory is not held
    beside a restarted gateway's), and the client that finds it gone on its next call fails as before."""
    import signal
    import time

    from kvgate.client import GatewayUnavailable

    gw = gateway_factory(["--max-bytes", "16M"])
    gc.collect()
    before_maps, before_fds = _arena_maps(), _own_fds()
    for _ in range(3):
        with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
            assert c.put_many([b"k"], [os.urandom(1 << 20)]) == [True]
            assert c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0] is not None
            assert _arena_maps() == before_maps + 1
            with Client.connect(gw.socket, namespace="lent", engine_id="lent") as second:  # one mapping for both
                assert second.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0] is not None
                assert _arena_maps() == before_maps + 1
            assert c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0] is not None
            assert _arena_maps() == before_maps + 1
    deadline = time.monotonic() + 5
    while (_arena_maps() != before_maps or _own_fds() - before_fds) and time.monotonic() < deadline:
        time.sleep(0.05)  # (the watch closes its duplicate on its own thread)
    assert _arena_maps() == before_maps
    assert not _own_fds() - before_fds, "descriptors left open"
    c = Client.connect(gw.socket, namespace="lent", engine_id="lent")
    try:
        assert c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0] is not None
        assert _arena_maps() == before_maps + 1
        gw.kill(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _arena_maps() > before_maps and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _arena_maps() == before_maps, "a dead gateway's arena is still mapped"
        with pytest.raises(GatewayUnavailable):
            c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_client_dropped_without_close_leaves_no_descriptor_or_mapping_behind(gateway_factory) -> None:
    """A session the engine forgot to close, once collected: its pidfd of the gateway, the watch's duplicate
    of it and the arena mapping all go (a process opening sessions in a loop would run out of them)."""
    import time

    gw = gateway_factory(["--max-bytes", "16M"])
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert c.put_many([b"k"], [os.urandom(1 << 20)]) == [True]
    gc.collect()
    before_maps, before_fds = _arena_maps(), _own_fds()
    for _ in range(3):
        c = Client.connect(gw.socket, namespace="lent", engine_id="lent")
        assert c.get_many([b"k"], into=[np.zeros(1 << 20, np.uint8)])[0] is not None
        assert _arena_maps() == before_maps + 1 and len(_own_pidfds() - before_fds) == 2  # its own, the watch's
        del c
        gc.collect()
    deadline = time.monotonic() + 5
    while (_arena_maps() != before_maps or _own_fds() - before_fds) and time.monotonic() < deadline:
        time.sleep(0.05)  # (the watch closes its duplicate on its own thread)
    assert _arena_maps() == before_maps
    assert not _own_fds() - before_fds, "descriptors left open"


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd")
def test_an_arena_dropped_while_a_copy_reads_it_stays_mapped_until_that_copy_ends(gateway_factory,
                                                                                   monkeypatch) -> None:
    """What the exit watch does when the gateway dies (the session lets go of its arena) may happen while a
    copy out of that arena runs on another thread: the copy holds its own reference, so the pages stay
    mapped under it (an unmapped page would be a SIGBUS in this process) and go once it ends."""
    gw = gateway_factory(["--max-bytes", "16M"])
    data = os.urandom(1 << 20)
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert c.put_many([b"k"], [data]) == [True]
        with c._session as session:
            transport = session.transport
        assert transport.arena is not None
        gc.collect()
        before = _arena_maps()
        seen = []
        copy = crossmem._copy_mapped

        def dropped_meanwhile(spans, arena):
            transport.arena = None  # as the watch does
            gc.collect()
            seen.append(_arena_maps())
            return copy(spans, arena)

        monkeypatch.setattr(crossmem, "_copy_mapped", dropped_meanwhile)
        out = np.zeros(1 << 20, np.uint8)
        assert c.get_many([b"k"], into=[out])[0] is not None
        assert seen == [before], "unmapped under the copy"
        assert out.tobytes() == data
        gc.collect()
        assert _arena_maps() == before - 1, "still mapped once the copy ended and nothing holds it"


def _counts(gw) -> tuple[dict, int]:
    st = gw.stats()
    return st["get_paths"], st["tiers"]["ram"]["pinned_bytes"]


def _hello(gw):
    import socket

    from kvgate import protocol as p
    from tests.gateway.test_inline_bytes import _frame
    from tests.helpers import read_reply

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(gw.socket)
        s.settimeout(20)
        s.sendall(_frame(p.Hello(id=1, namespace="lent", engine_id="lent", want_shm=False)))
        return read_reply(s)[0]


@pytest.mark.slow
@pytest.mark.parametrize("cross,shared", [(True, True), (True, False), (False, True)])
def test_gets_of_plain_buffers_are_lent_and_given_back(gateway_factory, tmp_path, cross: bool, shared: bool) -> None:
    """The same gets, lent with the RAM tier's arena shared (the default) or private, and not lent."""
    gw = gateway_factory(["--max-bytes", "16M", "--storage-devices", str(tmp_path / "card"),
                          "--cross-memory-gets", "true" if cross else "false",
                          "--shared-ram-arena", "true" if shared else "false"])
    hello = _hello(gw)
    assert hello.lends == cross and (hello.arena is not None) == (cross and shared), hello
    assert ("the RAM tier is shared read-only with them" in gw.log()) == (cross and shared)
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

    from kvgate.client.async_client import AsyncClient

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
    from tests.gateway.test_inline_bytes import _frame
    from tests.helpers import read_reply as _read_reply

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
        assert not hello.lends and hello.arena is None
        t.sendall(_frame(p.Get(id=2, keys=keys, region=p.LENT, capacities=[2 << 20] * len(keys))))
        reply, _ = _read_reply(t)
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST and "TCP" in reply.message


# ---- card objects lent as open files -------------------------------------------------------------

def _holds_files(paths, q, r) -> None:
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    q.put((os.getpid(), fds))
    r.get()


TAKE_AS_NOBODY = """
import sys
import numpy as np
from kvgate.client import crossmem
pid, fd = int(sys.argv[1]), int(sys.argv[2])
try:
    crossmem.read_files(crossmem.open_pidfd(pid), pid, [crossmem.LentFile(fd, 0, np.zeros(4096, np.uint8).data, 0)])
    print("read")
except crossmem.CrossMemoryError as e:
    print(e.errno)
"""


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd and RWF_NOWAIT")
def test_read_files_takes_another_processes_descriptors_and_reads_only_what_is_cached_and_right(tmp_path) -> None:
    """Payloads go straight into the destinations, split over two threads past ``SPLIT_BYTES``; a payload
    that does not hash to what the lender said, or one the page cache does not hold, is given back as
    not read (the gateway reads those itself).  A process that may not take the descriptors (another
    user) gets ``CrossMemoryError``, not bytes."""
    import shutil
    import subprocess
    import sys

    from kvgate.keys import payload_hash
    from tests.helpers import kvgate_env

    sizes = [3 << 20, 5 << 20, 4096, 1 << 20, 2 << 20]
    datas = [os.urandom(n) for n in sizes]
    paths = []
    for i, d in enumerate(datas):
        p = tmp_path / f"obj{i}"
        p.write_bytes(b"h" * 100 + d)
        paths.append(str(p))
    fd = os.open(paths[4], os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the last one is not in the page cache
    os.close(fd)
    ctx = mp.get_context("fork")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_holds_files, args=(paths, q, r))
    p.start()
    try:
        pid, fds = q.get(timeout=20)
        dests = [np.zeros(n, np.uint8) for n in sizes]
        hashes = [payload_hash(d) for d in datas]
        hashes[2] ^= 1  # a lender's hash that the bytes do not match
        files = [crossmem.LentFile(f, 100, dst.data, h) for f, dst, h in zip(fds, dests, hashes)]
        pidfd = crossmem.open_pidfd(pid)
        assert pidfd is not None
        try:
            assert crossmem.read_files(pidfd, pid, files) == [2, 4]
        finally:
            os.close(pidfd)
        for i in (0, 1, 3):
            assert dests[i].tobytes() == datas[i]
        if os.geteuid() == 0 and shutil.which("setpriv"):
            run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                                  TAKE_AS_NOBODY, str(pid), str(fds[0])], env=kvgate_env(), cwd="/",
                                 capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            assert run.stdout.strip() == "1", run.stdout  # EPERM
    finally:
        r.put(1)
        p.join(10)


def _objects_open(gw, card) -> list[str]:
    """The object files of ``card`` the gateway holds open (its claim's lock file is not one)."""
    out = []
    for f in os.listdir(f"/proc/{gw.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{gw.pid}/fd/{f}")
        except OSError:
            continue
        if target.startswith(str(card)) and not target.endswith(".lock"):
            out.append(target)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd and RWF_NOWAIT")
def test_card_objects_are_read_by_the_client_out_of_lent_files_and_a_bad_one_never_reaches_it(gateway_factory,
                                                                                             tmp_path) -> None:
    """No RAM tier: a get of card objects into plain buffers is read out of the card's files by the client
    (counted as ``files_lent``), and every file is closed once given back.  An object changed on the
    card after it was written reaches the client as a miss: its hash fails in the client, the gateway
    reads it again, finds it corrupt and removes it; its neighbours come back right."""
    card = tmp_path / "card"
    gw = gateway_factory(["--max-bytes", "0", "--storage-devices", str(card)])
    datas = [os.urandom(n) for n in (2 << 20, 1 << 20, 300 << 10, 2 << 20)]
    keys = [f"file-{i}".encode() for i in range(len(datas))]
    gc.collect()
    pidfds = _own_pidfds()
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert len(_own_pidfds() - pidfds) == 1  # the client's, of the gateway: it takes the files with it
        assert all(c.put_many(keys, datas, retention="long"))
        for _ in range(3):
            bufs = [np.zeros(len(d), np.uint8) for d in datas]
            got = c.get_many(keys, into=bufs)
            assert [bytes(g) for g in got] == datas
        st = gw.stats()
        assert st["files_lent"]["objects"] == 3 * len(keys) and st["files_lent"]["open"] == 0, st["files_lent"]
        with open(f"/proc/{gw.pid}/limits") as f:  # the files it may lend: the soft limit raised to the hard
            soft, hard = next(ln for ln in f if ln.startswith("Max open files")).split()[3:5]
        assert soft == hard
        assert _objects_open(gw, card) == [], "a lent file stayed open"
        # one object's payload rewritten in place on the card (its pages stay cached)
        files = [f for f in card.rglob("*") if f.is_file() and f.stat().st_size > len(datas[1])
                 and f.stat().st_size < len(datas[0])]
        assert len(files) == 1
        with open(files[0], "r+b") as f:
            f.seek(-100, os.SEEK_END)
            f.write(bytes(100))
        bufs = [np.zeros(len(d), np.uint8) for d in datas]
        got = c.get_many(keys, into=bufs)
        assert got[1] is None
        assert [bytes(g) for i, g in enumerate(got) if i != 1] == [d for i, d in enumerate(datas) if i != 1]
        st = gw.stats()
        assert st["corrupt_objects"] == 1 and not files[0].exists()
        assert st["files_lent"]["open"] == 0
    assert not _own_pidfds() - pidfds, "a closed client keeps its pidfd of the gateway"


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd and RWF_NOWAIT")
def test_a_client_that_may_not_take_the_gateways_descriptors_gets_every_byte_the_other_way(gateway_factory,
                                                                                          tmp_path, monkeypatch
                                                                                          ) -> None:
    """``pidfd_getfd`` refused (a seccomp filter, a Yama setting that allows reading memory but not taking
    descriptors): the files of that get are read again by the gateway, the session lends no more files, and
    the lent files were all closed."""
    card = tmp_path / "card"
    gw = gateway_factory(["--max-bytes", "0", "--storage-devices", str(card)])
    datas = [os.urandom(n) for n in (1 << 20, 300 << 10, 2 << 20)]
    keys = [f"refused-{i}".encode() for i in range(len(datas))]
    tries = []

    def refused(pidfd, pid, files):
        tries.append(len(files))
        raise crossmem.CrossMemoryError(1, "pidfd_getfd: Operation not permitted")

    monkeypatch.setattr(crossmem, "read_files", refused)
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert all(c.put_many(keys, datas, retention="long"))
        for _ in range(2):
            bufs = [np.zeros(len(d), np.uint8) for d in datas]
            assert [bytes(g) for g in c.get_many(keys, into=bufs)] == datas
        assert tries == [len(keys)], "tried once; the session then asks for no files"
        st = gw.stats()
        assert st["files_lent"]["objects"] == len(keys) and st["files_lent"]["open"] == 0, st["files_lent"]
        assert _objects_open(gw, card) == []


def _own_pidfds() -> set[tuple[str, str]]:
    return {(fd, target) for fd, target in _own_fds() if target == "anon_inode:[pidfd]"}


@pytest.mark.slow
@pytest.mark.skipif(not crossmem.files_supported, reason="needs pidfd_getfd and RWF_NOWAIT")
def test_lent_files_and_loans_a_peer_keeps_are_bounded_and_closed_with_its_connection(gateway_factory,
                                                                                      tmp_path) -> None:
    """A peer that never gives back: a lent get that finds nothing holds no loan; past ``FILES_PER_SESSION``
    files held its gets are lent out of the gateway's memory instead; past ``MAX_LOANS`` held a lent get is
    refused, naming the fix; the files its loans hold are closed when it goes."""
    import socket
    import time

    from kvgate import protocol as p
    from kvgate.gateway.operations import FILES_PER_SESSION, MAX_LOANS
    from tests.gateway.test_inline_bytes import _frame
    from tests.helpers import read_reply as _read_reply

    card = tmp_path / "card"
    gw = gateway_factory(["--max-bytes", "0", "--storage-devices", str(card)])
    keys = [f"kept-{i}".encode() for i in range(5)]
    size = 64 << 10
    with Client.connect(gw.socket, namespace="lent", engine_id="lent") as c:
        assert all(c.put_many(keys, [os.urandom(size) for _ in keys], retention="long"))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(gw.socket)
    s.settimeout(20)
    s.sendall(_frame(p.Hello(id=1, namespace="lent", engine_id="lent", want_shm=False)))
    hello, _ = _read_reply(s)
    assert hello.lends
    for i in range(MAX_LOANS + 10):
        s.sendall(_frame(p.Get(id=2 + i, keys=[b"absent"], region=p.LENT, capacities=[1 << 20], files=True)))
        reply, _ = _read_reply(s)
        assert isinstance(reply, p.GetReply) and reply.loan == 0 and reply.sizes == [p.MISS]
    files = 0
    for i in range(MAX_LOANS):
        s.sendall(_frame(p.Get(id=1000 + i, keys=keys, region=p.LENT, capacities=[size] * 5, files=True)))
        reply, _ = _read_reply(s)
        assert isinstance(reply, p.GetReply) and reply.loan and reply.sizes == [size] * 5, reply
        lent = len(reply.files or ()) // 4
        in_memory = sum(reply.segments[1::2])
        assert lent * size + in_memory == 5 * size, "every hit lent: as a file, or out of the gateway's memory"
        files += lent
    assert files == FILES_PER_SESSION and not reply.files, "past FILES_PER_SESSION, lent out of memory"
    s.sendall(_frame(p.Get(id=5000, keys=keys, region=p.LENT, capacities=[size] * 5, files=True)))
    reply, _ = _read_reply(s)
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST and "GiveBack" in reply.message
    assert gw.stats()["files_lent"]["open"] == FILES_PER_SESSION == len(_objects_open(gw, card))
    s.close()
    deadline = time.monotonic() + 10
    while gw.stats()["files_lent"]["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.stats()["files_lent"]["open"] == 0
    assert _objects_open(gw, card) == []


class _Wire:
    def out_of_step(self, what: str) -> Exception:
        return ConnectionError(what)


@pytest.mark.parametrize("segments, sizes", [
    ([100, 5, 200, 3], [6, 2]),  # a segment straddles two objects
    ([100, 5], [6]),  # fewer bytes than the objects
    ([100, 5, 200, 3], [5]),  # more
    ([100, 5, 200, 0], [5]),  # an empty segment
    ([1, 2, 3], [2]),  # not pairs
    ([], [3]),
])
def test_a_lent_gets_segments_must_be_its_objects_whole(segments: list[int], sizes: list[int]) -> None:
    """A gateway's reply that does not lay each object out as whole segments breaks the connection: the
    client never reads where the lengths disagree."""
    t = object.__new__(SharedMemoryTransport)
    t.wire = _Wire()
    with pytest.raises(ConnectionError, match="lent get's segments"):
        t._lent_segments(segments, sizes)
    assert t._lent_segments([100, 5, 200, 3, 300, 4], [0, 8, 4]).tolist() == [[100, 5], [200, 3], [300, 4]]
