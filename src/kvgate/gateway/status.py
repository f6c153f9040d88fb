"""Status: one snapshot dict, rendered as Prometheus text for the status file and /metrics.

The snapshot is taken on the event loop (where the counters live), so the
renderers in other threads never read state that is being changed.  The
same dict answers the ``stats`` op that ``kvgate stat`` uses.

``snapshot`` is called on the loop: by the ``stats`` op, the gateway's
status file task, and /metrics.  ``HttpStatus`` serves from threads of its
own and reaches the gateway only through the callables it is given, run on
the loop, so a slow HTTP peer never blocks it; a snapshot only reads
counters.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                   SummaryMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvgate import __version__
from kvgate.config import Config
from kvgate.gateway.headsync import HeadSync
from kvgate.latency import Latencies
from kvgate.gateway.listeners import Listeners
from kvgate.gateway.operations import MAX_KEYS_PER_REQUEST
from kvgate.gateway.peers import is_loopback_peer, tcp_peer_uid, trusted_uid
from kvgate.gateway.sessions import Sessions
from kvgate.heads import SharedHeads
from kvgate.keys import MAX_KEY_BYTES
from kvgate.tiers.io import IoPool
from kvgate.tiers.referee import EXPERTS
from kvgate.tiers.store import TieredStore

log = logging.getLogger("kvgate.status")

# Each HTTP connection has a thread: at most this many at once (scrapes and prewarms are short), each
# closed after HTTP_TIMEOUT_S without a byte from its peer; beyond the cap a connection gets a 503 at once.
MAX_HTTP_CONNECTIONS = 32
HTTP_TIMEOUT_S = 10.0
MAX_PREWARM_BODY = 4 << 20
_BUSY_BODY = b'{"error": "too many HTTP connections (%d at most); try again later"}' % MAX_HTTP_CONNECTIONS
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))

TIER_COUNTERS = (
    ("sets", "objects stored"),
    ("gets", "objects asked for"),
    ("hits", "objects found"),
    ("misses", "objects not found"),
    ("bytes_read", "payload bytes read"),
    ("bytes_written", "payload bytes written"),
    ("evictions", "objects evicted"),
)
CARD_FIELDS = (  # the value of each is a number or a bool (1 / 0)
    ("read_only", "1 when the card refuses writes as read-only (it still serves reads)", False),
    ("used_bytes", "bytes the card holds (headers included)", False),
    ("capacity_bytes", "bytes the card may hold", False),
    ("objects", "objects indexed on the card", False),
    ("hits", "reads served by the card", True),
    ("misses", "reads the card could not serve", True),
    ("errors", "failed I/Os on the card", True),
    ("bytes_read", "payload bytes read from the card", True),
    ("bytes_written", "bytes written to the card", True),
    ("evictions", "objects evicted from the card", True),
    ("prefix_order_evictions", "evictions the adaptive policy chose in its prefix order (one-off blocks first, "
     "blocks used again kept)", True),
    ("recency_order_evictions", "evictions the adaptive policy chose in its recency order (LRU by dialog)", True),
    ("refused", "objects of puts refused without I/O: larger than the card's capacity, or past what the card can "
     "take of their batch beside the writes in flight and the held objects (the batch keeps its leading ones)", True),
    ("writing_bytes", "bytes the card's writes in flight have taken room for", False),
    ("read_hints", "objects a lookup found on the card and passed on for their reads to be prepared (each file "
     "prepared at most once in 30-60 s)", True),
    ("index_bytes", "memory the card's index takes in the gateway (its columns and tables)", False),
    ("cached_copy_bytes_per_second", "directory card: recent rate of reads copied out of the page cache", False),
    ("direct_read_bytes_per_second", "directory card: recent rate of O_DIRECT reads (the faster one serves "
     "cached files)", False),
)

NAMESPACE_FIELDS = (  # at most kvgate.tiers.usage.MAX_ROWS namespaces, then one row for the rest
    ("ram_objects", "objects in the RAM tier", False),
    ("ram_bytes", "payload bytes in the RAM tier", False),
    ("card_objects", "objects on cards", False),
    ("card_bytes", "bytes on cards (headers included)", False),
    ("gets", "objects asked for by get", True),
    ("hits", "objects get returned", True),
    ("bytes_read", "payload bytes get returned", True),
    ("sets", "objects stored", True),
    ("bytes_written", "payload bytes stored", True),
)


def card_state(card: dict[str, Any]) -> str:
    """One word for a card's state in the snapshot: serving, read_only, draining, inactive or held_out."""
    if card.get("held_out"):
        return "held_out"
    if not card["active"]:
        return "inactive"
    if card.get("state") == "draining":
        return "draining"
    return "read_only" if card["read_only"] else "serving"


