"""Long-tier parts on their own: a ``ManagedCard`` in service as ``CardSet`` hands one over (no slot map,
no scan), and a ``CardSet`` with hooks of its own."""

from __future__ import annotations

from kvgate.cards import Card
from kvgate.config import Config
from kvgate.tiers.card import ManagedCard, TierHooks
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.holds import Holds
from kvgate.tiers.io import CardIo, IoPool
from kvgate.tiers.usage import NamespaceUsage
from tests.helpers import wait_until_async


def serving_card(card: Card, io: CardIo, cfg: Config | None = None, serial: str = "test-serial",
                 capacity: int = 1 << 30, holds: Holds | None = None) -> ManagedCard:
    cfg = cfg or Config(storage_devices=[card.location])
    hooks = TierHooks(NamespaceUsage(), holds if holds is not None else Holds())
    mc = ManagedCard(card.location, card.location, card, cfg, IoPool(1), hooks, io=io)
    mc.life.serve(card, card.location, serial)
    mc.catalog.room.capacity = capacity
    return mc


def card_set(cfg: Config, threads: int = 2) -> CardSet:
    return CardSet(cfg, IoPool(threads), TierHooks(NamespaceUsage(), Holds()))


async def scanned_card_set(cfg: Config, threads: int = 2) -> CardSet:
    """A started ``card_set`` whose cards have all finished their start-up scan."""
    cards = card_set(cfg, threads)
    await cards.start()
    await wait_until_async(lambda: all(mc.life.scanned for mc in cards.cards), 10, "every card's start-up scan")
    return cards


async def background_deletes_done(mc: ManagedCard, timeout: float = 10.0) -> None:
    """Until the card's background deletes (evictions, expiries) have ended: their keys are ``leaving``
    from the moment they are decided, so one decided but not yet started counts too."""
    await wait_until_async(lambda: not mc.catalog.leaving, timeout, lambda: f"deletes of {sorted(mc.catalog.leaving)} still under way")
