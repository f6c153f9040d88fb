"""The long tier's cards: which cards there are, and where each object belongs.

``CardSet`` is the membership: it finds the configured cards, claims them,
checks them every second, and takes cards in and out while serving (joins,
drains, removals, SIGHUP), each change re-mapping its ``layout``.  Where a
key belongs is the layout's (``CardLayout``: the slot map, rendezvous
placement over the serials); where a key *is* (any index may hold it) is
``kvgate.tiers.finder``'s rule; copying what a change misplaced is the
``CardMover``'s; everything about one card (its I/O, index, eviction,
capacity, health) is its ``ManagedCard``'s.

Who calls it: the card tier (``CardTier``: the cards, their writes'
bookkeeping), the gateway's card operations and the cluster follower (the
changes), the mover (what it moved).  Threading contract: every method runs
on the gateway's event loop and never blocks; card I/O runs on each card's
own threads (``ManagedCard``), globbing on the general pool.

A card is known by the serial on its label: found again under another path
that its ``storage_devices`` entry matches (a glob), it is taken back there;
a different card at its old path is never used in its place
(``kvgate.tiers.discovery``).

Claims: every card is claimed (``Card.claim``) before it is used, exclusively
or, with ``shared_storage``, shared.  At start a card another gateway holds
in a way that does not mix refuses the start (``CardInUse``, one line with
the fix); a card that appears later (pending, relocated) and is held so is
not used, and logged.

A configured card directory that does not exist is not created (unless
``create_card_dirs``, or it is the default ``./var/kvgate/card0``): it is
logged and pending, and taken as soon as it exists, labelled or not, as at
start; what it must not be is a directory the gateway made itself on the
filesystem under a missing mount.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvgate.cards import CardInUse, NotACardLocation, expand, make_card
from kvgate.config import Config, ConfigError
from kvgate.tiers.card import ManagedCard, TierHooks
from kvgate.tiers.discovery import CardDiscovery
from kvgate.tiers.io import IoPool, Tasks
from kvgate.tiers.layout import CardLayout, LayoutMismatch
from kvgate.tiers.mover import CardMover
from kvgate.tiers.referee import Referee
from kvgate.tiers.rows import join_digest, key_digest_array
from kvgate.errors import KvgateError

log = logging.getLogger("kvgate.long")

CHECK_INTERVAL_S = 1.0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class CardChangeError(KvgateError, ValueError):
    """A change of the card set that cannot be made (unknown serial, a card that cannot be used...); says why.

    ``unavailable``: the card could not be opened (missing, unreadable): it may be there later.
    """

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class CardSet:
    """The configured cards: which there are, in service, draining or pending (module docstring).

    Owned by ``TieredStore``; ``start`` finds and claims the cards, ``stop``
    lets them go.  ``cards`` are the cards found (in service or not),
    ``pending`` the entries with no readable card yet, ``layout`` where each
    object belongs among them.

    The set changes while it serves (``add``, ``drain``, ``undrain``,
    ``remove``); each change re-maps the layout, counts one ``generation`` and
    wakes the ``CardMover``.  A draining card is out of the slot map (no
    writes) but still answers for what it holds until the mover has copied
    it elsewhere; then it leaves.
    """

    def __init__(self, cfg: Config, pool: IoPool, hooks: TierHooks):
        self.cfg = cfg
        self.hooks = hooks
        self.pool = pool  # for work that is not one card's (globbing)
        self.cards: list[ManagedCard] = []
        self.pending: list[ManagedCard] = []
        self.patterns = list(cfg.storage_devices)  # the storage_devices entries in force (SIGHUP changes them)
        self.generation = 0  # changes of the card set since start
        self._by_serial: dict[str, ManagedCard] = {}
        self.layout = CardLayout(cfg, self._by_serial)
        self._draining: dict[str, bool] = {}  # serial -> leave even if some objects could not be copied
        # What running drains have moved so far, by destination serial, then draining serial: [objects, bytes].
        # Their copies on the draining card are gone (``note_written``), so these are only on the destination
        # until the drain ends: a removal of the destination would lose them (``_loss``).
        self._moved_in: dict[str, dict[str, list[int]]] = {}
        self.mover = CardMover(self, cfg.card_move_rate, self._after_move_round)
        self._tasks = Tasks()
        self.discovery = CardDiscovery(cfg, pool)
        # Under "adaptive", one referee judges the orders for all the cards: their merit is the traffic's.
        self.referee = Referee(self.objects) if cfg.eviction_policy == "adaptive" else None

    @property
    def slots(self) -> int:
        return self.cfg.storage_slots

    @property
    def fingerprint(self) -> str:
        """The key layout fingerprint of the cards in force (``CardLayout``)."""
        return self.layout.fingerprint

    def _new_card(self, pattern: str, location: str) -> ManagedCard:
        return ManagedCard(pattern, location, make_card(location, self.cfg), self.cfg, self.pool, self.hooks,
                           referee=self.referee)

    def objects(self) -> int:
        """Objects indexed on the cards in service."""
        return sum(len(mc.index) for mc in self.cards)

    # ---- start and stop ---------------------------------------------------

    async def start(self) -> None:
        for pattern in self.patterns:
            locations = await self.pool.run(expand, pattern)
            if not locations:
                log.warning("card %s is not available at startup: nothing matches", pattern)
                self.pending.append(self._new_card(pattern, pattern))
            for loc in locations:
                mc = self._new_card(pattern, loc)
                try:
                    serial = await mc.io.run(mc.card.open)
                except NotACardLocation as e:  # waiting would not make it a card: the entry is wrong
                    mc.io.shutdown(wait=False)
                    await self.stop()  # release the cards claimed so far
                    raise ConfigError(f"config key 'storage_devices': {pattern}: {e.strerror}") from None
                except OSError as e:
                    log.warning("card %s is not available at startup: %s", mc.where, e)
                    self.pending.append(mc)
                    continue
                if serial in self._by_serial:
                    log.warning("card %s carries serial %s, already in use at %s: ignored", loc, serial,
                                self._by_serial[serial].location)
                    continue
                try:
                    await mc.io.run(mc.card.claim, self.cfg.shared_storage)
                except CardInUse:
                    mc.io.shutdown(wait=False)
                    await self.stop()  # release the cards claimed so far
                    raise
                except OSError as e:
                    log.warning("card %s is not available at startup: %s", mc.where, e)
                    mc.card.close()
                    self.pending.append(mc)
                    continue
                mc.life.serve(mc.card, loc, serial)
                self.cards.append(mc)
                self._by_serial[mc.serial] = mc
        self.layout.remap(self._writable())
        expected = self.cfg.key_layout_fingerprint
        if expected and expected != self.fingerprint:
            raise LayoutMismatch(
                f"key layout fingerprint is {self.fingerprint} but key_layout_fingerprint is {expected}: "
                "these cards, slots, num_dbs or placement differ from the other gateways'; refusing to start"
            )
        if self.cfg.start_clean:
            deleted = await self.clean()
            log.info("start_clean: deleted %d objects", deleted)
        for mc in self.cards:
            await mc.life.adopt()
        self._spawn(self._health_loop())
        self._spawn(self.mover.run())

    def _writable(self) -> list[str]:
        """The serials of the cards that take writes: the layout's slots go to them."""
        return [s for s in self._by_serial if s not in self._draining]

    async def stop(self) -> None:
        """Let the cards go, each saving its index snapshot first (``ManagedCard.stop``)."""
        await self._tasks.cancel()
        await asyncio.gather(*(mc.life.stop() for mc in self.cards), *(mc.life.close() for mc in self.pending))

    def _spawn(self, coro) -> asyncio.Task:
        return self._tasks.spawn(coro)

    # ---- the cards --------------------------------------------------------

    def serves(self, mc: ManagedCard) -> bool:
        """Whether ``mc`` is (still) one of the set's cards: false once it was removed."""
        return self._by_serial.get(mc.serial) is mc

    def note_written(self, mc: ManagedCard, fkeys: list[bytes], stored: list[int], payload_lens: list[int],
                     metas: list) -> list[bool]:
        """Index objects just written to ``mc``; per object, whether it stayed there (not evicted by its batch).

        A copy on any other card is deleted: the key is now on ``mc``, and a
        stale copy elsewhere must not answer for it (``find``).
        """
        if not fkeys:
            return []
        digests = key_digest_array(fkeys)
        for other in self.cards:
            if other is mc or not other.index:
                continue
            there = np.flatnonzero(other.index.find(digests) >= 0)
            if there.size:
                stale = [join_digest(*digests[i].tolist()) for i in there.tolist()]
                for digest in stale:
                    other.catalog.note_gone_digest(digest)
                other.catalog.let_go(stale)
        return mc.catalog.note_written(fkeys, stored, payload_lens, metas, digests).tolist()

    async def clean_namespace(self, ns: bytes) -> int:
        """``ManagedCard.clean_namespace`` on every card in service; how many objects were deleted."""
        total = 0
        for mc in self.cards:
            if mc.active:
                total += await mc.clean_namespace(ns)
        return total

    async def clean(self) -> int:
        total = 0
        for mc in self.cards:
            if mc.active:
                total += await mc.clean()
        return total

    # ---- health and discovery -----------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                await asyncio.gather(*(self._check(mc) for mc in self.cards), self._retry_pending())
            except Exception:  # noqa: BLE001 - health checks must go on
                log.exception("card health check failed")

    async def _check(self, mc: ManagedCard) -> None:
        was_active = mc.active
        if not await mc.life.check():
            await self.discovery.relocate(mc, {c.location for c in self.cards if c is not mc})
        elif mc.active and not was_active and (self.layout.settling or self._draining):
            self.mover.wake()  # what waited for this card can move now

    async def readdress(self, mc: ManagedCard, pattern: str) -> None:
        """The card is to be found under ``pattern`` from now on (cluster mode: the registry says it moved):
        taken there at once if it no longer answers where it is, else at its first failed check."""
        if mc.pattern == pattern:
            return
        log.warning("card %s (%s): its address is now %s", mc.where, mc.serial, pattern)
        mc.life.readdress(pattern)
        await self._check(mc)

    async def _retry_pending(self) -> None:
        """Entries with no card at start: take the card as soon as one is there (``CardDiscovery.find``)."""
        for mc in list(self.pending):
            found = await self.discovery.find(mc, {c.location for c in self.cards}, self._by_serial)
            if found is None:
                continue
            probe, loc, serial = found
            self.pending.remove(mc)
            mc.life.serve(probe, loc, serial)
            await mc.life.adopt()  # its index snapshot loaded before any request can reach it
            self.cards.append(mc)
            self._by_serial[serial] = mc
            log.warning("card %s (%s) is available now; moved from inactive to active", loc, serial)
            self.layout.remap(self._writable())

    # ---- changes while serving ---------------------------------------------------

    def is_draining(self, mc: ManagedCard) -> bool:
        return mc.serial in self._draining

    def _card(self, serial: str) -> ManagedCard:
        mc = self._by_serial.get(serial)
        if mc is None:
            known = ", ".join(self._by_serial) or "none"
            raise CardChangeError(f"no card with serial {serial!r} (cards: {known}); `kvgate cards list` shows them")
        return mc

    def _changed(self, what: str) -> None:
        self.generation += 1
        self.layout.change(self._writable())
        log.warning("card set generation %d: %s; layout fingerprint %s", self.generation, what, self.fingerprint)
        self.mover.wake()

    async def add(self, location: str, pattern: str | None = None) -> ManagedCard:
        """Take the card at ``location`` (a directory or a Redis URL) into service now; placement moves
        about 1/(N+1) of the slots to it, and the mover copies their objects over.  ``pattern``: the
        ``storage_devices`` entry it came from (itself when given by hand)."""
        (got,) = await self.add_all([(location, pattern or location)])
        if isinstance(got, CardChangeError):
            raise got
        return got

    async def add_all(self, wanted: list[tuple[str, str]]) -> list[ManagedCard | CardChangeError]:
        """``add`` of several ``(location, pattern)`` cards as one change of the set (one generation, one
        re-mapping of the slots: a cluster view of 64 cards is not 64 changes); per card, the card taken
        or why not."""
        out: list[ManagedCard | CardChangeError] = []
        for location, pattern in wanted:
            try:
                out.append(await self._take(location, pattern))
            except CardChangeError as e:
                out.append(e)
        taken = [mc for mc in out if isinstance(mc, ManagedCard)]
        if taken:
            self._changed(", ".join(f"card {mc.where} ({mc.serial}) added" for mc in taken))
        return out

    async def _take(self, location: str, pattern: str) -> ManagedCard:
        """Open and claim the card at ``location`` and put it among the cards (the caller re-maps)."""
        if any(mc.location == location for mc in self.cards):
            raise CardChangeError(f"card {location} is in use already")
        mc = self._new_card(pattern, location)
        try:
            serial = await mc.io.run(mc.card.open)
            if serial in self._by_serial:
                raise CardChangeError(f"card {location} carries serial {serial}, already in use at "
                                      f"{self._by_serial[serial].location}")
            await mc.io.run(mc.card.claim, self.cfg.shared_storage)
        except (OSError, CardChangeError) as e:
            await mc.life.close()
            if isinstance(e, CardChangeError):
                raise
            raise CardChangeError(f"card {mc.where} cannot be used: {e}",
                                  unavailable=not isinstance(e, (CardInUse, NotACardLocation))) from None
        mc.life.serve(mc.card, location, serial)
        await mc.life.adopt()  # its index snapshot loaded before any request can reach it
        self.cards.append(mc)
        self._by_serial[serial] = mc
        return mc

    def drain(self, serial: str, now: bool = False, force: bool = False) -> ManagedCard:
        """No new writes to the card; it leaves once the mover has copied what it holds elsewhere (``now``:
        leaves at once, what it holds is no longer read; refused as ``remove`` is, unless ``force``)."""
        mc = self._card(serial)
        if now:
            if not force:
                self._refuse_loss(serial, "drained --now")
            self._spawn(self._drop(serial).life.close())
            return mc
        if serial not in self._draining:
            if len(self._by_serial) - len(self._draining) <= 1:
                raise CardChangeError(f"card {serial} is the last card in service: add another before draining it")
            self._draining[serial] = False
            self._changed(f"card {mc.where} ({serial}) draining: {len(mc.index)} objects to copy")
        return mc

    def undrain(self, serial: str) -> ManagedCard:
        mc = self._card(serial)
        if serial not in self._draining:
            raise CardChangeError(f"card {serial} is not draining")
        del self._draining[serial]
        self._forget_moves(serial)  # what it moved is where placement puts it: that card's, like any object
        self._changed(f"card {mc.where} ({serial}) takes writes again")
        return mc

    async def remove(self, serial: str, force: bool = False) -> None:
        """The card leaves now: what it holds is no longer read (it stays on the medium).

        Refused (``CardChangeError``, saying what would be lost and how to go on) when it would leave no
        card in service, or drop objects a running drain is moving (the card drains and still holds some)
        or has moved onto it; ``force`` removes it anyway."""
        if not force:
            self._refuse_loss(serial, "removed")
        await self._drop(serial).life.close()

    def note_moved(self, src: ManagedCard, dst: ManagedCard, nbytes: int) -> None:
        """The mover landed one object of ``src`` on ``dst`` (and deleted ``src``'s copy): counted while ``src``
        drains, so that removing ``dst`` before the drain ends is refused (``_loss``)."""
        if src.serial in self._draining:
            row = self._moved_in.setdefault(dst.serial, {}).setdefault(src.serial, [0, 0])  # type: ignore[arg-type]
            row[0] += 1
            row[1] += nbytes

    def _forget_moves(self, serial: str) -> None:
        """``serial`` stopped draining or left: what it moved is no longer a running drain's."""
        self._moved_in.pop(serial, None)
        for moved in self._moved_in.values():
            moved.pop(serial, None)

    def _loss(self, serial: str) -> tuple[list[str], list[str]]:
        """Why taking card ``serial`` out now, without copying, would cost data or service, one clause each,
        and what to do instead (both empty when only what the card alone holds by choice would go)."""
        mc = self._card(serial)
        why, instead = [], []
        if not any(s != serial and s not in self._draining for s in self._by_serial):
            why.append("it is the last card in service: without it every put is refused (answers False)")
            instead.append("add another card first (`kvgate cards add`)")
        if serial in self._draining and mc.index:
            why.append(f"it is draining and still holds {len(mc.index)} objects ({_mib(mc.used)}) its drain has "
                       "not copied elsewhere yet")
            instead.append("wait for its drain to end (it then leaves by itself; `kvgate cards list` shows it)")
        moved = {src: n for src, n in self._moved_in.get(serial, {}).items() if src in self._draining}
        if moved and mc.index:
            objects = min(sum(n[0] for n in moved.values()), len(mc.index))  # some may have gone since
            nbytes = min(sum(n[1] for n in moved.values()), mc.used)
            sources = ", ".join(sorted(moved))
            why.append(f"{objects} objects ({_mib(nbytes)}) the running drain of card {sources} moved onto it are "
                       "on no other card")
            instead.append(f"drain it without --now (its objects are copied on), or wait for the drain of "
                           f"{sources} to end, or undrain {sources}")
        return why, instead

    def _refuse_loss(self, serial: str, what: str) -> None:
        why, instead = self._loss(serial)
        if why:
            raise CardChangeError(f"card {serial} not {what}: {'; '.join(why)}. Instead: {'; or '.join(instead)}; "
                                  "or --force to take it out anyway")

    def _drop(self, serial: str, why: str = "removed") -> ManagedCard:
        mc = self._card(serial)
        self.cards.remove(mc)
        del self._by_serial[serial]
        self._draining.pop(serial, None)
        self._forget_moves(serial)
        mc.catalog.clear()  # its namespaces' figures no longer count it
        self._changed(f"card {mc.where} ({serial}) {why}")
        return mc

    async def apply_devices(self, patterns: list[str]) -> list[str]:
        """The config's ``storage_devices`` now (SIGHUP): cards of new entries join, cards of entries gone
        drain.  Returns what could not be done, one line each (also logged)."""
        problems = []
        old = set(self.patterns)
        for pattern in patterns:
            if pattern in old:
                continue
            locations = await self.pool.run(expand, pattern)
            if not locations:
                log.warning("card %s is not available: nothing matches; taken once it is there", pattern)
                self.pending.append(self._new_card(pattern, pattern))
            for loc in locations:
                if any(mc.location == loc for mc in self.cards):
                    continue  # taken already (by hand, or under another entry)
                try:
                    await self.add(loc, pattern)
                except CardChangeError as e:
                    log.warning("%s", e)
                    if e.unavailable:  # as at start: taken as soon as it is there
                        self.pending.append(self._new_card(pattern, loc))
                    else:
                        problems.append(str(e))
        gone = old - set(patterns)
        for mc in [mc for mc in self.pending if mc.pattern in gone]:
            self.pending.remove(mc)
            self._spawn(mc.life.close())
        for mc in list(self.cards):
            if mc.pattern in gone and mc.serial not in self._draining:
                try:
                    self.drain(mc.serial)  # type: ignore[arg-type]
                except CardChangeError as e:
                    log.warning("%s", e)
                    problems.append(str(e))
        self.patterns = list(patterns)
        return problems

    def _after_move_round(self, settled: bool) -> None:
        """After each mover round: a draining card with nothing left to copy leaves; once the mover has
        settled every change, misses no longer fall back to the cards slots had before."""
        if settled:
            self.layout.settle()
        for serial in list(self._draining):
            mc = self._by_serial[serial]
            if not mc.index:
                self._spawn(self._drop(serial, "drained").life.close())

    def status(self, pending: bool = False) -> list[dict]:
        """Every card's row (``ManagedCard.snapshot``) with its state and its share of the slots; with
        ``pending``, a short row for each entry with no card yet."""
        rows = []
        for mc in self.cards:
            row = mc.snapshot()
            row["state"] = ("draining" if mc.serial in self._draining else "serving") if mc.active else "inactive"
            row["slots"] = self.layout.slots_of(mc.serial)
            rows.append(row)
        if pending:
            rows += [{"serial": None, "location": mc.where, "state": "pending", "slots": 0} for mc in self.pending]
        return rows

    # ---- figures --------------------------------------------------------------

    @property
    def active_cards(self) -> int:
        return sum(1 for mc in self.cards if mc.active)

    def oldest_io_age(self) -> float:
        return max((mc.io.oldest_age() for mc in self.cards + self.pending), default=0.0)

    @property
    def io_errors(self) -> int:
        return sum(mc.life.health.errors for mc in self.cards + self.pending)

    @property
    def io_timeouts(self) -> int:
        return sum(mc.life.health.timeouts for mc in self.cards + self.pending)

