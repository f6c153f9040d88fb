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


def serving_card(card: Card, io: CardIo, cfg: Config | None = None, serial: str = "test-serial",
                 capacity: int = 1 << 30) -> ManagedCard:
    cfg = cfg or Config(storage_devices=[card.location])
    mc = ManagedCard(card.location, card.location, card, cfg, IoPool(1), TierHooks(NamespaceUsage(), Holds()), io=io)
    mc.serve(card, card.location, serial)
    mc.capacity = capacity
    return mc


def card_set(cfg: Config, threads: int = 2) -> CardSet:
    return CardSet(cfg, IoPool(threads), TierHooks(NamespaceUsage(), Holds()))
