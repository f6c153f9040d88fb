"""DirectoryCard against real files: round trips, corruption, crashes, races."""

from __future__ import annotations

import errno
import json
import mmap
import multiprocessing
import multiprocessing.sharedctypes
import multiprocessing.synchronize
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvgate.cards import (
    CardInUse,
    CardUnavailable,
    DirectoryCard,
    Header,
    ObjectCorrupt,
    ObjectMeta,
    ObjectMissing,
    ObjectTooNew,
)
from kvgate.cards.base import HOST_TAG
from kvgate.cards.directory.directio import SUPPORTED
from kvgate.cards.directory.layout import LABEL_NAME
from kvgate.cards.directory.scan import STALE_TEMP_SECONDS
from kvgate.cards.objectformat import ALIGN, CHECKSUM_PIECE, header_size, pack_header, padded_size
from kvgate.keys import key_digest, payload_hash
from tests.cards.common import check_snapshot_round_trip, key, payload_for
from tests.helpers import as_newer_format, evict, pages_cached, wait_until

P = CHECKSUM_PIECE
GUARD = 4096
GUARD_BYTE = 0xEE

# fork is much cheaper than spawn on a loaded 2-core machine; the children
# only touch files, so fork's caveats do not apply.
_MP = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


@pytest.fixture
def card(tmp_path: Path) -> DirectoryCard:
    c = DirectoryCard(str(tmp_path / "card"), num_dbs=2)
    c.open()
    return c


def read_back(c: DirectoryCard, k: bytes, size_hint: int) -> tuple[Header, np.ndarray]:
    buf = np.empty(size_hint, dtype=np.uint8)
    h = c.read_into(k, memoryview(buf))
    return h, buf[: h.payload_len]


# ---------------------------------------------------------------- the object file


@pytest.mark.parametrize("size", [0, 1, P + 1])
def test_an_object_file_is_its_header_padded_to_a_block_then_its_payload(card: DirectoryCard, size: int) -> None:
    """The layout direct reads rely on; the round trip itself is the conformance suite's."""
    k = key(size)
    data = payload_for(k, size)
    stored = card.write(k, memoryview(data), ObjectMeta(position=size))
    assert stored == padded_size(header_size(k)) + size
    assert os.path.getsize(card.object_path(k)) == stored
    with open(card.object_path(k), "rb") as f:
        f.seek(padded_size(header_size(k)))
        assert f.read() == data.tobytes()


def test_sync_writes(tmp_path: Path) -> None:
    c = DirectoryCard(str(tmp_path / "c"), sync_writes=True)
    c.open()
    k = key("sync")
    data = payload_for(k, P + 3)
    c.write(k, memoryview(data), ObjectMeta())
    assert np.array_equal(read_back(c, k, P + 3)[1], data)


def test_prepare_reads_looks_up_each_object_file_and_never_raises(card: DirectoryCard, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    k = key("here")
    card.write(k, memoryview(payload_for(k, 5000)), ObjectMeta())
    seen: list[str] = []
    real_stat = os.stat

    def stat(path, *a, **kw):
        seen.append(os.fspath(path))
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    card.prepare_reads([k, key("absent")])
    assert seen == [card.object_path(k), card.object_path(key("absent"))]
    shutil.rmtree(card.location)  # a card that went away: still no exception
    card.prepare_reads([k])
    monkeypatch.undo()
    with pytest.raises(CardUnavailable):
        card.read_into(k, memoryview(bytearray(5000)))


# ------------------------------------------------------------- direct reads


def aligned(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A page-aligned buffer, as vLLM's CPU tier and the RAM tier are."""
    m = mmap.mmap(-1, max(size, 1))
    return m, np.frombuffer(m, dtype=np.uint8)[:size]


needs_cachestat = pytest.mark.skipif(
    not SUPPORTED or pages_cached(__file__) is None, reason="kernel without cachestat(2) or O_DIRECT")


@needs_cachestat
@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, P + 1, (3 << 20) + 7])
@pytest.mark.parametrize("slack", [0, 1000])
def test_cold_read_is_direct_and_touches_nothing_past_the_payload(card: DirectoryCard, size: int,
                                                                   slack: int) -> None:
    k = key(f"cold-{size}")
    data = payload_for(k, size)
    card.write(k, memoryview(data), ObjectMeta(position=3))
    path = card.object_path(k)
    evict(path)
    if pages_cached(path):
        pytest.skip("this filesystem keeps the file cached")
    m, buf = aligned(size + slack + GUARD)
    buf[:] = GUARD_BYTE
    h = card.read_into(k, memoryview(m)[: size + slack])
    assert h.payload_len == size and h.meta.position == 3
    assert np.array_equal(buf[:size], data)
    assert (buf[size:] == GUARD_BYTE).all()
    # Read around the page cache: it holds no more of the file than before.
    assert pages_cached(path) == 0
    assert card.direct_reads


