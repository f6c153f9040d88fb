"""A card that a card server serves over TCP: ``kvgate://host:port/<serial>``, or over TLS: ``kvgates://``.

The server (``kvgate.cards.network.server``, ``kvgate export``) holds the card's
directory on its host; objects, labels, claims, snapshots and the heads list
are the directory card's, and the wire format is ``kvgate.cards.network.wire``.
This side does what a local card does with its medium: a read receives the
object file as it is on disk into this thread's scratch, checks header key,
lengths and hash there, and hands the payload to the caller's buffer only
through ``guard.copy`` (into memory the gateway owns, ``guard.own``, the
payload is received in place and hashed there: ``Conn.receive_object``); a
corrupt object is deleted (only if the server still holds the very bytes
found bad) and reported as ``ObjectCorrupt``.

Connections: one persistent connection per calling thread (the gateway's
I/O threads), made on first use; each batch (``read_many_into``,
``write_many``, ``exists_many``) is one request on it, answered in one
stream.  A listing (``names``) and a snapshot writer get a connection of
their own for their life, since the gateway advances them from whichever
pool thread is free; the claim gets one too, held for as long as the claim
is (see ``claim``).

TLS (``kvgates://``): the connection is encrypted and the server's
certificate checked against ``tls_ca_file`` (the config's
``card_tls_ca_file``; the system's trusted CAs if unset) and the URL's host,
so neither the token nor an object can be read or changed on the way.
Without it the token travels in the clear: anyone who can listen on the
network can take it and write objects of their own under any key (each
hashes right: the hash guards against damage, not against a writer).

Deadlines: every connect, send and receive is bounded by ``io_timeout_ms``.
A connection that timed out, broke or met a reply it cannot parse is closed
at once, never reused half-read, and the call fails with ``CardUnavailable``
naming the URL.  An idle connection the server closed (a restart) is noticed
before it is used (a poll that does not wait), so the first call after a restart
reconnects instead of failing.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
import weakref
from typing import Any, Iterator
from urllib.parse import urlsplit

from kvgate.cards.network import wire as w
from kvgate.cards.base import Card, CardUnavailable, SnapshotWriter, StoredObject, WriteAbandoned, byte_view, holder_doc
from kvgate.cards.network.conn import Conn, copies
from kvgate.cards.network.heads import NetworkHeads
from kvgate.cards.objectformat import Header, ObjectMeta, padded_object_size
from kvgate.config import ConfigError, read_token
from kvgate.keys import key_digest, payload_hasher
from kvgate.memcopy import Abandon, ReadAbandoned
from kvgate.memguard import hash_with

log = logging.getLogger("kvgate.cards.network")

PREFIX = "kvgate://"
TLS_PREFIX = "kvgates://"
# Keys per request of a batch; a bigger batch takes one round trip per this many.
BATCH = w.MAX_BATCH
# While a lost claim cannot be taken again (the server is down: the gateway's health check asks every
# second), the log says so once, then once this often with the attempts made, then when it is back.
CLAIM_RETRY_SAY_S = 60.0


def is_network(location: str) -> bool:
    return location.startswith((PREFIX, TLS_PREFIX))


class NetworkCard(Card):
    """A card served by a ``kvgate export`` server, reached at ``kvgate://host:port/<serial>``.

    Every method blocks on the network (bounded by ``io_timeout_ms``) and is
    safe to call from several threads at once: each thread uses a connection
    of its own.  ``max_object_bytes``: the largest object file this side
    accepts from the server (the gateway's ``max_frame_bytes``); an answer
    that announces more is a broken server, and its connection is closed.
    """

    kind = "kvgate"

    def __init__(self, location: str, num_dbs: int = 1, io_timeout_ms: int = 2000, max_object_bytes: int = 256 << 20,
                 token_file: str | None = None, tls_ca_file: str | None = None,
                 tls_ca_key: str = "card_tls_ca_file", server_name: str = "card server",
                 timeout_key: str = "io_timeout_ms", serves_it: str = "kvgate export"):
        """``tls_ca_key``, ``server_name``, ``timeout_key``, ``serves_it``: the config key of ``tls_ca_file``,
        what serves the card, the config key of ``io_timeout_ms`` and what listens there, as messages name
        them (a peer gateway's ``PeerTier``: ``peer_tls_ca_file``, ``peer``, ``peer_timeout_ms``, a gateway
        with ``peer_listen``)."""
        super().__init__(location, num_dbs)
        self.token_file = token_file  # read at each connect (on the calling I/O thread): a rotated token is used
        if io_timeout_ms < 1:
            raise ValueError(f"io_timeout_ms must be at least 1, got {io_timeout_ms}")
        parts = urlsplit(location)
        serial = parts.path.strip("/")
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("kvgate", "kvgates") or not parts.hostname or port is None or not serial \
                or "/" in serial:
            raise ValueError(f"not a kvgate card location: {location!r}; write kvgate://HOST:PORT/SERIAL, or "
                             "kvgates:// for a server with a TLS certificate (kvgate export prints the URL of each "
                             "card it serves)")
        self.host, self.port, self.url_serial = parts.hostname, port, serial
        self.tls: ssl.SSLContext | None = None
        if parts.scheme == "kvgates":
            try:
                self.tls = ssl.create_default_context(cafile=tls_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"{tls_ca_key} {tls_ca_file}: cannot load it as PEM certificates "
                                 f"({getattr(e, 'strerror', None) or e})") from None
            self.tls.minimum_version = ssl.TLSVersion.TLSv1_2
        self.tls_ca_file = tls_ca_file
        self.tls_ca_key, self.server_name = tls_ca_key, server_name
        self.timeout_key, self.serves_it = timeout_key, serves_it
        self.timeout = io_timeout_ms / 1000
        self.max_object_bytes = max_object_bytes
        self._local = threading.local()
        self._conns: weakref.WeakSet[Conn] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._claim_conn: Conn | None = None
        self._claim_lock = threading.Lock()
        # A lost claim being taken again: since when (time.monotonic()), the attempts that failed, when the log
        # last said so (None: the claim is held, or was never lost).
        self._claim_lost_at: float | None = None
        self._claim_failures = 0
        self._claim_said_at = 0.0
        # The largest object file the server takes, as its hello said; a bigger write is refused here.
        self.server_max_object_bytes = max_object_bytes
        self.heads = NetworkHeads(self._call)

    # ----------------------------------------------------------- connections

    def lost(self, exc: BaseException) -> CardUnavailable:
        """The ``CardUnavailable`` for a connection that failed with ``exc``."""
        if isinstance(exc, ssl.SSLCertVerificationError):
            trusted = f"the CAs in {self.tls_ca_key} ({self.tls_ca_file})" if self.tls_ca_file else \
                f"the system's trusted CAs (set {self.tls_ca_key} to the CA that signed it)"
            why = f"the {self.server_name}'s TLS certificate is not trusted by {trusted}: {exc.verify_message}"
            code = errno.EACCES
        elif isinstance(exc, ssl.SSLError):
            why, code = f"TLS with the {self.server_name} failed ({exc.reason or exc})", errno.EPROTO
        elif isinstance(exc, TimeoutError):
            why = f"{self.server_name} did not answer within {self.timeout_key} ({self.timeout * 1000:.0f} ms)"
            code = errno.ETIMEDOUT
        elif isinstance(exc, w.WireError):
            why, code = f"{self.server_name} broke the protocol ({exc}): is it {self.serves_it} of this version?", \
                errno.EPROTO
        elif isinstance(exc, ConnectionRefusedError):
            why, code = f"nothing listens at {self.host}:{self.port} (is {self.serves_it} running there?)", \
                errno.ECONNREFUSED
        else:
            why = f"connection to the {self.server_name} failed: {getattr(exc, 'strerror', None) or exc}"
            code = getattr(exc, "errno", None) or errno.ECONNRESET
        return CardUnavailable(code, why, self.location)

    def _connect(self) -> Conn:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as e:
            raise self.lost(e) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)  # the handshake, within the timeout
            except OSError as e:
                sock.close()
                if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLCertVerificationError):
                    hint = "does it serve TLS (kvgate export --tls-cert)? A plain server's cards are kvgate://, not " \
                           "kvgates://" if self.tls_ca_key == "card_tls_ca_file" else \
                           f"does it serve TLS? With {self.tls_ca_key} set, it is reached over TLS only"
                    raise CardUnavailable(errno.EPROTO, f"TLS handshake with the {self.server_name} failed "
                                          f"({e.reason or e}): {hint}", self.location) from e
                raise self.lost(e) from e
        conn = Conn(self, sock)
        try:
            try:
                token = read_token(self.token_file, "config key 'card_token_file'") if self.token_file else None
            except ConfigError as e:
                raise CardUnavailable(errno.EACCES, str(e), self.location) from None
            said, _ = conn.call(w.Hello(self.url_serial, self.num_dbs, token))
        except BaseException:
            conn.close()
            raise
        if isinstance(said, dict) and isinstance(said.get("max_object_bytes"), int):
            self.server_max_object_bytes = said["max_object_bytes"]
        with self._lock:
            self._conns.add(conn)
        return conn

    def _conn(self) -> Conn:
        """This thread's connection, made now if it has none or the server closed it."""
        conn: Conn | None = getattr(self._local, "conn", None)
        if conn is not None and (conn.closed or conn.stale()):
            conn.close()
            conn = None
        if conn is None:
            conn = self._local.conn = self._connect()
        return conn

    def _call(self, msg: w.Msg, *body: Any, max_body: int = 0) -> tuple[Any, bytes]:
        return self._conn().call(msg, *body, max_body=max_body)

    def ask(self, msg: w.Msg) -> Any:
        """A request beyond the card interface (a peer listener's ``Namespaces``) on this thread's
        connection: the value it is answered with, or the error it is refused with (``from_err``)."""
        return self._call(msg)[0]

    def close(self) -> None:
        """Close every connection; the claim goes with its connection."""
        with self._lock:
            conns = list(self._conns)
        with self._claim_lock:
            self._claim_conn = None
            self._claim_lost_at = None
            for c in conns:
                c.close()
        self.claimed = None

    # ----------------------------------------------------------------- label

    def open(self) -> str:
        self.serial = self.check()
        return self.serial

    def check(self) -> str:
        """The serial the server finds in the label now; over the claim's connection while claimed, which
        proves the claim is still held (a lost one, after a server restart, is taken again here)."""
        if self.claimed is None:
            return self._call(w.Check())[0]
        with self._claim_lock:
            conn = self._claim_conn
            if conn is None or conn.closed or conn.stale():
                conn = self._claim_again()
            return conn.call(w.Check())[0]

    def _claim_again(self) -> Conn:
        """Take the lost claim again, logging the loss once, a summary every ``CLAIM_RETRY_SAY_S`` while the
        server does not take it, and its return.  Under ``_claim_lock``."""
        now = time.monotonic()
        if self._claim_lost_at is None:
            self._claim_lost_at, self._claim_failures, self._claim_said_at = now, 0, now
            log.warning("card %s: the connection holding its claim was lost (server restarted?); claiming again "
                        "(while that fails, said again every %.0f s)", self.location, CLAIM_RETRY_SAY_S)
        try:
            conn = self._take_claim(self.claimed)
        except OSError as e:
            self._claim_failures += 1
            if now - self._claim_said_at >= CLAIM_RETRY_SAY_S:
                self._claim_said_at = now
                log.warning("card %s: claim not taken again for %.0f s (%d attempts; the last: %s)", self.location,
                            now - self._claim_lost_at, self._claim_failures, getattr(e, "strerror", None) or e)
            raise
        log.warning("card %s: claim taken again after %.1f s (%d attempts failed)", self.location,
                    now - self._claim_lost_at, self._claim_failures)
        self._claim_lost_at = None
        return conn

    def claim(self, shared: bool) -> None:
        """Held by the server for this card on a connection of its own, until ``close`` (or this process
        dies: the server sees the connection close and releases it)."""
        with self._claim_lock:
            conn = self._claim_conn
            if conn is not None and not conn.closed and not conn.stale():
                try:
                    conn.call(w.Claim(shared, holder_doc(shared)))
                except BaseException:
                    conn.close()
                    self._claim_conn, self.claimed = None, None
                    raise
            else:
                self._take_claim(shared)
            self.claimed = shared

    def _take_claim(self, shared: bool) -> Conn:
        if self._claim_conn is not None:
            self._claim_conn.close()
            self._claim_conn = None
        conn = self._connect()
        try:
            conn.call(w.Claim(shared, holder_doc(shared)))
        except BaseException:
            # ``claimed`` stays: a claim lost and refused now (another gateway took it meanwhile) is asked
            # for again at every check, never dropped, or the card would go on serving unclaimed.
            conn.close()
            raise
        self._claim_conn = conn
        return conn

    def check_writable(self) -> None:
        self._call(w.CheckWritable())

    # ------------------------------------------------------------------- reads

    def read_into(self, full_key: bytes, dest: memoryview, guard: Abandon | None = None) -> Header:
        result = self.read_many_into([(full_key, dest)], guard)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def read_many_into(self, items: list[tuple[bytes, memoryview]],
                       guard: Abandon | None = None) -> list[Header | BaseException]:
        """One ``ReadMany`` per ``BATCH`` objects; the replies stream in, each verified as it lands."""
        guard = guard or Abandon()
        out: list[Header | BaseException] = []
        for start in range(0, len(items), BATCH):
            chunk = items[start : start + BATCH]
            try:
                conn = self._conn()
                conn.send(w.ReadMany([k for k, _ in chunk]))
            except CardUnavailable as e:
                out.extend(copies(e, len(chunk)))
                continue
            corrupt: list[tuple[bytes, bytes, int]] = []
            for i, (full_key, dest) in enumerate(chunk):
                try:
                    out.append(conn.receive_object(full_key, byte_view(dest), guard, corrupt))
                except (CardUnavailable, ReadAbandoned) as e:  # the connection is closed: the rest fail alike
                    conn.close()
                    out.extend(copies(e, len(chunk) - i))
                    break
            for key, seen, size in corrupt:
                self._discard(key, seen, size)
        return out

    def _discard(self, full_key: bytes, seen: bytes, size: int) -> None:
        """Best effort: a failure leaves the object for the next read or scan to find again."""
        try:
            self._call(w.Discard(full_key, seen, size))
        except (OSError, LookupError, ValueError):
            pass

    # ------------------------------------------------------------------ writes

    def write(self, full_key: bytes, payload: memoryview, meta: ObjectMeta,
              guard: Abandon | None = None) -> int:
        return self._write_one(full_key, payload, meta, guard)

    def write_many(self, items: list[tuple[bytes, memoryview, ObjectMeta]],
                   guard: Abandon | None = None) -> list[int | BaseException]:
        """One ``WriteMany`` per ``BATCH`` objects.  Each payload goes to the socket from the caller's buffer,
        its hash beside it; after it is sent, ``guard`` decides whether the server publishes it."""
        out: list[int | BaseException | None] = [None] * len(items)
        views = [byte_view(p) for _, p, _ in items]
        sendable = []
        for i, ((k, _, _), v) in enumerate(zip(items, views)):
            size = padded_object_size(k, len(v))
            if size > self.server_max_object_bytes:  # the server would refuse the whole request
                out[i] = OSError(errno.EFBIG, f"object of {size} bytes is over the card server's max_object_bytes "
                                 f"({self.server_max_object_bytes}): raise it on the server (kvgate export "
                                 "--max-object-bytes) or write smaller blocks", self.location)
            else:
                sendable.append(i)
        for start in range(0, len(sendable), BATCH):
            chunk = sendable[start : start + BATCH]
            if guard is not None and guard.abandoned:
                for i in chunk:
                    out[i] = WriteAbandoned(self.location)
                continue
            req = w.WriteMany([w.WriteItem(items[i][0], len(views[i]), hash_with(views[i], payload_hasher), items[i][2].dialog,
                                           items[i][2].position, items[i][2].created_ns) for i in chunk])
            try:
                conn = self._conn()
                # The body follows: each payload, then its publish byte.
                conn.send(req, body_len=sum(len(views[i]) + 1 for i in chunk))
                go = b""
                with conn.transport():
                    for i in chunk:
                        w.send_all(conn.sock, [go, views[i]])
                        go = b"\0" if guard is not None and guard.abandoned else b"\1"
                    w.send_all(conn.sock, [go])
                results, _ = conn.reply(req)
            except CardUnavailable as e:
                for i, err in zip(chunk, copies(e, len(chunk))):
                    out[i] = err
                continue
            for i, r in zip(chunk, self._results(results)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _results(self, results: w.Results) -> list[Any]:
        return [v if e is None else w.from_err(e, self.location) for v, e in zip(results.values, results.errors)]

    def exists(self, full_key: bytes, not_before_ns: int | None = None) -> bool:
        result = self.exists_many([full_key], not_before_ns)[0]
        if isinstance(result, BaseException):
            raise result
        return bool(result)

    def exists_many(self, full_keys: list[bytes], not_before_ns: int | None = None) -> list[bool | BaseException]:
        out: list[bool | BaseException] = []
        for start in range(0, len(full_keys), BATCH):
            chunk = full_keys[start : start + BATCH]
            try:
                results, _ = self._call(w.ExistsMany(chunk, not_before_ns))
            except CardUnavailable as e:
                out.extend(copies(e, len(chunk)))
                continue
            out.extend(self._results(results))
        return out

    def delete(self, full_key: bytes) -> bool:
        return self.delete_named(key_digest(full_key))

    def delete_named(self, digest: bytes) -> bool:
        results, _ = self._call(w.DeleteNamed([digest]))
        result = self._results(results)[0]
        if isinstance(result, BaseException):
            raise result
        return bool(result)

    # --------------------------------------------------------- whole-card ops

    def names(self) -> Iterator[list[bytes]]:
        """A listing on a connection of its own (the gateway advances it from any pool thread)."""
        conn = self._connect()
        try:
            conn.call(w.Names())
            while True:
                more, raw = conn.call(w.NamesNext(), max_body=16 * (1 << 24))
                if more is None:
                    return
                if len(raw) % 16:
                    raise self.lost(w.WireError(f"a names batch of {len(raw)} bytes is no list of digests"))
                yield [raw[i : i + 16] for i in range(0, len(raw), 16)]
        finally:
            conn.close()

    def stored_objects(self, digests: list[bytes]) -> list[StoredObject | None]:
        out: list[StoredObject | None] = []
        for start in range(0, len(digests), BATCH):
            value, _ = self._call(w.StoredObjects(digests[start : start + BATCH]))
            self.scan_corrupt += int(value["corrupt"])
            for row in value["objects"]:
                if row is None:
                    out.append(None)
                else:
                    key, plen, stored, dialog, position, created = row
                    out.append(StoredObject(key, plen, stored, ObjectMeta(dialog, position, created)))
        return out

    def snapshot_writer(self) -> SnapshotWriter:
        return _NetSnapshotWriter(self)

    def read_snapshot(self) -> bytes | None:
        there, data = self._call(w.ReadSnapshot(), max_body=w.MAX_SNAPSHOT)
        return data if there else None

    def drop_snapshot(self) -> None:
        self._call(w.DropSnapshot())

    def clean(self) -> int:
        return int(self._call(w.Clean())[0])

    def free_bytes(self) -> int:
        return int(self._call(w.FreeBytes())[0])

    def reserve_bytes(self, card_reserve: int) -> int:
        return card_reserve

    def why_empty(self, free: int, used: int, card_reserve: int) -> str:
        return (f"the filesystem of its directory on the card server {self.host} has {free} bytes free beside the "
                f"{used} bytes of objects it holds, and card_reserve keeps {card_reserve} bytes free; make room "
                "there or lower card_reserve")

    def __repr__(self) -> str:
        return f"NetworkCard({self.location!r}, serial={self.serial!r})"


class _NetSnapshotWriter(SnapshotWriter):
    """A snapshot streamed to the server on a connection of its own; the server publishes it on commit."""

    def __init__(self, card: NetworkCard) -> None:
        self.conn: Conn | None = card._connect()
        try:
            self.conn.call(w.SnapshotBegin())
        except BaseException:
            self.conn.close()
            raise

    def write(self, data: bytes | memoryview) -> None:
        assert self.conn is not None
        view = byte_view(data)
        for off in range(0, len(view), w.SNAPSHOT_PIECE):  # no reply each: a failure comes back on commit
            self.conn.send(w.SnapshotPiece(), view[off : off + w.SNAPSHOT_PIECE])

    def commit(self) -> None:
        conn, self.conn = self.conn, None
        assert conn is not None
        try:
            conn.call(w.SnapshotCommit())
        finally:
            conn.close()

    def abort(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()  # the server aborts a snapshot whose connection ends
