"""Finding a card after start: one that moved to another location its entry matches, and the card of an
entry that had none.

``CardSet``'s health loop asks ``CardDiscovery`` once a second, on the
gateway's event loop; every probe of a location is card I/O on the card's
own threads (``ManagedCard.io``, with its deadline), globbing runs on the
general pool.  A card is known by the serial on its label: found under
another location its ``storage_devices`` entry matches, it is taken back
there; a different card at its old location is never used in its place.

Claims: a card found after start is claimed as at start; one another gateway
holds in a way that does not mix is not used, and logged once per location
and reason.
"""

from __future__ import annotations

import logging
from typing import Container

from kvgate.cards import Card, expand, is_redis, make_card
from kvgate.config import Config
from kvgate.tiers.card import ManagedCard
from kvgate.tiers.io import IoPool

log = logging.getLogger("kvgate.long")


class CardDiscovery:
    """Looks for cards at the locations their entries match; opens and claims what it finds, the caller takes
    it into service."""

    def __init__(self, cfg: Config, pool: IoPool) -> None:
        self.cfg = cfg
        self.pool = pool  # globbing
        self._refusals: dict[str, str] = {}  # location -> the last reason it was not taken, said once

    async def relocate(self, mc: ManagedCard, in_use: Container[str]) -> None:
        """Look for ``mc``'s serial under the other locations its entry matches (``in_use``: other cards'
        locations); found, it is claimed there and reopened (``ManagedCard.reopen``)."""
        if is_redis(mc.pattern) and mc.pattern == mc.location:
            return  # one server, one address: nowhere else to look
        for loc in await self.pool.run(expand, mc.pattern):
            if loc == mc.location or loc in in_use:
                continue
            probe = make_card(loc, self.cfg)
            try:
                serial = await mc.io.run(probe.check)
            except OSError:
                continue
            if serial != mc.serial:
                continue
            try:
                await mc.io.run(probe.open)
            except OSError:
                continue
            # The old claim goes first: the card moved is the same lock file, which our own old lock would hold.
            mc.card.close()
            if not await self.claim(mc, probe, loc):
                try:
                    await mc.io.run(mc.card.claim, self.cfg.shared_storage)
                except OSError:
                    pass  # best effort: the old path failed its check, which is why we looked elsewhere
                continue
            mc.life.reopen(probe, loc)
            return

    async def find(self, mc: ManagedCard, in_use: Container[str],
                   serials: Container[str]) -> tuple[Card, str, str] | None:
        """A card for the pending entry ``mc``: ``(card, location, serial)``, opened and claimed, or None.

        A directory is taken labelled or not, as at start: what was missing
        then (a directory not created, a filesystem not mounted) is there now
        because someone made it so.  A directory this gateway would have had
        to create itself is never taken (``DirectoryCard.create_missing``).
        ``in_use``: the cards' locations; ``serials``: the cards' serials
        (a second copy of a card in use is not taken).
        """
        for loc in await self.pool.run(expand, mc.pattern):
            if loc in in_use:
                continue
            probe = make_card(loc, self.cfg)
            try:
                serial = await mc.io.run(probe.open)
            except OSError:
                continue
            if serial in serials:
                probe.close()
                continue
            if not await self.claim(mc, probe, loc):
                continue
            return probe, loc, serial
        return None

    async def claim(self, mc: ManagedCard, probe: Card, loc: str) -> bool:
        """Claim a card found after start; one another gateway holds is not used, and logged once."""
        try:
            await mc.io.run(probe.claim, self.cfg.shared_storage)
        except OSError as e:
            probe.close()
            if self._refusals.get(loc) != str(e):
                self._refusals[loc] = str(e)
                log.warning("card %s is not used: %s", probe.display_location, e)
            return False
        self._refusals.pop(loc, None)
        return True
