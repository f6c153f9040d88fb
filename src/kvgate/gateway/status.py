"""Status: one snapshot dict, rendered as Prometheus text for the status file and /metrics.

The snapshot is taken on the event loop (where the counters live), so the
renderers in other threads never read state that is being changed.  The
same dict answers the ``stats`` op that ``kvgate stat`` uses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from kvgate.gateway.server import Gateway

log = logging.getLogger("kvgate.status")

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
    ("read_hints", "objects a lookup found on the card and passed on for their reads to be prepared", True),
    ("cached_copy_bytes_per_second", "directory card: recent rate of reads copied out of the page cache", False),
    ("direct_read_bytes_per_second", "directory card: recent rate of O_DIRECT reads (the faster one serves "
     "cached files)", False),
)


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
        yield CounterMetricFamily("kvgate_lookups", "lookup requests", value=s["lookups"])
        yield CounterMetricFamily("kvgate_corrupt_objects", "objects that failed their checks (removed, served as misses)",
                                  value=s["corrupt_objects"])
        yield CounterMetricFamily("kvgate_expired_objects", "objects past their TTL", value=s["expired_objects"])
        yield CounterMetricFamily("kvgate_io_timeouts", "card I/Os past io_timeout_ms", value=s["io_timeouts"])
        yield CounterMetricFamily("kvgate_io_errors", "card I/Os that failed", value=s["io_errors"])
        yield GaugeMetricFamily("kvgate_worker_oldest_io_age_seconds", "age of the oldest I/O in flight",
                                value=s["oldest_io_age_s"])
        yield GaugeMetricFamily("kvgate_sessions", "connected client sessions", value=s["gateway"]["sessions"])
        active = GaugeMetricFamily("kvgate_storage_group_active", "1 when the card is in service", labels=["group"])
        for card in s["cards"]:
            active.add_metric([card["serial"] or card["location"]], 1 if card["active"] else 0)
        yield active
        yield GaugeMetricFamily("kvgate_storage_groups_active", "cards in service",
                                value=sum(1 for c in s["cards"] if c["active"]))
        for name, doc, counter in CARD_FIELDS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            m = family(f"kvgate_storage_group_{name}", f"Per card: {doc}", labels=["group"])
            for card in s["cards"]:
                m.add_metric([card["serial"] or card["location"]], card[name])
            yield m
        info = InfoMetricFamily("kvgate_key_layout", "key layout fingerprint")
        info.add_metric([], {"fingerprint": s["gateway"]["fingerprint"]})
        yield info
        info = InfoMetricFamily("kvgate_key_placement", "key placement")
        info.add_metric([], {"placement": s["gateway"]["placement"]})
        yield info


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


class HttpStatus:
    """/metrics, /healthz and POST /v1/cache/prewarm, served from a thread."""

    def __init__(self, gateway: "Gateway", loop: asyncio.AbstractEventLoop, host: str, port: int):
        self.gateway = gateway
        self.loop = loop
        handler = self._handler_class()
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
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

    def _handler_class(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # route to logging, quietly
                log.debug("http: " + fmt, *args)

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.split("?")[0] == "/metrics":
                    snap = outer._call(outer.gateway.snapshot_async())
                    self._send(200, render(snap), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    self._send(200, b'{"ok": true}')
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self):
                if self.path != "/v1/cache/prewarm":
                    self._send(404, b'{"error": "not found"}')
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    if length > (4 << 20):
                        raise ValueError("request body over 4 MiB")
                    req = json.loads(self.rfile.read(length) or b"{}")
                    namespace, keys, dialog = _parse_prewarm(req)
                except (ValueError, TypeError) as e:
                    self._send(400, json.dumps({"error": str(e)}).encode())
                    return
                n = outer._call(outer.gateway.prewarm(namespace, keys, dialog))
                self._send(200, json.dumps({"in_ram": n, "asked": len(keys)}).encode())

        return Handler


def _parse_prewarm(req: Any) -> tuple[str, list[bytes], bytes | None]:
    if not isinstance(req, dict):
        raise ValueError("expected a JSON object")
    namespace = req.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("'namespace' (string) is required")
    keys: list[bytes] = []
    for k in req.get("keys", []):
        if not isinstance(k, str):
            raise ValueError("'keys' must be strings (UTF-8 keys); use 'keys_hex' for binary keys")
        keys.append(k.encode())
    for k in req.get("keys_hex", []):
        keys.append(bytes.fromhex(k))
    if not keys:
        raise ValueError("'keys' or 'keys_hex' must name at least one key")
    dialog = req.get("dialog")
    if dialog is not None and not isinstance(dialog, str):
        raise ValueError("'dialog' must be a string")
    return namespace, keys, dialog.encode() if dialog else None
