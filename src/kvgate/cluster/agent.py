"""``kvgate cluster serve``: the agent every storage host and witness host runs.

A ``ClusterAgent``

- opens its local cards (``--cards``: directories, globs looked at again each
  round, Redis URLs), labelling a new one as ``kvgate cluster register``
  does, and registers each (``joining``) whose serial the registry lacks;
- reads each card's label back every round (on a thread, bounded) and
  reports ``alive/<serial>`` for each card that reads back, and ``agents/<name>``,
  under one lease (TTL ``liveness_ttl_s``, renewed every third of it), and
  grants a new lease and puts the keys again when the old one lapsed (an etcd
  outage longer than the TTL): liveness comes back on its own with etcd;
- stands for leader under that same lease, so its leadership lapses with its
  liveness; the leader, once per ``interval_s``, moves ``joining`` cards to
  ``active``, ``draining`` ones to ``drained`` once every reporting gateway
  lists them in its ``drained`` (and one reports at least), and publishes the
  next view when the layout would change (``Registry.publish_next``, which
  ``kvgate cluster publish`` shares).  Health is the gateways' business (they
  read ``alive/``): an agent that goes quiet changes no view, and a new
  leader publishes nothing while no card changed;
- optionally runs an etcd member as its child (``kvgate.cluster.member``);
- optionally has its directory cards served to gateways on other hosts
  (``--export HOST:PORT``: a ``CardServer``, which ``kvgate.cli.agent``
  makes from ``kvgate.cards.network.server``) and registers them by their
  ``kvgate://HOST:PORT/<serial>`` addresses.  The agent only starts, stops
  and asks that server: serving cards is the data plane, not this package's.

Every etcd call is bounded (``Registry``); card I/O runs on threads.  SIGTERM
or SIGINT stops it: it resigns, revokes its lease (its cards' liveness goes at
once) and stops its etcd member, within two etcd call bounds and the member's
``STOP_GRACE_S`` (14 s on the defaults; a second or less when etcd answers).
Every change it makes is logged.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


from kvgate.cards import expand, is_redis, kind_of, make_card
from kvgate.cluster.member import EtcdMember
from kvgate.cluster.liveness import INTERVAL_S, LIVENESS_TTL_S
from kvgate.cluster.registry import (CardRecord, CardState, LeaderEntry, etcd_client, Registry, RegistryConflict,
                                     RegistryUnavailable)
from kvgate.config import Config
from kvgate.types import split_host_port

log = logging.getLogger("kvgate.cluster.agent")


def label_card(location: str, address: str | None = None, token_file: str | None = None,
               tls_ca_file: str | None = None) -> CardRecord:
    """The card at ``location`` as the registry records it, labelling it if it has no label yet (blocking
    I/O: run it on a thread).  A gateway opening the same location finds the same serial; ``address``:
    where gateways reach it instead (a glob on a shared filesystem, under which they find it by serial);
    ``token_file``: what a ``kvgate://`` card's server requires; ``tls_ca_file``: what a ``kvgates://``
    card's certificate is checked against."""
    card = make_card(location, Config(storage_devices=[location], create_card_dirs=False,
                                      card_token_file=token_file, card_tls_ca_file=tls_ca_file))
    try:
        serial = card.open()
    finally:
        card.close()
    return CardRecord(serial=serial, kind=kind_of(location), address=address or location)


def _check_endpoint(endpoint: str) -> None:
    try:
        host, _port = split_host_port(endpoint)
        if host != "localhost":
            ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"etcd endpoint {endpoint!r}: an IPv4 address and port such as 10.0.0.5:2379 (the etcd "
                         "client connects to IPv4 addresses only; for --etcd-member, a client URL with one)") from None


def _copied_away(report: Any, serial: str) -> bool:
    """Whether a gateway's report lists ``serial`` in ``drained`` (a report it cannot read: not)."""
    drained = report.get("drained") if isinstance(report, dict) else None
    return isinstance(drained, list) and serial in drained


def read_label(location: str) -> str:
    """The serial on the card's label, only read (blocking I/O)."""
    card = make_card(location, Config(storage_devices=[location], create_card_dirs=False))
    try:
        return card.check()
    finally:
        card.close()


