"""The vLLM tier's gateway sessions: one per background thread (stores, loads, lookups).

A session connects lazily and again after it broke, after a back-off (``reconnect``).  On
one host a session that moves bytes registers vLLM's CPU tier with the gateway, so the
gateway reads and writes chunk rows in place, and takes a shared-memory session region
when the gateway cannot map the tier.  Imports no vLLM, and not the tier.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvgate.client import Client
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.reconnect import GatewayDown, Reconnector
from kvgate.integrations.vllm.settings import TierSettings

__all__ = ["GatewayDown", "TierConnection"]

# the tier's logger (vLLM's logging configuration applies under "vllm.")
logger = logging.getLogger("vllm.kvgate")


class TierConnection(Reconnector[Client]):
    """One lazily (re)connected gateway session of the tier (see ``Reconnector``).

    Used by one background thread, and at start also by the load thread, which opens the
    lookup session ahead of the first lookup: ``get`` serialises opens, so that is safe.
    ``bulk`` False: no bytes travel here (lookups), the CPU tier is not registered.
    ``zero_copy``: the last session opened has the CPU tier registered.
    """

    def __init__(self, name: str, timeout: float, *, settings: TierSettings, namespace: str, engine_id: str,
                 region_path: Callable[[], str | None], region_view: memoryview, log: RateLimitedLog,
                 bulk: bool = True):
        super().__init__(settings.target, self._open, closed_message="the tier is shutting down",
                         on_down=self._went_down)
        self.name = name
        self.timeout = timeout
        self.bulk = bulk
        self.zero_copy = False
        self._settings = settings
        self.namespace = namespace
        self.engine_id = engine_id
        self._region_path = region_path  # the /dev/shm file behind the CPU tier, looked up when connecting
        self._region_view = region_view  # the scheduler's mapping of it
        self._log = log

    def _went_down(self, e: Exception) -> None:
        self._log.warning(f"connect-{self.name}", "kvgate: cannot connect to gateway %s (%s); serving without it "
                          "(misses, no stores) and retrying", self._settings.target, e)

    def _open(self) -> Client:
        s = self._settings
        kw = dict(namespace=self.namespace, token=s.token, engine_id=self.engine_id, salted=s.salted_only)
        client = Client.connect(s.target, want_shm=False, timeout=min(s.connect_timeout, self.timeout), **kw)
        client.set_timeout(self.timeout)  # every later call: a stuck gateway is an error, not a hang
        if not client.local:
            logger.info("kvgate: connected to %s over TCP (%s): bytes travel inline", s.target, self.name)
            return client
        if not self.bulk:
            logger.info("kvgate: connected to %s (%s)", s.target, self.name)
            return client
        path = self._region_path()
        if path:
            try:
                client.register_region(path, mapping=self._region_view)
                self.zero_copy = True
                logger.info("kvgate: connected to %s (%s); %s registered: transfers are zero copy",
                            s.target, self.name, path)
                return client
            except Exception as e:
                self._log.warning("region", "kvgate: the gateway could not map vLLM's CPU tier %s (%s); "
                                  "falling back to copies through a session region", path, e)
        client.close()
        self.zero_copy = False
        client = Client.connect(s.target, want_shm=True, timeout=min(s.connect_timeout, self.timeout), **kw)
        client.set_timeout(self.timeout)
        logger.info("kvgate: connected to %s (%s) with a shared-memory session region (one copy per "
                    "transfer)", s.target, self.name)
        return client