@needs_cachestat
def test_cached_file_is_read_through_the_page_cache(card: DirectoryCard) -> None:
    k = key("warm")
    data = payload_for(k, 2 * P + 5)
    card.write(k, memoryview(data), ObjectMeta())
    path = card.object_path(k)
    with open(path, "rb") as f:
        f.read()
    assert pages_cached(path) == -(-os.path.getsize(path) // mmap.PAGESIZE)
    m, buf = aligned(len(data))
    card.read_into(k, memoryview(m))
    assert np.array_equal(buf, data)
    # A direct read would leave the page cache as full as a copy does; which way it went shows in
    # what the card timed: the copy, and (nothing read cold yet) no direct read.
    assert card.cached_reads.copy_rate is not None and card.cached_reads.direct_rate is None


@needs_cachestat
def test_direct_reads_off_reads_through_the_page_cache(tmp_path: Path) -> None:
    c = DirectoryCard(str(tmp_path / "c"), direct_reads=False)
    c.open()
    k = key("buffered")
    data = payload_for(k, P + 1)
    c.write(k, memoryview(data), ObjectMeta())
    evict(c.object_path(k))
    m, buf = aligned(len(data))
    c.read_into(k, memoryview(m))
    assert np.array_equal(buf, data)
    assert pages_cached(c.object_path(k))


def test_filesystem_refusing_direct_io_falls_back_once(card: DirectoryCard, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import kvgate.cards.directory.card as directory

    monkeypatch.setattr(directory, "set_direct", lambda fd, on: not on)  # refuses O_DIRECT, allows clearing it
    monkeypatch.setattr(directory, "fully_cached", lambda fd, size: False)
    k = key("refused")
    data = payload_for(k, P + 9)
    card.write(k, memoryview(data), ObjectMeta())
    m, buf = aligned(len(data))
    with caplog.at_level("WARNING", logger="kvgate.cards.directory.card"):
        card.read_into(k, memoryview(m))
        card.read_into(k, memoryview(m))
    assert np.array_equal(buf, data)
    assert not card.direct_reads
    assert sum("direct reads are off" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("cold", [False, True], ids=["unaligned-dest", "aligned-cold"])
@pytest.mark.parametrize("size", [0, 5, P + 3])
def test_unpadded_object_is_still_read(card: DirectoryCard, size: int, cold: bool) -> None:
    """Objects written before payloads were padded to a block boundary keep reading right."""
    k = key(f"old-{size}")
    data = payload_for(k, size)
    path = card.object_path(k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pack_header(k, size, payload_hash(memoryview(data)), ObjectMeta(position=4)))
        f.write(data.tobytes())
    if cold:
        evict(path)
        m, buf = aligned(size)
        dest = memoryview(m)[:size]
    else:
        buf = np.zeros(size + 1, dtype=np.uint8)[1:]  # not aligned
        dest = memoryview(buf)
    h = card.read_into(k, dest)
    assert h.payload_offset == header_size(k) and h.meta.position == 4
    assert np.array_equal(buf[:size], data)
    assert [o.stored_bytes for o in card.scan()] == [header_size(k) + size]


# ---------------------------------------------------------------- corruption


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(path: str, new_size: int) -> None:
    os.truncate(path, new_size)


def _corruptions(k: bytes, size: int) -> dict[str, Callable[[str], None]]:
    hs = header_size(k)
    po = padded_size(hs)  # where the payload starts
    return {
        "payload-first-byte": lambda p: _flip(p, po),
        "payload-middle": lambda p: _flip(p, po + size // 2),
        "payload-last-byte": lambda p: _flip(p, po + size - 1),
        "payload-second-piece": lambda p: _flip(p, po + P + 3),
        "header-magic": lambda p: _flip(p, 0),
        "header-payload-len": lambda p: _flip(p, 16),
        "header-position": lambda p: _flip(p, 33),
        "header-payload-crc": lambda p: _flip(p, 57),
        "header-crc": lambda p: _flip(p, 65),
        "header-key": lambda p: _flip(p, hs - 1),
        "truncate-one": lambda p: _truncate(p, po + size - 1),
        "truncate-to-padding": lambda p: _truncate(p, po),
        "truncate-to-header": lambda p: _truncate(p, hs),
        "truncate-inside-header": lambda p: _truncate(p, hs - 5),
        "truncate-empty": lambda p: _truncate(p, 0),
        "append-byte": lambda p: open(p, "ab").write(b"\0"),
    }


CORRUPTIONS = sorted(_corruptions(key(0), 10))


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corruption_is_detected_and_deleted(card: DirectoryCard, how: str, direct: bool) -> None:
    k = key("victim")
    size = 2 * P + 5
    card.write(k, memoryview(payload_for(k, size)), ObjectMeta())
    path = card.object_path(k)
    _corruptions(k, size)[how](path)
    if direct:
        evict(path)  # cold, into aligned memory: the O_DIRECT path where the kernel has it
        m, _buf = aligned(size + 10)
        dest = memoryview(m)
    else:
        dest = memoryview(np.zeros(size + 11, dtype=np.uint8)[1:])  # never aligned: buffered
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, dest)
    assert not os.path.exists(path)
    assert not card.exists(k)
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(np.zeros(size + 10, dtype=np.uint8)))


@pytest.mark.parametrize("other_name", ["block-other", "other-length-key"])
def test_file_holding_another_key_is_corrupt(card: DirectoryCard, other_name: str) -> None:
    k, other = key("victim"), key(other_name)
    card.write(k, memoryview(payload_for(k, 100)), ObjectMeta())
    card.write(other, memoryview(payload_for(other, 100)), ObjectMeta())
    shutil.copyfile(card.object_path(other), card.object_path(k))
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, memoryview(bytearray(1000)))
    assert not card.exists(k)
    assert card.exists(other)  # the source is untouched


def test_corrupt_object_is_not_returned_in_small_buffer(card: DirectoryCard) -> None:
    # Corruption wins over BufferTooSmall when the file's size already gives it away.
    k = key("c")
    card.write(k, memoryview(payload_for(k, 1000)), ObjectMeta())
    open(card.object_path(k), "ab").write(b"x")
    with pytest.raises(ObjectCorrupt):
        card.read_into(k, memoryview(bytearray(10)))
    assert not card.exists(k)


# --------------------------------------------------------------------- label


def test_label_created_once_and_stable(tmp_path: Path) -> None:
    loc = tmp_path / "a" / "b"  # parents are created too
    c = DirectoryCard(str(loc))
    serial = c.open()
    assert c.serial == serial
    label = json.loads((loc / LABEL_NAME).read_text())
    assert label["serial"] == serial and label["format"] == 1 and "created" in label
    before = (loc / LABEL_NAME).read_bytes()
    assert c.open() == serial
    assert DirectoryCard(str(loc), num_dbs=4).open() == serial
    assert c.check() == serial
    assert (loc / LABEL_NAME).read_bytes() == before
    # open() leaves no label temp files behind, and does not pre-create dbs.
    assert sorted(os.listdir(loc)) == [LABEL_NAME]


def test_two_cards_get_different_serials(tmp_path: Path) -> None:
    assert DirectoryCard(str(tmp_path / "x")).open() != DirectoryCard(str(tmp_path / "y")).open()


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"format": 1}', b'{"serial": "ab", "format": 2}'])
def test_bad_label_is_unavailable(tmp_path: Path, content: bytes) -> None:
    loc = tmp_path / "card"
    loc.mkdir()
    (loc / LABEL_NAME).write_bytes(content)
    c = DirectoryCard(str(loc))
    with pytest.raises(CardUnavailable) as info:
        c.open()
    assert str(loc / LABEL_NAME) in str(info.value)
    assert (loc / LABEL_NAME).read_bytes() == content  # never rewritten


