"""Gets into pieces: an ``into`` entry that is a list of buffers is filled in order, and ``Pieces`` (rows of
offsets and sizes in one buffer, as SGLang's pages are fragments of its host pool) fills each key's row.
Against a real gateway, on every path a get takes: read out of the gateway's memory straight into the
pieces (a local client that may, RAM tier and card), through the session region (``cross_memory_gets``
off), and inline over TCP; the bytes are right, a short object fills the first pieces, a miss is None, a
destination too small is named, and loans are given back.  ``Pieces`` is checked before anything is sent."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvgate.client import AsyncClient, Client, InvalidArgument, ObjectTooLarge, Pieces
from kvgate.client.core import get_many_op
from tests.helpers import free_port

KIB = 1 << 10


def _pieces(sizes: list[int]) -> list[np.ndarray]:
    return [np.zeros(n, np.uint8) for n in sizes]


@pytest.mark.parametrize("path", ["lent", "region", "tcp"])
def test_a_get_fills_lists_of_buffers_in_order_on_every_path(gateway_factory, tmp_path, path: str) -> None:
    port = free_port()
    gw = gateway_factory(["--max-bytes", "8M", "--storage-devices", str(tmp_path / "card"), "--port", str(port),
                          "--cross-memory-gets", "false" if path == "region" else "true"])
    # the last is larger than the session region (8 MiB here): where nothing is lent, received whole first
    datas = [os.urandom(n) for n in (512 * KIB, 512 * KIB, 100 * KIB, 3 << 20, 10 << 20)]
    keys = [f"scatter-{i}".encode() for i in range(len(datas))]
    target = f"127.0.0.1:{port}" if path == "tcp" else gw.socket
    with Client.connect(target, namespace="scatter", engine_id="scatter", timeout=30) as c:
        assert all(c.put_many(keys, datas, retention="long"))
        for i in range(4):  # the first ones leave the RAM tier: they come from the card
            c.put_many([f"push-{i}".encode()], [os.urandom(2 << 20)], retention="long")
        dests = [_pieces([32 * KIB] * 16), _pieces([100 * KIB, 412 * KIB]), _pieces([64 * KIB] * 4),
                 _pieces([1 << 20, 2 << 20]), _pieces([4 << 20, 6 << 20])]
        plain = np.zeros(1 << 20, np.uint8)
        got = c.get_many([*keys, b"absent", keys[1]], into=[*dests, _pieces([KIB, KIB]), plain])
        paths = gw.stats()["get_paths"]
        if path == "lent":  # every piece read out of the gateway's memory
            assert paths["lent"] >= 1 and paths["session_region"] == 0, paths
        elif path == "region":
            assert paths["lent"] == 0 and paths["session_region"] >= 1, paths
        for d, g, want in zip(dests, got, datas):
            assert b"".join(bytes(p) for p in g) == want  # the entry: the pieces filled
            assert bytes(np.concatenate(d))[:len(want)] == want
        assert len(got[2]) == 2 and len(got[2][1]) == 36 * KIB, "a short object fills the first pieces"
        assert not dests[2][2].any() and not dests[2][3].any()
        assert got[5] is None
        assert bytes(got[6]) == datas[1]  # a plain buffer beside them
        with pytest.raises(ObjectTooLarge) as ei:
            c.get_many(keys[:2], into=[_pieces([512 * KIB]), _pieces([256 * KIB, 255 * KIB])])
        assert ei.value.index == 1
        with pytest.raises(ObjectTooLarge) as ei:  # a plain buffer after a list, too small
            c.get_many(keys[:2], into=[_pieces([512 * KIB]), np.zeros(10, np.uint8)])
        assert ei.value.index == 1
        assert bytes(c.get_many(keys[:1], into=[plain])[0]) == datas[0]  # still in step
        with pytest.raises(InvalidArgument, match=r"destination buffers\[0\]\[1\] is read-only"):
            c.get_many(keys[:1], into=[[bytearray(10), b"x"]])
        lent_before = gw.stats()["get_paths"]["lent"]
        _pieces_of_one_pool(c, keys, datas)
        if path == "lent":  # the Pieces were read out of the gateway's memory too
            assert gw.stats()["get_paths"]["lent"] > lent_before
    assert gw.stats()["tiers"]["ram"]["pinned_bytes"] == 0, "a loan was not given back"


def _pieces_of_one_pool(c: Client, keys: list[bytes], datas: list[bytes]) -> None:
    """``Pieces`` rows laid out as SGLang's layer-first pool: fragment j of row i at (j * rows + i) x 32 KiB."""
    rows, frags, frag = 5, 16, 32 * KIB
    pool = np.zeros(rows * frags * frag, np.uint8)
    offsets = (np.arange(frags)[None, :] * rows + np.arange(rows)[:, None]) * frag
    pieces = Pieces(pool, offsets, np.full((rows, frags), frag))
    ask = [keys[0], keys[2], b"absent", keys[1], keys[0]]
    got = c.get_many(ask, into=pieces)
    assert got == [512 * KIB, 100 * KIB, None, 512 * KIB, 512 * KIB]  # a hit's entry: the bytes written
    for i, want in enumerate([datas[0], datas[2], b"", datas[1], datas[0]]):
        row = b"".join(bytes(pool[o:o + frag]) for o in offsets[i])
        assert row == want + bytes(len(row) - len(want)), f"row {i}"  # a short object fills the first pieces
    pool[:] = 0
    assert c.get_many([keys[1], keys[0]], into=pieces[3:]) == [512 * KIB, 512 * KIB]  # rows of a slice
    rows_now = [b"".join(bytes(pool[o:o + frag]) for o in offsets[i]) for i in range(rows)]
    assert rows_now[3:] == [datas[1], datas[0]] and not any(any(r) for r in rows_now[:3]), "a slice's rows"
    with pytest.raises(ObjectTooLarge) as ei:
        c.get_many([keys[0], keys[3]], into=pieces[:2])
    assert ei.value.index == 1
    assert bytes(c.get_many(keys[:1])[0]) == datas[0]  # still in step


