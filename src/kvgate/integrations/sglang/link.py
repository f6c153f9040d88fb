"""The SGLang backend's connection to the gateway: one per storage thread, bounded in time.

SGLang's three storage threads (lookups, loads, stores) run at once and a ``Client``
serialises its calls, so each thread has a ``GatewayLink`` of its own, and for the two that
move bytes, its own staging region registered with that session.  A link connects lazily and
again after a failure, after a back-off (0.5 s doubling to 10 s; ``reconnect.Reconnector``), so
a dead gateway costs a call microseconds, not a timeout; and the gateway calls of one SGLang call share one time
budget, so a stuck gateway costs at most that budget (plus the connect timeout when the link
has to reconnect).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvgate.client import Client
from kvgate.integrations.reconnect import GatewayDown, Reconnector
from kvgate.integrations.settings import TierSettings
from kvgate.integrations.sglang.staging import StagingRegion
from kvgate.errors import KvgateError

if TYPE_CHECKING:
    from kvgate.integrations.sglang.failures import FailureLog

__all__ = ["GatewayDown", "GatewayLink", "OutOfTime"]


class OutOfTime(KvgateError, Exception):
    """A method's time budget (``kvgate.io_timeout`` / ``lookup_timeout``) is spent before its next
    gateway call: it returns what it has (the connection is fine and stays)."""


class GatewayLink(Reconnector[Client]):
    """One lazily (re)connected gateway session for one SGLang thread (see ``Reconnector``).

    Used under ``lock``, which the caller holds for a whole operation (``begin``, its gateway
    calls, the staging slots); ``abort`` (shutdown, from another thread) does not take it.
    ``get`` never waits longer than the connect timeout and refuses at once during the
    back-off after a failure, so a dead gateway costs each call microseconds, not a timeout.
    Going down and coming back are logged through ``log`` (one line each, not one per call).
    """

    def __init__(self, name: str, timeout: float, slots: int, *, settings: TierSettings, namespace: str,
                 engine_id: str, slot_bytes: int, log: FailureLog, namespace_inputs: str = ""):
        super().__init__(settings.target, self._open, closed_message="the backend is closed",
                         on_down=lambda e: log.went_down(name, e), on_up=lambda: log.came_up(name))
        self.settings = settings
        self.namespace = namespace
        self.namespace_inputs = namespace_inputs  # what the namespace stands for (told to the gateway's peers)
        self.engine_id = engine_id
        self.slot_bytes = slot_bytes  # one page slot of the anchor (KV) pool
        self.log = log
        self.name = name
        self.timeout = timeout
        self.slots = slots  # 0: no bytes travel here (lookups)
        self.min_bytes = 0  # the largest page of any registered pool must fit the staging region
        self.lock = threading.Lock()  # held for a whole operation: the staging slots are per call
        self.staging: StagingRegion | None = None
        self.registered = False
        self.deadline = 0.0

    def begin(self) -> Client:
        """The connected client, and the method's time budget starts (caller holds ``self.lock``).

        One SGLang call may take several gateway calls (a dialog mark, one per dialog run or
        staging round): together they get ``timeout``, not each."""
        client = self.get()
        self.deadline = time.monotonic() + self.timeout
        return client

    def budget(self) -> Client:
        """The client with its socket deadline set to what is left of the method's budget."""
        left = self.deadline - time.monotonic()
        client = self.client
        if left <= 0 or client is None:
            raise OutOfTime(f"{self.name}: the {self.timeout} s budget is spent")
        client.set_timeout(left)
        return client

    def _open(self) -> Client:
        s = self.settings
        client = Client.connect(s.target, namespace=self.namespace, token=s.token, engine_id=self.engine_id,
                                want_shm=False, timeout=min(s.connect_timeout, self.timeout),
                                namespace_inputs=self.namespace_inputs)
        client.set_timeout(self.timeout)  # every later call: a stuck gateway is an error, not a hang
        if not self.slots:
            return client
        nbytes = max(self.slots * self.slot_bytes, self.min_bytes)
        if self.staging is None:
            self.staging = StagingRegion(nbytes)
        self.registered = False
        if client.local:
            path = self.staging.path
            if path is None:  # unlinked after an earlier registration: a new gateway needs a new file
                self.staging.close()
                self.staging = StagingRegion(nbytes)
                path = self.staging.path
            try:
                client.register_region(path, mapping=self.staging.view)
                self.registered = True
            except Exception as e:
                self.log.warn_once("region", "kvgate: the gateway could not map the staging region %s (%s); "
                                   "pages travel inline in the socket frames", path, e)
            self.staging.unlink()
        return client

    def fit(self, nbytes: int) -> None:
        """Make the staging region hold at least ``nbytes`` (a newly registered pool's page).

        A region cannot grow in place (the gateway has mapped it): the session and the region
        are replaced, and the link reconnects at once (or on its next call if the gateway is
        away).  Scheduler thread, at attach or when SGLang adds a pool."""
        if not self.slots or nbytes <= self.min_bytes:
            return
        with self.lock:
            self.min_bytes = nbytes
            if self.staging is None or self.staging.size >= nbytes:
                return
            self.drop()
            self.staging.close()
            self.staging = None
            try:
                self.get()
            except GatewayDown:
                pass  # logged; the next call retries

    def close(self) -> None:
        """Close the session and the staging region, once a call in progress is over (scheduler
        thread, after ``abort``, which refused new calls at once)."""
        with self.lock:
            super().close()
            if self.staging is not None:
                self.staging.close()
                self.staging = None
