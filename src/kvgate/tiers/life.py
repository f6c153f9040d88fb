"""One card's life in this gateway: which card it is and where, taken into service, checked, resized, stopped.

``CardLife`` holds the card's identity (the ``storage_devices`` entry it came
from, its location, the open ``Card``, its serial once its label is read),
its health (``CardHealth``), its index across restarts (``IndexKeeper``) and
its background tasks.  ``adopt`` starts serving it: the index snapshot taken
(``IndexKeeper.load`` returns a new index, which the catalog takes), the card
sized, the index checked against the card in the background; ``check`` is the
health check the card set runs every second (label, write probe, free space);
``stop`` saves the snapshot and ``close`` ends the tasks and the threads.

Who calls it: its ``ManagedCard`` (which creates it), the card set and its
discovery (``serve``, ``reopen``, ``readdress``, ``check``), and the card's
I/O channel (``note_result``, once per chunk).  Threading: every method runs on
the event loop and never blocks; the card's I/O runs on its ``CardIo`` threads
with a deadline (a card that hangs ties up only its own threads), the index
keeper's on the general pool (a slow scan must not hold the card's threads).

Capacity: what a card may hold is what it holds plus what its medium has
free beyond the reserve of its kind, or ``card_capacity`` when set
(``CardRoom``).  What a card holds at start counts exactly as it does later,
so a restart evicts only from a card that really is over its capacity, and
says so.  A card that can hold nothing is warned about, and long puts to it
fail.
"""

from __future__ import annotations

import errno
import logging
from typing import Callable

from kvgate.cards import Card, CardUnavailable
from kvgate.config import Config
from kvgate.tiers.catalog import CardCatalog
from kvgate.tiers.health import CardHealth, Outcome
from kvgate.tiers.io import CardIo, IoPool, Tasks
from kvgate.tiers.restart import IndexKeeper

log = logging.getLogger("kvgate.long")

RESIZE_EVERY_CHECKS = 30  # re-read a card's free space about every 30 s


