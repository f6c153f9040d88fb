"""A gateway in cluster mode keeps its card set on the view the cluster's leader publishes.

``ViewFollower`` reads the view about once a second (``POLL_S``), each read
bounded by the registry (``Registry.call_timeout_s``), and applies a newer
epoch to the gateway's ``CardSet`` with the machinery of a card set that
changes at runtime: a card of the view the set lacks is added (its slots'
misses ask their cards of before until the mover settles), a card the view
has ``draining`` drains (read, no writes, copied away), one that is active
again is undrained, and a card the view no longer has leaves.

Peers: each poll also gives the gateway's store its peers (``set_peers``):
the config's ``peers`` and the address every other live gateway reports
(``GatewayReport.peer``) with this one's key layout fingerprint, this
gateway's own address left out.  A gateway that reports another fingerprint
is skipped, said once.  A poll that fails leaves the peers as they were.

The last view applied is kept on local disk (``state_path``, written to a
temp file and renamed): a gateway started while etcd is unreachable applies
it and serves, and a poll that fails changes nothing (the gateway goes on
with the last view it knew).  A card of the view that cannot be opened here,
or whose label carries another serial than the registry's, is left out and
logged once per epoch.

Runs on the gateway's event loop; the card set's own methods do the I/O on
their threads.
"""

from __future__ import annotations

import asyncio
import glob
import logging
from collections import Counter
import os
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import msgspec

from etcd3aio import EtcdError

from kvgate.cards import expand, make_card
from kvgate.cards.base import HOST
from kvgate.cluster.liveness import Liveness
from kvgate.cluster.registry import CardRecord, CardState, etcd_client, GatewayReport, Registry, RegistryConflict, RegistryUnavailable, View
from kvgate.config import Config, peer_address
from kvgate.tiers.cardset import CardChangeError, CardSet

if TYPE_CHECKING:
    from kvgate.tiers.store import TieredStore

log = logging.getLogger("kvgate.cluster")

POLL_S: Final = 1.0
# A gateway's report outlives a few missed polls; a gateway that died stops
# counting toward a drain that long after.
REPORT_TTL_S: Final = 10
# Cards of the view this gateway could not take are tried again this often (polls).
RETRY_POLLS: Final = 5
# The leading agent is read this often (polls), for the status and metrics only: one more etcd call.
LEADER_POLLS: Final = 5
_decoder = msgspec.json.Decoder(View)


