"""The vLLM tier's gateway sessions: one per background thread (stores, loads, lookups).

A session connects lazily and again after it broke, after a back-off (``reconnect``).  On
one host a session that moves bytes registers vLLM's CPU tier with the gateway, so the
gateway reads and writes chunk rows in place, and takes a shared-memory session region
when the gateway cannot map the tier.  Imports no vLLM, and not the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvgate.client import Client
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.reconnect import GatewayDown, Reconnector
from kvgate.integrations.vllm.settings import TierSettings

__all__ = ["GatewayDown", "Outage", "TierConnection"]

# the tier's logger (vLLM's logging configuration applies under "vllm.")
logger = logging.getLogger("vllm.kvgate")


class Outage:
    """Since when the tier's gateway has been unreachable, shared by the tier's three sessions, so that
    its coming back is logged once, by whichever session reconnects first (as SGLang's backend and
    LMCache's adapter do).  Called from the sessions' threads; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None

    def down(self) -> None:
        """A connect failed (the first failure of an outage starts it)."""
        with self._lock:
            if self._since is None:
                self._since = self._clock()

    def up(self) -> float | None:
        """A connect succeeded: the outage's length in seconds if one was under way (it ends), else None."""
        with self._lock:
            since, self._since = self._since, None
        return None if since is None else self._clock() - since


class TierConnection(Reconnector[Client]):
    """One lazily (re)connected gateway session of the tier (see ``Reconnector``).

    Used by one background thread, and at start also by the load thread, which opens the
    lookup session ahead of the first lookup: ``get`` serialises opens, so that is safe.
    ``bulk`` False: no bytes travel here (lookups), the CPU tier is not registered.
    ``zero_copy``: the last session opened has the CPU tier registered.  ``outage``: shared by the
    tier's sessions (a gateway that comes back is logged once); None: this session's own.
    """

    def __init__(self, name: str, timeout: float, *, settings: TierSettings, namespace: str, engine_id: str,
                 region_path: Callable[[], str | None], region_view: memoryview, log: RateLimitedLog,
                 bulk: bool = True, outage: Outage | None = None, block_size: int = 0, namespace_inputs: str = ""):
        super().__init__(settings.target, self._open, closed_message="the tier is shutting down",
                         on_down=self._went_down, on_up=self._came_up)
        self._outage = outage if outage is not None else Outage()
        self.name = name
        self.timeout = timeout
        self.bulk = bulk
        self.zero_copy = False
        self._settings = settings
        self.block_size = block_size  # tokens per key, declared in the hello with block_keys="vllm"
        self.namespace_inputs = namespace_inputs  # what the namespace stands for (told to the gateway's peers)
        self.namespace = namespace
        self.engine_id = engine_id
        self._region_path = region_path  # the /dev/shm file behind the CPU tier, looked up when connecting
        self._region_view = region_view  # the scheduler's mapping of it
        self._log = log

    def _went_down(self, e: Exception) -> None:
        self._outage.down()
        self._log.warning(f"connect-{self.name}", "kvgate: cannot connect to gateway %s (%s); serving without it "
                          "(misses, no stores) and retrying", self._settings.target, e)

    def _came_up(self) -> None:
        down_s = self._outage.up()
        if down_s is not None:
            logger.info("kvgate: gateway %s reachable again after %.1f s (%s); lookups and stores go to it again",
                        self._settings.target, down_s, self.name)

    def _open(self) -> Client:
        s = self._settings
        kw = dict(namespace=self.namespace, token=s.token, engine_id=self.engine_id, salted=s.salted_only,
                  block_keys="vllm", block_size=self.block_size,  # keys are vLLM offloading keys
                  namespace_inputs=self.namespace_inputs)
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
