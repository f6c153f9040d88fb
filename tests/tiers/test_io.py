"""CardIo's hint thread: best-effort work nobody waits for, which a stuck card cannot pile up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvgate.tiers.io import HINT_BACKLOG, CardIo, IoPool

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
    from kvgate.tiers.long import CardState, LongTier

    class NoPrep(DirectoryCard):
        prepares_reads = False

        def prepare_reads(self, full_keys: list[bytes]) -> None:
            raise AssertionError("hinted a card kind that prepares nothing")

    async def main() -> tuple[int, int]:
        tier = LongTier(Config(storage_devices=[str(tmp_path / "a")]), IoPool(1))
        states = []
        for name, kind in (("a", DirectoryCard), ("b", NoPrep)):
            cs = CardState(name, str(tmp_path / name), kind(str(tmp_path / name)), CardIo(1, 5.0, f"test-{name}"))
            cs.active = True
            states.append(cs)
        tier.hint_reads({id(cs): (cs, [b"k1", b"k2"]) for cs in states})
        for cs in states:
            cs.io.shutdown(wait=True)
        return states[0].read_hints, states[1].read_hints

    assert asyncio.run(main()) == (2, 0)
