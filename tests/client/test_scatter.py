"""Gets into pieces: an ``into`` entry that is a list of buffers is filled in order (SGLang's pages are
fragments of its host pool).  Against a real gateway, on every path a get takes: read out of the
gateway's memory straight into the pieces (a local client that may, RAM tier and card), through the
session region (``cross_memory_gets`` off), and inline over TCP; the bytes are right, a short object
fills the first pieces, a miss is None, a destination too small is named, and loans are given back."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvgate.client import AsyncClient, Client, InvalidArgument, ObjectTooLarge
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
    assert gw.stats()["tiers"]["ram"]["pinned_bytes"] == 0, "a loan was not given back"


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
