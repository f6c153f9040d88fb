"""CardRoom on its own: the reserve a card leaves on its medium, the slack writes in flight may use, and
which objects of a batch a card can take."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.cards import make_card
from kvgate.config import Config
from kvgate.tiers.room import DEFAULT_RESERVE_MAX, UNBOUNDED_SLACK, CardRoom

GiB = 1 << 30


def room(tmp_path: Path, **cfg) -> CardRoom:
    (tmp_path / "card").mkdir(exist_ok=True)
    config = Config(storage_devices=[str(tmp_path / "card")], **cfg)
    card = make_card(str(tmp_path / "card"), config)
    return CardRoom(lambda: card, config, lambda: "card test")


@pytest.mark.parametrize("free, used, reserve", [
    (64 << 20, 0, (64 << 20) // 10),  # a 64 MiB tmpfs keeps 6.4 MiB, not the 1 GiB it cannot have
    (8 * GiB, 2 * GiB, GiB),  # a tenth, 1 GiB
    (4000 * GiB, 0, DEFAULT_RESERVE_MAX),  # a large NVMe: no more than 1 GiB
])
def test_the_default_reserve_is_a_tenth_of_what_the_card_could_hold_at_most_1_gib(
        tmp_path: Path, free: int, used: int, reserve: int) -> None:
    r = room(tmp_path)
    r.size(free, used)
    assert r.reserve == reserve and r.capacity == used + free - reserve
    assert r.slack == reserve, "writes in flight may use the reserve"


def test_a_configured_reserve_is_kept_whatever_the_card(tmp_path: Path) -> None:
    r = room(tmp_path, card_reserve=32 << 20)
    r.size(16 << 20, 0)
    assert r.reserve == 32 << 20 and r.capacity == 0


def test_a_batch_is_cut_from_its_end_to_what_the_card_holds_beside_writes_in_flight(tmp_path: Path) -> None:
    r = room(tmp_path, card_capacity=10_000)
    r.set(10_000, "")
    assert r.plan([3000, 3000, 3000, 3000]) == 3
    r.writing = 5000
    assert r.plan([3000, 3000, 3000]) == 1
    assert r.plan([6000, 1000]) == 0, "the leading object must fit: a prefix, not whatever fits"


def test_a_configured_capacity_has_slack_until_the_medium_runs_full(tmp_path: Path) -> None:
    r = room(tmp_path, card_capacity=GiB)
    r.set(GiB, "")
    assert r.slack == UNBOUNDED_SLACK and r.evict_to(100) > GiB
    assert not r.shrink_to_medium(free=2 * GiB, used=0), "room enough: nothing lowered"
    assert r.shrink_to_medium(free=1000, used=5000)
    assert r.capacity == 6000 and r.slack == 0, "no reserve for a configured capacity; the medium ends there"
    assert r.evict_to(1000) == 5000


def test_a_card_lowered_to_nothing_says_so_once_and_again_when_it_can_hold_objects(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    r = room(tmp_path, card_reserve=4096)
    r.size(free=1000, used=0)
    r.size(free=1000, used=0)
    r.size(free=64 << 20, used=0)
    lines = [m for m in caplog.messages if "card test" in m]
    assert len(lines) == 2 and "can hold nothing" in lines[0] and "can hold objects again" in lines[1], lines