def snapshot(cfg: Config, store: TieredStore, pool: IoPool, heads: SharedHeads, head_sync: HeadSync,
             sessions: Sessions, listeners: Listeners, started_at: float, tcp_port: int | None,
             cluster: dict[str, Any] | None = None, latency: Latencies | None = None) -> dict[str, Any]:
    """The gateway's state as one dict of plain values: the ``stats`` reply, and what ``render`` renders."""
    c = store.counters
    tiers = store.status()
    ram = tiers["ram"]
    cards = tiers["cards"]
    long_tier = {
        "sets": c.long.sets, "gets": c.long.gets, "hits": c.long.hits, "misses": c.long.misses,
        "bytes_read": c.long.bytes_read, "bytes_written": c.long.bytes_written,
        "evictions": sum(x["evictions"] for x in cards),
        "used_bytes": sum(x["used_bytes"] for x in cards if x["active"]),
        "capacity_bytes": sum(x["capacity_bytes"] for x in cards if x["active"]),
        "objects": sum(x["objects"] for x in cards if x["active"]),
    }
    ram_tier = {
        "sets": c.ram.sets, "gets": c.ram.gets, "hits": c.ram.hits, "misses": c.ram.misses,
        "bytes_read": c.ram.bytes_read, "bytes_written": c.ram.bytes_written, "evictions": ram["evictions"],
        "used_bytes": ram["used_bytes"], "capacity_bytes": ram["capacity_bytes"], "objects": ram["objects"],
        "pinned_bytes": ram["pinned_bytes"],
        "prefix_order_evictions": ram["prefix_order_evictions"],
        "recency_order_evictions": ram["recency_order_evictions"],
    }
    engine = None
    if sessions.engine is not None:
        engine = {"engine_id": sessions.engine.engine_id, "pid": sessions.engine.pid,
                  "connections": sessions.engine.connections}
    return {
        "gateway": {
            "version": __version__, "pid": os.getpid(), "uptime_s": round(time.time() - started_at, 3),
            "fingerprint": tiers["fingerprint"], "placement": cfg.key_placement,
            "storage_slots": tiers["storage_slots"], "card_generation": tiers["card_generation"],
            "socket": cfg.socket_path, "port": tcp_port, "sessions": len(sessions),
            # sessions whose shared memory is used in place (kvgate.gateway.shm): the rest go through the kernel
            "sessions_in_place": sum(s.in_place for s in sessions.by_id.values()),
            "connections": listeners.open_connections,
            "refused_connections": listeners.refused_connections,
            "displaced_connections": listeners.displaced_connections, "engine": engine,
            "shared_storage": cfg.shared_storage,
            "read_priority": "realtime" if pool.realtime else "normal",
        },
        "tiers": {"ram": ram_tier, "long": long_tier},
        "get_paths": dict(c.get_paths),
        # card objects a client read itself out of files lent open (lent gets), and those open now
        "files_lent": {"objects": c.files_lent, "open": store.files_lent},
        "namespaces": store.usage.snapshot(),
        "holds": {"objects": len(store.holds), "refused": store.holds.refused},
        "lookups": c.lookups,
        "corrupt_objects": c.corrupt,
        "expired_objects": c.expired,
        "io_timeouts": tiers["io_timeouts"],
        "io_errors": tiers["io_errors"],
        "oldest_io_age_s": max(pool.oldest_age(), tiers["oldest_io_age_s"]),
        "cards": cards,
        "peers": tiers["peers"],  # peer gateways this one reads from (peers), one row each
        # requests whose source (vLLM's remote_kv_source) chose the peers asked, and those naming none of them
        "peer_sources": tiers["peer_sources"],
        "card_moves": tiers["card_moves"],
        "shared_heads": {"blocks": len(heads), "learned": heads.learned, "replaced": heads.replaced,
                         "refused": heads.refused,
                         "sync_rounds": head_sync.rounds, "sync_errors": head_sync.errors},
        "cluster": cluster,
        "request_seconds": latency.snapshot() if latency is not None else {},
        "card_io_seconds": store.card_io_seconds.snapshot(),
    }


