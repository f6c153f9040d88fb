"""Who a peer is: the uid the kernel gives for a connection, and who may open a session without a token.

The gateway's own user (its effective uid) and root are trusted: a process
of either could read the gateway's memory and cards anyway.  Anyone else
needs the token of ``auth_token_file``.  The kernel tells the uid of a Unix
socket peer (``SO_PEERCRED``, ``unix_peer``) and of a loopback TCP peer: the
client's socket is a row of ``/proc/net/tcp`` (``tcp6``) whose local address
is the peer's and remote address ours, and the row's uid is the user who
made that socket (``tcp_peer_uid``).  Where that file does not tell (no
procfs, another network namespace's view), ``loopback_uids_visible`` says
so at start, and the gateway then opens no TCP listener without a token.

``unix_peer`` is called on the event loop (one ``getsockopt``).
``tcp_peer_uid`` and ``loopback_uids_visible`` read files and make
connections: they block, and run in a thread (``PeerLookups``), never on
the loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

_PEERCRED = struct.Struct("3i")
_PROC_NET = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}
_NATIVE_U32 = struct.Struct("=I")


def trusted_uid(uid: int | None) -> bool:
    """Whether ``uid`` gets a session without a token: the gateway's own user, or root."""
    return uid is not None and uid in (0, os.geteuid())


def unix_peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of a Unix socket's peer, as the kernel recorded them at connect."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def is_loopback_peer(address: str) -> bool:
    """Whether a TCP peer's address is loopback (127.0.0.0/8, ::1, or 127.x mapped into IPv6)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _proc_address(family: int, host: str, port: int) -> str:
    """``host:port`` as /proc/net/tcp writes it: the address's 32-bit words in host byte order, in hex."""
    raw = socket.inet_pton(family, host.split("%")[0])
    words = "".join(f"{_NATIVE_U32.unpack_from(raw, i)[0]:08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def tcp_peer_uids(peers: list[tuple[int, tuple, tuple]]) -> list[int | None]:
    """The uid owning the client end of each local TCP connection (None: no such socket in our network
    namespace).  Each is (address family, the accepted socket's own address (``getsockname``), its peer's
    (``getpeername``)).  Reads each family's /proc file once for all of them: blocks, call it in a thread.
    """
    wanted: dict[int, dict[tuple[bytes, bytes], int | None]] = {}
    rows = []
    for family, ours, theirs in peers:
        row = (_proc_address(family, theirs[0], theirs[1]).encode(), _proc_address(family, ours[0], ours[1]).encode())
        wanted.setdefault(family, {})[row] = None
        rows.append((family, row))
    for family, found in wanted.items():
        try:
            with open(_PROC_NET[family], "rb") as f:
                for line in f:
                    # sl local_address rem_address st tx:rx tr:tm retrnsmt uid ...
                    parts = line.split(None, 8)
                    if len(parts) > 7 and (parts[1], parts[2]) in found:
                        found[(parts[1], parts[2])] = int(parts[7])
        except (OSError, KeyError, ValueError):
            pass
    return [wanted[family][row] for family, row in rows]


def tcp_peer_uid(family: int, ours: tuple, theirs: tuple) -> int | None:
    """``tcp_peer_uids`` of one connection."""
    return tcp_peer_uids([(family, ours, theirs)])[0]


def loopback_uids_visible(hosts: list[str]) -> str | None:
    """None when the uid of a loopback TCP peer can be told on each address family of ``hosts``, else why not.

    Checked by connecting to a listener of our own on each and looking the connection up: it must
    come back as our own uid.  Blocks (connections, /proc): call it in a thread, once at start.
    """
    families = set()
    for host in hosts:
        try:
            for af, *_rest in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM):
                families.add(af)
        except OSError:
            continue
    if not sys.platform.startswith("linux"):
        return f"{_PROC_NET[socket.AF_INET]} is Linux's; this is {sys.platform}"
    for af in sorted(families & set(_PROC_NET)):
        where = "127.0.0.1" if af == socket.AF_INET else "::1"
        try:
            open(_PROC_NET[af], "rb").close()
        except OSError as e:
            return f"{_PROC_NET[af]} cannot be read: {e.strerror or e}"
        try:
            with socket.socket(af, socket.SOCK_STREAM) as srv:
                srv.bind((where, 0))
                srv.listen(1)
                with socket.create_connection(srv.getsockname()[:2], timeout=2.0) as cli:
                    srv.settimeout(2.0)
                    acc, _ = srv.accept()
                    with acc:
                        uid = tcp_peer_uid(af, acc.getsockname(), acc.getpeername())
        except OSError as e:
            return f"cannot connect to myself on {where} to check: {e.strerror or e}"
        if uid != os.geteuid():
            seen = "finds no row" if uid is None else f"says uid {uid}"
            return (f"{_PROC_NET[af]} {seen} for a connection of my own (uid {os.geteuid()}): the uid of a "
                    "loopback peer cannot be told here")
    return None


class PeerLookups:
    """Looks up loopback TCP peers' uids in a thread of its own, the lookups asked meanwhile in one read.

    Its own thread, not the ``IoPool``: a stream of tokenless connections must not take the card I/O
    threads, and each read of /proc answers every hello that waits (a flood of them costs a read per
    batch, not per hello).  A read costs about 5 us per socket of the network namespace, the kernel's
    formatting most of it: 12 ms with 2,354 sockets here, 17 ms for 100 lookups at once.  Used on the event loop by ``Sessions.admit`` (``uid``); ``close`` at stop.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvgate-peers")
        self._queue: list[tuple[int, tuple, tuple, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def uid(self, family: int, ours: tuple, theirs: tuple) -> int | None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((family, ours, theirs, fut))
        if self._drainer is None:
            self._drainer = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    uids = await loop.run_in_executor(self._pool, tcp_peer_uids, [q[:3] for q in batch])
                except Exception:  # noqa: BLE001 - unknown uids: those peers need the token
                    uids = [None] * len(batch)
                for (*_q, fut), u in zip(batch, uids):
                    if not fut.done():
                        fut.set_result(u)
        finally:
            self._drainer = None
            for *_q, fut in self._queue:  # cancelled (the gateway stops): nobody is let in unknown
                if not fut.done():
                    fut.set_result(None)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