def _open_after(location: str, go: multiprocessing.synchronize.Event, out: multiprocessing.Queue) -> None:
    go.wait()
    out.put(DirectoryCard(location).open())


@pytest.mark.slow  # starts processes
def test_processes_racing_to_label_agree(tmp_path: Path) -> None:
    for round_ in range(3):
        loc = str(tmp_path / f"race{round_}")
        go, out = _MP.Event(), _MP.Queue()
        procs = [_MP.Process(target=_open_after, args=(loc, go, out)) for _ in range(4)]
        for p in procs:
            p.start()
        go.set()
        serials = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert len(set(serials)) == 1
        assert DirectoryCard(loc).check() == serials[0]
        assert sorted(os.listdir(loc)) == [LABEL_NAME]


# --------------------------------------------------------------------- shards


def test_num_dbs_spreads_objects(tmp_path: Path) -> None:
    c = DirectoryCard(str(tmp_path / "card"), num_dbs=4)
    c.open()
    keys = [key(i) for i in range(64)]
    for k in keys:
        c.write(k, memoryview(payload_for(k, 50)), ObjectMeta())
    used = set()
    for k in keys:
        d = key_digest(k)
        db = int.from_bytes(d[:4], "little") % 4
        expected = tmp_path / "card" / f"db{db:02d}" / d.hex()[:2] / d.hex()
        assert c.object_path(k) == str(expected)
        assert expected.is_file()
        used.add(db)
    assert used == {0, 1, 2, 3}
    assert sorted(p.name for p in (tmp_path / "card").iterdir() if p.is_dir()) == ["db00", "db01", "db02", "db03"]
    assert {o.full_key for o in c.scan()} == set(keys)