class ViewFollower:
    """Follows the cluster's view for one gateway's ``CardSet`` (module docstring).

    Made by the gateway in cluster mode; ``start`` applies the view kept on
    disk (if any) before the gateway serves, ``run`` is its polling task.
    Each poll also holds out or releases cards by liveness (``Liveness``),
    reports this gateway (``GatewayReport``) under a lease of its own, and,
    given ``set_peers``, sets the peers this gateway pulls from: ``peers``
    (the config's) and those of the other gateways' reports, less ``peer``
    (where this one serves peers; "" when it does not).
    """

    def __init__(self, registry: Registry, cards: CardSet, state_path: str | os.PathLike,
                 poll_s: float = POLL_S, sick_polls: int = 3, gateway_id: str = "", peer: str = "",
                 peers: Sequence[str] = (), set_peers: Callable[[list[str]], None] | None = None) -> None:
        self.registry = registry
        self.cards = cards
        self.state_path = Path(state_path)
        self.poll_s = poll_s
        self.gateway_id = gateway_id or f"{HOST}-{os.getpid()}"
        self.view: View | None = None  # applied last
        self.problems: list[str] = []  # what the last apply could not do, one line each
        self.unreachable = False  # the last poll failed (said once in the log until one succeeds)
        self.last_good_poll: float | None = None  # time.monotonic() of the last poll etcd answered
        self.liveness = Liveness(sick_polls)
        self.drained_here: set[str] = set()  # draining cards of the view this gateway copied away and let go
        self.mismatch: list[str] = []  # gateways of this epoch with another layout fingerprint
        self.refused_epoch = 0  # a view not applied because it does not fit this gateway (said once)
        self._lease = 0
        self._polls_since_retry = 0
        self._woken = asyncio.Event()  # a watch saw a change: poll now
        self.unavailable: set[str] = set()  # cards of the view that could not be reached: tried again
        self.answering: set[str] = set()  # unreported long enough to be held out, but they answer here
        self.leader: str | None = None  # the leading agent, as last read (every LEADER_POLLS polls)
        self._polls = 0
        self.peer = peer  # reported: where the other gateways pull from this one
        self.fixed_peers = list(peers)  # the config's peers, asked first, whatever the registry says
        self.set_peers = set_peers
        self.found_peers: list[str] = []  # other gateways' peer addresses of this layout, as last read
        self.peers_skipped: dict[str, tuple[str, str]] = {}  # gateway -> (its fingerprint, ours): not pulled from

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view is not None else 0

    async def start(self) -> None:
        """Apply the view kept on disk, if there is a usable one."""
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("cluster view kept at %s not read (%s): waiting for etcd", self.state_path, e)
            return
        try:
            view = _decoder.decode(raw)
        except msgspec.DecodeError as e:
            log.warning("cluster view kept at %s ignored: %s", self.state_path, e)
            return
        if self._fits(view):
            log.info("cluster view %d (kept on disk) applied before the first poll", view.epoch)
            await self.apply(view)

    async def run(self) -> None:
        """Poll about once a second, and at once when a watch sees the view or a liveness report change."""
        watcher = asyncio.create_task(self._watch())
        try:
            while True:
                await self.poll()
                self._woken.clear()
                try:
                    async with asyncio.timeout(self.poll_s):
                        await self._woken.wait()
                except TimeoutError:
                    pass
        finally:
            # Awaited, not only cancelled: the watch's streams end before the etcd client closes, or their
            # gRPC tasks are left pending on a closed client (asyncio's "Task was destroyed but it is pending!"
            # after an etcd outage).
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            try:
                async for _ in self.registry.changes():
                    self._woken.set()
            except RegistryUnavailable:
                pass  # the polls go on; the watch is made again after one
            await asyncio.sleep(self.poll_s)

    async def poll(self) -> bool:
        """Read the registry once: apply a newer view, hold out or release cards, report; False when etcd did
        not answer (nothing changes then)."""
        try:
            seen = await self.registry.observe()
        except (RegistryUnavailable, RegistryConflict) as e:
            if not self.unreachable:
                log.warning("cluster registry unreachable (%s): serving with view %d", e, self.epoch)
            self.unreachable = True
            return False
        self.last_good_poll = time.monotonic()
        if self.unreachable:
            log.warning("cluster registry reachable again")
            self.unreachable = False
        self._note_drained()
        view = seen.view
        if view is not None and view.epoch > self.epoch and self._fits(view):
            await self.apply(view)
            await self.cards.pool.run(self._keep, view)
        elif self.unavailable and self.view is not None:
            self._polls_since_retry += 1
            if self._polls_since_retry >= RETRY_POLLS:  # a mount that came up, a server that came back
                self._polls_since_retry = 0
                await self.apply(self.view, retry=True)
        await self._follow_liveness(seen.alive)
        self._compare(seen.gateways)
        self._follow_peers(seen.gateways)
        await self._report()
        self._polls += 1
        if self._polls % LEADER_POLLS == 1:
            try:
                self.leader = await self.registry.leader()
            except (RegistryUnavailable, RegistryConflict):
                pass  # as it was; the next read says
        return True

    def _fits(self, view: View) -> bool:
        """Whether this gateway can place keys as the view does (its slot count); said once per epoch if not."""
        if view.slots == self.cards.slots:
            return True
        if self.refused_epoch != view.epoch:
            self.refused_epoch = view.epoch
            log.error("cluster view %d has %d slots and this gateway's storage_slots is %d: not applied (every key "
                      "would be looked for on another card than the other gateways use); set storage_slots: %d",
                      view.epoch, view.slots, self.cards.slots, view.slots)
        return False

    def _note_drained(self) -> None:
        """Cards the view has draining that the card set let go (the mover copied them away): not taken again."""
        if self.view is None:
            return
        mine = {mc.serial for mc in self.cards.cards}
        for rec in self.view.cards:
            if rec.state is CardState.DRAINING and rec.serial not in mine and rec.serial not in self.drained_here:
                self.drained_here.add(rec.serial)

    async def apply(self, view: View, retry: bool = False) -> None:
        """Make the card set the view's: add what it lacks, drain, undrain, and let go of what left.

        ``retry``: the same view again, for the cards that could not be reached (``unavailable``) only.
        """
        problems = []
        mine = {mc.serial: mc for mc in self.cards.cards}
        draining = {rec.serial for rec in view.cards if rec.state is CardState.DRAINING}
        self.drained_here &= draining
        missing = [rec for rec in view.cards if rec.serial not in mine and rec.serial not in self.drained_here
                   and (not retry or rec.serial in self.unavailable)]
        unavailable = set()
        locations = await self.cards.pool.run(_locate_all, missing, self.cards.cfg)
        # Every card first, as one change of the set (a drain refuses to take the last card in service).
        added = await self.cards.add_all([(loc, rec.address) for rec, loc in zip(missing, locations)])
        present = {rec.serial: (rec, mine[rec.serial]) for rec in view.cards if rec.serial in mine}
        for rec, got in zip(missing, added):
            if isinstance(got, CardChangeError):
                problems.append(f"card {rec.serial} at {rec.address}: {got}")
                if got.unavailable:
                    unavailable.add(rec.serial)
            elif got.serial != rec.serial:
                problems.append(f"card at {rec.address} carries serial {got.serial}, the registry says "
                                f"{rec.serial}: left out")
                await self.cards.remove(got.serial, force=True)  # type: ignore[arg-type]
            else:
                present[rec.serial] = (rec, got)
        for rec, mc in list(present.values()):
            if rec.address != mc.pattern:  # moved (kvgate cluster relocate): found there by its label
                await self.cards.readdress(mc, rec.address)
        for drain in (False, True):  # undrains before drains, for the same reason
            for rec, mc in present.values():
                try:
                    if drain and rec.state is CardState.DRAINING and not self.cards.is_draining(mc):
                        self.cards.drain(rec.serial)
                    elif not drain and rec.state is not CardState.DRAINING and self.cards.is_draining(mc):
                        self.cards.undrain(rec.serial)
                except CardChangeError as e:
                    problems.append(str(e))
        wanted = {rec.serial for rec in view.cards}
        for serial in [s for s in mine if s not in wanted]:
            # The view decides (a card leaves it drained, or retired by the operator): never refused here
            # for what it would lose, as a `kvgate cards remove` by hand is (CardSet.remove).
            await self.cards.remove(serial, force=True)  # type: ignore[arg-type]
        self.view = view
        if retry:  # what was not retried still stands
            problems += [p for p in self.problems if not any(f"card {s} " in p for s in self.unavailable)]
            problems = list(dict.fromkeys(problems))
        for line in problems:
            if line not in self.problems:
                log.warning("cluster view %d: %s", view.epoch, line)
        self.problems = problems
        self.unavailable = unavailable
        if retry and not missing:
            return
        log.info("cluster view %d applied: %d cards, layout fingerprint %s", view.epoch, len(self.cards.cards),
                 self.cards.fingerprint)

    async def _follow_liveness(self, alive: frozenset[str]) -> None:
        by_serial = {mc.serial: mc for mc in self.cards.cards}
        sick, release = self.liveness.observe(list(by_serial), alive)
        for serial in release:
            by_serial[serial].life.release()
        self.answering &= sick  # reported again (or gone from the set): said again if it goes quiet again
        if not sick:
            return
        # The agent's silence alone takes nothing out: the card must fail this gateway's own check too.
        order = sorted(sick)
        answers = await asyncio.gather(*(by_serial[s].life.answers() for s in order))
        down = [s for s, ok in zip(order, answers) if not ok]
        self.liveness.hold(down)
        for serial in down:
            by_serial[serial].life.hold_out(f"no agent has reported it alive for {self.liveness.sick_polls} polls and "
                                       "it does not answer this gateway")
            self.answering.discard(serial)
        for serial in (s for s, ok in zip(order, answers) if ok and s not in self.answering):
            log.warning("card %s: no agent has reported it alive for %d polls, but it answers this gateway: kept "
                        "in service (is its agent down, or cut off from etcd?)", serial, self.liveness.sick_polls)
            self.answering.add(serial)

    def _compare(self, gateways: dict[str, GatewayReport]) -> None:
        """Gateways on this epoch whose layout differs from ours: each key of theirs is looked for elsewhere."""
        mine = self.cards.fingerprint
        other = sorted(gid for gid, r in gateways.items()
                       if gid != self.gateway_id and r.epoch == self.epoch and r.fingerprint
                       and r.fingerprint != mine)
        for gid in other:
            if gid not in self.mismatch:
                log.error("gateway %s applied view %d with layout fingerprint %s and this one %s: the two look for "
                          "keys on different cards (check storage_slots, num_dbs and placement on both)",
                          gid, self.epoch, gateways[gid].fingerprint, mine)
        self.mismatch = other

    def _follow_peers(self, gateways: dict[str, GatewayReport]) -> None:
        """The store's peers: the config's, then every other gateway's address with our layout fingerprint
        (sorted), ours left out.  Another fingerprint is skipped: said once per gateway and pair of them."""
        if self.set_peers is None:
            return
        mine = self.cards.fingerprint
        found, skipped = set(), {}
        for gid, r in gateways.items():
            if gid == self.gateway_id or not r.peer or r.peer == self.peer:
                continue
            if r.fingerprint != mine:
                skipped[gid] = (r.fingerprint, mine)
                if self.peers_skipped.get(gid) != skipped[gid]:
                    log.warning("gateway %s (peer %s) has layout fingerprint %s and this one %s: not pulled from "
                                "until they agree", gid, r.peer, r.fingerprint or "(none yet)", mine or "(none yet)")
                continue
            found.add(r.peer)
        self.peers_skipped = skipped
        self.found_peers = sorted(found)
        self.set_peers([a for a in dict.fromkeys([*self.fixed_peers, *self.found_peers]) if a != self.peer])

    async def _report(self) -> None:
        """This gateway's report under its lease (granted again when it lapsed, as after an etcd outage)."""
        drained = tuple(sorted(self.drained_here)) if self.view is not None else ()
        report = GatewayReport(epoch=self.epoch, fingerprint=self.cards.fingerprint, drained=drained,
                               peer=self.peer)
        try:
            if self._lease == 0 or await self.registry.keep_alive(self._lease) == 0:
                self._lease = await self.registry.grant(REPORT_TTL_S)
            await self.registry.report_gateway(self._lease, self.gateway_id, report)
        except RegistryUnavailable:
            pass  # the next poll says so if etcd is gone; the report is made again then

    async def stop(self) -> None:
        """Take this gateway's report away at once (it no longer counts toward a drain)."""
        if self._lease:
            try:
                await self.registry.revoke(self._lease)
            except RegistryUnavailable:
                pass
            self._lease = 0

    def _keep(self, view: View) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(view))
            os.replace(tmp, self.state_path)
        except OSError as e:
            log.warning("cluster view %d not kept at %s (%s): a restart while etcd is unreachable would not "
                        "serve it", view.epoch, self.state_path, e)