class _SnapshotCollector:
    def __init__(self, snap: dict[str, Any]):
        self.snap = snap

    def collect(self):
        s = self.snap
        for name, doc in TIER_COUNTERS:
            m = CounterMetricFamily(f"kvgate_{name}", f"Per tier: {doc}", labels=["tier"])
            for tier, values in s["tiers"].items():
                m.add_metric([tier], values[name])
            yield m
        for name, doc in (("used_bytes", "payload bytes held"), ("capacity_bytes", "capacity"), ("objects", "objects held")):
            m = GaugeMetricFamily(f"kvgate_tier_{name}", f"Per tier: {doc}", labels=["tier"])
            for tier, values in s["tiers"].items():
                m.add_metric([tier], values[name])
            yield m
        yield GaugeMetricFamily("kvgate_ram_pinned_bytes", "RAM-tier bytes held by reads and replies in progress "
                                "(eviction cannot take them)", value=s["tiers"]["ram"]["pinned_bytes"])
        m = CounterMetricFamily("kvgate_ram_order_evictions", "RAM-tier evictions the adaptive policy chose in each "
                                "of its orders (prefix: one-off blocks first, blocks used again kept; recency: LRU "
                                "by dialog)", labels=["order"])
        for order in EXPERTS:
            m.add_metric([order], s["tiers"]["ram"][f"{order}_order_evictions"])
        yield m
        m = CounterMetricFamily("kvgate_get_requests", "get requests by the way their bytes travel (lent: "
                                "read by the client out of the gateway's memory)", labels=["path"])
        for path, n in s["get_paths"].items():
            m.add_metric([path], n)
        yield m
        yield CounterMetricFamily("kvgate_files_lent_objects", "card objects a client read itself out of a file "
                                  "the gateway lent it open", value=s["files_lent"]["objects"])
        yield GaugeMetricFamily("kvgate_files_lent_open", "files lent open now", value=s["files_lent"]["open"])
        yield CounterMetricFamily("kvgate_lookups", "lookup requests", value=s["lookups"])
        yield CounterMetricFamily("kvgate_corrupt_objects", "objects that failed their checks (removed, served as misses)",
                                  value=s["corrupt_objects"])
        yield CounterMetricFamily("kvgate_expired_objects", "objects past their TTL", value=s["expired_objects"])
        yield CounterMetricFamily("kvgate_io_timeouts", "card I/Os past io_timeout_ms", value=s["io_timeouts"])
        yield CounterMetricFamily("kvgate_io_errors", "card I/Os that failed", value=s["io_errors"])
        yield GaugeMetricFamily("kvgate_worker_oldest_io_age_seconds", "age of the oldest I/O in flight",
                                value=s["oldest_io_age_s"])
        yield GaugeMetricFamily("kvgate_sessions", "connected client sessions", value=s["gateway"]["sessions"])
        yield GaugeMetricFamily("kvgate_sessions_in_place",
                                "sessions whose shared memory the gateway reads, hashes and writes in place",
                                value=s["gateway"]["sessions_in_place"])
        active = GaugeMetricFamily("kvgate_storage_group_active", "1 when the card is in service", labels=["group"])
        for card in s["cards"]:
            active.add_metric([card["serial"] or card["location"]], 1 if card["active"] else 0)
        yield active
        yield GaugeMetricFamily("kvgate_storage_groups_active", "cards in service",
                                value=sum(1 for c in s["cards"] if c["active"]))
        state = GaugeMetricFamily("kvgate_storage_group_state", "Per card: 1 for the state it is in (serving, "
                                  "read_only, draining, inactive, held_out)", labels=["group", "state"])
        for card in s["cards"]:
            state.add_metric([card["serial"] or card["location"], card_state(card)], 1)
        yield state
        yield _histogram("kvgate_request_seconds", "seconds from a request's start to its reply sent, per request "
                         "type", "op", s.get("request_seconds", {}))
        yield _histogram("kvgate_card_io_seconds", "seconds a card I/O call ran on its card thread, per call, all "
                         "cards together", "call", s.get("card_io_seconds", {}))
        for name, doc, counter in CARD_FIELDS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            m = family(f"kvgate_storage_group_{name}", f"Per card: {doc}", labels=["group"])
            for card in s["cards"]:
                m.add_metric([card["serial"] or card["location"]], card[name])
            yield m
        for name, doc, counter in NAMESPACE_FIELDS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            m = family(f"kvgate_namespace_{name}", f"Per namespace: {doc}", labels=["namespace"])
            for ns, row in s["namespaces"].items():
                m.add_metric([ns], row[name])
            yield m
        heads = s["shared_heads"]
        yield GaugeMetricFamily("kvgate_shared_head_blocks", "blocks known as shared heads (system prompts) "
                                "on this gateway's cards", value=heads["blocks"])
        yield CounterMetricFamily("kvgate_shared_head_blocks_learned", "shared-head blocks this gateway found itself",
                                  value=heads["learned"])
        yield CounterMetricFamily("kvgate_shared_head_blocks_replaced", "idle shared heads that gave their place to new ones",
                                  value=heads["replaced"])
        yield CounterMetricFamily("kvgate_shared_head_blocks_refused", "shared heads not learned because every place was "
                                  "held by a head in use", value=heads["refused"])
        yield CounterMetricFamily("kvgate_shared_head_sync_errors", "card exchanges of the shared heads that failed",
                                  value=heads["sync_errors"])
        cluster = s.get("cluster")
        if cluster is not None:
            yield GaugeMetricFamily("kvgate_cluster_view_epoch", "epoch of the cluster view applied",
                                    value=cluster["view_epoch"])
            yield GaugeMetricFamily("kvgate_cluster_registry_reachable", "1 when the last etcd poll answered",
                                    value=1 if cluster["reachable"] else 0)
            yield GaugeMetricFamily("kvgate_cluster_last_good_poll_age_seconds",
                                    "seconds since etcd last answered a poll (-1: never)",
                                    value=cluster["last_good_poll_age_s"])
            yield SummaryMetricFamily("kvgate_cluster_etcd_call_seconds", "etcd calls made and their time",
                                      count_value=cluster["etcd_calls"], sum_value=cluster["etcd_call_seconds"])
            yield CounterMetricFamily("kvgate_cluster_etcd_failed_calls",
                                      "etcd calls that failed or passed cluster_call_timeout",
                                      value=cluster["etcd_failed_calls"])
            by_state = GaugeMetricFamily("kvgate_cluster_cards", "cards of the applied view, by registry state",
                                         labels=["state"])
            for state, n in sorted(cluster["cards_by_state"].items()):
                by_state.add_metric([state], n)
            yield by_state
            leader = GaugeMetricFamily("kvgate_cluster_leader", "1 for the agent this gateway last read as the "
                                       "cluster's leader (none: no leader)", labels=["agent"])
            leader.add_metric([cluster["leader"] or ""], 1 if cluster["leader"] else 0)
            yield leader
            yield GaugeMetricFamily("kvgate_cluster_cards_held_out",
                                    "cards held out of service because no agent reports them alive",
                                    value=len(cluster["held_out"]))
            yield GaugeMetricFamily("kvgate_cluster_layout_mismatches",
                                    "other gateways on this view epoch with another key layout fingerprint",
                                    value=len(cluster["layout_mismatch"]))
        events = s.get("kv_events")
        if events is not None:  # kv_events_endpoint set: the publisher's counters (docs/events.md)
            for name, doc in (("changes", "tier changes taken for publishing"),
                              ("published", "KV event batches published"),
                              ("dropped", "KV event batches dropped on a full queue (subscribers get a snapshot)"),
                              ("replays", "replay requests answered"),
                              ("snapshots", "snapshots sent to subscribers"),
                              ("malformed_requests", "replay requests of no known shape, ignored")):
                yield CounterMetricFamily(f"kvgate_kv_events_{name}", doc, value=events.get(name, 0))
        for name, doc, family in (("gets", "objects asked of the peer", CounterMetricFamily),
                                  ("hits", "objects pulled from the peer, verified", CounterMetricFamily),
                                  ("bytes_read", "payload bytes pulled from the peer", CounterMetricFamily),
                                  ("failures", "calls to the peer that failed or ran past peer_timeout_ms",
                                   CounterMetricFamily),
                                  ("lookups", "keys the peer answered lookups of", CounterMetricFamily),
                                  ("negative_hits", "keys answered absent without asking the peer (it said it "
                                   "lacks them less than NEGATIVE_S, 2 s, ago)", CounterMetricFamily),
                                  ("namespace_refused", "keys the peer was not asked for: its engines run their "
                                   "namespace's model another way (the log names how)", CounterMetricFamily)):
            m = family(f"kvgate_peer_{name}", f"Per peer gateway (peers): {doc}", labels=["peer"])
            for peer in s.get("peers", []):
                m.add_metric([peer["address"]], peer.get(name, 0))
            yield m
        sources = s.get("peer_sources", {})
        yield CounterMetricFamily("kvgate_peer_sourced_requests", "requests whose source (vLLM's remote_kv_source) "
                                  "chose the peers asked: those on its host", value=sources.get("chosen", 0))
        yield CounterMetricFamily("kvgate_peer_sourced_here_requests", "requests whose source named this gateway's "
                                  "own host and no peer on it: no peer was asked", value=sources.get("here", 0))
        yield CounterMetricFamily("kvgate_peer_unknown_sources", "requests whose source named no peer of this "
                                  "gateway: no peer was asked", value=sources.get("unknown", 0))
        served = s.get("peer_listen")
        if served is not None:  # peer_listen set: what peers read from this gateway
            for name, doc in (("served_objects", "objects peer gateways pulled from this one"),
                              ("served_bytes", "payload bytes peer gateways pulled from this one"),
                              ("refused", "peer connections or requests refused (token, protocol, limits)"),
                              ("displaced", "peer connections closed before their hello to make room at a full "
                                            "listener"),
                              ("timed_out", "peer connections closed for time (no hello within hello_timeout, "
                                            "a request not whole in time, a reply not taken)"),
                              ("idle_closed", "peer gateways' connections closed after long without a request "
                                              "(the peer reconnects)"),
                              ("tls_failed", "peer connections closed for TLS (peer_tls_cert_file): plain ones, "
                                             "handshakes that failed (a certificate the peer does not trust)"),
                              ("namespaces_differ", "peers' namespaces of a model this gateway's engines run in "
                                                    "another namespace (each logged once with the difference)")):
                yield CounterMetricFamily(f"kvgate_peer_listen_{name}", doc, value=served.get(name, 0))
            yield GaugeMetricFamily("kvgate_peer_listen_connections", "peer connections open now",
                                    value=served["connections"])
        info = InfoMetricFamily("kvgate_key_layout", "key layout fingerprint")
        info.add_metric([], {"fingerprint": s["gateway"]["fingerprint"]})
        yield info
        info = InfoMetricFamily("kvgate_key_placement", "key placement")
        info.add_metric([], {"placement": s["gateway"]["placement"]})
        yield info
        info = InfoMetricFamily("kvgate_read_priority", "priority of the card read threads (realtime or normal)")
        info.add_metric([], {"priority": s["gateway"]["read_priority"]})
        yield info