def test_scan_relocates_objects_after_num_dbs_change(tmp_path: Path) -> None:
    loc = str(tmp_path / "card")
    old = DirectoryCard(loc, num_dbs=3)
    old.open()
    keys = [key(i) for i in range(30)]
    for k in keys:
        old.write(k, memoryview(payload_for(k, 40)), ObjectMeta(position=1))
    new = DirectoryCard(loc, num_dbs=2)
    new.open()
    found = list(new.scan())
    assert sorted(o.full_key for o in found) == sorted(keys)  # each once
    for k in keys:
        assert np.array_equal(read_back(new, k, 100)[1], payload_for(k, 40))
    assert sorted(o.full_key for o in new.scan()) == sorted(keys)


# ---------------------------------------------------------------------- scan


def test_scan_deletes_corrupt_and_skips_foreign(card: DirectoryCard) -> None:
    good, bad_hdr, short, wrong_name = key("good"), key("bad"), key("short"), key("wrong")
    for k in (good, bad_hdr, short, wrong_name):
        card.write(k, memoryview(payload_for(k, 500)), ObjectMeta())
    _flip(card.object_path(bad_hdr), 2)
    _truncate(card.object_path(short), 300)
    # A whole object stored under the wrong name (another key's digest).
    misnamed = card.object_path(key("elsewhere"))
    os.makedirs(os.path.dirname(misnamed), exist_ok=True)
    shutil.copyfile(card.object_path(wrong_name), misnamed)
    foreign = os.path.join(os.path.dirname(card.object_path(good)), ".nfs000000001")
    Path(foreign).write_bytes(b"not ours")
    assert sorted(o.full_key for o in card.scan()) == sorted([good, wrong_name])
    assert not os.path.exists(card.object_path(bad_hdr))
    assert not os.path.exists(card.object_path(short))
    assert not os.path.exists(misnamed)
    assert os.path.exists(foreign)


