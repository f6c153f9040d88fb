"""IoPool and CardIo: urgent calls at real-time priority, and the hint thread (best-effort work
nobody waits for, which a stuck card cannot pile up)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.tiers.io import (CALL_BYTES, CALL_OBJECTS, HINT_BACKLOG, CardIo, IoPool, realtime_permitted, split_calls,
                             worth_calls)

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def io():
    pool = CardIo(2, 5.0, "test-card")
    yield pool
    pool.shutdown(wait=False)


def test_a_hint_runs_without_the_caller_waiting(io: CardIo) -> None:
    release, ran = threading.Event(), threading.Event()

    def work(arg: str) -> None:
        release.wait(5)
        assert arg == "keys"
        ran.set()

    assert io.hint(work, "keys")  # returns while work() is still blocked
    assert not ran.is_set()
    release.set()
    assert ran.wait(5)


def test_hints_past_the_backlog_of_a_stuck_card_are_dropped(io: CardIo) -> None:
    stuck = threading.Event()
    done: list[int] = []
    accepted = [io.hint(lambda i=i: (stuck.wait(5), done.append(i))) for i in range(HINT_BACKLOG + 3)]
    assert accepted == [True] * HINT_BACKLOG + [False] * 3
    assert io.hints_dropped == 3
    stuck.set()
    finished = threading.Event()
    for _ in range(50):  # the backlog drains, after which hints are taken again
        if io.hint(finished.set):
            break
        threading.Event().wait(0.05)
    assert finished.wait(5)
    assert sorted(done) == list(range(HINT_BACKLOG))


def test_a_failing_hint_does_not_stop_later_ones(io: CardIo) -> None:
    def boom() -> None:
        raise OSError("card gone")

    ok = threading.Event()
    assert io.hint(boom)
    assert io.hint(ok.set)
    assert ok.wait(5)


def test_reads_do_not_wait_for_a_stuck_hint(io: CardIo) -> None:
    stuck = threading.Event()
    assert io.hint(stuck.wait, 10)

    async def read() -> int:
        return await io.run(lambda: 7)

    try:
        assert asyncio.run(asyncio.wait_for(read(), 2)) == 7
    finally:
        stuck.set()


def test_lookup_hints_go_only_to_card_kinds_that_prepare_reads(tmp_path) -> None:
    from kvgate.cards import DirectoryCard
    from kvgate.config import Config
    from tests.tiers.common import serving_card

    class NoPrep(DirectoryCard):
        prepares_reads = False

        def prepare_reads(self, full_keys: list[bytes]) -> None:
            raise AssertionError("hinted a card kind that prepares nothing")

    async def main() -> tuple[int, int]:
        states = []
        for name, kind in (("a", DirectoryCard), ("b", NoPrep)):
            card = kind(str(tmp_path / name))
            states.append(serving_card(card, CardIo(1, 5.0, f"test-{name}"), Config(storage_devices=[card.location])))
        for cs in states:
            cs.hint_reads([b"k1", b"k2"])
        for cs in states:
            cs.io.shutdown(wait=True)
        return states[0].catalog.counters.read_hints, states[1].catalog.counters.read_hints

    assert asyncio.run(main()) == (2, 0)


needs_rt = pytest.mark.skipif(not realtime_permitted(), reason="SCHED_RR is not permitted here")


def _policies(pool: IoPool, calls: list[bool]) -> list[int]:
    """The scheduling policy each call saw on its thread, for calls run in turn (urgent or not)."""
    async def go() -> list[int]:
        return [await pool.run(os.sched_getscheduler, 0, urgent=u) for u in calls]
    return asyncio.run(go())


@needs_rt
@pytest.mark.parametrize("make", [lambda: IoPool(1, realtime=True), lambda: CardIo(1, 5.0, "rt", realtime=True)])
def test_urgent_calls_run_at_sched_rr_and_others_go_back_to_normal(make) -> None:
    pool = make()  # one thread: every call below runs on the same thread
    try:
        seen = _policies(pool, [False, True, True, False, True])
    finally:
        pool.shutdown()
    assert seen == [os.SCHED_OTHER, os.SCHED_RR, os.SCHED_RR, os.SCHED_OTHER, os.SCHED_RR]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is never touched


def test_a_pool_without_realtime_leaves_urgent_calls_at_normal_priority() -> None:
    pool = IoPool(1)
    try:
        assert _policies(pool, [True, True]) == [os.SCHED_OTHER, os.SCHED_OTHER]
    finally:
        pool.shutdown()


@needs_rt
def test_urgent_chunks_all_run_at_sched_rr() -> None:
    pool = IoPool(3, realtime=True)

    def work(chunk: list) -> list[int]:
        return [os.sched_getscheduler(0)] * len(chunk)

    async def go() -> list[list[int]]:
        return await pool.map_chunks(work, list(range(9)), urgent=True)

    try:
        seen = asyncio.run(go())
    finally:
        pool.shutdown()
    assert [p for chunk in seen for p in chunk] == [os.SCHED_RR] * 9


@needs_rt
def test_an_urgent_hint_runs_at_sched_rr_and_a_background_one_at_normal() -> None:
    io = CardIo(1, 5.0, "rt", realtime=True)
    seen: list[int] = []
    done = threading.Event()
    try:
        assert io.hint(lambda: seen.append(os.sched_getscheduler(0)), urgent=True)
        assert io.hint(lambda: seen.append(os.sched_getscheduler(0)))
        assert io.hint(done.set)
        assert done.wait(5)
    finally:
        io.shutdown()
    assert seen == [os.SCHED_RR, os.SCHED_OTHER]


def test_a_refused_priority_switch_still_runs_the_call(monkeypatch, caplog) -> None:
    def refuse(*_a) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    pool = IoPool(1, realtime=True)
    try:
        async def go() -> list[int]:
            return [await pool.run(lambda x: x * 2, 21, urgent=True), await pool.run(lambda: 7, urgent=True)]
        assert asyncio.run(go()) == [42, 7]
    finally:
        pool.shutdown()
    assert "cannot switch an I/O thread's scheduling class" in caplog.text


def test_a_call_on_a_card_that_left_the_set_fails_as_io_not_as_a_crash() -> None:
    """A request that found a card just before it was removed gets a failed I/O (a miss), not an internal error."""
    import threading

    from kvgate.tiers.io import CardGone

    async def main() -> None:
        io = CardIo(1, 5.0, "leaving")
        release = threading.Event()
        busy = asyncio.ensure_future(io.run(release.wait, 5))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(io.run(lambda: "ran"))  # waits for the card's one thread
        await asyncio.sleep(0.05)
        io.shutdown(wait=False)  # the card leaves
        release.set()
        assert await busy is True
        with pytest.raises(CardGone):
            await queued
        with pytest.raises(OSError):
            await io.run(lambda: "ran")

    asyncio.run(main())


def test_a_result_that_comes_after_its_caller_stopped_waiting_is_handed_to_late() -> None:
    """``late`` gets what a call returns after its deadline passed or its caller was cancelled (open
    files to close); a call answered in time, or one that failed, never reaches it."""
    from kvgate.tiers.io import IoTimeout

    async def main() -> None:
        io = CardIo(4, 0.05, "late")  # a thread for each call left stuck, one for the call in time
        late: list = []
        release = threading.Event()
        with pytest.raises(IoTimeout):
            await io.run(lambda: release.wait(5) and "past the deadline", late=late.append)
        task = asyncio.ensure_future(io.run(lambda: release.wait(5) and "cancelled", late=late.append))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await io.run(lambda: "in time", late=late.append) == "in time"
        with pytest.raises(IoTimeout):
            await io.run(lambda: release.wait(5) and 1 / 0, late=late.append)
        release.set()
        for _ in range(100):
            if len(late) == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert sorted(late) == ["cancelled", "past the deadline"]
        io.shutdown(wait=False)

    asyncio.run(main())


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * CALL_BYTES // 2), max_size=200), parts=st.integers(1, 16))
def test_card_calls_keep_every_item_once_in_order_and_each_call_bounded(sizes: list[int], parts: int) -> None:
    """``split_calls``: io_timeout_ms bounds one call, so no call carries more than a fixed amount of work."""
    items = list(range(len(sizes)))
    chunks = split_calls(items, parts, sizes)
    assert [i for c in chunks for i in c] == items
    assert all(c for c in chunks)
    assert len(chunks) >= min(parts, len(items), worth_calls(len(items), sum(sizes)))
    for c in chunks:
        assert len(c) <= CALL_OBJECTS
        assert len(c) == 1 or sum(sizes[i] for i in c) <= CALL_BYTES


def test_a_large_batch_is_many_calls_that_queue_on_the_card() -> None:
    """A put of 1,024 small objects on 2 threads: 32 calls of 32, not 2 of 512 under one deadline each."""
    chunks = split_calls(list(range(1024)), 2, [100] * 1024)
    assert [len(c) for c in chunks] == [32] * 32
    assert [len(c) for c in split_calls(list(range(8)), 4, [1 << 20] * 8)] == [2, 2, 2, 2]


def test_a_small_read_is_one_call_and_a_large_one_uses_every_thread() -> None:
    """A thread hand-off costs more than a few small objects' work: they stay one call."""
    assert [len(c) for c in split_calls(list(range(4)), 4, [4096] * 4)] == [4]
    assert [len(c) for c in split_calls(list(range(20)), 4, [4096] * 20)] == [10, 10]  # 16 objects a call
    assert [len(c) for c in split_calls(list(range(32)), 4, [2 << 20] * 32)] == [8] * 4
    assert [len(c) for c in split_calls(list(range(3)), 4, [512 << 10] * 3)] == [2, 1]