def test_pieces_are_checked_before_anything_is_sent() -> None:
    buf = np.zeros(100, np.uint8)
    with pytest.raises(InvalidArgument, match=r"piece \[1\]\[0\] \(offset 90, 20 bytes\) is not inside the buffer"):
        Pieces(buf, [[0, 10], [90, 95]], [[10, 10], [20, 5]])
    with pytest.raises(InvalidArgument, match=r"piece \[0\]\[1\]"):
        Pieces(buf, [[0, -1]], [[10, 10]])
    with pytest.raises(InvalidArgument, match=r"piece \[0\]\[0\]"):
        Pieces(buf, np.array([[2**64 - 1]], np.uint64), [[1]])  # wraps negative in int64: still refused
    with pytest.raises(InvalidArgument, match="2-D integer array"):
        Pieces(buf, [0, 10], [10, 10])
    with pytest.raises(InvalidArgument, match="2-D integer array"):
        Pieces(buf, [[0.0]], [[10]])
    with pytest.raises(InvalidArgument, match="of one shape"):
        Pieces(buf, [[0, 10]], [[10]])
    with pytest.raises(InvalidArgument, match="row 1 has no bytes"):
        Pieces(buf, [[0], [10]], [[10], [0]])
    with pytest.raises(InvalidArgument, match="is read-only"):
        Pieces(bytes(100), [[0]], [[10]])
    with pytest.raises(InvalidArgument, match="sliced by rows"):
        Pieces(buf, [[0]], [[10]])[0]
    with pytest.raises(InvalidArgument, match="2 keys but 1 rows of Pieces"):  # (checked before any call)
        get_many_op([b"a", b"b"], Pieces(buf, [[0]], [[10]]), None)


@pytest.mark.parametrize("lend", [True, False])
def test_the_async_client_fills_lists_of_buffers_too(gateway_factory, lend: bool) -> None:
    gw = gateway_factory(["--max-bytes", "64M", "--cross-memory-gets", "true" if lend else "false"])
    datas = [os.urandom(n) for n in (300 * KIB, 10 << 20)]  # the second is larger than the session region
    keys = [b"async-a", b"async-b"]

    async def run() -> list:
        async with AsyncClient.connect(gw.socket, namespace="scatter", engine_id="scatter", timeout=30) as c:
            assert all(await c.put_many(keys, datas))
            return await c.get_many(keys, into=[_pieces([100 * KIB, 200 * KIB]), _pieces([5 << 20, 5 << 20])])

    got = asyncio.run(run())
    assert [b"".join(bytes(p) for p in g) for g in got] == datas
    assert [len(g) for g in got] == [2, 2]


@pytest.mark.parametrize("lend", [True, False])
def test_the_async_client_fills_pieces_too(gateway_factory, lend: bool) -> None:
    """``Pieces`` through ``AsyncClient``: lent (out of the mapped RAM arena) and through the session
    region, the second object larger than that region; a miss is None."""
    gw = gateway_factory(["--max-bytes", "64M", "--cross-memory-gets", "true" if lend else "false"])
    datas = [os.urandom(n) for n in (300 * KIB, 10 << 20)]
    keys = [b"async-a", b"async-b", b"async-absent"]
    pool = np.zeros(24 << 20, np.uint8)
    # each object in two pieces, the second piece first in the pool
    pieces = Pieces(pool, [[1 << 20, 0], [(12 << 20) + 4096, 2 << 20], [20 << 20, (20 << 20) + 4096]],
                    [[100 * KIB, 200 * KIB], [5 << 20, 5 << 20], [4096, 4096]])

    async def run() -> list:
        async with AsyncClient.connect(gw.socket, namespace="scatter", engine_id="scatter", timeout=30) as c:
            assert all(await c.put_many(keys[:2], datas))
            return await c.get_many(keys, into=pieces)

    assert asyncio.run(run()) == [300 * KIB, 10 << 20, None]
    assert bytes(pool[1 << 20:(1 << 20) + 100 * KIB]) + bytes(pool[:200 * KIB]) == datas[0]
    assert bytes(pool[(12 << 20) + 4096:][:5 << 20]) + bytes(pool[2 << 20:(2 << 20) + (5 << 20)]) == datas[1]
    assert not pool[20 << 20:].any()
    assert (gw.stats()["get_paths"]["lent"] > 0) == lend
