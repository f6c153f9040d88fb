"""The on-card object header: layout, round trips, and every way it can be bad."""

from __future__ import annotations

import struct
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.cards.objectformat import (
    ALIGN,
    FIXED_SIZE,
    FLAG_PADDED,
    MAGIC,
    VERSION,
    BufferTooSmall,
    ObjectCorrupt,
    ObjectMissing,
    ObjectTooNew,
    ObjectMeta,
    header_size,
    pack_header,
    padded_size,
    parse_header,
    peek_header,
)
from kvgate.keys import payload_hash, payload_hasher
from kvgate.keys import NO_DIALOG, dialog_digest, full_key

KEY = full_key(b"tenant", b"block-0001")
META = ObjectMeta(dialog=dialog_digest(b"chat-42"), position=7, created_ns=1_700_000_000_123_456_789)

# The layout as documented in objectformat's docstring, written out again so
# an accidental change to the format fails here.
_DOC_FIXED = struct.Struct("<4sHHIHHQQq16sQ")


def _craft(key: bytes, *, magic: bytes = MAGIC, version: int = VERSION, hlen: int | None = None,
           klen: int | None = None, plen: int = 10, pcrc: int = 0, flags: int = 0) -> bytes:
    """A header with a correct header hash but chosen (possibly wrong) fields."""
    hlen = FIXED_SIZE + len(key) if hlen is None else hlen
    klen = len(key) if klen is None else klen
    fixed = _DOC_FIXED.pack(magic, version, flags, hlen, klen, 0, plen, 1, -1, NO_DIALOG, pcrc)
    return fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + key)) + key


def test_layout_matches_documentation() -> None:
    h = pack_header(KEY, 12345, 0xDEADBEEF01234567, META)
    assert len(h) == header_size(KEY) == 72 + len(KEY)
    assert h[0:4] == b"KVGO"
    assert struct.unpack_from("<H", h, 4)[0] == 1
    assert struct.unpack_from("<H", h, 6)[0] == 0
    assert struct.unpack_from("<I", h, 8)[0] == 72 + len(KEY)
    assert struct.unpack_from("<H", h, 12)[0] == len(KEY)
    assert struct.unpack_from("<Q", h, 16)[0] == 12345
    assert struct.unpack_from("<Q", h, 24)[0] == META.created_ns
    assert struct.unpack_from("<q", h, 32)[0] == 7
    assert h[40:56] == META.dialog
    assert struct.unpack_from("<Q", h, 56)[0] == 0xDEADBEEF01234567
    assert struct.unpack_from("<Q", h, 64)[0] == xxhash.xxh3_64_intdigest(h[:64] + KEY)
    assert h[72:] == KEY


def test_round_trip() -> None:
    h = pack_header(KEY, 4096, 99, META)
    parsed = parse_header(h, expect_key=KEY)
    assert parsed.header_len == len(h)
    assert parsed.payload_len == 4096
    assert parsed.payload_hash == 99
    assert parsed.meta == META
    assert parsed.full_key == KEY
    assert parse_header(bytearray(h)) == parsed
    assert parse_header(memoryview(h)) == parsed


def test_trailing_bytes_are_ignored() -> None:
    # Scans read a header plus whatever follows it in one go.
    h = pack_header(KEY, 3, 0, META)
    assert parse_header(h + b"payload and more", expect_key=None).full_key == KEY


def test_created_defaults_to_now() -> None:
    before = time.time_ns()
    parsed = parse_header(pack_header(KEY, 0, 0, ObjectMeta()))
    assert before <= parsed.meta.created_ns <= time.time_ns()
    assert parsed.meta.dialog == NO_DIALOG
    assert parsed.meta.position == -1


@settings(max_examples=60, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=1300),
    plen=st.integers(min_value=0, max_value=(1 << 64) - 1),
    pcrc=st.integers(min_value=0, max_value=(1 << 64) - 1),
    dialog=st.binary(min_size=16, max_size=16),
    position=st.integers(min_value=-1, max_value=(1 << 63) - 1),
    created=st.integers(min_value=1, max_value=(1 << 64) - 1),
)
def test_round_trip_property(key: bytes, plen: int, pcrc: int, dialog: bytes, position: int, created: int) -> None:
    meta = ObjectMeta(dialog=dialog, position=position, created_ns=created)
    h = pack_header(key, plen, pcrc, meta)
    assert len(h) == header_size(key)
    parsed = parse_header(h, expect_key=key)
    assert (parsed.full_key, parsed.payload_len, parsed.payload_hash, parsed.meta) == (key, plen, pcrc, meta)


@pytest.mark.parametrize("expect", [KEY, None], ids=["expect-key", "any-key"])
def test_every_single_byte_flip_is_corrupt(expect: bytes | None) -> None:
    h = pack_header(KEY, 1000, 1234, META)
    for i in range(len(h)):
        for bit in (0x01, 0x80):
            bad = bytearray(h)
            bad[i] ^= bit
            with pytest.raises(ObjectCorrupt):
                parse_header(bad, expect_key=expect)


def test_every_truncation_is_corrupt() -> None:
    h = pack_header(KEY, 1000, 1234, META)
    for n in range(len(h)):
        with pytest.raises(ObjectCorrupt):
            parse_header(h[:n], expect_key=KEY)
        with pytest.raises(ObjectCorrupt):
            parse_header(h[:n], expect_key=None)


def test_bad_magic() -> None:
    with pytest.raises(ObjectCorrupt, match="magic"):
        parse_header(_craft(KEY, magic=b"KVGX"))