class CardServer(Protocol):
    """What an agent needs of the server that serves its directory cards to other hosts (``--export``):
    ``add`` serves one more card and names its address (blocking: the card's label; called on a thread),
    ``start`` binds and returns (its threads serve), ``stop`` blocks until it has stopped."""

    host: str
    port: int

    def add(self, location: str) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class AgentSettings:
    name: str = field(default_factory=socket.gethostname)
    cards: list[str] = field(default_factory=list)  # locations and globs; none on a witness host
    endpoints: list[str] = field(default_factory=list)
    cluster: str = "default"
    slots: int = field(default_factory=lambda: Config().storage_slots)
    liveness_ttl_s: int = LIVENESS_TTL_S
    interval_s: float = INTERVAL_S
    call_timeout_s: float = 2.0
    member: EtcdMember | None = None
    server: CardServer | None = None  # serves the directory cards over TCP (kvgate://host:port/serial)


class ClusterAgent:
    """The agent of one host (module docstring).  ``run`` until ``stop`` (or a signal, via ``serve``).

    ``served``: serial -> the record this agent registered (or found registered) for each card it opened.
    ``lease``: the lease its keys are under now, None while it has none.  ``leading``: whether it led at
    its last look.
    """

    def __init__(self, settings: AgentSettings) -> None:
        if not settings.name or "/" in settings.name:
            raise ValueError(f"agent name {settings.name!r}: a non-empty name without '/' (--name)")
        if settings.liveness_ttl_s < 1:
            raise ValueError(f"--liveness-ttl {settings.liveness_ttl_s}: whole seconds, at least 1")
        self.s = settings
        self.member = settings.member
        endpoints = list(settings.endpoints)
        if self.member is not None and self.member.endpoint not in endpoints:
            endpoints.insert(0, self.member.endpoint)
        if not endpoints:
            raise ValueError("no etcd to reach: give --etcd-endpoints, or run a member here (--etcd-member)")
        for ep in endpoints:
            _check_endpoint(ep)
        self.endpoints = endpoints
        self.client = etcd_client(endpoints)
        self.registry = Registry(self.client, settings.cluster, settings.call_timeout_s)
        self.served: dict[str, CardRecord] = {}
        self.location_of: dict[str, str] = {}  # location -> serial, of the cards opened
        self.where: dict[str, str] = {}  # serial -> location
        self.unregistered: set[str] = set()
        self.failed_open: dict[str, str] = {}  # location -> why, said once
        self.healthy: dict[str, bool] = {}  # serial -> whether its label read back at the last check
        self._checking: set[str] = set()  # checks still running (a hung mount must not pile threads up)
        self.reported: set[str] = set()  # serials whose alive/ key stands under the current lease
        self._keys = asyncio.Lock()  # a lease change and the puts under it, one at a time
        self._doc_cards = -1  # how many cards the agents/<name> put last listed
        # Directory cards served to gateways on other hosts (``--export``): registered as kvgate:// addresses.
        self.exporter = settings.server
        self.export: str | None = None  # the exporter's HOST:PORT once it listens
        self.lease: int | None = None
        self.candidate: tuple[int, bytes] | None = None  # (lease, election key) it stands with
        self.leading = False
        self.leader_name: str | None = None
        self._down: set[str] = set()  # what etcd could not do lately, each said once until it works again
        self._stop = asyncio.Event()

    # ---- cards -----------------------------------------------------------------------

    def export_address(self, location: str, serial: str) -> str | None:
        """Where gateways reach the card over the network, when this agent exports it (``kvgate://host:port/
        <serial>`` from its ``CardServer``); None registers the location itself, which gateways on this
        host or on a shared filesystem open directly.  Blocks (the card's label): runs on a thread."""
        if self.exporter is None or is_redis(location):
            return None
        return self.exporter.add(location)

    async def open_cards(self) -> None:
        """Open (and label) the cards of ``--cards`` not opened yet; a glob may match new directories."""
        locations = []
        for pattern in self.s.cards:
            found = await asyncio.to_thread(expand, pattern)
            if not found and pattern not in self.failed_open:
                self.failed_open[pattern] = "nothing matches"
                log.warning("card %s: nothing matches (looked at again each round)", pattern)
            locations += found
        for loc in locations:
            if loc in self.location_of:
                continue
            try:
                record = await asyncio.to_thread(label_card, loc)
            except Exception as e:  # noqa: BLE001 - any card's failure (OSError, a Redis error): said, tried again
                why = f"{type(e).__name__}: {e}"
                if self.failed_open.get(loc) != why:
                    log.error("card %s not opened: %s (tried again each round)", loc, why)
                self.failed_open[loc] = why
                continue
            self.failed_open.pop(loc, None)
            try:
                exported = await asyncio.to_thread(self.export_address, loc, record.serial)
            except (OSError, ValueError) as e:
                log.error("card %s not exported: %s (tried again each round)", loc, e)
                self.failed_open[loc] = str(e)
                continue
            if exported is not None:
                record = CardRecord(serial=record.serial, kind="kvgate", address=exported)
            if record.serial in self.served:
                log.error("card %s carries serial %s, as %s does: a copied directory? left out", loc,
                          record.serial, self.served[record.serial].address)
                self.location_of[loc] = record.serial
                continue
            log.info("card %s opened: serial %s, reached at %s", loc, record.serial, record.address)
            self.location_of[loc] = record.serial
            self.where[record.serial] = loc
            self.served[record.serial] = record
            self.healthy[record.serial] = True
            self.unregistered.add(record.serial)

    async def check_cards(self, bound_s: float = 2.0) -> None:
        """Read each card's label back (on a thread, bounded): a card whose medium went away, or that now
        carries another label, is no longer reported alive until its label reads back again."""
        def finished(serial: str, fut: asyncio.Future) -> None:  # the thread is done, however late
            self._checking.discard(serial)
            if not fut.cancelled():
                fut.exception()  # retrieved: a late failure was said (or is moot) already

        async def check(serial: str) -> None:
            location = self.where[serial]
            fut = asyncio.ensure_future(asyncio.to_thread(read_label, location))
            fut.add_done_callback(functools.partial(finished, serial))
            try:
                found = await asyncio.wait_for(asyncio.shield(fut), bound_s)
                ok, why = found == serial, f"it carries serial {found} now"
            except Exception as e:  # noqa: BLE001 - whatever the medium says, the card is not usable
                ok, why = False, f"{type(e).__name__}: {e}" if str(e) else f"no answer within {bound_s:g} s"
            if ok != self.healthy.get(serial):
                if ok:
                    log.warning("card %s at %s reads back again: reported alive again", serial, location)
                else:
                    log.error("card %s at %s fails its check (%s): no longer reported alive", serial, location, why)
            self.healthy[serial] = ok

        todo = [s for s in self.served if s not in self._checking]
        self._checking.update(todo)
        await asyncio.gather(*(check(s) for s in todo))

    async def sync_alive(self) -> None:
        """Make the alive/ keys under the current lease those of the healthy cards."""
        async with self._keys:
            lease = self.lease
            if lease is None:
                return
            for serial, ok in sorted(self.healthy.items()):
                if ok and serial not in self.reported:
                    await self._report_card(lease, self.served[serial])
                    self.reported.add(serial)
                elif not ok and serial in self.reported:
                    await self.registry.withdraw_alive(serial)
                    self.reported.discard(serial)
            await self._report_doc(lease)

    async def _report_doc(self, lease: int) -> None:
        """``agents/<name>`` again when the cards it serves changed since it was put (a card opened)."""
        if self._doc_cards != len(self.served):
            doc = self.agent_doc()
            await self.registry.report_agent(lease, self.s.name, doc)
            # What the doc put lists, not what is served now: a card opened during the put goes in the next.
            self._doc_cards = len(doc["cards"])

    async def register_cards(self) -> None:
        for serial in sorted(self.unregistered):
            record = self.served[serial]
            if await self.registry.register(record):
                log.info("card %s at %s registered (joining)", serial, record.address)
            else:
                known = await self.registry.card(serial)
                if known is not None and known.address != record.address:
                    log.warning("card %s is registered at %s, not %s: gateways look for it there (if it moved: "
                                "kvgate cluster relocate %s --address %s)", serial, known.address, record.address,
                                serial, record.address)
            self.unregistered.discard(serial)

    # ---- liveness --------------------------------------------------------------------

    def agent_doc(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "cards": sorted(self.served),
                "export": self.export, "etcd_member": self.member.name if self.member else None}

    async def _report_card(self, lease: int, record: CardRecord) -> None:
        await self.registry.report_alive(lease, record.serial, {"agent": self.s.name, "address": record.address})

    async def _put_keys(self, lease: int) -> None:
        """The keys under a new lease; it becomes the current one once they are all there."""
        async with self._keys:
            healthy = {serial for serial, ok in self.healthy.items() if ok}
            for serial in sorted(healthy):
                await self._report_card(lease, self.served[serial])
            doc = self.agent_doc()
            await self.registry.report_agent(lease, self.s.name, doc)
            self.lease, self.reported, self._doc_cards = lease, healthy, len(doc["cards"])

    async def keep_liveness(self) -> None:
        """Keep a lease and the keys under it, whatever etcd does meanwhile (module docstring)."""
        renew_s = self.s.liveness_ttl_s / 3
        last_ok = time.monotonic()
        given_up: int | None = None
        while True:
            try:
                if self.lease is None:
                    lease = await self.registry.grant(self.s.liveness_ttl_s)
                    try:
                        await self._put_keys(lease)
                    except RegistryUnavailable:
                        await self._quietly(self.registry.revoke(lease))
                        raise
                    last_ok = time.monotonic()
                    log.info("lease %x granted (TTL %d s): %d cards reported alive, agent %s reported", lease,
                             self.s.liveness_ttl_s, len(self.reported), self.s.name)
                    if given_up is not None:
                        # A restarted etcd extends the leases it had by their TTL: the one given up for lapsed
                        # may stand again for a while, its election key ahead of ours.  Its other keys are
                        # ours again (put under the new lease): revoking it takes just that key away.
                        await self._quietly(self.registry.revoke(given_up), "the lease given up")
                        given_up = None
                else:
                    left = await self.registry.keep_alive(self.lease)
                    if left <= 0:
                        log.warning("lease %x lapsed or was revoked, its keys are gone: granting another",
                                    self.lease)
                        self.lease = None
                        continue
                    last_ok = time.monotonic()
                    async with self._keys:
                        await self._report_doc(self.lease)
                self._up("liveness")
            except RegistryUnavailable as e:
                self._failed("liveness", e)
                if self.lease is not None and time.monotonic() - last_ok > self.s.liveness_ttl_s:
                    log.warning("lease %x not renewed for %.1f s, longer than its TTL: it has lapsed, its keys "
                                "are gone; granting another once etcd answers", self.lease,
                                time.monotonic() - last_ok)
                    given_up, self.lease = self.lease, None
            await asyncio.sleep(renew_s if self.lease is not None else min(renew_s, self.s.interval_s))

    # ---- the leader ------------------------------------------------------------------

    async def stand(self) -> LeaderEntry | None:
        """Stand for leader under the current lease; whether it leads now (its entry) or not (None)."""
        lease = self.lease
        if lease is None:  # its lease lapsed: so did its candidacy
            self._set_leading(False, "unknown while this agent has no lease")
            return None
        if self.candidate is None or self.candidate[0] != lease:
            self.candidate = (lease, await self.registry.campaign(lease, self.s.name))
        entry = await self.registry.leader_entry()
        leads = entry is not None and entry.key == self.candidate[1]
        self._set_leading(leads, entry.name if entry else None)
        return entry if leads else None

    def _set_leading(self, leads: bool, name: str | None) -> None:
        if leads and not self.leading:
            log.info("leadership won: agent %s leads cluster %s", self.s.name, self.s.cluster)
        elif self.leading and not leads:
            log.warning("leadership lost: agent %s no longer leads (leader now: %s)", self.s.name, name or "none")
        elif not leads and name != self.leader_name and name is not None:
            log.info("agent %s leads cluster %s", name, self.s.cluster)
        self.leading, self.leader_name = leads, name

    async def lead(self, entry: LeaderEntry) -> None:
        """One round of the leader's work; every write fenced by its leadership."""
        guard = self.registry.leadership(entry)
        reports = await self.registry.gateway_reports()
        if reports:
            for r in await self.registry.cards():
                if r.state is CardState.DRAINING and all(_copied_away(doc, r.serial) for doc in reports.values()):
                    await self.registry.set_state(r.serial, CardState.DRAINED, guard)
                    log.info("card %s: drained (all %d reporting gateways copied it away: %s)", r.serial,
                             len(reports), ", ".join(sorted(reports)))
        activated, view = await self.registry.publish_next(self.s.slots, guard)
        for r in activated:
            log.info("card %s: active", r.serial)
        if view is not None:
            log.info("view %d published: %d cards (%s), %d slots", view.epoch, len(view.cards),
                     ", ".join(f"{c.serial} {c.state.value}" for c in view.cards) or "none", view.slots)

    async def rounds(self) -> None:
        """Cards, registration and leadership, once per ``interval_s``."""
        while True:
            try:
                await self.open_cards()
                await self.check_cards()
                asks_etcd = bool(self.unregistered) or self.lease is not None
                await self.register_cards()
                await self.sync_alive()
                entry = await self.stand()
                if entry is not None:
                    await self.lead(entry)
                if asks_etcd:
                    self._up("rounds")
            except RegistryUnavailable as e:
                self._failed("rounds", e)
            except RegistryConflict as e:  # a change raced another writer: the next round reads again
                log.warning("%s (next round reads again)", e)
            except Exception:  # a bug, or a record it cannot read: said in full, and the agent goes on
                log.exception("agent round failed (next round tries again)")
            await asyncio.sleep(self.s.interval_s)

    # ---- running -----------------------------------------------------------------------

    def _failed(self, what: str, e: Exception) -> None:
        if what not in self._down:
            log.warning("etcd at %s: %s (%s goes on trying)", ", ".join(self.endpoints), e, what)
        self._down.add(what)

    def _up(self, what: str) -> None:
        if what in self._down:
            log.warning("etcd answers again (%s)", what)
            self._down.discard(what)

    async def _quietly(self, coro, what: str = "on the way out") -> None:
        try:
            await coro
        except RegistryUnavailable as e:
            log.info("%s: %s", what, e)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        tasks: list[asyncio.Task] = []
        stopped = asyncio.create_task(self._stop.wait())
        if self.member is not None:
            tasks.append(asyncio.create_task(self.member.run(), name="etcd-member"))
            # Its own member first (the others of a new cluster start meanwhile), unless told to stop.
            first = asyncio.create_task(self.member.wait_answering(30.0))
            await asyncio.wait([first, stopped], return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
        if self.exporter is not None:
            self.exporter.start()  # binds and returns; its threads serve the cards
            self.export = f"{self.exporter.host}:{self.exporter.port}"
        await self.client.connect()  # makes a channel; reaching etcd is each call's business
        log.info("agent %s serving %d card patterns in cluster %s (etcd %s, TTL %d s)", self.s.name,
                 len(self.s.cards), self.s.cluster, ", ".join(self.endpoints), self.s.liveness_ttl_s)
        tasks += [asyncio.create_task(self.keep_liveness(), name="liveness"),
                  asyncio.create_task(self.rounds(), name="rounds")]
        try:
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopped and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            stopped.cancel()
            for t in tasks:
                if t.get_name() != "etcd-member":
                    t.cancel()
            await asyncio.gather(*[t for t in tasks if t.get_name() != "etcd-member"], return_exceptions=True)
            await self._leave()
            if self.member is not None:
                await self.member.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.close()
            if self.exporter is not None:
                await asyncio.to_thread(self.exporter.stop)

    async def _leave(self) -> None:
        """Resign and revoke the lease: the cards' liveness and the leadership go now, not a TTL later."""
        if self.candidate is not None:
            await self._quietly(self.registry.resign(self.candidate[1]))
            if self.leading:
                log.info("leadership given up: agent %s stops", self.s.name)
        if self.lease is not None:
            await self._quietly(self.registry.revoke(self.lease))
            log.info("lease %x revoked: %d cards no longer reported alive", self.lease, len(self.served))
        self.lease, self.candidate, self.leading = None, None, False


def serve(agent: ClusterAgent) -> int:
    """Run ``agent`` until SIGTERM or SIGINT."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        await agent.run()

    asyncio.run(main())
    log.info("agent %s stopped", agent.s.name)
    return 0
