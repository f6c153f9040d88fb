import msgspec
import pytest

from kvgate import protocol as p


def frame(msg):
    return p.encode_frame(msg)


def test_round_trip_of_every_request():
    for msg in [p.Hello(namespace="ns", engine_id="e"), p.Put(keys=[b"a"], sizes=[3], region=0, offsets=[0]),
                p.Get(keys=[b"a"], region=-1), p.Lookup(keys=[b"a", b"b"], dialog=b"d"), p.Exists(keys=[b"x"]),
                p.Delete(keys=[b"x"]), p.Prewarm(keys=[b"x"]), p.Clean(), p.Stats(), p.RegisterRegion(path="/dev/shm/x")]:
        msg.id = 7
        data = frame(msg)
        kind, hlen, blen = p.parse_preamble(data[: p.PREAMBLE_SIZE], 1 << 20)
        assert (kind, blen) == (p.KIND_REQUEST, 0)
        assert p.decode_request(data[p.PREAMBLE_SIZE : p.PREAMBLE_SIZE + hlen]) == msg


def test_bad_preambles():
    good = frame(p.Stats())
    with pytest.raises(p.FrameError) as e:
        p.parse_preamble(b"XX" + good[2:12], 1 << 20)
    assert e.value.code == p.ErrorCode.BAD_FRAME
    with pytest.raises(p.FrameError) as e:
        p.parse_preamble(good[:2] + bytes([9]) + good[3:12], 1 << 20)
    assert e.value.code == p.ErrorCode.BAD_VERSION
    with pytest.raises(p.FrameError) as e:
        p.parse_preamble(p.PREAMBLE.pack(b"KG", 1, 0, 10, 1 << 30), 1 << 20)
    assert e.value.code == p.ErrorCode.TOO_LARGE
    with pytest.raises(p.FrameError):
        p.parse_preamble(p.PREAMBLE.pack(b"KG", 1, 0, 0, 0), 1 << 20)


def test_unknown_op_and_bad_fields_keep_the_id():
    enc = msgspec.msgpack.encode
    with pytest.raises(p.RequestError) as e:
        p.decode_request(enc({"op": "explode", "id": 42}))
    assert e.value.code == p.ErrorCode.UNKNOWN_OP and e.value.request_id == 42
    with pytest.raises(p.RequestError) as e:
        p.decode_request(enc({"op": "put", "id": 5, "keys": "not a list"}))
    assert e.value.code == p.ErrorCode.BAD_REQUEST and e.value.request_id == 5
    with pytest.raises(p.RequestError) as e:
        p.decode_request(b"\xc1garbage")
    assert e.value.code == p.ErrorCode.BAD_REQUEST