def test_a_whole_header_of_a_newer_version_is_too_new_not_corrupt() -> None:
    with pytest.raises(ObjectTooNew, match="version"):
        parse_header(_craft(KEY, version=VERSION + 1), expect_key=KEY)
    # a newer version may carry fields after the key
    longer = bytearray(_craft(KEY, version=VERSION + 1, hlen=FIXED_SIZE + len(KEY) + 16)) + bytes(16)
    with pytest.raises(ObjectTooNew):
        parse_header(longer)
    with pytest.raises(ObjectCorrupt, match="version"):
        parse_header(_craft(KEY, version=0))
    assert issubclass(ObjectTooNew, ObjectMissing) and not issubclass(ObjectTooNew, ObjectCorrupt)


def test_a_flipped_version_bit_is_corrupt_not_too_new() -> None:
    h = bytearray(pack_header(KEY, 1000, 1234, META))
    h[4] ^= 0x02  # version 1 -> 3, the header hash no longer matches
    with pytest.raises(ObjectCorrupt, match="checksum"):
        parse_header(h, expect_key=KEY)


@pytest.mark.parametrize("field", ["hlen-short", "hlen-long", "klen"])
def test_inconsistent_lengths(field: str) -> None:
    if field == "hlen-short":
        h = _craft(KEY, hlen=FIXED_SIZE + len(KEY) - 1)
    elif field == "hlen-long":
        h = _craft(KEY, hlen=FIXED_SIZE + len(KEY) + 1)
    else:
        h = _craft(KEY, klen=len(KEY) + 1)
    with pytest.raises(ObjectCorrupt, match="length"):
        parse_header(h)


@pytest.mark.parametrize("key", [KEY, full_key(b"t", b"k" * 5000)], ids=["short-key", "long-key"])
def test_padded_header_puts_the_payload_on_a_block_boundary(key: bytes) -> None:
    h = pack_header(key, 12345, 7, META, padded=True)
    hsize = header_size(key)
    assert len(h) == padded_size(hsize) == (4096 if hsize <= 4096 else 8192)
    assert struct.unpack_from("<H", h, 6)[0] == FLAG_PADDED
    assert h[hsize:] == bytes(len(h) - hsize)
    parsed = parse_header(h, expect_key=key)
    assert parsed.header_len == hsize
    assert parsed.payload_offset == len(h) and parsed.payload_offset % ALIGN == 0
    assert parsed.object_size == len(h) + 12345
    plain = parse_header(pack_header(key, 12345, 7, META), expect_key=key)
    assert plain.payload_offset == hsize and plain.meta == parsed.meta


def test_unknown_flags_in_a_whole_header_are_too_new() -> None:
    assert parse_header(_craft(KEY, flags=FLAG_PADDED)).payload_offset == ALIGN
    with pytest.raises(ObjectTooNew, match="flags"):
        parse_header(_craft(KEY, flags=2))


def test_crafted_header_is_accepted() -> None:
    # Guards the crafting helper itself: the cases above fail for the field
    # they change, not for a mistake in the helper.
    assert parse_header(_craft(KEY), expect_key=KEY).full_key == KEY


@pytest.mark.parametrize(
    "other", [full_key(b"tenant", b"block-0002"), full_key(b"tenant", b"block-00001"), full_key(b"t", b"b")]
)
def test_another_key_is_corrupt(other: bytes) -> None:
    h = pack_header(other, 10, 0, META)
    assert parse_header(h).full_key == other
    with pytest.raises(ObjectCorrupt):
        parse_header(h, expect_key=KEY)


def test_header_crc_mismatch_message() -> None:
    bad = bytearray(pack_header(KEY, 10, 0, META))
    bad[33] ^= 1  # inside the position field: only the header hash can notice
    with pytest.raises(ObjectCorrupt, match="checksum"):
        parse_header(bad)


def test_payload_hash_known_value_and_incremental() -> None:
    assert payload_hash(b"") == 0x2D06800538D394C2  # XXH3-64 of nothing, seed 0
    data = bytes(range(256)) * 1000
    whole = payload_hash(data)
    assert whole != payload_hash(data[:-1] + b"x")
    for cut in (0, 1, 4095, len(data) // 2, len(data)):
        h = payload_hasher()
        h.update(memoryview(data)[:cut])
        h.update(memoryview(data)[cut:])
        assert h.intdigest() == whole


def test_buffer_too_small_carries_needed() -> None:
    exc = BufferTooSmall(12345)
    assert exc.needed == 12345
    assert "12345" in str(exc)


def test_peek_header_reads_more_only_for_a_header_longer_than_its_start() -> None:
    key = full_key(b"tenant", b"k" * 300)
    obj = pack_header(key, 50, 1234, META) + bytes(50)
    reads: list[int] = []

    def read_head(n: int) -> bytes:
        reads.append(n)
        return obj[:n]

    assert peek_header(obj[:FIXED_SIZE + 400], len(obj), read_head).full_key == key
    assert reads == []
    header = peek_header(obj[:FIXED_SIZE + 16], len(obj), read_head)
    assert (header.full_key, header.payload_len, header.meta) == (key, 50, META)
    assert reads == [header_size(key)]


def test_peek_header_checks_the_object_size_and_never_reads_past_the_object() -> None:
    obj = pack_header(KEY, 50, 1234, META) + bytes(50)
    with pytest.raises(ObjectCorrupt, match="object file is 40 bytes, its header says"):
        peek_header(obj, 40, pytest.fail, "object file")
    with pytest.raises(ObjectCorrupt, match="^object is 200 bytes"):
        peek_header(obj, 200, pytest.fail)
    # A header longer than the whole object is corrupt without a second read.
    with pytest.raises(ObjectCorrupt):
        peek_header(obj[:FIXED_SIZE], FIXED_SIZE + 1, pytest.fail)
