"""The card server: the directory cards of a storage host, served over TCP to gateways on other hosts.

A gateway reaches a served card as ``kvgate://host:port/<serial>``
(``kvgate.cards.network.card.NetworkCard``); the wire format is
``kvgate.cards.network.wire``.  The server does the disk work a ``DirectoryCard``
does and nothing more: it never verifies an object it sends.  A read sends
the object file as it is on disk with ``sendfile`` (zero copy from the page
cache), and the client checks header, lengths and hash as a local card
does, so a byte flipped on the disk, in the server or on the wire is caught
by the one check.  Writes go the other way: the client sends the payload's
hash beside it, the server checks it before ``DirectoryCard.write``
publishes the object.

Threads: one accept thread, and one thread per connection doing that
connection's requests in order with blocking calls.  Every request is
blocking disk work (open, fstat, sendfile, fsync, rename, listing), which an
event loop would hand to threads anyway; a thread per connection keeps a
slow disk call of one gateway from delaying another's, and the number of
connections is small (one per I/O thread of each gateway, plus one per
claim) and bounded (``max_connections``).  A connection's garbage, its
stalls and its disconnect end that connection's thread only.

Claims: ``Claim`` on a connection takes the card's claim (the directory's
lock, exclusive or shared) for the remote gateway, on a ``DirectoryCard`` of
its own, so it conflicts with every other claim, remote or local, exactly as
two local gateways would.  It is held for as long as that connection stays
open and released when it closes: the gateway's card closes it, or its
process dies (the kernel closes its sockets), or its host goes away (TCP
keepalive, about 30 s).  ``Claim`` again on the same connection renews it
(another mode included).  The client keeps the claim on a connection of its
own and takes it again when that connection was lost (a server restart).

A disk error while an object file is being sent (the frame's length is
already on the wire) ends the connection: the gateway sees the card
unavailable for the rest of that batch and counts it, as it would an I/O
error of a local card, and the object is not deleted for a transient error.

Limits: a frame's header and body lengths, a batch's count and each
payload's length are checked against limits before anything is allocated; a
frame must arrive whole within ``frame_timeout`` (plus 1 s per 4 MiB of
body) once its first byte has; a peer that breaks the protocol gets an
``Err`` naming what was wrong and is disconnected.

Access: a server bound beyond loopback needs a token (``token``, from
``--token-file``); every connection's hello must present it (compared in
constant time) before any card is named, and one that does not is answered
an error naming ``card_token_file`` and closed.  The token keeps strangers
from reading, writing or deleting objects.  With a certificate (``tls``,
``--tls-cert``/``--tls-key``) every connection is TLS (its cards are
``kvgates://``): the token and the objects cannot be read or changed on the
way.  Without, the token travels in the clear, which is only for a network
no stranger can listen on: whoever takes it can store objects of their own
under any key, and each would hash right.  An object goes out over TLS in
256 KiB reads (no ``sendfile`` through TLS).
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
import time
from typing import Any

from kvgate.cards.base import CardUnavailable
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.network.serverconn import Connection, refuse, url_host
from kvgate.config import is_loopback, read_token
from kvgate.types import split_host_port

log = logging.getLogger("kvgate.cards.network.server")

class CardExporter:
    """Serves local ``DirectoryCard`` s by serial on one TCP listener.

    ``start()`` opens each card not opened yet, binds, and starts the accept
    thread; it returns at once.  ``stop()`` closes the listener and every
    connection (releasing the claims held through them) and joins the
    threads.  Both may be called from any thread; from asyncio, call them
    directly (start binds and returns; stop waits at most about a second
    per connection thread) or through ``to_thread``.  ``urls`` names each
    served card as a gateway reaches it.
    """

    def __init__(self, cards: list[DirectoryCard], host: str = "127.0.0.1", port: int = 0,
                 max_object_bytes: int = 256 << 20, max_connections: int = 256, frame_timeout: float = 10.0,
                 token: str | None = None, tls: ssl.SSLContext | None = None):
        if max_object_bytes < (1 << 20):
            raise ValueError(f"max_object_bytes must be at least 1 MiB, got {max_object_bytes}")
        if token is None and not is_loopback(host):
            raise ValueError(f"{host or 'every address'} is not loopback: give a token file (--token-file) so "
                             "that only gateways that present it (card_token_file) read and write these cards")
        self.token = token  # what every connection's hello must present; None: loopback only, no token
        self.tls = tls  # every connection is TLS with this server context (tls_server_context); None: plain
        if tls is None and not is_loopback(host):
            log.warning("card server on %s without a TLS certificate: the token and every object travel in the "
                        "clear; give --tls-cert and --tls-key unless no stranger can listen on this network",
                        host or "every address")
        self.refusal_logged = 0.0  # when a refused token was last logged
        self.cards = list(cards)
        self.host, self.port = host, port
        self.max_object_bytes = max_object_bytes
        self.max_connections = max_connections
        self.frame_timeout = frame_timeout
        self.send_timeout = 60.0  # a gateway that reads nothing for this long has gone
        self.by_serial: dict[str, DirectoryCard] = {}
        self._variants: dict[tuple[str, int], DirectoryCard] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self.requests: collections.Counter[str] = collections.Counter()  # by op, for tests and status

    # ------------------------------------------------------------------ life

    def start(self) -> "CardExporter":
        for card in self.cards:
            serial = card.serial or card.open()
            if serial in self.by_serial:
                raise ValueError(f"cards {self.by_serial[serial].location} and {card.location} have the same "
                                 f"serial {serial} (one copied from the other?): give one a new label")
            self.by_serial[serial] = card
            self._variants[(serial, card.num_dbs)] = card
        sock = socket.create_server((self.host, self.port), backlog=128, reuse_port=False)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvgate-export-accept", daemon=True)
        self._accept_thread.start()
        for serial, url in self.urls().items():
            log.info("exporting card %s (%s) as %s", serial, self.by_serial[serial].location, url)
        return self

    def add(self, location: str) -> str:
        """Serve the directory card at ``location`` too (an agent's glob matched a new one); its URL.
        Blocks on the card's label: call it from a thread."""
        card = DirectoryCard(location, create_missing=False)
        serial = card.open()
        with self._lock:
            known = self.by_serial.get(serial)
            if known is not None and known.location != card.location:
                raise ValueError(f"cards {known.location} and {card.location} have the same serial {serial} "
                                 f"(one copied from the other?): give one a new label")
            if known is None:
                self.by_serial[serial] = card
                self._variants[(serial, card.num_dbs)] = card
        if known is None:
            log.info("exporting card %s (%s) as %s", serial, location, self.urls()[serial])
        return self.urls()[serial]

    def urls(self) -> dict[str, str]:
        scheme = "kvgates" if self.tls is not None else "kvgate"
        return {s: f"{scheme}://{url_host(self.host)}:{self.port}/{s}" for s in self.by_serial}

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            except OSError:
                pass
            self._listener.close()
        for c in conns:
            c.shutdown()
        if self._accept_thread is not None:
            self._accept_thread.join(5)
        for c in conns:
            c.thread.join(5)

    def __enter__(self) -> "CardExporter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def card_for(self, serial: str, num_dbs: int) -> DirectoryCard:
        """The served card ``serial`` seen with the client's ``num_dbs`` (objects are placed by it)."""
        with self._lock:
            card = self._variants.get((serial, num_dbs))
            if card is None:
                base = self.by_serial[serial]
                card = DirectoryCard(base.location, num_dbs=num_dbs, sync_writes=base.sync_writes,
                                     direct_reads=base.direct_reads, create_missing=False)
                card.serial = serial
                self._variants[(serial, num_dbs)] = card
            return card

    def count(self, op: str) -> None:
        with self._lock:
            self.requests[op] += 1

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._stopping:
                    return
                time.sleep(0.01)  # EMFILE and friends: let connections end
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full and not self._stopping:
                    conn = Connection(self, sock, peer)
                    self._conns.add(conn)
            if full or self._stopping:
                refuse(sock, f"card server has {self.max_connections} connections, its max_connections")
                continue
            conn.thread.start()

    def ended(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)


def tls_server_context(cert_file: str, key_file: str | None = None) -> ssl.SSLContext:
    """A card server's TLS context from its certificate chain and key (PEM); ``ValueError`` naming the file."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.num_tickets = 0  # no session tickets: nothing unasked arrives on an idle connection (see Conn.stale)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-cert {cert_file}" + (f" --tls-key {key_file}" if key_file else "") +
                         f": cannot load a certificate and its key from them ({getattr(e, 'strerror', None) or e})"
                         ) from None
    return ctx


def serve(dirs: list[str], listen: str, num_dbs: int = 1, max_object_bytes: int = 256 << 20,
          sync_writes: bool = False, token_file: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None) -> int:
    """``kvgate export``: serve ``dirs`` on ``listen`` (HOST:PORT) until SIGINT or SIGTERM."""
    import signal

    try:
        host, port = split_host_port(listen, any_port=True)
    except ValueError as e:
        raise ValueError(f"--listen wants HOST:PORT, got {listen!r} ({e})") from None
    token = read_token(token_file, "--token-file") if token_file else None
    if tls_key and not tls_cert:
        raise ValueError("--tls-key needs --tls-cert")
    tls = tls_server_context(tls_cert, tls_key) if tls_cert else None
    cards = [DirectoryCard(d, num_dbs=num_dbs, sync_writes=sync_writes, create_missing=False) for d in dirs]
    try:
        ex = CardExporter(cards, host.strip("[]"), int(port), max_object_bytes=max_object_bytes,
                          token=token, tls=tls).start()
    except CardUnavailable as e:
        why = e.strerror.replace(", or set create_card_dirs: true", "")  # a gateway's key; export has none
        raise ValueError(f"cannot export card {e.filename}: {why}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for serial, url in ex.urls().items():
        print(f"{url} {ex.by_serial[serial].location}", flush=True)
    stop.wait()
    ex.stop()
    return 0
