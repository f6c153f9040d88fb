"""ChunkMarks (what an LMCache lookup teaches the stores after it) and MarkCache, without LMCache."""

from __future__ import annotations

from kvgate.integrations.lmcache.marks import ChunkMarks
from kvgate.integrations.markcache import MarkCache
from kvgate.keys import DialogMark
from tests.helpers import run_threads


def row(conv: int, n: int, head: int = 2) -> list[bytes]:
    return [b"sys-%d" % i for i in range(head)] + [b"c%d-%d" % (conv, i) for i in range(n - head)]


def test_a_store_batch_is_cut_into_runs_of_one_dialog_and_consecutive_positions() -> None:
    marks = ChunkMarks()
    a, b = row(1, 5), row(2, 4)
    marks.note(a, DialogMark(b"c1-0", 2, [(0, b"sys-0")]))
    marks.note(b, DialogMark(b"c2-0", 2, [(0, b"sys-0")]))
    # L1 finished writing a's tail, b's tail, a key never looked up, and a's middle, in that order
    batch = a[3:] + b[2:] + [b"stray-1", b"stray-2"] + a[2:3]
    runs = marks.runs(batch)
    assert runs == [([0, 1], b"c1-0", 3), ([2, 3], b"c2-0", 2), ([4, 5], None, -1), ([6], b"c1-0", 2)]
    assert marks.runs(a[:2]) == [([0, 1], b"sys-0", 0)], "the shared head is its own dialog, from position 0"
    assert marks.runs(a[4:] + a[3:4]) == [([0], b"c1-0", 4), ([1], b"c1-0", 3)], "a gap in positions cuts a run"
    assert marks.by_dialog(batch) == {b"c1-0": [0, 1, 6], b"c2-0": [2, 3], None: [4, 5]}


def test_it_remembers_at_most_size_chunks_the_latest_looked_up() -> None:
    marks = ChunkMarks(size=10)
    for conv in range(5):
        marks.note(row(conv, 4, head=0), DialogMark(b"c%d-0" % conv, 0))
    assert len(marks) == 10
    assert marks.runs(row(0, 4, head=0)) == [([0, 1, 2, 3], None, -1)], "forgotten: stored without a dialog"
    assert marks.runs(row(4, 4, head=0)) == [([0, 1, 2, 3], b"c4-0", 0)]


def test_lookup_and_store_threads_share_it() -> None:
    marks = ChunkMarks(size=1000)

    def work(t: int) -> None:
        for conv in range(2000):
            if t == 0:  # the lookup thread
                marks.note(row(conv, 8), DialogMark(b"c%d-0" % conv, 2, [(0, b"sys-0")]))
                continue
            for _run, dialog, position in marks.runs(row(conv, 8)[2:]):  # store threads
                assert dialog in (None, b"c%d-0" % conv) and (dialog is None) == (position == -1)

    run_threads(work, 3)
    assert len(marks) == 1000


def test_mark_cache_by_the_leads_last_key_for_its_ttl(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr("kvgate.integrations.markcache.time.monotonic", lambda: now[0])
    cache = MarkCache(ttl_s=30, size=2)
    dm = DialogMark(b"c1-0", 2, [(0, b"sys-0")])
    cache.put(b"c1-0", dm)
    assert cache.get(b"c1-0") == dm and cache.get(b"sys-0") is None
    now[0] += 30
    assert cache.get(b"c1-0") is None, "asked again after the ttl: the gateway keeps learning heads"
    for k in (b"a", b"b", b"c"):
        cache.put(k, dm)
    assert cache.get(b"a") is None and cache.get(b"c") == dm, "at most size marks"


def test_mark_cache_is_shared_by_threads() -> None:
    """SGLang's storage threads and LMCache's lookup thread share one cache."""
    cache = MarkCache(size=500)

    def work(t: int) -> None:
        for i in range(3000):
            k = b"lead-%d" % (i % 700)
            cache.put(k, DialogMark(k, 0))
            asked = b"lead-%d" % ((i * 7 + t) % 700)
            got = cache.get(asked)
            assert got is None or got.mark == asked

    run_threads(work, 4)
    assert len(cache._marks) <= 500