def _histogram(name: str, doc: str, label: str, snap: dict[str, Any]) -> HistogramMetricFamily:
    """A ``kvgate.latency.Latencies`` snapshot as one histogram family, a series per name."""
    m = HistogramMetricFamily(name, doc, labels=[label])
    for key, h in snap.items():
        m.add_metric([key], [(repr(float(b)), n) for b, n in h["buckets"]] + [("+Inf", h["count"])],
                     sum_value=h["sum"])
    return m


def render(snapshot: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry)


def write_status_file(path: str, text: bytes) -> None:
    """Atomic replace, so a reader never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_HTTP_CONNECTIONS of them; the rest are answered 503 and closed."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 leaves a burst of connections in SYN retries for seconds

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)  # this runs on the accepting thread: never wait long on one peer
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        """A peer that stalled or went away mid-request is a line at debug level, not a traceback on stderr."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("http: connection from %s ended: %s: %s", client_address, type(err).__name__, err)
        else:
            log.error("http: request from %s failed", client_address, exc_info=err)


class HttpStatus:
    """/metrics, /healthz and POST /v1/cache/prewarm, served from threads.

    The gateway starts and stops it; each request runs on a thread of its own and calls ``snapshot``
    (/metrics) and ``prewarm`` (namespace, keys, dialog -> objects in RAM) on ``loop``, waiting for them
    there, so the loop is never blocked by a slow HTTP peer.

    Who may ask what: /healthz anyone.  ``token`` (the gateway's auth_token_file) set: every other path
    needs ``Authorization: Bearer <token>``, loopback peers too; without it or with another token, a 401.
    No token (a loopback listener): /metrics anyone on the host, and a prewarm (it changes what the RAM
    tier holds) only a peer the kernel says is the gateway's user or root (``local_uids``: whether it can
    tell, ``kvgate.gateway.peers``), else a 401 naming auth_token_file.  A bad request gets a 400 with a
    JSON ``error`` naming what was wrong.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 prewarm: Callable[[str, list[bytes], bytes | None], Awaitable[int]],
                 loop: asyncio.AbstractEventLoop, host: str, port: int, token: str | None = None,
                 local_uids: bool = False):
        self.snapshot = snapshot
        self.prewarm = prewarm
        self.loop = loop
        self.token = token.encode() if token is not None else None
        self.local_uids = local_uids
        handler = self._handler_class()
        self.server = _BoundedHTTPServer((host, port), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvgate-http", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _snapshot_on_loop(self) -> dict[str, Any]:
        return self.snapshot()

    def _handler_class(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HTTP_TIMEOUT_S  # a socket timeout: an idle or dribbling peer does not keep its thread

            def log_message(self, fmt, *args):  # route to logging, quietly
                log.debug("http: " + fmt, *args)

            def _send(self, code: int, body: bytes, ctype: str = "application/json",
                      headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
                self._send(code, json.dumps({"error": message}).encode(), headers=headers)

            def _authorized(self, changes: bool) -> bool:
                """True, or the request was answered 401.  ``changes``: the request changes the gateway's
                state (a prewarm), which without a token only its own user or root may ask for."""
                if outer.token is None:
                    if not changes or trusted_uid(self._peer_uid()):
                        return True
                    self._error(401, "only the gateway's user or root may prewarm without a token, and the kernel "
                                "does not say this peer is either: set auth_token_file on the gateway and send "
                                "'Authorization: Bearer <token>'", {"WWW-Authenticate": 'Bearer realm="kvgate"'})
                    return False
                scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), outer.token):
                    return True
                self._error(401, "this listener needs 'Authorization: Bearer <token>' (the token of auth_token_file)"
                            if not scheme else "the token in 'Authorization: Bearer <token>' is not this gateway's (auth_token_file)",
                            {"WWW-Authenticate": 'Bearer realm="kvgate"'})
                return False

            def _peer_uid(self) -> int | None:
                """The uid of a loopback peer (None: not loopback, or the kernel does not say).  Reads /proc:
                on this request's thread, never the loop."""
                sock = self.connection
                if not outer.local_uids or not is_loopback_peer(self.client_address[0]):
                    return None
                try:
                    return tcp_peer_uid(sock.family, sock.getsockname(), sock.getpeername())
                except OSError:
                    return None

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/healthz":
                    self._send(200, b'{"ok": true}')
                elif not self._authorized(changes=False):
                    return
                elif path == "/metrics":
                    snap = outer._call(outer._snapshot_on_loop())
                    self._send(200, render(snap), CONTENT_TYPE_LATEST)
                else:
                    self._error(404, "not found")

            def do_POST(self):
                if not self._authorized(changes=True):
                    return
                if self.path != "/v1/cache/prewarm":
                    self._error(404, "not found")
                    return
                try:
                    try:
                        length = int(self.headers.get("Content-Length", "0"))
                    except ValueError:
                        raise ValueError("Content-Length is not a number") from None
                    if not 0 <= length <= MAX_PREWARM_BODY:
                        raise ValueError(f"Content-Length {length}: a prewarm body has 0 to {MAX_PREWARM_BODY} bytes")
                    namespace, keys, dialog = parse_prewarm(self.rfile.read(length))
                    # a bad namespace (BadKey) is the client's error too
                    n = outer._call(outer.prewarm(namespace, keys, dialog))
                except ValueError as e:
                    self._error(400, str(e))
                    return
                except OSError:
                    raise  # the peer is gone or stalled (the socket timeout): nothing to answer
                except Exception as e:  # noqa: BLE001 - a request never takes the listener down
                    log.warning("prewarm over HTTP failed: %s: %s", type(e).__name__, e)
                    self._error(500, f"{type(e).__name__}: {e}")
                    return
                self._send(200, json.dumps({"in_ram": n, "asked": len(keys)}).encode())

        return Handler


class PrewarmBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON body of POST /v1/cache/prewarm: every field typed, no other field taken."""

    namespace: str
    keys: list[str] = []  # UTF-8 keys
    keys_hex: list[str] = []  # binary keys, in hex
    dialog: str = ""  # the prompt's dialog mark, UTF-8


_prewarm_decoder = msgspec.json.Decoder(PrewarmBody)


def parse_prewarm(body: bytes) -> tuple[str, list[bytes], bytes | None]:
    """(namespace, keys, dialog) of a prewarm body; ``ValueError`` naming the field (and key index) that is
    wrong.  The decoder checks each value's type as it reads it, so a deeply nested value is refused where
    it starts, never recursed into."""
    try:
        req = _prewarm_decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad prewarm body: {e} (expected {{\"namespace\": str, \"keys\": [str], "
                         f"\"keys_hex\": [hex str], \"dialog\": str}})") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ValueError(f"the prewarm body is not valid JSON (a JSON object is expected): {e}") from None
    if not req.namespace:
        raise ValueError("'namespace' must not be empty")
    n = len(req.keys) + len(req.keys_hex)
    if not n:
        raise ValueError("'keys' or 'keys_hex' must name at least one key")
    if n > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"'keys' and 'keys_hex' name {n} keys; at most {MAX_KEYS_PER_REQUEST} in one request")
    keys: list[bytes] = []
    for field_name, given in (("keys", req.keys), ("keys_hex", req.keys_hex)):
        for i, k in enumerate(given):
            if field_name == "keys":
                key = k.encode()
            else:
                try:
                    key = bytes.fromhex(k)
                except ValueError:
                    raise ValueError(f"'keys_hex'[{i}] is not hexadecimal (an even number of digits 0-9, a-f)") from None
            if not 0 < len(key) <= MAX_KEY_BYTES:
                size = f"{len(key)} bytes" if key else "empty"
                raise ValueError(f"'{field_name}'[{i}] is {size}; a key has 1 to {MAX_KEY_BYTES} bytes")
            keys.append(key)
    return req.namespace, keys, req.dialog.encode() if req.dialog else None
