"""The peer listener (``peer_listen``): what this gateway's tiers hold, read by peer gateways.

A peer's ``PeerTier`` (``kvgate.tiers.peertier``) is a network card on
``kvgate://HOST:PORT/peer``, so this listener speaks the network card's wire
(``kvgate.cards.network.wire``) and serves four requests: ``hello`` (serial
``peer`` and the token of ``peer_token_file``, compared in constant time),
``exists_many`` (answered with each present object's size where known, so
the peer sizes its read), ``read_many``, and ``namespaces`` (the peer's
namespaces and their inputs, answered with this gateway's: a namespace of
the peer's whose model this gateway's engines run in another namespace is
logged once with the difference, as the peer logs it;
``kvgate.keys.NamespaceBook``).  Anything else is refused and the
connection closed: a peer reads, it never writes, deletes or cleans.  An
object goes out as an object file (header with its key, length and payload
hash, then the payload), so the peer verifies every byte as it verifies a
card read.  Only this gateway's own tiers answer (``TieredStore.local``): a
pull is never passed on to this gateway's peers, so two gateways that list
each other never pull in a loop.

TLS: with ``peer_tls_cert_file`` and ``peer_tls_key_file`` every connection
is TLS (1.2 at least; the pullers' ``PeerTier`` reach it as ``kvgates://`` and
check the certificate against their ``peer_tls_ca_file``), so the token and
the objects cannot be read or changed on the way.  The handshake is the
connection's thread's, never the accept thread's, and must be done, hello
included, within ``hello_timeout`` of the connect; a connection that speaks
plain kvgate is answered a plain ``Err`` saying so, and one whose handshake
fails (a certificate its peer does not trust) is closed, each logged and
counted (``tls_failed``).  An object then goes out through TLS buffer by
buffer (no ``sendmsg`` on a TLS socket); without TLS it is one ``sendmsg``
of its pages as below.  Without TLS the token travels in the clear: a
listener beyond loopback says so in the log at start.

Threads: as the card server's connections, each peer connection has a
thread of its own that reads its requests and sends its replies with
blocking calls; what touches the store (lookups, lends, reads) runs on the
event loop, handed over with ``run_coroutine_threadsafe``.  An object in the
RAM tier is sent straight from its pages, lent for the send
(``TieredStore.lend_ram``), hashed and written by this thread with one
``sendmsg``: no copy on this side, and the loop never waits on a socket.

Bounds, against a peer that means harm or is merely broken: at most
``PEER_CONNECTIONS`` connections, and connections without a peer behind
them cannot keep a peer out: at a full listener a new connection displaces
the oldest that has not said its hello (one that has sent nothing of it
first, else one waiting over ``HELLO_GRACE_S``), and only a listener full
of peers that said their hello refuses it; the whole hello within
``hello_timeout`` of the connect; a peer's connection closed after
``PEER_IDLE_S`` without a request (its ``PeerTier`` reconnects when it next
asks), and every request whole within ``FRAME_TIMEOUT_S`` of its first byte;
every frame's lengths checked before anything is read for them (requests
carry no body); a batch of at most ``MAX_BATCH`` keys; a ``read_many`` served in
rounds of at most ``PEER_ROUND_BYTES``, each sent before the next is read or
lent, so a peer asking for 4,096 objects of 256 MiB makes this gateway hold
one round, not a terabyte.  Card reads for peers are not urgent (the I/O
pool's normal class): the local engine's reads go first.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

from kvgate.cards import ObjectMeta
from kvgate.cards.network import wire as w
from kvgate.cards.objectformat import pack_header
from kvgate.config import Config, is_loopback, peer_tls_server_context, read_token
from kvgate.errors import KvgateError
from kvgate.keys import NO_DIALOG, NamespaceBook, counterpart, namespace_difference, payload_hasher
from kvgate.tiers.peertier import PEER_SERIAL
from kvgate.tiers.store import GetItem, RamLoan, TieredStore
from kvgate.types import split_host_port

log = logging.getLogger("kvgate.peers")

PEER_CONNECTIONS = 64  # a peer gateway holds two (its lookup and pull threads): room for a fleet
PEER_ROUND_BYTES = 64 << 20  # objects of one read_many lent or read, and sent, at a time
LOOP_TIMEOUT_S = 60.0  # a store call for a peer that takes longer: the gateway is stopping or stuck
SEND_TIMEOUT_S = 30.0  # a peer that takes no bytes for this long is gone
# A request (at most MAX_REQUEST_HEADER of header, no body) not whole this long after its first byte: the peer
# is stalled or dribbles on purpose, and its thread and slot are not held for it.
FRAME_TIMEOUT_S = 30.0
# At a full listener, a connection whose hello has begun to arrive is displaced only once it has waited this
# long: a peer's hello follows its connect within milliseconds, even on a loaded host (as the client
# listeners' HELLO_GRACE_S).
HELLO_GRACE_S = 1.0
# A peer's connection that sends no request for this long is closed.  PeerTier keeps its connections open
# between calls and, finding one closed, makes a new one before it asks (a connect and a hello: one round
# trip), so this costs a peer that asks at least every few minutes nothing; it frees the slots of a peer
# whose host vanished without closing them, and of a token holder that opens connections and leaves them.
PEER_IDLE_S = 300.0
NAMESPACES_HEARD = 16  # a peer's namespaces compared with ours (a PeerTier tells its latest NAMESPACES_TOLD)
_TLS_HANDSHAKE = 0x16  # the first byte of every TLS connection (a handshake record)


class PeerRefused(KvgateError, RuntimeError):
    """A request this listener does not serve: answered with ``err`` and the connection closed."""

    def __init__(self, err: w.Err) -> None:
        super().__init__(err.message)
        self.err = err


@dataclass(eq=False)
class _Slot:
    """One open connection, as the accept thread weighs it when the listener is full (under ``_lock``)."""

    sock: socket.socket  # as accepted (the key of ``PeerServer.conns``)
    since: float  # time.monotonic() of its accept
    tls: ssl.SSLSocket | None = None  # ``sock`` wrapped for TLS: what the connection speaks on (sock is detached)
    heard: bool = False  # the first bytes of its hello arrived (advisory: written without the lock)
    peer: bool = False  # its hello was accepted: a peer with the token, never displaced


class _Silent(KvgateError, TimeoutError):
    """No request began in time: no hello within ``hello_timeout``, or none within ``PEER_IDLE_S``."""


class _NotTls(KvgateError, ConnectionError):
    """A connection to a TLS listener that began with anything but a TLS handshake (a plain kvgate hello)."""


@dataclass
class _Round:
    """One round of a ``read_many``: per key its payload views (None: missing) and meta, and what to give back."""

    views: list[list[memoryview] | None]
    metas: list[ObjectMeta | None]
    loans: list[RamLoan | None] = field(default_factory=list)
    buffers: list[memoryview] = field(default_factory=list)


class PeerServer:
    """Serves ``store``'s own tiers to peer gateways on ``cfg.peer_listen`` (module docstring)."""

    def __init__(self, cfg: Config, store: TieredStore, namespaces: NamespaceBook | None = None) -> None:
        assert cfg.peer_listen and cfg.peer_token_file  # (the config's checks)
        self.cfg = cfg
        self.store = store
        self.namespaces = namespaces if namespaces is not None else NamespaceBook()  # ours, told to peers that ask
        self._differences_said: set[tuple[str, str, str]] = set()  # (peer host, ours, theirs) logged
        self.token = read_token(cfg.peer_token_file, "'peer_token_file'")
        self.tls = peer_tls_server_context(cfg)  # every connection TLS with it; None: plain
        self.host, self.port = split_host_port(cfg.peer_listen, any_port=True)  # (checked with the config; 0: any)
        self.listener: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.conns: dict[socket.socket, _Slot] = {}  # open connections, oldest first
        self._lock = threading.Lock()  # conns (and closing their sockets), and the counters the threads write
        self.served_objects = 0
        self.served_bytes = 0
        self.refused = 0  # connections and requests refused (token, not a peer, protocol, limits)
        self.displaced = 0  # connections closed before their hello, to make room at a full listener
        self.timed_out = 0  # closed for time: no hello in time, a request not whole in time, a reply not taken
        self.idle_closed = 0  # peers' connections closed after PEER_IDLE_S without a request
        self.tls_failed = 0  # connections whose TLS failed: not TLS, a handshake refused or broken, a bad record
        self.namespaces_differ = 0  # peers' namespaces of a model our engines run another way (each logged once)

    async def start(self) -> None:
        """Listen (an ``OSError`` when the address cannot be had) and accept on a thread of its own."""
        self.loop = asyncio.get_running_loop()
        self.listener = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        if self.tls is None and not is_loopback(self.host):
            log.warning("peer listener on %s without a TLS certificate: the peer token and every object travel in "
                        "the clear; set peer_tls_cert_file and peer_tls_key_file unless no stranger can listen on "
                        "this network", self.cfg.peer_listen)
        threading.Thread(target=self._accept, name="kvgate-peer-accept", daemon=True).start()

    async def close(self) -> None:
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
            self.listener = None
        with self._lock:
            for slot in self.conns.values():
                _shut(slot)

    def status(self) -> dict:
        with self._lock:
            return {"listen": f"{self.host}:{self.port}", "connections": len(self.conns),
                    "served_objects": self.served_objects, "served_bytes": self.served_bytes,
                    "refused": self.refused, "displaced": self.displaced, "timed_out": self.timed_out,
                    "idle_closed": self.idle_closed, "tls": self.tls is not None, "tls_failed": self.tls_failed,
                    "namespaces_differ": self.namespaces_differ}

    # ---- connections (their threads) ---------------------------------------------------

    def _accept(self) -> None:
        """The accept thread: each connection gets a slot (displacing one at a full listener: ``_displaceable``)
        and a thread of its own.  Never waits on a peer but for the refusal it sends into a fresh socket."""
        listener = self.listener
        while listener is not None:
            try:
                conn, where = listener.accept()
            except OSError:
                return  # closed
            now = time.monotonic()
            with self._lock:
                if len(self.conns) >= PEER_CONNECTIONS:
                    out = self._displaceable(now)
                    if out is not None:  # its thread wakes from its read and leaves, closing the socket
                        del self.conns[out.sock]
                        self.displaced += 1
                        _shut(out)
                full = len(self.conns) >= PEER_CONNECTIONS
                if full:
                    self.refused += 1
                else:
                    slot = self.conns[conn] = _Slot(conn, now)
            if full and self.tls is not None:
                conn.close()  # (a refusal in plain bytes means nothing to a TLS client; no handshake here)
                continue
            if full:
                _send_quietly(conn, w.Err("unavailable", f"this gateway serves {PEER_CONNECTIONS} peer connections "
                                          "at most, all of them peers that said their hello; try again later",
                                          errno.EBUSY))
                conn.close()
                continue
            addr = _shown(where)
            threading.Thread(target=self._connection, args=(slot, addr, str(where[0])), name=f"kvgate-peer-{addr}",
                             daemon=True).start()

    def _displaceable(self, now: float) -> _Slot | None:
        """The connection a newcomer displaces at a full listener (under ``_lock``): the oldest that has sent
        nothing of its hello, else the oldest whose hello has taken ``HELLO_GRACE_S``; None when every slot
        is a peer's (or a hello just arriving): then the newcomer is refused."""
        aged = None
        for slot in self.conns.values():  # oldest first
            if slot.peer:
                continue
            if not slot.heard:
                return slot
            if aged is None and now - slot.since >= HELLO_GRACE_S:
                aged = slot
        return aged

    def _connection(self, slot: _Slot, addr: str, host: str) -> None:
        """A connection's thread: its hello, then its requests until it leaves, breaks a rule or idles past
        ``PEER_IDLE_S``.  Blocks on its socket only, each wait bounded; store calls go to the loop."""
        conn: socket.socket = slot.sock
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello_by = slot.since + self.cfg.hello_timeout
            if self.tls is not None:
                conn = self._start_tls(slot, hello_by)
            self._check_hello(self._request(conn, hello_by - time.monotonic(), hello_by, slot))
            with self._lock:
                if self.conns.get(slot.sock) is not slot:
                    return  # displaced while its hello was checked: the socket is shut already
                slot.peer = True
            conn.settimeout(SEND_TIMEOUT_S)
            conn.sendall(w.frame(w.Ok({"max_object_bytes": self.cfg.max_frame_bytes})))
            while True:
                msg = self._request(conn, PEER_IDLE_S)  # a peer's connection waits idle between its calls
                conn.settimeout(SEND_TIMEOUT_S)
                if isinstance(msg, w.ExistsMany):
                    _check_batch(msg.keys)
                    conn.sendall(w.frame(self._on_loop(self._exists(msg.keys))))
                elif isinstance(msg, w.ReadMany):
                    _check_batch(msg.keys)
                    self._read_many(conn, msg.keys)
                elif isinstance(msg, w.Namespaces):
                    conn.sendall(w.frame(w.Ok(self._namespaces(host, msg.namespaces))))
                elif isinstance(msg, w.Check):
                    conn.sendall(w.frame(w.Ok(PEER_SERIAL)))
                else:
                    raise PeerRefused(w.Err("bad_request", f"a peer listener serves exists_many, read_many and "
                                            f"namespaces, not {type(msg).__name__}: peers only read each other's "
                                            f"tiers"))
        except _NotTls:
            self._count("tls_failed")
            log.warning("peer %s refused: it spoke plain kvgate to this TLS listener (peer_tls_cert_file); its "
                        "gateway must reach it over TLS: set peer_tls_ca_file there", addr)
            _send_quietly(conn, w.Err("unavailable", "this peer listener speaks TLS: set peer_tls_ca_file (the CA "
                                      "of its certificate), so that peers are reached as kvgates://HOST:PORT/peer",
                                      errno.EPROTO))
        except ssl.SSLError as e:
            if slot.peer and isinstance(e, ssl.SSLEOFError):
                return  # a peer that went mid-reply (its deadline passed): gone, as a plain one's reset
            self._count("tls_failed")
            if slot.peer:
                log.warning("peer %s: TLS failed (%s); connection closed", addr, e.reason or e)
            else:  # (a client that does not trust this certificate says so in an alert: its own log names why)
                log.warning("peer %s: TLS handshake failed (%s); connection closed", addr, e.reason or e)
        except PeerRefused as e:
            self._count_refused()
            log.warning("peer %s refused: %s", addr, e.err.message)
            _send_quietly(conn, e.err)
        except w.WireError as e:
            self._count_refused()
            log.warning("peer %s broke the protocol: %s", addr, e)
            _send_quietly(conn, w.Err("bad_request", str(e)))
        except _Silent:
            if slot.peer:
                self._count("idle_closed")
                log.debug("peer %s: no request for %.0f s; connection closed (it reconnects)", addr, PEER_IDLE_S)
            else:
                self._count("timed_out")
        except TimeoutError:
            self._count("timed_out")  # a request not whole in time, or a reply it did not take
        except (OSError, ConnectionError):
            pass  # it went, or was displaced; or the gateway is stopping
        except Exception:
            log.exception("peer %s: connection failed", addr)
        finally:
            with self._lock:
                if self.conns.get(slot.sock) is slot:
                    del self.conns[slot.sock]
                (slot.tls or slot.sock).close()  # (under the lock: the accept thread never shuts a closed socket)

    def _start_tls(self, slot: _Slot, by: float) -> ssl.SSLSocket:
        """The TLS handshake, done by ``by`` (time.monotonic(): the hello's deadline) or ``_Silent`` /
        ``TimeoutError``; ``_NotTls`` for a connection that begins with anything but a handshake (nothing
        of it read).  The wrapped socket, also in ``slot.tls``."""
        assert self.tls is not None
        raw = slot.sock
        if by - time.monotonic() <= 0:
            raise _Silent()
        raw.settimeout(by - time.monotonic())
        try:
            first = raw.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            raise _Silent() from None
        if not first:
            raise ConnectionResetError("peer closed the connection")
        slot.heard = True
        if first[0] != _TLS_HANDSHAKE:
            raise _NotTls()
        with self._lock:  # (the accept thread shuts slot.tls once it is set: never the detached raw socket)
            if self.conns.get(raw) is not slot:
                raise ConnectionResetError("displaced")  # shut already
            tls = slot.tls = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        tls.settimeout(max(0.001, by - time.monotonic()))  # (one bound for the whole handshake)
        tls.do_handshake()
        return tls

    def _count_refused(self) -> None:
        self._count("refused")

    def _count(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _check_hello(self, msg: w.Msg) -> None:
        if not isinstance(msg, w.Hello):
            raise PeerRefused(w.Err("bad_request", f"expected a hello first, got {type(msg).__name__}"))
        if msg.serial != PEER_SERIAL:
            raise PeerRefused(w.Err("unavailable", f"this is a kvgate peer listener (peer_listen): it serves "
                                    f"kvgate://HOST:PORT/{PEER_SERIAL}, not the card {msg.serial!r}",
                                    errno.ENOENT))
        if not hmac.compare_digest((msg.token or "").encode(), self.token.encode()):
            raise PeerRefused(w.Err("unavailable", "the token is wrong or missing: a peer's peer_token_file must "
                                    "hold this gateway's peer token", errno.EACCES))

    @staticmethod
    def _request(conn: socket.socket, wait_s: float, by: float | None = None, slot: _Slot | None = None) -> w.Msg:
        """The next request: its first bytes within ``wait_s`` (else ``_Silent``), the whole frame by ``by``
        (time.monotonic(); default ``FRAME_TIMEOUT_S`` after its first bytes, else ``TimeoutError``).
        ``slot``: marked ``heard`` once its first bytes arrived (a hello on its way)."""
        prefix = bytearray(w.PREFIX.size)
        view = memoryview(prefix)
        if wait_s <= 0:
            raise _Silent()
        conn.settimeout(wait_s)
        try:
            got = conn.recv_into(view)
        except TimeoutError:
            raise _Silent() from None
        if not got:
            raise ConnectionResetError("peer closed the connection")
        if slot is not None:
            slot.heard = True
            if prefix[0] == _TLS_HANDSHAKE:  # (only at a plain listener: over TLS the hello arrives decrypted)
                raise PeerRefused(w.Err("unavailable", "a TLS handshake at a plain peer listener (no "
                                        "peer_tls_cert_file here): the peer's gateway has peer_tls_ca_file set; give "
                                        "this listener a certificate, or unset peer_tls_ca_file there", errno.EPROTO))
        deadline = by if by is not None else time.monotonic() + FRAME_TIMEOUT_S
        w.recv_exact(conn, view[got:], deadline)
        hlen, _blen = w.parse_prefix(prefix, w.MAX_REQUEST_HEADER, 0)  # no request of a peer has a body
        return w.decode_request(w.recv_body(conn, hlen, deadline))

    def _namespaces(self, host: str, theirs: dict[str, dict]) -> dict[str, dict]:
        """Ours, for a peer that told its own (``theirs``); each of its namespaces whose model our engines run
        in another namespace logged once a peer host (as its ``PeerTier`` logs it on its side)."""
        ours = self.namespaces.items()
        for namespace in list(theirs)[:NAMESPACES_HEARD]:  # (a PeerTier tells its latest few)
            mine = counterpart(namespace, theirs[namespace], ours)
            if mine is None:
                continue
            why = namespace_difference((mine, ours[mine]), (namespace, theirs[namespace]))
            said = (host, mine, namespace)
            with self._lock:
                if said in self._differences_said:
                    continue
                if len(self._differences_said) >= NAMESPACES_HEARD * 64:
                    self._differences_said.clear()
                self._differences_said.add(said)
                self.namespaces_differ += 1
            log.warning("peer %s runs namespace %r, of the model this gateway's engines run in namespace %r, "
                        "which differs in %s: neither gateway can use the other's KV of it (the peer is refused "
                        "for it on its side)", host, namespace, mine, why)
        return ours

    def _on_loop(self, coro):
        """Run ``coro`` on the gateway's loop and wait for it (this is a connection's thread)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(LOOP_TIMEOUT_S)

    def _read_many(self, conn: socket.socket, keys: list[bytes]) -> None:
        """One ``Item`` per key, in order: the object file, or ``missing``; lent or read, and sent, in rounds."""
        hints = self._on_loop(self._sizes(keys))
        start = 0
        while start < len(keys):
            end, total = start, 0
            while end < len(keys) and (end == start or total + (hints[end] or 0) <= PEER_ROUND_BYTES):
                total += hints[end] or 0
                end += 1
            batch = keys[start:end]
            round_ = self._on_loop(self._take(batch, hints[start:end]))
            try:
                self._send_round(conn, batch, round_)
            finally:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self.store.return_ram, round_.loans, round_.buffers)
            start = end

    def _send_round(self, conn: socket.socket, keys: list[bytes], round_: _Round) -> None:
        for key, views, meta in zip(keys, round_.views, round_.metas):
            if views is None or meta is None:
                conn.sendall(w.frame(w.Item(w.Err("missing", "not held by this gateway"))))
                continue
            size = sum(len(v) for v in views)
            hasher = payload_hasher()
            for v in views:
                hasher.update(v)
            header = pack_header(key, size, hasher.intdigest(), meta)
            # counted as it is handed to the socket: a peer that has its last byte may ask for our status
            # before this thread would get past the send (a send that fails ends the connection anyway)
            with self._lock:
                self.served_objects += 1
                self.served_bytes += size
            w.send_all(conn, [w.frame(w.Item(), len(header) + size) + header, *views])

    # ---- on the loop ---------------------------------------------------------------

    async def _exists(self, keys: list[bytes]) -> w.Results:
        present = await self.store.exists(keys, NO_DIALOG, local=True)
        hints = self.store.size_hints(keys, NO_DIALOG)
        values = [(h if h is not None else True) if p else False for p, h in zip(present, hints)]
        return w.Results(values, [None] * len(values))

    async def _sizes(self, keys: list[bytes]) -> list[int | None]:
        return self.store.size_hints(keys, NO_DIALOG)

    async def _take(self, keys: list[bytes], hints: list[int | None]) -> _Round:
        """The round's objects: lent from the RAM tier where it holds them, else read from the cards into
        reply buffers; what to give back afterwards (``return_ram``)."""
        n = len(keys)
        out = _Round([None] * n, [None] * n)
        known = [i for i, h in enumerate(hints) if h is not None]
        out.loans = self.store.lend_ram([keys[i] for i in known], [hints[i] for i in known])  # type: ignore[misc]
        rest = []
        for i, loan in zip(known, out.loans):
            if loan is not None:
                out.views[i], out.metas[i] = loan.views, loan.entry.meta
            else:
                rest.append(i)
        if rest:
            out.buffers = self.store.reply_buffers.take([hints[i] for i in rest])  # type: ignore[misc]
            items = [GetItem(keys[i], NO_DIALOG, buf) for i, buf in zip(rest, out.buffers)]
            sizes, metas = await self.store.read_for_peer(items)
            for i, buf, size, meta in zip(rest, out.buffers, sizes, metas):
                if size >= 0:
                    out.views[i], out.metas[i] = [buf[:size]], meta
        return out


def _shown(addr) -> str:
    """An accepted connection's peer address as the log shows it: HOST:PORT, [V6]:PORT."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr)


def _shut(slot: _Slot) -> None:
    """Wake the connection's thread from its read (it then closes the socket): under ``PeerServer._lock``.
    The socket's own shutdown, also under TLS: ``SSLSocket.shutdown`` drops its TLS state, which the
    connection's thread may be using right now."""
    try:
        socket.socket.shutdown(slot.tls or slot.sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _send_quietly(conn: socket.socket, err: w.Err) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(w.frame(err))
    except OSError:
        pass


def _check_batch(keys: list[bytes]) -> None:
    if len(keys) > w.MAX_BATCH:
        raise w.WireError(f"batch of {len(keys)} objects is over the limit of {w.MAX_BATCH}")
    for k in keys:
        if not isinstance(k, bytes) or len(k) > 0xFFFF:
            raise w.WireError("a key that is not bytes, or is over 64 KiB")