def test_an_object_a_newer_kvgate_wrote_is_a_miss_and_stays(card: DirectoryCard,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    k, ok = key("newer"), key("current")
    for x in (k, ok):
        card.write(x, memoryview(payload_for(x, 9000)), ObjectMeta())
    path = card.object_path(k)
    Path(path).write_bytes(as_newer_format(Path(path).read_bytes(), k))
    for direct in (True, False):  # both read paths
        card.direct_reads = direct
        with pytest.raises(ObjectTooNew):
            card.read_into(k, memoryview(aligned(9000)[0]))
    assert os.path.exists(path)
    with caplog.at_level("WARNING"):
        assert [o.full_key for o in card.scan()] == [ok]
        assert [o.full_key for o in card.scan()] == [ok]
    assert os.path.exists(path)
    assert sum("newer kvgate" in r.getMessage() for r in caplog.records) == 1  # said once per card


# --------------------------------------------------------------------- crash


def test_leftover_temp_is_never_seen(card: DirectoryCard) -> None:
    k = key("crashed")
    other = key("donor")
    card.write(other, memoryview(payload_for(other, 100)), ObjectMeta())
    final = card.object_path(k)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    young = f"{final}.tmp.999999.1"
    old = f"{final}.tmp.999999.2"
    for t in (young, old):
        shutil.copyfile(card.object_path(other), t)  # even a whole object
    aged = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(old, (aged, aged))
    with pytest.raises(ObjectMissing):
        card.read_into(k, memoryview(bytearray(1000)))
    assert not card.exists(k)
    assert [o.full_key for o in card.scan()] == [other]
    assert os.path.exists(young)  # may still be a write in progress
    assert not os.path.exists(old)  # a crash's leftover: reaped


def test_failed_write_leaves_nothing(card: DirectoryCard, monkeypatch: pytest.MonkeyPatch) -> None:
    k = key("fail")
    card.write(k, memoryview(b"old"), ObjectMeta())

    def broken_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(OSError) as info:
        card.write(k, memoryview(payload_for(k, P * 2)), ObjectMeta())
    monkeypatch.undo()
    assert info.value.errno == 28 and not isinstance(info.value, CardUnavailable)
    assert os.listdir(os.path.dirname(card.object_path(k))) == [os.path.basename(card.object_path(k))]
    h, got = read_back(card, k, 10)
    assert bytes(got) == b"old"


CRASH_KEYS = 24


def crash_payload(i: int) -> np.ndarray:
    return payload_for(key(i), 64 * 1024 + i * 61 * 1024)  # 64 KiB .. ~1.4 MiB


def _write_forever(location: str, start: int, done: multiprocessing.sharedctypes.Synchronized) -> None:
    c = DirectoryCard(location, num_dbs=2)
    c.open()
    payloads = [crash_payload(i) for i in range(CRASH_KEYS)]
    i = start
    while True:
        n = i % CRASH_KEYS
        c.write(key(n), memoryview(payloads[n]), ObjectMeta(position=n))
        done.value += 1
        i += 1


@pytest.mark.slow  # starts processes
def test_sigkill_mid_write_leaves_only_whole_objects(tmp_path: Path) -> None:
    loc = str(tmp_path / "card")
    DirectoryCard(loc, num_dbs=2).open()
    for round_, (writes, delay) in enumerate(((4, 0.0), (7, 0.0007), (11, 0.0023))):
        done = _MP.Value("i", 0, lock=False)
        proc = _MP.Process(target=_write_forever, args=(loc, round_ * 9, done))
        proc.start()
        wait_until(lambda: done.value >= writes, 20, f"the writer's first {writes} writes", interval=0.001)
        time.sleep(delay)  # the writer is almost always inside a write now
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    temps_seen = sum(1 for _, _, fs in os.walk(loc) for f in fs if ".tmp." in f)

    c = DirectoryCard(loc, num_dbs=2)
    c.open()
    # First as the gateway sees the card before any scan tidies it: every key
    # is either whole or absent, never corrupt (a read would delete it).
    present = set()
    for n in range(CRASH_KEYS):
        expected = crash_payload(n)
        buf = np.empty(len(expected), dtype=np.uint8)
        try:
            h = c.read_into(key(n), memoryview(buf))
        except ObjectMissing:
            assert not c.exists(key(n))
            continue
        assert h.meta.position == n
        assert np.array_equal(buf, expected)
        present.add(key(n))
    assert present, "the writer never finished an object"
    # Then as a restart sees it: scan finds exactly those, and they still read whole.
    found = list(c.scan())
    assert sorted(o.full_key for o in found) == sorted(present)
    for o in found:
        expected = crash_payload(o.meta.position)
        assert o.payload_len == len(expected)
        assert np.array_equal(read_back(c, o.full_key, len(expected))[1], expected)
    # A kill mid-write usually leaves a temp file; it must stay invisible.
    print(f"objects: {len(found)}, temp files left by kills: {temps_seen}")


# ---------------------------------------------------------------------- clean


def test_clean_removes_leftover_temp_files_too(card: DirectoryCard) -> None:
    k = key(0)
    card.write(k, memoryview(b"payload"), ObjectMeta())
    final = card.object_path(k)
    Path(f"{final}.tmp.1.2").write_bytes(b"partial")
    assert card.clean() == 1, "a temp file is no object"
    assert not Path(f"{final}.tmp.1.2").exists()


# -------------------------------------------------------------- unavailable


def test_a_write_to_a_removed_card_does_not_rebuild_its_directory(card: DirectoryCard) -> None:
    """An unmounted card would otherwise fill the root filesystem.  (That every call on a removed card
    is CardUnavailable is the conformance suite's.)"""
    k = key("k")
    card.write(k, memoryview(b"data"), ObjectMeta())
    shutil.rmtree(card.location)
    with pytest.raises(CardUnavailable):
        card.write(k, memoryview(b"data"), ObjectMeta())
    assert not os.path.exists(card.location)


def test_permission_denied_object_vs_card(card: DirectoryCard, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, where permissions do not bite: fake the EACCES.
    k = key("perm")
    card.write(k, memoryview(b"data"), ObjectMeta())
    real_open = os.open
    denied = {card.object_path(k)}

    def guarded_open(path: str, flags: int, *args: int) -> int:
        if path in denied:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", guarded_open)
    with pytest.raises(PermissionError) as info:
        card.read_into(k, memoryview(bytearray(10)))
    assert not isinstance(info.value, CardUnavailable)  # one object, the card is fine
    denied.add(os.path.join(card.location, LABEL_NAME))
    with pytest.raises(CardUnavailable):
        card.read_into(k, memoryview(bytearray(10)))
    with pytest.raises(CardUnavailable):
        card.check()
    monkeypatch.undo()
    assert card.exists(k)


def test_missing_label_is_unavailable(card: DirectoryCard) -> None:
    os.unlink(os.path.join(card.location, LABEL_NAME))
    with pytest.raises(CardUnavailable, match="label"):
        card.check()


def test_free_bytes(card: DirectoryCard) -> None:
    st = os.statvfs(card.location)
    assert abs(card.free_bytes() - st.f_bavail * st.f_frsize) < (256 << 20)
    assert card.free_bytes() > 0


# ---------------------------------------------------------------- the write probe


def test_write_probe_leaves_nothing(card: DirectoryCard) -> None:
    before = sorted(os.listdir(card.location))
    card.check_writable()
    assert sorted(os.listdir(card.location)) == before


@pytest.mark.slow  # runs mount
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")
def test_write_probe_fails_on_a_read_only_mount(card: DirectoryCard) -> None:
    # root ignores permission bits: only a read-only mount refuses it
    loc = card.location
    assert subprocess.run(["mount", "--bind", loc, loc]).returncode == 0
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", loc]).returncode == 0
        with pytest.raises(CardUnavailable) as e:
            card.check_writable()
        assert e.value.errno == errno.EROFS
    finally:
        subprocess.run(["umount", loc])
    card.check_writable()


# ---- killed holders, missing directories, leftovers -----------------------------------------


@pytest.mark.slow  # starts processes
def test_a_killed_holder_releases_its_claim(tmp_path) -> None:
    loc = str(tmp_path / "card")
    DirectoryCard(loc).open()
    code = ("import sys, time; from kvgate.cards import DirectoryCard; c = DirectoryCard(sys.argv[1]); c.open(); "
            "c.claim(False); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, loc], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    try:
        assert proc.stdout.readline().strip() == "held"
        mine = DirectoryCard(loc)
        with pytest.raises(CardInUse, match=f"pid {proc.pid} "):
            mine.claim(False)
    finally:
        proc.kill()
        proc.wait(10)
    mine.claim(False)
    mine.close()


def test_a_missing_directory_is_not_created_unless_asked(tmp_path) -> None:
    loc = tmp_path / "mnt" / "kv"
    with pytest.raises(CardUnavailable) as ei:
        DirectoryCard(str(loc), create_missing=False).open()
    assert ei.value.errno == errno.ENOENT and "create the directory or mount its filesystem" in str(ei.value)
    assert not loc.parent.exists()
    assert DirectoryCard(str(loc)).open()  # the default for library use creates it
    assert DirectoryCard(str(loc), create_missing=False).open()  # and an existing one is opened


def test_scan_during_own_writes_keeps_their_temp_files(card: DirectoryCard) -> None:
    """A card held alone: every temp file but this process's is garbage, and this process may be writing."""
    card.claim(False)
    k = key(1)
    card.write(k, memoryview(payload_for(k, 1000)), ObjectMeta())
    final = card.object_path(k)
    own = f"{final}.tmp.{HOST_TAG}.{os.getpid()}.{threading.get_ident()}"
    other = f"{final}.tmp.{HOST_TAG}.{os.getpid() + 1}.1"
    for p in (own, other):
        Path(p).write_bytes(b"partial")
    assert [o.full_key for o in card.scan()] == [k]
    assert os.path.exists(own) and not os.path.exists(other)


# ---------------------------------------------------------------- names and the index snapshot


def test_names_removes_a_dead_writer_s_temp_file(card: DirectoryCard) -> None:
    keys = [key(i) for i in range(3)]
    for k in keys:
        card.write(k, memoryview(b"x"), ObjectMeta())
    leftover = card.object_path(keys[0]) + f".tmp.{HOST_TAG}.999999999.1"  # a dead writer's
    Path(leftover).write_bytes(b"partial")
    assert sorted(d for b in card.names() for d in b) == sorted(key_digest(k) for k in keys)
    assert not os.path.exists(leftover)


def test_the_index_snapshot_is_replaced_whole_or_not_at_all(card: DirectoryCard) -> None:
    check_snapshot_round_trip(card, 0)
    assert not [p for p in os.listdir(card.location) if ".tmp." in p], "no temp file left"


# ------------------------------------------------------------ reads into the gateway's own memory


def test_reads_into_memory_the_gateway_may_load_go_straight_there_and_are_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory that is no guarded client memory: cached pieces land in the destination in one copy
    (``read_cached``: header and the first 2 MiB in one call), a piece the page cache lacks goes through
    the scratch, and either way a flipped byte is caught.  Guarded memory never sees ``read_cached``."""
    import ctypes

    from kvgate import memcopy
    from kvgate.memcopy import Abandon, ReadAbandoned

    c = DirectoryCard(str(tmp_path / "c"), direct_reads=False)
    c.open()
    k = key("own")
    data = payload_for(k, (3 << 20) + 123)  # the first call's 2 MiB, a whole piece and a short one
    c.write(k, memoryview(data), ObjectMeta())
    calls: list[int | None] = []
    real = Abandon.read_cached

    def counted(self, fd, dst, offset):
        n = real(self, fd, dst, offset)
        calls.append(n)
        return n

    monkeypatch.setattr(Abandon, "read_cached", counted)
    guarded = mmap.mmap(-1, data.size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(guarded))
    memcopy.add_client_memory(base, data.size)
    try:
        c.read_into(k, memoryview(guarded))  # warms the cache; guarded: no read_cached
    finally:
        memcopy.remove_client_memory(base, data.size)
    assert calls == []
    assert guarded[:] == data.tobytes()
    fd = os.open(c.object_path(k), os.O_RDONLY)
    try:  # a filesystem without cache-only reads: every piece goes the usual way, and that is all
        nowait = os.preadv(fd, [bytearray(16)], 0, os.RWF_NOWAIT) == 16
    except OSError as e:
        nowait = e.errno not in (errno.EOPNOTSUPP, errno.EINVAL)
    finally:
        os.close(fd)
    buf = np.zeros(data.size, np.uint8)
    for own in (True, False):  # the gateway's memory, or an unguarded client region
        calls.clear()
        buf[:] = 0
        assert c.read_into(k, memoryview(buf), Abandon(own=own)).payload_len == data.size
        assert np.array_equal(buf, data)
        if nowait:
            assert calls == [padded_size(header_size(k)) + (2 << 20), 1 << 20, 123], calls

    evict(c.object_path(k))
    calls.clear()
    buf[:] = 0
    c.read_into(k, memoryview(buf), Abandon(own=True))
    assert np.array_equal(buf, data)
    if pages_cached(c.object_path(k)) is not None:
        assert None in calls, "an evicted piece is read through the scratch"

    gone = Abandon(own=True)
    gone.abandon()
    with pytest.raises(ReadAbandoned):
        c.read_into(k, memoryview(buf), gone)

    raw = bytearray(Path(c.object_path(k)).read_bytes())
    raw[padded_size(header_size(k)) + (2 << 20) + 5] ^= 0x40  # in the second call's piece
    for own in (False, True):  # not own: the scratch reads it again and decides
        Path(c.object_path(k)).write_bytes(bytes(raw))
        with pytest.raises(ObjectCorrupt):
            c.read_into(k, memoryview(buf), Abandon(own=own))
        assert not os.path.exists(c.object_path(k)), "deleted as corrupt"


def test_a_mismatch_in_client_memory_is_decided_by_a_read_through_the_scratch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that writes its (unguarded) buffer while the gateway hashes it there makes the hash
    mismatch: the object is read again through the scratch, delivered whole, and not deleted."""
    import kvgate.cards.directory.card as directory
    from kvgate.memcopy import Abandon

    c = DirectoryCard(str(tmp_path / "c"), direct_reads=False)
    c.open()
    k = key("raced")
    data = payload_for(k, 1 << 20)
    c.write(k, memoryview(data), ObjectMeta())
    c.read_into(k, memoryview(np.zeros(data.size, np.uint8)))  # cached
    buf = np.zeros(data.size, np.uint8)
    real = directory.payload_hasher
    made = []

    class Raced:
        """The first hasher sees the destination after the client scribbled on it."""

        def __init__(self) -> None:
            self.inner = real()

        def update(self, piece) -> None:
            buf[7] ^= 0xFF  # the client writes its buffer under the hash
            self.inner.update(piece)

        def intdigest(self) -> int:
            return self.inner.intdigest()

    def hasher():
        made.append(1)
        return Raced() if len(made) == 1 else real()

    monkeypatch.setattr(directory, "payload_hasher", hasher)
    assert c.read_into(k, memoryview(buf), Abandon(own=False)).payload_len == data.size
    assert len(made) == 2, "read again through the scratch"
    assert np.array_equal(buf, data), "the scratch's read delivered every byte"
    assert os.path.exists(c.object_path(k)), "a good object is not deleted for a client's scribbling"
