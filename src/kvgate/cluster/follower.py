"""A gateway in cluster mode keeps its card set on the view the cluster's leader publishes.

``ViewFollower`` reads the view about once a second (``POLL_S``), each read
bounded by the registry (``Registry.call_timeout_s``), and applies a newer
epoch to the gateway's ``CardSet`` with the machinery of a card set that
changes at runtime: a card of the view the set lacks is added (its slots'
misses ask their cards of before until the mover settles), a card the view
has ``draining`` drains (read, no writes, copied away), one that is active
again is undrained, and a card the view no longer has leaves.

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
import logging
import os
import time
from pathlib import Path
from typing import Final

import msgspec

from etcd3aio import Etcd3Client, EtcdError

from kvgate.cluster.registry import CardState, Registry, RegistryUnavailable, View
from kvgate.config import Config
from kvgate.tiers.cardset import CardChangeError, CardSet

log = logging.getLogger("kvgate.cluster")

POLL_S: Final = 1.0
_decoder = msgspec.json.Decoder(View)


class ViewFollower:
    """Follows the cluster's view for one gateway's ``CardSet`` (module docstring).

    Made by the gateway in cluster mode; ``start`` applies the view kept on
    disk (if any) before the gateway serves, ``run`` is its polling task.
    """

    def __init__(self, registry: Registry, cards: CardSet, state_path: str | os.PathLike,
                 poll_s: float = POLL_S) -> None:
        self.registry = registry
        self.cards = cards
        self.state_path = Path(state_path)
        self.poll_s = poll_s
        self.epoch = 0  # of the view applied last
        self.problems: list[str] = []  # what the last apply could not do, one line each
        self.unreachable = False  # the last poll failed (said once in the log until one succeeds)
        self.last_good_poll: float | None = None  # time.monotonic() of the last poll etcd answered

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
        log.info("cluster view %d (kept on disk) applied before the first poll", view.epoch)
        await self.apply(view)

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.poll_s)

    async def poll(self) -> bool:
        """Read the view once and apply it if it is newer; False when etcd did not answer."""
        try:
            view = await self.registry.view()
        except RegistryUnavailable as e:
            if not self.unreachable:
                log.warning("cluster registry unreachable (%s): serving with view %d", e, self.epoch)
            self.unreachable = True
            return False
        self.last_good_poll = time.monotonic()
        if self.unreachable:
            log.warning("cluster registry reachable again")
            self.unreachable = False
        if view is not None and view.epoch > self.epoch:
            await self.apply(view)
            await self.cards.pool.run(self._keep, view)
        return True

    async def apply(self, view: View) -> None:
        """Make the card set the view's: add what it lacks, drain, undrain, and let go of what left."""
        problems = []
        mine = {mc.serial: mc for mc in self.cards.cards}
        missing = [rec for rec in view.cards if rec.serial not in mine]
        # Every card first, as one change of the set (a drain refuses to take the last card in service).
        added = await self.cards.add_all([(rec.address, rec.address) for rec in missing])
        present = {rec.serial: (rec, mine[rec.serial]) for rec in view.cards if rec.serial in mine}
        for rec, got in zip(missing, added):
            if isinstance(got, CardChangeError):
                problems.append(f"card {rec.serial} at {rec.address}: {got}")
            elif got.serial != rec.serial:
                problems.append(f"card at {rec.address} carries serial {got.serial}, the registry says "
                                f"{rec.serial}: left out")
                await self.cards.remove(got.serial)  # type: ignore[arg-type]
            else:
                present[rec.serial] = (rec, got)
        for draining in (False, True):  # undrains before drains, for the same reason
            for rec, mc in present.values():
                try:
                    if draining and rec.state is CardState.DRAINING and not self.cards.is_draining(mc):
                        self.cards.drain(rec.serial)
                    elif not draining and rec.state is not CardState.DRAINING and self.cards.is_draining(mc):
                        self.cards.undrain(rec.serial)
                except CardChangeError as e:
                    problems.append(str(e))
        wanted = {rec.serial for rec in view.cards}
        for serial in [s for s in mine if s not in wanted]:
            await self.cards.remove(serial)  # type: ignore[arg-type]
        self.epoch = view.epoch
        for line in problems:
            if line not in self.problems:
                log.warning("cluster view %d: %s", view.epoch, line)
        self.problems = problems
        log.info("cluster view %d applied: %d cards, layout fingerprint %s", view.epoch, len(self.cards.cards),
                 self.cards.fingerprint)

    def _keep(self, view: View) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(view))
            os.replace(tmp, self.state_path)
        except OSError as e:
            log.warning("cluster view %d not kept at %s (%s): a restart while etcd is unreachable would not "
                        "serve it", view.epoch, self.state_path, e)


class ClusterCards:
    """A gateway's ``CardSource`` in cluster mode: its etcd client, the registry and a ``ViewFollower``.

    ``start`` (before the gateway listens) applies the view kept on disk,
    then connects and polls once, each bounded: with etcd up, a gateway
    serves the current view from its first request; with etcd down, the
    last one it knew.  ``run`` connects again until it can and then polls.
    """

    CONNECT_S: Final = 2.0  # one connection attempt (etcd answers in milliseconds when it is there)

    def __init__(self, cfg: Config, cards: CardSet) -> None:
        self.endpoints = list(cfg.cluster_etcd_endpoints)
        self.client = Etcd3Client(self.endpoints, rpc_max_attempts=1)
        self.registry = Registry(self.client, cfg.cluster_name, cfg.cluster_call_timeout)
        self.follower = ViewFollower(self.registry, cards, cfg.cluster_view_file)
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
        await self.client.close()

    def status(self) -> dict:
        f = self.follower
        return {"view_epoch": f.epoch, "reachable": not f.unreachable and f.last_good_poll is not None,
                "last_good_poll_age_s": round(time.monotonic() - f.last_good_poll, 3)
                if f.last_good_poll is not None else -1, "problems": list(f.problems),
                "endpoints": self.endpoints, "cluster": self.registry.prefix.decode()}
