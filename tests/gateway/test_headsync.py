"""HeadSync: what each card gets and gives in a round, with cards that fail or take no writes.

The card, its heads channel and its I/O are stand-ins here (the real
cards' channels have their own tests in tests/cards/test_heads_channel.py;
two real gateways agreeing through real cards are in test_dialog_marks.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvgate.cards.heads import HeadsChannel
from kvgate.gateway.headsync import HeadSync
from kvgate.heads import BRANCHES, SharedHeads, block_id


class FakeHeads(HeadsChannel):
    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.fail = False
        self.calls: list[set[int]] = []

    def merge(self, ids) -> set[int]:
        self.calls.append(set(ids))
        if self.fail:
            raise OSError(5, "card gone")
        self.ids |= set(ids)
        return set(self.ids)


async def _run(fn, *args):
    return fn(*args)


def card_state(serial: str) -> SimpleNamespace:
    return SimpleNamespace(serial=serial, active=True, read_only=False, where=serial,
                           card=SimpleNamespace(heads=FakeHeads()), io=SimpleNamespace(run=_run))


def learn(heads: SharedHeads) -> None:
    for c in range(BRANCHES):
        heads.shared_prefix([b"ns-sys-0", b"ns-sys-1", b"ns-conv-%d" % c])


def test_a_card_that_missed_a_round_or_took_no_writes_gets_the_whole_set_later() -> None:
    async def main() -> None:
        heads = SharedHeads()
        a, b, ro = card_state("a"), card_state("b"), card_state("ro")
        ro.read_only = True
        sync = HeadSync(heads, SimpleNamespace(cards=[a, b, ro]))
        learn(heads)
        everything = heads.all()
        assert block_id(b"ns-sys-1") in everything and len(everything) == 3  # 2 heads + the branch point
        b.card.heads.fail = True
        await sync.sync_once()
        assert a.card.heads.ids == everything and b.card.heads.ids == set() and ro.card.heads.calls == [set()]
        assert sync.errors == 1
        b.card.heads.fail = False
        await sync.sync_once()
        assert b.card.heads.calls[-1] == everything, "the card that missed a round gets the whole set"
        ro.read_only = False
        await sync.sync_once()
        assert ro.card.heads.ids == everything, "a card that only was read gets the whole set once it takes writes"
        await sync.sync_once()
        assert a.card.heads.calls[-1] == set() and b.card.heads.calls[-1] == set(), "nothing new: nothing written"

    asyncio.run(main())


def test_heads_another_gateway_wrote_come_back_from_any_card() -> None:
    async def main() -> None:
        other = SharedHeads()
        learn(other)
        a = card_state("a")
        a.card.heads.ids = other.all()
        mine = SharedHeads()
        await HeadSync(mine, SimpleNamespace(cards=[a])).sync_once()
        assert mine.shared_prefix([b"ns-sys-0", b"ns-sys-1", b"ns-conv-new"]) == (2, [0])

    asyncio.run(main())


def test_the_loop_merges_only_what_is_new_on_a_card_since_its_last_answer() -> None:
    """A card answers with its whole list every round; merging all of it each time held the loop for 40 ms."""
    async def main() -> None:
        heads = SharedHeads()
        merged: list[int] = []
        real_merge = heads.merge
        heads.merge = lambda ids: merged.append(len(ids)) or real_merge(ids)  # type: ignore[method-assign]
        a = card_state("a")
        a.card.heads.ids = set(range(1, 5001))
        sync = HeadSync(heads, SimpleNamespace(cards=[a]))
        await sync.sync_once()
        await sync.sync_once()
        a.card.heads.ids |= {9001, 9002}
        a.card.heads.fail = True
        await sync.sync_once()
        a.card.heads.fail = False
        await sync.sync_once()
        await sync.sync_once()
        assert merged == [5000, 0, 2, 0], merged
        assert len(heads) == 5002

    asyncio.run(main())


def test_the_list_of_a_card_that_left_the_set_is_forgotten() -> None:
    async def main() -> None:
        heads = SharedHeads()
        a, b = card_state("a"), card_state("b")
        a.card.heads.ids, b.card.heads.ids = {1, 2}, {3}
        cards = SimpleNamespace(cards=[a, b])
        sync = HeadSync(heads, cards)
        await sync.sync_once()
        assert set(sync._answers) == {"a", "b"}
        b.active = False
        await sync.sync_once()
        assert set(sync._answers) == {"a", "b"}, "an inactive card keeps its list: it comes back"
        cards.cards = [a]
        await sync.sync_once()
        assert set(sync._answers) == {"a"}

    asyncio.run(main())


def test_a_card_that_keeps_no_list_is_passed_by_and_what_was_learned_waits_for_one_that_does() -> None:
    async def main() -> None:
        heads = SharedHeads()
        none = card_state("none")
        none.card.heads = None
        sync = HeadSync(heads, SimpleNamespace(cards=[none]))
        learn(heads)
        await sync.sync_once()
        assert sync.errors == 0 and sync._answers == {}
        waiting = heads.take_new()
        assert waiting == heads.all(), "what was learned waits for a card that keeps a list"
        heads.put_back(waiting)
        a = card_state("a")
        sync.card_set.cards.append(a)
        await sync.sync_once()
        assert a.card.heads.ids == heads.all() and heads.take_new() == set()

    asyncio.run(main())
