"""Objects larger than a session's shared-memory region, or than a frame, against a real gateway.

A 3 MiB object and a 1 MiB session region: stored over TCP, it must read
over the Unix socket (packed and into a buffer); stored over the Unix
socket from a plain buffer, it travels inline.  An object no frame can
carry is refused before anything is sent, and the connection goes on.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers import free_port
from kvgate.client import Client, GatewayError
from kvgate.protocol import ErrorCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ENGINE = "large"
NS = "large-ns"
MIB = 1 << 20


def _exact(got, want: bytes) -> None:
    assert got is not None, "a miss"
    assert bytes(got) == want


@pytest.fixture
def small_region(gateway_factory):
    port = free_port()
    gw = gateway_factory(["--shared-memory-size", "1M", "--port", str(port), "--max-bytes", "64M"])
    return gw, f"127.0.0.1:{port}"


def test_an_object_larger_than_the_session_region_reads_and_writes_over_the_unix_socket(small_region) -> None:
    gw, tcp = small_region
    big, small, other = os.urandom(3 * MIB), os.urandom(100_000), os.urandom(MIB + 7)
    with Client.connect(tcp, namespace=NS, engine_id=ENGINE) as t, \
            Client.connect(gw.socket, namespace=NS, engine_id=ENGINE) as u:
        with u._session as session:
            assert session.transport.session_region is not None and session.transport.session_region.size == MIB
        assert t.put_many([b"big"], [big]) == [True]
        # packed: alone, and between objects that fit the region
        assert u.get_many([b"big"]) == [big]
        assert u.get_many([b"s1", b"big", b"absent", b"big"]) == [None, big, None, big]
        assert t.put_many([b"s1"], [small]) == [True]
        assert u.get_many([b"s1", b"big", b"s1"]) == [small, big, small]
        # into a plain buffer larger than the region: received straight into it
        dst = bytearray(3 * MIB + 100)
        got = u.get_many([b"big"], into=[dst])
        _exact(got[0], big)
        assert bytes(dst[3 * MIB :]) == bytes(100)
        got = u.get_many([b"s1", b"big", b"absent"], into=[bytearray(200_000), np.zeros(3 * MIB, np.uint8),
                                                           bytearray(4 * MIB)])
        _exact(got[0], small)
        _exact(got[1], big)
        assert got[2] is None
        # stored over the Unix socket from plain buffers, some larger than the region, and read back both ways
        assert u.put_many([b"u1", b"u2", b"u3"], [other, small, big[::-1]], dialog=b"d", position=0) == [True] * 3
        assert u.get_many([b"u1", b"u2", b"u3"], dialog=b"d") == [other, small, big[::-1]]
        got = u.get_many([b"u3", b"u1", b"u2"], into=[bytearray(3 * MIB), bytearray(2 * MIB), bytearray(MIB)],
                         dialog=b"d")
        for g, w in zip(got, [big[::-1], other, small]):
            _exact(g, w)
        assert t.get_many([b"u1", b"u2", b"u3"], dialog=b"d") == [other, small, big[::-1]]
        assert not u.broken and not t.broken


def test_an_object_no_frame_can_carry_is_refused_and_the_connection_goes_on(gateway_factory) -> None:
    port = free_port()
    gw = gateway_factory(["--shared-memory-size", "1M", "--max-frame-bytes", "2M", "--port", str(port)])
    too_big = os.urandom(2 * MIB)
    for target in (f"127.0.0.1:{port}", gw.socket):
        with Client.connect(target, namespace=NS, engine_id=ENGINE) as c:
            assert c.max_frame_bytes == 2 * MIB
            with pytest.raises(GatewayError) as ei:
                c.put_many([b"first", b"huge"], [b"f", too_big])
            e = ei.value
            assert e.code == ErrorCode.TOO_LARGE
            for words in ("object 1", str(2 * MIB), "max_frame_bytes"):
                assert words in e.message, e.message
            assert not c.broken
            assert c.lookup([b"first"]) == 0  # refused whole, before anything was sent
            fits = os.urandom(2 * MIB - 4096)  # one frame with its request
            assert c.put_many([b"first", b"fits"], [b"f", fits]) == [True, True]
            assert c.get_many([b"first", b"fits"]) == [b"f", fits]
            c.delete_many([b"first", b"fits"])
    assert gw.alive()
