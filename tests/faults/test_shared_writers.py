"""Several gateways writing and reading the same keys on the same directory cards at once (SPEC 2, 6).

Three gateway processes share two directory cards (``--shared-storage true``,
no RAM tier, so every read goes to a card).  Each gateway has a writer thread
that keeps rewriting the SAME keys with contents of its own (every content
names its writer, version and key, and has a size of its own), and a reader
thread that keeps restoring them, with destination buffers and packed.

Every read must be a miss or one complete content written for that key:
never a mix of two writes (torn), never another key's bytes, never a length
that does not match the content.

Two variants: every content of a key has the same size (as KV blocks of one
namespace do), read with destination buffers and packed; or each writer and
version has a size of its own, read with destination buffers only.  A packed
get sizes its reply from the gateway's index before reading; while other
gateways keep rewriting a key with other sizes, that size can be stale on two
rounds in a row and the client gives up with TOO_LARGE (a refusal, not wrong
bytes; see the last test here for the case of one rewrite).
"""

from __future__ import annotations

import random
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tests.faults.common import balanced_serials, label_directory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NAMESPACE = "shared-ns"
N_GATEWAYS = 3
N_DIALOGS = 6
BLOCKS = 4
RUN_S = 5.0
HEAD = struct.Struct("<4sIIII")  # magic, writer, version, key id, size
MAGIC = b"KVGT"
MAX_SIZE = 48 << 10


def key_of(d: int, b: int) -> bytes:
    return f"shared/d{d}/b{b}".encode()


def mark_of(d: int) -> bytes:
    return f"shared/dialog-{d}".encode()


def key_id(d: int, b: int) -> int:
    return d * BLOCKS + b


def content(writer: int, version: int, kid: int, varying: bool) -> bytes:
    """A complete object: its header says who wrote it; its size and body follow from that."""
    if varying:  # a size per writer and version
        size = (16 << 10) + (4 << 10) * ((writer * 5 + version) % 8) + writer * 8
    else:  # a size per key
        size = (16 << 10) + 1000 * kid
    seed = xxhash.xxh64_intdigest(HEAD.pack(MAGIC, writer, version, kid, size))
    return HEAD.pack(MAGIC, writer, version, kid, size) + np.random.default_rng(seed).bytes(size - HEAD.size)


def check(data, d: int, b: int, varying: bool) -> tuple[int, int]:
    """(writer, version) of a read, or AssertionError when it is not one complete content of this key."""
    data = bytes(data)
    assert len(data) >= HEAD.size, f"{key_of(d, b)!r}: {len(data)} bytes, shorter than any content"
    magic, writer, version, kid, size = HEAD.unpack_from(data)
    assert magic == MAGIC and writer < N_GATEWAYS, f"{key_of(d, b)!r}: not a content of this test"
    assert kid == key_id(d, b), f"{key_of(d, b)!r}: read the content of key id {kid}"
    assert len(data) == size, f"{key_of(d, b)!r}: {len(data)} bytes, its content (w{writer} v{version}) has {size}"
    assert data == content(writer, version, kid, varying), f"{key_of(d, b)!r}: torn or wrong bytes (w{writer} v{version})"
    return writer, version


