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


def _nested(levels: int, rid: bytes = b"\x2a") -> bytes:
    """{"op": "lookup", "id": 42, "keys": [[[...]]]}, ``levels`` deep."""
    return b"\x83\xa2op\xa6lookup\xa2id" + rid + b"\xa4keys" + b"\x91" * levels + b"\xc0"


@pytest.mark.parametrize("header, rid", [
    (_nested(1_000_000), 42),
    (_nested(5000, rid=b"\xcd\x01\x05"), 261),  # a uint16 id
    (b"\x81\xa1x" * 100_000 + b"\xc0", 0),  # maps all the way down: no id to read
    (b"\x91" * 100_000 + b"\xc0", 0),
])
def test_a_deeply_nested_header_is_a_bad_request_not_a_recursion_error(header, rid):
    with pytest.raises(p.RequestError) as e:
        p.decode_request(header)
    assert e.value.code == p.ErrorCode.BAD_REQUEST and e.value.request_id == rid
    assert "nested" in str(e.value)


def test_a_frame_over_the_limit_says_how_to_skip_it():
    with pytest.raises(p.FrameTooLarge) as e:
        p.parse_preamble(p.PREAMBLE.pack(b"KG", 1, 0, 100, 2 << 20), 1 << 20)
    assert (e.value.code, e.value.header_len, e.value.body_len) == (p.ErrorCode.TOO_LARGE, 100, 2 << 20)
    assert "max_frame_bytes" in str(e.value)
    with pytest.raises(p.FrameError) as e:  # a header over the header limit cannot be skipped
        p.parse_preamble(p.PREAMBLE.pack(b"KG", 1, 0, p.MAX_HEADER_BYTES + 1, 0), 1 << 30)
    assert not isinstance(e.value, p.FrameTooLarge)


def test_a_request_source_costs_older_peers_nothing():
    """``source`` (Lookup, Exists, Get) is sent only when set, and a gateway from before it skips it."""
    enc = msgspec.msgpack.encode
    for cls in (p.Lookup, p.Exists, p.Get):
        assert b"source" not in enc(cls(keys=[b"a"]))  # an unsourced request is byte for byte as before
        sourced = cls(keys=[b"a"], source="10.0.0.7:8200")
        assert p.decode_request(enc(sourced)) == sourced

        class Before(msgspec.Struct, tag_field="op", tag=cls.__struct_config__.tag, omit_defaults=True,
                     forbid_unknown_fields=False):  # the message as an older gateway decodes it
            id: int = 0
            keys: list[bytes] = []

        assert msgspec.msgpack.decode(enc(sourced), type=Before).keys == [b"a"]
    assert p.decode_request(enc({"op": "lookup", "id": 3, "keys": [b"a"]})).source is None  # an older client's