def _locate_all(records: list[CardRecord], cfg: Config) -> list[str]:
    """Where this host reaches each card: its address, or for a glob (a shared filesystem, mounted wherever
    each host mounts it) the directory it matches whose label carries the card's serial.  Reads labels:
    runs on a pool thread."""
    out = []
    for rec in records:
        found = rec.address
        if glob.has_magic(rec.address):
            for loc in expand(rec.address):
                try:
                    if make_card(loc, cfg).check() == rec.serial:
                        found = loc
                        break
                except OSError:
                    continue  # not a card, or not reachable now: the next match may be it
        out.append(found)
    return out


class ClusterCards:
    """A gateway's ``CardSource`` in cluster mode: its etcd client, the registry and a ``ViewFollower`` of
    its store's card set, which also sets the store's peers (``TieredStore.set_peers``).

    ``start`` (before the gateway listens) applies the view kept on disk,
    then connects and polls once, each bounded: with etcd up, a gateway
    serves the current view from its first request; with etcd down, the
    last one it knew.  ``run`` connects again until it can and then polls.
    """

    CONNECT_S: Final = 2.0  # one connection attempt (etcd answers in milliseconds when it is there)

    def __init__(self, cfg: Config, store: TieredStore) -> None:
        self.endpoints = list(cfg.cluster_etcd_endpoints)
        self.client = etcd_client(self.endpoints)
        self.registry = Registry(self.client, cfg.cluster_name, cfg.cluster_call_timeout)
        self.follower = ViewFollower(self.registry, store.card_set, cfg.cluster_view_file,
                                     sick_polls=cfg.cluster_sick_polls, peer=peer_address(cfg), peers=cfg.peers,
                                     set_peers=store.set_peers)
        self.connected = False

    async def _connect(self) -> bool:
        try:
            async with asyncio.timeout(self.CONNECT_S):
                await self.client.connect()
        except (TimeoutError, OSError, EtcdError) as e:
            await self.client.close()
            if not self.follower.unreachable:
                log.warning("cluster registry at %s unreachable (%s): serving with view %d",
                            ", ".join(self.endpoints), type(e).__name__, self.follower.epoch)
            self.follower.unreachable = True
            return False
        self.connected = True
        return True

    async def start(self) -> None:
        os.makedirs(self.follower.state_path.parent, exist_ok=True)
        await self.follower.start()
        if await self._connect():
            await self.follower.poll()

    async def run(self) -> None:
        while not self.connected:
            await asyncio.sleep(self.follower.poll_s)
            await self._connect()
        await self.follower.run()

    async def close(self) -> None:
        if self.connected:
            await self.follower.stop()
        await self.client.close()

    def status(self) -> dict:
        f = self.follower
        return {"view_epoch": f.epoch, "reachable": not f.unreachable and f.last_good_poll is not None,
                "last_good_poll_age_s": round(time.monotonic() - f.last_good_poll, 3)
                if f.last_good_poll is not None else -1, "problems": list(f.problems),
                "endpoints": self.endpoints, "cluster": self.registry.prefix.decode(),
                "etcd_calls": self.registry.calls, "etcd_call_seconds": round(self.registry.call_seconds, 6),
                "etcd_failed_calls": self.registry.failed_calls,
                "cards_by_state": dict(Counter(r.state.value for r in f.view.cards)) if f.view else {},
                "gateway_id": f.gateway_id, "leader": f.leader, "held_out": sorted(f.liveness.held),
                "unreported_but_answering": sorted(f.answering),
                "drained_here": sorted(f.drained_here), "layout_mismatch": list(f.mismatch),
                "peer": f.peer, "peers_found": list(f.found_peers), "peers_skipped": sorted(f.peers_skipped)}
