"""The L2 adapter's gateway sessions: per worker thread, one per namespace.

Each session connects lazily and again after it broke (``reconnect.Reconnector``); the
sessions of one thread share one back-off, since a gateway that is down is down for every
namespace.  A session that moves bytes registers LMCache's L1 arena when it is a /dev/shm
file (``l1``), or takes a shared-memory session region.  Imports no LMCache, and not the
adapter.
"""

from __future__ import annotations

import threading
from typing import Callable

from kvgate.client import Client
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.reconnect import Backoff, GatewayDown, Reconnector
from kvgate.integrations.settings import TierSettings

__all__ = ["GatewayDown", "Sessions"]

_CLOSING = "the adapter is closing"


class Sessions:
    """One worker thread's gateway sessions, one per namespace, (re)opened lazily with a shared back-off.

    ``get``, ``drop``: the worker thread.  ``abort`` and ``close``: the thread that closes the
    adapter (``abort`` while the worker may be in a call, which then fails; neither waits for a
    connect in progress).  ``on_down(why)`` and ``on_up()`` run in the worker, after a connect
    failed or succeeded.  ``zero_copy``: how many sessions were opened with L1 registered.
    """

    def __init__(self, name: str, timeout: float, *, tier: TierSettings, bulk: bool,
                 l1: Callable[[], tuple[str, memoryview] | None], log: RateLimitedLog,
                 on_down: Callable[[str], None], on_up: Callable[[], None]):
        self.name = name
        self.timeout = timeout
        self.bulk = bulk  # bytes travel on these sessions: register L1 (or take a session region)
        self.zero_copy = 0
        self._tier = tier
        self._l1 = l1  # L1's /dev/shm file and this process's view of it, or None
        self._log = log
        self._on_down = on_down
        self._on_up = on_up
        self._backoff = Backoff()
        self._links: dict[str, Reconnector[Client]] = {}
        self._lock = threading.Lock()  # _links and _closed: abort() and close() come from another thread
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def get(self, namespace: str) -> Client:
        """This namespace's client; ``GatewayDown`` when there is none (back-off, closing)."""
        link = self._links.get(namespace)
        if link is None:
            with self._lock:
                if self._closed:
                    raise GatewayDown(_CLOSING)
                link = self._links[namespace] = Reconnector(
                    self._tier.target, lambda: self._open(namespace), closed_message=_CLOSING,
                    on_down=self._went_down, on_up=self._on_up, backoff=self._backoff)
        return link.get()

    def _went_down(self, e: Exception) -> None:
        self._on_down(f"cannot connect ({type(e).__name__}: {e})")

    def _open(self, namespace: str) -> Client:
        s = self._tier
        kw = dict(namespace=namespace, token=s.token, timeout=min(s.connect_timeout, self.timeout))
        region = self._l1() if self.bulk else None
        c = Client.connect(s.target, want_shm=self.bulk and region is None, **kw)
        c.set_timeout(self.timeout)
        if region is not None and c.local:
            path, view = region
            try:
                c.register_region(path, mapping=view)
                self.zero_copy += 1
                return c
            except Exception as e:
                self._log.warning("region", "kvgate: the gateway could not map LMCache's L1 %s (%s); staging "
                                  "through a session region instead", path, e)
                c.close()
                c = Client.connect(s.target, want_shm=True, **kw)
                c.set_timeout(self.timeout)
        return c

    def drop(self, namespace: str) -> None:
        """Forget this namespace's session (it broke, or the gateway refused it); ``get`` reconnects."""
        link = self._links.get(namespace)
        if link is not None:
            link.drop()

    def abort(self) -> None:
        """Wake a call in progress on any of the sessions (it fails), and refuse new ones."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.abort()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.close()
