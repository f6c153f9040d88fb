"""The client of a kvgate gateway.

    c = Client.connect(namespace="my-model|tp1|bf16")
    c.put_many(keys, buffers)            # -> [True, ...]
    c.lookup(keys)                       # leading keys present
    c.get_many(keys, into=buffers)       # fills buffers; None for a miss

Over the Unix socket bulk bytes never cross the socket: they move through a
shared-memory region the gateway gives each session, or, with no copy at
all, through regions the client registers (``register_region``): any buffer
that lies inside a registered file mapping is read or written in place by
the gateway.  An object that lies in no registered region and is larger
than the session region travels inline in the frames instead, as all bytes
do over TCP.

Threads: a ``Client`` may be shared by threads, and its calls are
serialised: each call holds the client for its whole operation (the copies
into the session region, its requests, the copies out of it), so calls from
several threads behave exactly as if made one after another.  The session
(socket I/O, request ids, regions) is reached only through the client's
lock, so no call can touch it without holding the client.  Calls in
parallel need a client each.  ``abort`` may be called from any thread at
any time.

Arguments are checked before anything is sent: a wrong one raises
``TypeError`` or ``ValueError`` naming it, and the client stays usable.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Mapping, Sequence

from kvgate.client import core
from kvgate.client.args import Buffer  # noqa: F401  (imported from here)
from kvgate.client.wire import (  # noqa: F401  (GatewayError, ObjectTooLarge are imported from here)
    CLOSED_BY_GATEWAY,
    SEND_PARTS,
    Copy,
    GatewayError,
    GatewayUnavailable,
    ObjectTooLarge,
    Op,
    Recv,
    Send,
    Steps,
    call_failure,
    connect_failure,
    not_permitted,
)
from kvgate.keys import MARK_KEYS, DialogMark  # noqa: F401  (MARK_KEYS is imported from here)


class Client(core.ClientCore):
    """A kvgate client with blocking sockets; see the module docstring.

    Called from any thread.  Each call holds the client (a
    ``threading.Lock``) for its whole operation and performs its steps on
    the calling thread; the session is reached only through that lock
    (``Guarded``), so calls from several threads run one after another.
    ``abort`` may be called from any thread at any time and never waits.
    """

    def __init__(self, sock: socket.socket, local: bool):
        super().__init__(sock, local, threading.Lock())

    # ---- connecting -----------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        target: str | None = None,
        namespace: str = "",
        *,
        token: str | None = None,
        engine_id: str = "",
        role: str = "engine",
        salted: bool = False,
        timeout: float | None = 60.0,
        want_shm: bool = True,
        block_keys: str = "",
        block_size: int = 0,
        namespace_inputs: str | Mapping[str, Any] = "",
    ) -> "Client":
        """Connect and open a session.

        ``target``: a Unix socket path (``unix://...`` optional) or ``host:port``
        (``tcp://`` optional); None, the default: the socket a bare ``kvgate serve``
        listens on (``$XDG_RUNTIME_DIR/kvgate-5557.sock``, else ``/tmp/kvgate-5557.sock``).  ``engine_id`` names the engine
        (all processes of one engine share it); a gateway serves one engine.
        ``role="admin"`` opens a session for stats and clean only.

        Raises ``GatewayUnavailable`` when no gateway listens at ``target``,
        ``GatewayError`` when the gateway refuses the session (its code says
        why, e.g. TOO_MANY_CONNECTIONS, ENGINE_BUSY), and ``NotPermitted`` (a
        ``PermissionError``) saying who owns what when the socket or the
        session's region belongs to another user; all are ``KvgateError``.

        ``block_keys`` and ``block_size`` say how this engine's keys name KV blocks, for the KV events a
        gateway with ``kv_events_endpoint`` publishes: ``block_keys="vllm"`` when each key is a block hash
        followed by a 4-byte big-endian KV cache group index (vLLM's offloading key), ``""`` (the default)
        when the whole key is the block's hash (group 0); ``block_size`` the tokens each key covers (0:
        not said).  They change nothing else.

        ``namespace_inputs`` says what the namespace stands for (a JSON object or a mapping: model, dtype,
        layout, parallelism, as the engine derived its namespace from them): a gateway shows it to its peers,
        so that a peer whose engines run the same model another way is refused with the difference named
        in both gateways' logs, rather than asked in vain.  It changes nothing else.
        """
        hello = core.hello_op(namespace, token, engine_id, role, salted, want_shm, block_keys, block_size,
                              namespace_inputs)
        kind, addr = core.parse_target(target)
        where = addr if kind == "unix" else f"{addr[0]}:{addr[1]}"
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            try:
                sock = socket.create_connection(addr, timeout=timeout)
            except OSError as e:
                raise connect_failure(e, where) from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        try:
            if kind == "unix":
                try:
                    sock.connect(addr)
                except PermissionError as e:
                    raise not_permitted(addr, "connect to the gateway socket",
                                        "run the engine as the gateway's user (a member of the socket's "
                                        "group also needs the gateway's token, auth_token_file)") from e
                except OSError as e:
                    raise connect_failure(e, where) from e
            client = cls(sock, local=kind == "unix")
            if kind != "unix" and want_shm:
                hello = core.hello_op(namespace, token, engine_id, role, salted, False, block_keys, block_size,
                                      namespace_inputs)
            client._hello = client._run(hello)
        except BaseException:
            sock.close()
            raise
        return client

    def set_timeout(self, seconds: float | None) -> None:
        """Deadline of each later call (None: wait forever).

        A call that runs past it raises ``TimeoutError`` and leaves the client
        broken (the reply may still arrive and would be misread as the next
        one's), so callers reconnect after a timeout.
        """
        self._link.sock.settimeout(seconds)

    def close(self) -> None:
        self.abort()
        with self._session as session:
            session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- performing the steps of an operation ------------------------------------------

    def _run(self, operation: core.Operation) -> Any:
        with self._session as session:
            try:
                return _drive(session.sock, operation(session))
            except (ConnectionError, TimeoutError) as e:
                failure = call_failure(e)
                if failure is e:
                    raise
                raise failure from e

    def _request(self, msg, body: Sequence[Buffer] = ()) -> tuple[Any, Any]:
        """One request as the wire carries it: (reply, reply body), for tests that speak the protocol directly."""
        return self._run(lambda session: session.wire.call(msg, body))

    # ---- regions --------------------------------------------------------------------

    def register_region(self, path: str, mapping: Buffer | None = None) -> int:
        """Let the gateway map a /dev/shm file this process has mapped too.

        Buffers inside ``mapping`` (the client's own mapping of the same file)
        are then transferred in place, with no copy at all.
        """
        return self._run(core.register_region_op(path, mapping, self.local))

    # ---- operations --------------------------------------------------------------------

    def put_many(self, keys: Sequence[bytes | str], buffers: Sequence[Buffer], retention: str = "long",
                 dialog: bytes | None = None, position: int = -1) -> list[bool]:
        """Store each buffer under its key.  Returns, per key, whether it was stored.

        ``retention``: ``long`` (RAM tier and cards), ``short`` (RAM only),
        ``none`` (not stored).  ``dialog``: the dialog mark (placement and
        prefix-aware eviction); ``position``: index of keys[0] in its dialog
        (-1: none).  An object that must travel inline (over TCP, or over the
        Unix socket when it is in no registered region and larger than the
        session region) and does not fit in one of the gateway's frames is
        refused with ``GatewayError`` TOO_LARGE before anything is sent.
        """
        return self._run(core.put_many_op(keys, buffers, retention, dialog, position))

    def get_many(self, keys: Sequence[bytes | str], into: Sequence[Buffer] | None = None,
                 dialog: bytes | None = None, *, source: str | None = None) -> list:
        """Read objects.  Returns one entry per key, None for a miss.

        With ``into`` (one writable buffer per key), each hit is written into
        its buffer and the entry is a memoryview of the filled part; buffers
        inside a registered region are filled by the gateway in place, and
        inline results (TCP; over the Unix socket, a buffer in no registered
        region larger than the session region) are received from the socket
        straight into their buffer.  Without, each hit is returned as ``bytes``.
        An entry of ``into`` may be a list of buffers, filled in order (as
        ``os.readv`` does); its result is then the list of pieces filled.

        ``source`` (here and in ``lookup``, ``exists_many``): ``HOST:PORT`` or ``HOST`` where the request's KV
        was computed (vLLM's ``remote_kv_source``): the gateway then asks only its peers on that host for
        what it lacks, and no peer when none is there (docs/peers.md).
        """
        return self._run(core.get_many_op(keys, into, dialog, source))

    def lookup(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *, source: str | None = None) -> int:
        """How many leading keys are stored (a prefix restores up to its first miss)."""
        return self._run(core.lookup_op(keys, dialog, source))

    def exists_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None, *,
                    source: str | None = None) -> list[bool]:
        return self._run(core.exists_many_op(keys, dialog, source))

    def delete_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> int:
        return self._run(core.delete_many_op(keys, dialog))

    def hold_many(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> list[bool]:
        """Per key, whether it is present and now kept on its card until ``release_many``, this
        session's end or a minute without renewal (holding it again renews it); see docs/client.md."""
        return self._run(core.hold_many_op(keys, dialog))

    def release_many(self, keys: Sequence[bytes | str]) -> int:
        """End this session's holds on these keys; how many it held."""
        return self._run(core.release_many_op(keys))

    def prewarm(self, keys: Sequence[bytes | str], dialog: bytes | None = None) -> int:
        """Pull the stored leading keys from cards into the RAM tier; returns how many are in RAM."""
        return self._run(core.prewarm_op(keys, dialog))

    def dialog_mark(self, keys: Sequence[bytes | str]) -> DialogMark:
        """The dialog mark of a prompt from its leading keys (position 0 on), in one gateway call.

        The gateway takes the mark past any head shared by many dialogs (a
        system prompt) and learns such heads from the prompts it is shown, so
        call it once per request with the request's keys, and use the result
        for every put, get and lookup of that request (``DialogMark.spans``
        splits a batch into runs of one dialog: the shared head's segments,
        then the conversation).  Every gateway on the same cards gives the same
        answer for the same keys.
        """
        return self._run(core.dialog_mark_op(keys))

    def stats(self) -> dict:
        return self._run(core.stats_op())

    def clean(self, namespace: str | None = None) -> int:
        """Delete objects; returns how many.  An engine session deletes those of its own namespace (a
        ``namespace`` other than its own is ``NOT_AUTHORIZED``).  An ``admin`` session on the gateway's
        Unix socket deletes every namespace's, or only ``namespace``'s.  Refused with CLEAN_REFUSED when
        the cards are shared (``shared_storage``)."""
        return self._run(core.clean_op(namespace))

    def cards(self, action: str = "list", target: str = "", now: bool = False, force: bool = False) -> Any:
        """List or change the gateway's cards: ``"list"``, ``"add"`` (``target``: a directory or Redis URL),
        ``"drain"`` (``now``: leave at once), ``"undrain"``, ``"remove"`` (``target``: a serial).
        A removal (``drain`` with ``now``, ``remove``) that would leave no card in service, or drop objects a
        running drain is moving or has moved onto the card, is refused unless ``force``.

        Returns the ``CardsReply`` (``generation``, ``fingerprint``, ``cards``, ``message``).  Needs an
        ``admin`` session on the gateway's local socket; a change that cannot be made is a
        ``GatewayError`` saying why.
        """
        return self._run(core.cards_op(action, target, now, force))


def _drive(sock: socket.socket, op: Op) -> Any:
    """Perform the steps ``op`` yields on ``sock``, in this thread (which holds the client)."""
    steps = Steps(op)
    for step in steps:
        try:
            if type(step) is Recv:
                _recv_into(sock, step.view)
            elif type(step) is Send:
                while step.views:
                    step.advance(sock.sendmsg(step.views[:SEND_PARTS]))
            else:
                assert type(step) is Copy
                steps.value = step.fn()
        except BaseException as e:  # the operation decides what it means for the connection
            steps.error = e
    return steps.result


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise GatewayUnavailable(CLOSED_BY_GATEWAY)
        got += n
