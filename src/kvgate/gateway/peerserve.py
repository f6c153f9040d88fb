"""The peer listener (``peer_listen``): what this gateway's tiers hold, read by peer gateways.

A peer's ``PeerTier`` (``kvgate.tiers.peertier``) is a network card on
``kvgate://HOST:PORT/peer``, so this listener speaks the network card's wire
(``kvgate.cards.network.wire``) and serves three requests: ``hello`` (serial
``peer`` and the token of ``peer_token_file``, compared in constant time),
``exists_many`` (answered with each present object's size where known, so
the peer sizes its read) and ``read_many``.  Anything else is refused and the
connection closed: a peer reads, it never writes, deletes or cleans.  An
object goes out as an object file (header with its key, length and payload
hash, then the payload), so the peer verifies every byte as it verifies a
card read.  Only this gateway's own tiers answer (``TieredStore.local``): a
pull is never passed on to this gateway's peers, so two gateways that list
each other never pull in a loop.

Bounds, against a peer that means harm or is merely broken: at most
``PEER_CONNECTIONS`` connections; a hello within ``hello_timeout``; every
frame's lengths checked before anything is read for them (requests carry no
body); a batch of at most ``MAX_BATCH`` keys; a ``read_many`` read in rounds
of at most ``PEER_ROUND_BYTES`` into reused buffers, each round written out
before the next is read, so a peer asking for 4,096 objects of 256 MiB
makes this gateway hold one round, not a terabyte.  Reads are not urgent
(the I/O pool's normal class): the local engine's reads go first.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging

from kvgate.cards.network import wire as w
from kvgate.cards.objectformat import pack_header
from kvgate.config import Config, read_token
from kvgate.keys import NO_DIALOG, payload_hash
from kvgate.tiers.io import IoPool
from kvgate.tiers.peertier import PEER_SERIAL
from kvgate.tiers.store import GetItem, TieredStore

log = logging.getLogger("kvgate.peers")

PEER_CONNECTIONS = 64  # a peer gateway holds two (its lookup and pull threads); room for a fleet
PEER_ROUND_BYTES = 64 << 20  # objects of one read_many read and sent at a time


class PeerRefused(Exception):
    """A request this listener does not serve: answered with ``err`` and the connection closed."""

    def __init__(self, err: w.Err) -> None:
        super().__init__(err.message)
        self.err = err


class PeerServer:
    """Serves ``store``'s own tiers to peer gateways on ``cfg.peer_listen`` (module docstring)."""

    def __init__(self, cfg: Config, store: TieredStore, pool: IoPool) -> None:
        assert cfg.peer_listen and cfg.peer_token_file  # (the config's checks)
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.token = read_token(cfg.peer_token_file, "'peer_token_file'")
        host, _, port = cfg.peer_listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.served_objects = 0
        self.served_bytes = 0
        self.refused = 0  # hellos refused (wrong token, not a peer) and requests a peer may not make

    async def start(self) -> None:
        """Listen; an ``OSError`` when the address cannot be had."""
        self.server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    def status(self) -> dict:
        return {"listen": f"{self.host}:{self.port}", "connections": self.connections,
                "served_objects": self.served_objects, "served_bytes": self.served_bytes, "refused": self.refused}

    # ---- one connection ----------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self.connections >= PEER_CONNECTIONS:
            self.refused += 1
            await self._send_err(writer, w.Err("unavailable", f"this gateway serves {PEER_CONNECTIONS} peer "
                                               "connections at most; try again later", errno.EBUSY))
            return
        self.connections += 1
        try:
            hello = await asyncio.wait_for(self._request(reader), self.cfg.hello_timeout)
            self._check_hello(hello)
            writer.write(w.frame(w.Ok({"max_object_bytes": self.cfg.max_frame_bytes})))
            await writer.drain()
            while True:
                msg = await self._request(reader)
                if isinstance(msg, w.ExistsMany):
                    _check_batch(msg.keys)
                    # each present object's size where known (the peer sizes its read by it), else true
                    present = await self.store.exists(msg.keys, NO_DIALOG, local=True)
                    hints = self.store.size_hints(msg.keys, NO_DIALOG)
                    values = [(h if h is not None else True) if p else False for p, h in zip(present, hints)]
                    writer.write(w.frame(w.Results(values, [None] * len(values))))
                    await writer.drain()
                elif isinstance(msg, w.ReadMany):
                    _check_batch(msg.keys)
                    await self._read_many(msg.keys, writer)
                elif isinstance(msg, w.Check):
                    writer.write(w.frame(w.Ok(PEER_SERIAL)))
                    await writer.drain()
                else:
                    raise PeerRefused(w.Err("bad_request", f"a peer listener serves exists_many and read_many, "
                                            f"not {type(msg).__name__}: peers only read each other's tiers"))
        except PeerRefused as e:
            self.refused += 1
            log.warning("peer %s refused: %s", peer, e.err.message)
            await self._send_err(writer, e.err)
        except w.WireError as e:
            self.refused += 1
            log.warning("peer %s broke the protocol: %s", peer, e)
            await self._send_err(writer, w.Err("bad_request", str(e)))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError):
            pass  # it went, or said nothing in time
        finally:
            self.connections -= 1
            writer.close()

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

    async def _request(self, reader: asyncio.StreamReader) -> w.Msg:
        prefix = await reader.readexactly(w.PREFIX.size)
        hlen, _blen = w.parse_prefix(prefix, w.MAX_REQUEST_HEADER, 0)  # no request of a peer has a body
        header = await asyncio.wait_for(reader.readexactly(hlen), self.cfg.frame_timeout)
        return w.decode_request(header)

    async def _send_err(self, writer: asyncio.StreamWriter, err: w.Err) -> None:
        try:
            writer.write(w.frame(err))
            await asyncio.wait_for(writer.drain(), 1.0)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            pass
        writer.close()

    async def _read_many(self, keys: list[bytes], writer: asyncio.StreamWriter) -> None:
        """One ``Item`` per key, in order: the object file, or ``missing``; read and sent in rounds."""
        hints = self.store.size_hints(keys, NO_DIALOG)
        start = 0
        while start < len(keys):
            end, total = start, 0
            while end < len(keys) and (end == start or total + (hints[end] or 0) <= PEER_ROUND_BYTES):
                total += hints[end] or 0
                end += 1
            await self._round(keys[start:end], hints[start:end], writer)
            start = end

    async def _round(self, keys: list[bytes], hints: list[int | None], writer: asyncio.StreamWriter) -> None:
        known = [i for i, h in enumerate(hints) if h is not None]
        buffers = self.store.reply_buffers.take([hints[i] for i in known])  # type: ignore[misc]
        try:
            items = [GetItem(keys[i], NO_DIALOG, buf) for i, buf in zip(known, buffers)]
            sizes, metas = await self.store.read_for_peer(items) if items else ([], [])
            views = {i: buf[:size] for i, buf, size in zip(known, buffers, sizes) if size >= 0}
            hashes = dict(zip(views, await self.pool.run(_hashes, list(views.values())))) if views else {}
            meta_of = dict(zip(known, metas))
            for i, key in enumerate(keys):
                view = views.get(i)
                if view is None:
                    writer.write(w.frame(w.Item(w.Err("missing", "not held by this gateway"))))
                    continue
                header = pack_header(key, len(view), hashes[i], meta_of[i])
                writer.write(w.frame(w.Item(), len(header) + len(view)))
                writer.write(header)
                writer.write(view)
                self.served_objects += 1
                self.served_bytes += len(view)
            await writer.drain()
        finally:
            # (a transport may still hold views of them: those go to the garbage collector, not to reuse)
            if writer.transport.get_write_buffer_size() == 0:
                self.store.reply_buffers.give(buffers)


def _hashes(views: list[memoryview]) -> list[int]:
    return [payload_hash(v) for v in views]


def _check_batch(keys: list[bytes]) -> None:
    if len(keys) > w.MAX_BATCH:
        raise w.WireError(f"batch of {len(keys)} objects is over the limit of {w.MAX_BATCH}")
    for k in keys:
        if not isinstance(k, bytes) or len(k) > 0xFFFF:
            raise w.WireError("a key that is not bytes, or is over 64 KiB")
