"""A lazily (re)connected gateway session with a back-off: what every engine integration's threads hold.

A gateway that is down must cost an engine's call microseconds, not a connect timeout each
time, and one that comes back must be used again without a restart.  vLLM's tier
(``vllm.connection``), SGLang's backend (``sglang.link``) and LMCache's L2 adapter
(``lmcache.sessions``) hold their sessions through ``Reconnector``; how a session is opened
(the client's options, which region is registered) and what is logged stay theirs.  This
module imports no engine.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, Protocol, TypeVar

from kvgate.errors import GatewayUnavailable


class GatewayDown(GatewayUnavailable):
    """No connection to the gateway right now (it failed recently; retried after a back-off), or the
    session is closed."""


class ClientLike(Protocol):
    """What ``Reconnector`` needs of a client (``kvgate.client.Client`` has it)."""

    @property
    def broken(self) -> bool: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


C = TypeVar("C", bound=ClientLike)

FIRST_DELAY_S = 0.5
LAST_DELAY_S = 10.0


class Backoff:
    """When the next connect may be tried: 0.5 s after a failure, doubling to 10 s, back to 0.5 s
    after a success.  One may be shared by several ``Reconnector`` used from one thread (LMCache's
    sessions of one worker, one per namespace: a gateway that is down is down for all of them); it
    has no lock of its own (each ``Reconnector`` reads and updates it under its open lock)."""

    def __init__(self, first_s: float = FIRST_DELAY_S, last_s: float = LAST_DELAY_S) -> None:
        self.first_s = first_s
        self.last_s = last_s
        self.delay_s = first_s
        self.next_try = 0.0  # the clock's time before which no connect is tried

    def left(self, now: float) -> float:
        """Seconds until the next try (0: now)."""
        return max(0.0, self.next_try - now)

    def failed(self, now: float) -> None:
        """A connect tried at ``now`` failed."""
        self.next_try = now + self.delay_s
        self.delay_s = min(self.delay_s * 2, self.last_s)

    def succeeded(self) -> None:
        self.delay_s = self.first_s


def _close_quietly(client: ClientLike) -> None:
    try:
        client.close()
    except Exception:
        pass  # a broken session: there is nothing more to say to it


class Reconnector(Generic[C]):
    """One gateway session, opened on first use and again after it broke, with a back-off.

    Who calls it: an integration's I/O thread calls ``get`` before its gateway calls and
    ``drop`` after a call that broke the session (or that the gateway refused the session
    itself); the thread that shuts the integration down calls ``abort`` (while I/O threads may
    be in a call) and then ``close``.  ``get`` may be called from two threads at once (vLLM's
    load thread opens the lookup session at start): opens are serialised, so one session is
    opened, not two.

    ``get`` returns the held client while it is not ``broken``; otherwise it calls
    ``open_session`` (the integration's connect, in the calling thread), unless a connect
    failed less than the back-off ago (0.5 s doubling to 10 s, reset by a success): then it
    raises ``GatewayDown`` at once, naming ``target`` and the seconds to the next try.  A failed open raises
    ``GatewayDown`` (from the cause) after ``on_down(exception)``; a successful one calls
    ``on_up()`` (the integration logs; both run in the thread in ``get``).  Once closed (``abort``
    or ``close``) ``get`` refuses with ``closed_message``, and a session whose open was under
    way is closed, not handed out.

    What never blocks: ``abort`` waits for nothing (it only wakes the call in progress, which
    fails), and ``drop``, ``abort`` and ``close`` never wait for an open in progress; ``drop``
    and ``close`` wait at most for a call in progress on the client to fail (``Client.close``
    aborts it first).  ``get`` refuses at once while closed or during the back-off; otherwise it
    waits only for its own open (bounded by the integration's connect timeout) or another
    thread's.
    """

    def __init__(self, target: str, open_session: Callable[[], C], *, closed_message: str = "closed",
                 on_down: Callable[[Exception], None] | None = None, on_up: Callable[[], None] | None = None,
                 backoff: Backoff | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self._open_session = open_session
        self._closed_message = closed_message
        self._on_down = on_down
        self._on_up = on_up
        self.backoff = backoff if backoff is not None else Backoff()
        self._clock = clock
        self._client: C | None = None
        self._closed = False
        # _opening: held by get() for a whole open (one session at a time).  _lock: held only to
        # read or swap _client and _closed, so drop/abort/close from another thread never wait on
        # a connect.  Order: _opening, then _lock.
        self._opening = threading.Lock()
        self._lock = threading.Lock()

    @property
    def client(self) -> C | None:
        """The session held now, broken or not (None: none); no connect."""
        return self._client

    @property
    def closed(self) -> bool:
        return self._closed

    def get(self) -> C:
        """The connected client; ``GatewayDown`` when there is none (see the class docstring)."""
        if self._closed:  # not behind another thread's connect
            raise GatewayDown(self._closed_message)
        with self._opening:
            with self._lock:
                if self._closed:
                    raise GatewayDown(self._closed_message)
                held = self._client
                if held is not None and not held.broken:
                    return held
                self._client = None
            if held is not None:
                _close_quietly(held)
            now = self._clock()
            left = self.backoff.left(now)
            if left > 0:
                raise GatewayDown(f"gateway {self.target} unreachable; next try in {left:.1f} s")
            try:
                client = self._open_session()
            except Exception as e:
                self.backoff.failed(now)
                if self._on_down is not None:
                    self._on_down(e)
                raise GatewayDown(str(e)) from e
            with self._lock:
                closed = self._closed
                if not closed:
                    self._client = client
            if closed:  # aborted while connecting: the caller must not start a call on it
                _close_quietly(client)
                raise GatewayDown(self._closed_message)
            self.backoff.succeeded()
            if self._on_up is not None:
                self._on_up()
            return client

    def drop(self) -> None:
        """Forget the session (it broke, or the gateway refused it); the next ``get`` reconnects."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def abort(self) -> None:
        """Unblock a thread waiting in a call on this session (the call fails), and refuse new calls."""
        with self._lock:
            self._closed = True
            client = self._client
        if client is not None:
            client.abort()

    def close(self) -> None:
        """Refuse new calls and close the session."""
        with self._lock:
            self._closed = True
        self.drop()
