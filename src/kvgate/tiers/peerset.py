"""The peer gateways a store reads from after its own tiers: which they are now, which of them one request
asks, and when a peer that left may be closed.

Which they are: ``cfg.peers`` at start; ``replace`` when a cluster's registry names others (the follower,
at each poll).  ``peers`` is then a new list, never changed in place, so a call that took the list goes on
with it.

Which one request asks (``for_source``): a request may name its ``source``, where its KV was computed
(vLLM's ``remote_kv_source``, ``HOST:PORT`` or ``HOST``).  Then only the peers on that host are asked (the
one at that very ``HOST:PORT`` where there is one, else all on the host: the port a request names is often
its engine's, not the peer listener's), none when no peer is there.  A source is never an address to
connect to: the peer token would go wherever a client says.  ``note_source`` counts, once a request, a
source that chose peers, one that named this gateway's own host (its KV is here), and one that named no
peer (logged at most once a minute).

When a peer that left is closed: every call that may reach the peers runs inside ``using()``, which counts
it against the set in force when it began; a peer that left is closed once no call that began while it
was in the set is in flight, so a pull through it completes first.

On the event loop only (the store's thread): nothing here blocks; ``PeerTier.close`` only closes sockets.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

from kvgate.config import Config
from kvgate.keys import NamespaceBook
from kvgate.tiers.peertier import PeerTier, host_port
from kvgate.types import MAX_SOURCE_CHARS

__all__ = ["PeerSet"]

log = logging.getLogger("kvgate.store")

UNKNOWN_SOURCE_LOG_S = 60.0  # a request source that names no peer is logged at most this often


class PeerSet:
    """The peer tiers of a store, the ones a request's source picks, and their closing (module docstring)."""

    def __init__(self, cfg: Config, namespaces: NamespaceBook | None = None) -> None:
        self.cfg = cfg
        self.namespaces = namespaces if namespaces is not None else NamespaceBook()  # ours: told to the peers
        self.peers: list[PeerTier] = [PeerTier(cfg, a, self.namespaces) for a in cfg.peers]
        self._version = 0  # bumped at each change of the set
        self._readers: dict[int, int] = {}  # version -> calls in flight that began under it
        self._retired: list[tuple[int, PeerTier]] = []  # peers that left, with the last version they were in
        self.sourced = 0  # requests whose source chose the peers asked
        self.sourced_here = 0  # ... named this gateway's own host (no peer asked)
        self.unknown_sources = 0  # ... named no peer (no peer asked)
        self._own_hosts = {host_port(a)[0] for a in (cfg.peer_listen, cfg.peer_advertise) if a}
        self._unknown_logged = -UNKNOWN_SOURCE_LOG_S  # time.monotonic() of the last such log line

    def replace(self, addresses: Sequence[str]) -> bool:
        """Ask the peers at ``addresses`` (HOST:PORT of their listeners) from now on, in this order; whether
        the set changed.  A peer kept keeps its tier (connections, backoff, counters)."""
        wanted = list(dict.fromkeys(addresses))
        if wanted == [p.address for p in self.peers]:
            return False
        have = {p.address: p for p in self.peers}
        self.peers = [have.pop(a) if a in have else PeerTier(self.cfg, a, self.namespaces) for a in wanted]
        self._retired += [(self._version, p) for p in have.values()]
        self._version += 1
        log.info("peers: %s", ", ".join(wanted) or "none")
        self._close_retired()
        return True

    def for_source(self, source: str | None) -> list[PeerTier]:
        """The peers a request whose KV was computed at ``source`` asks (module docstring); no source: all."""
        if not source:
            return self.peers
        host, port = host_port(source[:MAX_SOURCE_CHARS])
        on_host = [p for p in self.peers if p.host == host]
        return [p for p in on_host if p.port == port] or on_host

    def note_source(self, source: str | None) -> None:
        """Count a request's ``source`` (once a request; module docstring)."""
        if not source:
            return
        if self.for_source(source):
            self.sourced += 1
            return
        if host_port(source[:MAX_SOURCE_CHARS])[0] in self._own_hosts:
            self.sourced_here += 1
            return
        self.unknown_sources += 1
        now = time.monotonic()
        if now - self._unknown_logged >= UNKNOWN_SOURCE_LOG_S:
            self._unknown_logged = now
            log.warning("request source %r names no peer of this gateway (peers: %s): no peer asked for its keys "
                        "(%d such requests so far; logged at most once a minute)", source[:MAX_SOURCE_CHARS],
                        ", ".join(p.address for p in self.peers) or "none", self.unknown_sources)

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Around a call that may reach the peers: a peer that leaves meanwhile is not closed under it."""
        n = self._version
        self._readers[n] = self._readers.get(n, 0) + 1
        try:
            yield
        finally:
            left = self._readers[n] - 1
            if left:
                self._readers[n] = left
            else:
                del self._readers[n]
                if self._retired:
                    self._close_retired()

    def _close_retired(self) -> None:
        oldest = min(self._readers, default=self._version)
        keep = []
        for n, peer in self._retired:
            if n < oldest:
                peer.close()
            else:
                keep.append((n, peer))
        self._retired = keep

    def close(self) -> None:
        """Close every peer, those that left included (the store stops)."""
        for peer in [*self.peers, *(p for _, p in self._retired)]:
            peer.close()
        self._retired = []

    def status(self) -> dict:
        """The peers' rows and how requests' sources chose among them."""
        return {"peers": [p.status() for p in self.peers],
                "peer_sources": {"chosen": self.sourced, "here": self.sourced_here, "unknown": self.unknown_sources}}
