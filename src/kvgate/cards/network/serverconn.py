"""One connection of the card server (``kvgate.cards.network.server``): its thread, its frames, its requests.

A ``Connection`` reads requests off its socket in order and answers each
before it reads the next; its thread ends when the peer goes, stalls inside
a frame past ``frame_timeout``, or breaks the protocol (an ``Err`` naming
what was wrong, then the disconnect).  What it holds for its peer (a claim,
a listing, a snapshot being written) ends with it.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from kvgate.cards.network import wire as w
from kvgate.cards.base import WriteAbandoned
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.objectformat import ObjectMeta, header_size, padded_size
from kvgate.keys import payload_hash

if TYPE_CHECKING:
    from kvgate.cards.network.server import CardExporter

log = logging.getLogger("kvgate.cards.network.server")

# Bodies (payloads of a write) must arrive at least this fast once announced:
# a gateway below 4 MiB/s cannot feed an engine anyway (as the gateway's own frame_timeout).
_MIN_RATE = 4 << 20
_ZEROS = bytes(1 << 16)
_TLS_PIECE = 256 << 10  # an object file goes out over TLS in reads this large (no sendfile through TLS)
_TLS_HANDSHAKE = 0x16  # the first byte of every TLS connection (a handshake record)
# A claim held for a remote gateway is dropped this soon after its host goes silent.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 4}


def url_host(host: str) -> str:
    """The host part of a card URL for a listener bound to ``host`` (a wildcard: this host's name)."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def refuse(sock: socket.socket, why: str) -> None:
    try:
        sock.settimeout(1.0)
        sock.sendall(w.frame(w.Err("unavailable", why, errno.EBUSY)))
    except OSError:
        pass
    sock.close()


class Connection:
    """One client connection, served by its own thread, requests in order."""

    def __init__(self, ex: "CardExporter", sock: socket.socket, peer: Any):
        self.ex, self.sock, self.peer = ex, sock, peer
        self.card: DirectoryCard | None = None
        self.serial = ""
        self.claim: DirectoryCard | None = None
        self.names: Iterator[list[bytes]] | None = None
        self.snapshot = None
        self.snapshot_error: BaseException | None = None
        self.buf = bytearray()
        self.tls_buf: bytearray | None = None  # what object files are read into to go out over TLS
        self.thread = threading.Thread(target=self.run, name=f"kvgate-export-{peer}", daemon=True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def shutdown(self) -> None:
        try:
            # The socket's own shutdown, also under TLS: SSLSocket.shutdown drops its TLS state, which this
            # connection's thread may be using right now.
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def run(self) -> None:
        try:
            if self.ex.tls is None or self._start_tls():
                self._serve()
        except ssl.SSLError as e:
            log.warning("card server: TLS with client %s failed (%s); disconnected", self.peer, e.reason or e)
        except w.WireError as e:
            log.warning("card server: client %s broke the protocol (%s); disconnected", self.peer, e)
            self._send_quietly(w.to_err(e))
        except (OSError, TimeoutError) as e:  # gone, stalled, reset: only this connection ends
            log.debug("card server: connection of %s ended: %s", self.peer, e)
        except Exception:
            log.exception("card server: connection of %s failed", self.peer)
        finally:
            self._cleanup()
            self.ex.ended(self)

    def _start_tls(self) -> bool:
        """The TLS handshake, within ``frame_timeout``; a client speaking plain kvgate is told, in a plain
        frame, to use kvgates://.  False: the connection ends."""
        assert self.ex.tls is not None
        self.sock.settimeout(self.ex.frame_timeout)
        first = self.sock.recv(1, socket.MSG_PEEK)
        if not first:
            return False
        if first[0] != _TLS_HANDSHAKE:
            self._send_quietly(w.Err("unavailable", "this card server speaks TLS: reach its cards as kvgates://"
                                     "HOST:PORT/SERIAL (and set card_tls_ca_file to the CA of its certificate)",
                                     errno.EPROTO))
            return False
        self.sock = self.ex.tls.wrap_socket(self.sock, server_side=True)
        return True

    def _send_quietly(self, msg: w.Msg) -> None:
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(w.frame(msg))
        except OSError:
            pass

    def _cleanup(self) -> None:
        if self.snapshot is not None:
            self.snapshot.abort()
        if self.claim is not None:
            self.claim.close()  # the claim goes with the connection
        self.sock.close()

    # ---------------------------------------------------------------- frames

    def _read_frame(self, deadline: float | None) -> tuple[w.Msg, int, float]:
        """The next request and its body length; waits for its first byte as long as ``deadline`` allows."""
        prefix = bytearray(w.PREFIX.size)
        view = memoryview(prefix)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        self.sock.settimeout(left)
        n = self.sock.recv_into(view)
        if n == 0:
            raise ConnectionResetError("client closed the connection")
        start = time.monotonic()
        frame_deadline = start + self.ex.frame_timeout
        w.recv_exact(self.sock, view[n:], frame_deadline)
        max_body = w.MAX_BATCH * (self.ex.max_object_bytes + 1)
        hlen, blen = w.parse_prefix(prefix, w.MAX_REQUEST_HEADER, max_body)
        header = w.recv_body(self.sock, hlen, frame_deadline)
        msg = w.decode_request(header)
        return msg, blen, start + self.ex.frame_timeout + blen / _MIN_RATE

    def _send(self, msg: w.Msg, body: Any = b"") -> None:
        self.sock.settimeout(self.ex.send_timeout)
        w.send_all(self.sock, [w.frame(msg, len(body)), body])

    def _serve(self) -> None:
        msg, blen, _ = self._read_frame(time.monotonic() + self.ex.frame_timeout)
        if not isinstance(msg, w.Hello):
            raise w.WireError(f"the first request must be hello, got {type(msg).__name__}")
        if blen:
            raise w.WireError("hello carries no body")
        self.ex.count("hello")
        if self.ex.token is not None and (msg.token is None or not hmac.compare_digest(
                msg.token.encode(), self.ex.token.encode())):
            self.ex.count("refused_token")
            now = time.monotonic()
            if now - self.ex.refusal_logged >= 10:  # a peer that tries again and again fills no log
                self.ex.refusal_logged = now
                log.warning("card server: %s presented %s token: refused (%d refused so far)", self.peer,
                            "no" if msg.token is None else "a wrong", self.ex.requests["refused_token"])
            self._send(w.Err("unavailable", "this card server needs a valid token: set card_token_file on the "
                             "gateway to the file of kvgate export --token-file", errno.EACCES))
            return
        if msg.serial not in self.ex.by_serial:
            served = ", ".join(sorted(self.ex.by_serial)) or "none"
            self._send(w.Err("unavailable", f"this card server ({url_host(self.ex.host)}:{self.ex.port}) serves no "
                             f"card {msg.serial}; it serves {served}: check the kvgate:// URL", errno.ENOENT))
            return
        if not 1 <= msg.num_dbs <= 4096:
            raise w.WireError(f"num_dbs {msg.num_dbs} is not 1..4096")
        self.serial = msg.serial
        self.card = self.ex.card_for(msg.serial, msg.num_dbs)
        self._send(w.Ok({"serial": msg.serial, "max_object_bytes": self.ex.max_object_bytes}))
        while True:
            msg, blen, body_deadline = self._read_frame(None)
            op = type(msg).__name__
            self.ex.count(op)
            if isinstance(msg, w.WriteMany):
                self._write_many(msg, blen)
                continue
            if isinstance(msg, w.SnapshotPiece):
                self._snapshot_piece(blen, body_deadline)
                continue
            if blen:
                raise w.WireError(f"{op} carries no body, got {blen} bytes")
            if isinstance(msg, w.ReadMany):
                self._read_many(msg)
                continue
            handler = getattr(self, "_op_" + op, None)
            if handler is None:
                raise w.WireError(f"{op} is not a request after hello")
            try:
                reply, body = handler(msg)
            except w.WireError:
                raise
            except Exception as e:  # a card error: this request fails, the connection goes on
                reply, body = w.to_err(e), b""
            self._send(reply, body)

    # ------------------------------------------------------------------ reads

    def _read_many(self, msg: w.ReadMany) -> None:
        """One ``Item`` frame per key, in order; an object's frame body is its file, sent from the page cache."""
        _check_batch(msg.keys)
        assert self.card is not None
        paths = [self.card.object_path(k) for k in msg.keys]
        ahead = ReadAhead(paths)
        for i, path in enumerate(paths):
            ahead.before_sending(i)
            self._send_object(path)

    def _send_object(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._send(w.Item(self._missing(path)))
            return
        except OSError as e:
            self._send(w.Item(w.to_err(e)))
            return
        try:
            size = os.fstat(fd).st_size
            if size > self.ex.max_object_bytes:
                self._send(w.Item(w.Err("os", f"object file is {size} bytes, over the server's max_object_bytes "
                                        f"{self.ex.max_object_bytes}", errno.EFBIG, path)))
                return
            self.sock.settimeout(self.ex.send_timeout)
            self.sock.sendall(w.frame(w.Item(), size))
            if isinstance(self.sock, ssl.SSLSocket):
                sent = self._send_file_tls(fd, size)
            else:
                with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                    sent = self.sock.sendfile(f, 0, size) if size else 0
            # The file shrank since fstat (it never does for our writes; a damaged disk, a hand): the
            # announced length is kept with zeros and the client's check finds the object corrupt.
            while sent < size:
                k = min(len(_ZEROS), size - sent)
                self.sock.sendall(_ZEROS[:k])
                sent += k
        finally:
            os.close(fd)

    def _send_file_tls(self, fd: int, size: int) -> int:
        """The file's bytes through TLS (which has no sendfile), read in large pieces into one buffer."""
        if self.tls_buf is None:
            self.tls_buf = bytearray(_TLS_PIECE)
        view = memoryview(self.tls_buf)
        sent = 0
        while sent < size:
            k = os.preadv(fd, [view[: min(_TLS_PIECE, size - sent)]], sent)
            if k <= 0:
                break
            self.sock.sendall(view[:k])
            sent += k
        return sent

    def _missing(self, path: str) -> w.Err:
        card = self.card
        assert card is not None
        if not os.path.isdir(card.location):
            return w.Err("unavailable", "card directory is not accessible on the server", errno.ENOENT,
                         card.location)
        return w.Err("missing", f"no object {os.path.basename(path)}")

    # ----------------------------------------------------------------- writes

    def _write_many(self, msg: w.WriteMany, blen: int) -> None:
        """Each payload, then its publish byte, then ``DirectoryCard.write``; one ``Results`` at the end."""
        card = self.card
        assert card is not None
        items = msg.items
        if len(items) > w.MAX_BATCH:
            raise w.WireError(f"batch of {len(items)} objects is over the limit of {w.MAX_BATCH}")
        total = 0
        for it in items:
            if len(it.dialog) != 16 or len(it.key) > 0xFFFF:
                raise w.WireError("write item with a bad dialog digest or key length")
            # The object file a write makes: the same bound reads are held to (clients check it first).
            if not 0 <= it.payload_len <= self.ex.max_object_bytes - padded_size(header_size(it.key)):
                raise w.WireError(f"payload of {it.payload_len} bytes is over the server's max_object_bytes "
                                  f"{self.ex.max_object_bytes}")
            total += it.payload_len + 1
        if total != blen:
            raise w.WireError(f"write body is {blen} bytes, its items say {total}")
        values: list[Any] = []
        errors: list[w.Err | None] = []
        for it in items:
            if len(self.buf) < it.payload_len + 1:
                self.buf = bytearray(it.payload_len + 1)
            view = memoryview(self.buf)[: it.payload_len + 1]
            w.recv_exact(self.sock, view, time.monotonic() + self.ex.frame_timeout + it.payload_len / _MIN_RATE)
            payload, go = view[:-1], view[-1]
            try:
                if go != 1:
                    raise WriteAbandoned(card.location)
                if payload_hash(payload) != it.payload_hash:
                    raise OSError(errno.EIO, "payload damaged in transit (its hash differs from the client's); "
                                  "nothing written")
                meta = ObjectMeta(it.dialog, it.position, it.created_ns)
                values.append(card.write(it.key, payload, meta))
                errors.append(None)
            except Exception as e:
                values.append(None)
                errors.append(w.to_err(e))
        self._send(w.Results(values, errors))

    # ------------------------------------------------------------ the others

    def _op_Check(self, msg: w.Check) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        return w.Ok(self.card.check()), b""

    def _op_Claim(self, msg: w.Claim) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        if self.claim is None:
            claim = DirectoryCard(self.card.location, num_dbs=self.card.num_dbs, create_missing=False)
            claim.open()
        else:
            claim = self.claim
        try:
            claim.claim(msg.shared)
        except BaseException:
            if claim is not self.claim:
                claim.close()
            raise
        self.claim = claim
        for opt, value in _KEEPALIVE.items():  # a holder whose host vanished frees the card
            if hasattr(socket, opt):
                self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        holder = {k: msg.holder[k] for k in ("host", "boot", "pid", "mode") if k in msg.holder}
        claim.note_holder({**holder, "via": f"card server {url_host(self.ex.host)}:{self.ex.port}"})
        log.info("card %s claimed %s for %s (pid %s on host %s)", self.serial,
                 "shared" if msg.shared else "exclusively", self.peer, holder.get("pid"), holder.get("host"))
        return w.Ok(), b""

    def _op_CheckWritable(self, msg: w.CheckWritable) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        self.card.check_writable()
        return w.Ok(), b""

    def _op_ExistsMany(self, msg: w.ExistsMany) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        _check_batch(msg.keys)
        return _results(self.card.exists_many(msg.keys, msg.not_before_ns)), b""

    def _op_DeleteNamed(self, msg: w.DeleteNamed) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        _check_batch(msg.digests, 16)
        out: list[Any] = []
        for d in msg.digests:
            try:
                out.append(self.card.delete_named(d))
            except OSError as e:
                out.append(e)
        return _results(out), b""

    def _op_Discard(self, msg: w.Discard) -> tuple[w.Msg, bytes]:
        """Delete a corrupt object, unless it was replaced since the client saw it."""
        assert self.card is not None
        path = self.card.object_path(msg.key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return w.Ok(False), b""
        try:
            same = os.fstat(fd).st_size == msg.size and os.pread(fd, len(msg.seen), 0) == msg.seen
        finally:
            os.close(fd)
        if same:
            try:
                os.unlink(path)
            except OSError:
                same = False
        return w.Ok(same), b""

    def _op_Names(self, msg: w.Names) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        self.names = self.card.names()
        return w.Ok(), b""

    def _op_NamesNext(self, msg: w.NamesNext) -> tuple[w.Msg, bytes]:
        if self.names is None:
            raise w.WireError("names_next without names")
        batch = next(self.names, None)
        if batch is None:
            self.names = None
            return w.Ok(None), b""
        return w.Ok(True), b"".join(batch)

    def _op_StoredObjects(self, msg: w.StoredObjects) -> tuple[w.Msg, bytes]:
        card = self.card
        assert card is not None
        _check_batch(msg.digests, 16)
        before = card.scan_corrupt
        found = card.stored_objects(msg.digests)
        rows = [None if s is None else [s.full_key, s.payload_len, s.stored_bytes, s.meta.dialog, s.meta.position,
                                        s.meta.created_ns] for s in found]
        # Counted on the shared card object: another connection's scan at the same time may be counted here.
        return w.Ok({"objects": rows, "corrupt": max(0, card.scan_corrupt - before)}), b""

    def _op_SnapshotBegin(self, msg: w.SnapshotBegin) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        if self.snapshot is not None:
            self.snapshot.abort()
        self.snapshot, self.snapshot_error = None, None
        self.snapshot = self.card.snapshot_writer()
        return w.Ok(), b""

    def _snapshot_piece(self, blen: int, deadline: float) -> None:
        """Pieces get no reply (no round trip each); a failure is kept for the commit's reply."""
        if blen > w.SNAPSHOT_PIECE:
            raise w.WireError(f"snapshot piece of {blen} bytes is over the limit of {w.SNAPSHOT_PIECE}")
        data = w.recv_body(self.sock, blen, deadline)
        if self.snapshot is None:
            raise w.WireError("snapshot_piece without snapshot_begin")
        if self.snapshot_error is None:
            try:
                self.snapshot.write(data)
            except OSError as e:
                self.snapshot_error = e

    def _op_SnapshotCommit(self, msg: w.SnapshotCommit) -> tuple[w.Msg, bytes]:
        writer, self.snapshot = self.snapshot, None
        if writer is None:
            raise w.WireError("snapshot_commit without snapshot_begin")
        if self.snapshot_error is not None:
            writer.abort()
            raise self.snapshot_error
        writer.commit()
        return w.Ok(), b""

    def _op_SnapshotAbort(self, msg: w.SnapshotAbort) -> tuple[w.Msg, bytes]:
        writer, self.snapshot = self.snapshot, None
        if writer is not None:
            writer.abort()
        return w.Ok(), b""

    def _op_ReadSnapshot(self, msg: w.ReadSnapshot) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        data = self.card.read_snapshot()
        return w.Ok(data is not None), data or b""

    def _op_DropSnapshot(self, msg: w.DropSnapshot) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        self.card.drop_snapshot()
        return w.Ok(), b""

    def _op_Clean(self, msg: w.Clean) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        return w.Ok(self.card.clean()), b""

    def _op_FreeBytes(self, msg: w.FreeBytes) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        return w.Ok(self.card.free_bytes()), b""

    def _op_MergeHeads(self, msg: w.MergeHeads) -> tuple[w.Msg, bytes]:
        assert self.card is not None
        if len(msg.ids) > w.MAX_HEADS or any(not 0 <= i < 1 << 64 for i in msg.ids):
            raise w.WireError(f"merge_heads of {len(msg.ids)} ids, over {w.MAX_HEADS} or not u64s")
        return w.Ok(sorted(self.card.heads.merge(msg.ids))), b""


class ReadAhead:
    """Has the kernel read the next objects of a batch from the disk while the one before them is sent.

    ``sendfile`` of a file not in the page cache reads it with the file's own
    readahead, which starts small and one file at a time: batches of 32 cold
    objects of 2 MiB went out at 0.66-0.72 GiB/s (0.48-0.79 of the server's
    raw ``O_DIRECT`` read of them); with ``POSIX_FADV_WILLNEED`` on the next
    ``AHEAD_BYTES``, 0.87-1.0 GiB/s (``kvgate bench --network``, three runs
    each).  On pages already cached it costs a lookup.
    """

    AHEAD_BYTES = 32 << 20

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.advised = 0  # paths[:advised] were advised
        self.ends: list[int] = []  # bytes advised up to and including each advised path

    def before_sending(self, i: int) -> None:
        sent_before = self.ends[i - 1] if i else 0
        while self.advised < len(self.paths) and (self.advised <= i + 1 or
                                                  self.ends[-1] - sent_before < self.AHEAD_BYTES):
            size = 0
            try:
                fd = os.open(self.paths[self.advised], os.O_RDONLY)
            except OSError:
                pass  # missing: its Item says so when its turn comes
            else:
                try:
                    size = os.fstat(fd).st_size
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                finally:
                    os.close(fd)
            self.ends.append((self.ends[-1] if self.ends else 0) + size)
            self.advised += 1


def _check_batch(keys: list[bytes], exact: int | None = None) -> None:
    if len(keys) > w.MAX_BATCH:
        raise w.WireError(f"batch of {len(keys)} objects is over the limit of {w.MAX_BATCH}")
    for k in keys:
        if (exact is not None and len(k) != exact) or len(k) > 0xFFFF:
            raise w.WireError(f"a key or digest of {len(k)} bytes")


def _results(out: list[Any]) -> w.Results:
    values = [None if isinstance(v, BaseException) else v for v in out]
    errors = [w.to_err(v) if isinstance(v, BaseException) else None for v in out]
    return w.Results(values, errors)