class CardLife:
    """One card's identity, health and index keeping over its life (module docstring).

    ``pool``: the general pool (the index keeper's work); ``io``: the card's
    own threads; ``catalog``: what it holds (sized and filled here at start);
    ``on_corrupt``: the start-up check deleted n broken objects.
    """

    def __init__(self, pattern: str, location: str, card: Card, cfg: Config, pool: IoPool, io: CardIo,
                 catalog: CardCatalog, on_corrupt: Callable[[int], None] | None = None) -> None:
        self.pattern = pattern  # the storage_devices entry it came from
        self.location = location
        self.card = card
        self.serial: str | None = None  # set once the card's label is read
        self.cfg = cfg
        self.pool = pool
        self.io = io
        self.catalog = catalog
        self.on_corrupt = on_corrupt
        self.health = CardHealth(cfg.io_timeout_strikes, self.describe)
        self.keeper = IndexKeeper(self, catalog)
        self.scanned = False  # the index went through its check against the card
        self.refused_serial: str | None = None  # the other card last seen at our path
        self._shrinking = False  # a re-read of the free space after a full medium is under way
        self.tasks = Tasks()

    # ---- naming -------------------------------------------------------------

    @property
    def where(self) -> str:
        """The location as logs and status show it (a Redis password masked)."""
        return self.card.display_location

    def describe(self) -> str:
        return f"card {self.where} ({self.serial})"

    @property
    def active(self) -> bool:
        return self.health.active

    @property
    def read_only(self) -> bool:
        return self.health.read_only

    def hold_out(self, why: str) -> None:
        """Out of service until ``release``, whatever its checks say (cluster mode: no agent reports it alive)."""
        self.health.hold_out(why)

    def release(self) -> None:
        self.health.release()

    # ---- into service and out -------------------------------------------------

    def serve(self, card: Card, location: str, serial: str) -> None:
        """The card was opened and claimed at ``location``: it is in service from now on."""
        self.card, self.location, self.serial = card, location, serial
        self.catalog.name_tier(serial)
        self.health.active = True

    def reopen(self, card: Card, location: str) -> None:
        """The card was found again at ``location`` (already opened and claimed there)."""
        old = self.location
        self.card, self.location, self.refused_serial = card, location, None
        log.warning("card %s (%s) reopened as %s", old, self.serial, location)
        if self.health.held_out is None:
            self.health.bring_back()

    def readdress(self, pattern: str) -> None:
        """The card is now configured under ``pattern`` (its address changed in ``storage_devices``)."""
        self.pattern = pattern

    async def adopt(self) -> None:
        """Take the card's index snapshot (if usable), size the card, and check the index against the card
        in the background."""
        catalog = self.catalog
        catalog.take_index(catalog.new_index())
        fresh = await self.keeper.load()
        if fresh is not None:
            catalog.take_index(fresh)
        if self.cfg.card_capacity is not None:
            catalog.room.set(self.cfg.card_capacity, "card_capacity is 0; set it to what the card may hold")
        else:
            try:
                free = await self.io.run(self.card.free_bytes)
            except OSError as e:
                log.warning("card %s: cannot read free space (%s); capacity 0 until it can", self.where, e)
                free = 0
            catalog.room.size_at_start(free, catalog.used)
        self.tasks.spawn(self._check_at_start())
        self.tasks.spawn(self.keeper.save_now_and_then())

    async def _check_at_start(self) -> None:
        """The index checked against the card (``IndexKeeper.check``): the card reads as scanned once it
        went through, and its snapshot is written when the check changed the index."""
        if not await self.keeper.check():
            return
        self.scanned = True
        if self.keeper.changed_since_saved():
            await self.keeper.save("after the start-up check")

    async def stop(self) -> None:
        """Save the index snapshot (when it changed and the card is in service), then ``close``."""
        await self.tasks.cancel()
        if self.active and self.serial and self.keeper.changed_since_saved():
            try:
                await self.keeper.save("at stop")
            except CardUnavailable:
                pass
        await self.close()

    async def close(self) -> None:
        """End the card's tasks, its threads (not waiting for a hung one) and its claim."""
        await self.tasks.cancel()
        self.io.shutdown(wait=False)
        try:
            self.card.close()
        except OSError:
            pass

    async def emptied(self) -> None:
        """Every object of ours on the card was deleted (the ``clean`` op): the index is empty, the
        snapshot dropped, and the next stop writes whatever the card holds then."""
        self.catalog.clear()
        try:
            await self.pool.run(self.card.drop_snapshot)
        except OSError:
            pass  # the next start's check drops what it lists, all of it gone
        self.keeper.forget_saved()

    # ---- capacity -------------------------------------------------------------

    async def resize(self) -> None:
        """Follow the medium's free space (others write to shared filesystems too).

        Capacity is what we hold plus what is free beyond the reserve: it
        shrinks when others fill the filesystem and grows back when they
        delete, so a card lowered by a full disk recovers without a restart.
        """
        try:
            free = await self.io.run(self.card.free_bytes)
        except OSError:
            return
        self.catalog.room.size(free, self.catalog.used)
        self.catalog.evict_over_capacity()

    # ---- health -----------------------------------------------------------------

    def note_result(self, err: BaseException | None) -> None:
        """Feed one I/O outcome to the card's health (``CardHealth.note``)."""
        if self.health.note(err) is not Outcome.FULL or self.catalog.deleting:
            # (FULL while deleting: room is being made already, evicted objects
            # not deleted yet; this write raced that and tells nothing new.
            # Shrinking again for each such write would compound, 0.9 ** n of a batch.)
            return
        # Full, not broken: the medium holds less than we thought (other
        # writers, a smaller filesystem).  What it has free is read again
        # rather than guessed from what we hold: a batch that fails before
        # any of it is indexed would make such a guess 0.
        if not self._shrinking:
            self._shrinking = True
            self.tasks.spawn(self._shrink_to_medium())

    async def _shrink_to_medium(self) -> None:
        """After a write found the medium full: capacity at most what the card holds plus what is free now
        (``CardRoom.shrink_to_medium``); what no longer fits is evicted.  A card sized by its medium grows
        back at its next ``resize``; a configured ``card_capacity`` stays lowered."""
        try:
            free = await self.io.run(self.card.free_bytes)
        except OSError:
            return
        finally:
            self._shrinking = False
        if self.catalog.room.shrink_to_medium(free, self.catalog.used):
            self.catalog.evict_over_capacity()

    async def check(self) -> bool:
        """One health check of the card's label; False when the card is not (or no longer) at its location."""
        try:
            serial = await self.io.run(self.card.check)
        except OSError as e:
            # A check is one I/O like any other: a slow one is a strike; a
            # card that is gone (CardUnavailable) goes out at once.
            if self.active:
                self.note_result(e)
            return self.active or isinstance(e, TimeoutError)
        if serial != self.serial:
            if self.refused_serial != serial:
                log.warning("card %s: the card at %s now has serial %s, not %s: not used", self.serial, self.where,
                            serial, self.serial)
                self.refused_serial = serial
            if self.active:
                self.health.take_out(f"label now says serial {serial}", by_error=True)
            return False
        self.refused_serial = None
        self.health.checked()
        if self.health.recheck_due():
            await self._recheck_writable()
        if self.active and self.cfg.card_capacity is None and self.health.checks % RESIZE_EVERY_CHECKS == 0:
            await self.resize()
        self.health.come_back_if_due()
        return True

    async def answers(self) -> bool:
        """Whether the card reads back its own label now: one I/O, bounded like any other.

        Not fed to its health: the caller decides what a failure means (cluster mode holds the card out,
        and the card is back at its first passed check once released, with no I/O-error cooldown).
        """
        try:
            return await self.io.run(self.card.check) == self.serial
        except OSError:
            return False

    async def _recheck_writable(self) -> None:
        try:
            await self.io.run(self.card.check_writable)
        except OSError as e:
            if e.errno != errno.EROFS:
                log.warning("card %s (%s): write probe failed: %s", self.where, self.serial, e)
            self.health.still_read_only()
            return
        self.health.writable_again()