@pytest.mark.parametrize("varying", [False, True], ids=["size-per-key", "size-per-write"])
def test_gateways_sharing_cards_never_return_torn_or_wrong_reads(tmp_path: Path, gateway_factory, varying: bool) -> None:
    cards = [tmp_path / "cards" / n for n in ("c0", "c1")]
    for path, serial in zip(cards, balanced_serials(("c0", "c1"), 16, 6, 10, "shared").values()):
        label_directory(path, serial)
    gws = [gateway_factory(["--storage-devices", *map(str, cards), "--storage-slots", "16", "--shared-storage", "true",
                            "--max-bytes", "0", "--io-timeout-ms", "2000"], name=f"gw{i}")
           for i in range(N_GATEWAYS)]

    stop = threading.Event()
    errors: list[str] = []
    seen: dict[tuple[int, int], set[int]] = {}  # key -> writers whose content was read
    stats = {"puts": 0, "put_fails": 0, "reads": 0, "hits": 0, "misses": 0, "packed": 0}
    lock = threading.Lock()

    def writer(w: int) -> None:
        rng = random.Random(w)
        version = 0
        try:
            with gws[w].client(NAMESPACE) as c:
                while not stop.is_set():
                    d = rng.randrange(N_DIALOGS)
                    version += 1
                    blobs = [content(w, version, key_id(d, b), varying) for b in range(BLOCKS)]
                    ok = c.put_many([key_of(d, b) for b in range(BLOCKS)], blobs, dialog=mark_of(d), position=0)
                    with lock:
                        stats["puts"] += len(ok)
                        stats["put_fails"] += ok.count(False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"writer {w}: {type(e).__name__}: {e}")

    def reader(r: int) -> None:
        rng = random.Random(100 + r)
        try:
            with gws[r].client(NAMESPACE) as c:
                while not stop.is_set():
                    d = rng.randrange(N_DIALOGS)
                    keys = [key_of(d, b) for b in range(BLOCKS)]
                    packed = not varying and rng.random() < 0.5
                    if packed:  # the gateway sizes the reply from what it knows (maybe stale)
                        got = c.get_many(keys, dialog=mark_of(d))
                    else:
                        got = c.get_many(keys, into=[bytearray(MAX_SIZE) for _ in keys], dialog=mark_of(d))
                    c.lookup(keys, dialog=mark_of(d))
                    for b, data in enumerate(got):
                        with lock:
                            stats["reads"] += 1
                            stats["packed"] += packed
                        if data is None:
                            with lock:
                                stats["misses"] += 1
                            continue
                        try:
                            w, _v = check(data, d, b, varying)
                        except AssertionError as e:
                            errors.append(f"reader {r} ({'packed' if packed else 'into'}): {e}")
                            continue
                        with lock:
                            stats["hits"] += 1
                            seen.setdefault((d, b), set()).add(w)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"reader {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(N_GATEWAYS)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(N_GATEWAYS)]
    for t in threads:
        t.start()
    time.sleep(RUN_S)  # the point: writers and readers race this long
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not errors, f"{len(errors)} bad reads or errors, e.g.: {errors[:5]}; {stats}"
    assert stats["put_fails"] == 0, stats
    assert stats["hits"] > 100 and stats["puts"] > 100, stats
    assert varying or stats["packed"] > 50, stats
    mixed = [k for k, ws in seen.items() if len(ws) > 1]
    assert mixed, f"no key was read with contents of two writers: the test did not race ({stats})"

    # at rest, every gateway reads the same complete object for every key
    for d in range(N_DIALOGS):
        keys = [key_of(d, b) for b in range(BLOCKS)]
        finals = []
        for gw in gws:
            with gw.client(NAMESPACE) as c:
                finals.append(c.get_many(keys, into=[bytearray(MAX_SIZE) for _ in keys], dialog=mark_of(d)))
        for b in range(BLOCKS):
            views = [f[b] for f in finals]
            assert all(v is not None for v in views), f"{keys[b]!r} is missing after every write succeeded"
            check(views[0], d, b, varying)
            assert all(bytes(v) == bytes(views[0]) for v in views), f"{keys[b]!r}: gateways disagree at rest"
    for gw in gws:
        assert gw.stats()["corrupt_objects"] == 0


def test_a_key_another_gateway_rewrote_with_another_size_still_reads(tmp_path: Path, gateway_factory) -> None:
    """A packed get sizes its reply from the gateway's index; a stale size must not make the key unreadable.

    Gateway A wrote ``k`` (20 kB) and indexed it; gateway B replaced it (40 kB).
    A's packed get used to hint 20 kB, read TOO_SMALL, answer "not done", and
    the client gave up with TOO_LARGE, at every get until A wrote ``k`` again.
    """
    args = ["--storage-devices", str(tmp_path / "card"), "--shared-storage", "true", "--max-bytes", "0"]
    a, b = gateway_factory(args, name="a"), gateway_factory(args, name="b")
    with a.client(NAMESPACE) as ca, b.client(NAMESPACE) as cb:
        assert ca.put_many([b"k", b"j"], [b"x" * 20_000, b"j" * 10]) == [True, True]
        assert cb.put_many([b"k"], [b"y" * 40_000]) == [True]
        for _ in range(2):
            assert ca.get_many([b"k"]) == [b"y" * 40_000]
            assert ca.get_many([b"j", b"k"]) == [b"j" * 10, b"y" * 40_000]
            got = ca.get_many([b"k"], into=[bytearray(50_000)])
            assert bytes(got[0]) == b"y" * 40_000
        assert cb.put_many([b"k"], [b"z" * 30_000]) == [True]  # smaller again
        assert ca.get_many([b"k"]) == [b"z" * 30_000]
        assert ca.lookup([b"k"]) == 1
