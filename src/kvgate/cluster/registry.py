"""The card registry of a cluster, kept in etcd: the cards, their states, and the view every gateway follows.

Layout under the cluster's prefix ``/kvgate/<cluster>/``::

    cards/<serial>   a CardRecord (JSON): the card's kind, address, capacity,
                     weight and state; written by the leader, never leased,
                     so a registration never disappears because an agent
                     went quiet
    alive/<serial>   the agent that serves the card says it is alive, under
                     its lease: liveness only ever changes a card's health
    view             the View the leader publishes: an epoch, the serials in
                     service and the slot owners computed from them
    agents/<name>    {"host", "pid", "cards": [serials], "export": address or
                     null, "etcd_member": name or null}, under the agent's lease
    gateways/<id>    a GatewayReport, under the gateway's lease: the epoch it
                     applied, its layout fingerprint, the draining cards it
                     has copied away (the leader's cue that a drain is done),
                     the address it serves peers on (where the other gateways
                     of its layout pull from)

The leader is elected with etcd3aio's ``Election`` layout
(``__etcd3aio:election/<prefix>leader/<lease hex>``, the candidate created
first leads), so ``client.election(prefix + "leader").leader()`` names it too;
the agent campaigns under its one lease, so its leadership lapses with its
liveness.

A card's ``state`` moves ``joining -> active -> draining -> drained ->
retired`` (``draining -> active`` when undrained).  The view holds the cards
that take slots (``joining`` and ``active``: a joining card takes its share
at once, as a card added by hand does) and the ones still read
(``draining``); slots are assigned by rendezvous hashing over serials
(``kvgate.placement.SlotMap``), so the map depends on the set of cards only,
never on the order they registered in.

Every etcd call is bounded (``call_timeout_s``, 0.5 s by default) and made
once: a gateway polls again a second later rather than waiting on a
partitioned etcd.  A call that fails raises ``RegistryUnavailable``.

Runs on the event loop of its owner (an agent, a gateway); no method blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import grpc
import msgspec
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
from etcd3aio import SortOrder, SortTarget
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService

from kvgate.cards import kind_of
from kvgate.placement import SlotMap
from kvgate.errors import KvgateError

CALL_TIMEOUT_S: Final = 0.5
# etcd3aio's Election keys: "__etcd3aio:election/<name>/<lease id, 16 hex digits>".
ELECTION_PREFIX: Final = b"__etcd3aio:election/"


class CardState(str, Enum):
    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    RETIRED = "retired"


# Which state may follow which (an operator's drain, undrain and retire; the leader's join and drained).
NEXT_STATES: Final = {
    CardState.JOINING: {CardState.ACTIVE, CardState.DRAINING, CardState.RETIRED},
    CardState.ACTIVE: {CardState.DRAINING},
    CardState.DRAINING: {CardState.ACTIVE, CardState.DRAINED},
    CardState.DRAINED: {CardState.ACTIVE, CardState.RETIRED},
    CardState.RETIRED: set(),
}
TAKES_SLOTS: Final = (CardState.JOINING, CardState.ACTIVE)
READ: Final = (CardState.JOINING, CardState.ACTIVE, CardState.DRAINING)


class CardRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One card as the registry knows it."""

    serial: str
    kind: str  # "directory", "redis", "kvgate" (a card an agent serves over the network)
    address: str  # where a gateway reaches it: a path glob, a redis:// or kvgate:// URL
    capacity: int = 0  # bytes; 0: as the card reports
    weight: float = 1.0
    state: CardState = CardState.JOINING


class View(msgspec.Struct, frozen=True, kw_only=True):
    """What the leader publishes: the cards a gateway uses and where each slot is."""

    epoch: int
    slots: int
    cards: tuple[CardRecord, ...]  # the cards read: joining, active, draining (sorted by serial)
    owners: tuple[str | None, ...]  # per slot, the serial of the card it is on

    @classmethod
    def of(cls, epoch: int, records: list[CardRecord], slots: int) -> View:
        """The view of ``records`` (any order) over ``slots`` slots."""
        read = sorted((r for r in records if r.state in READ), key=lambda r: r.serial)
        slot_map = SlotMap([r.serial for r in read if r.state in TAKES_SLOTS], slots)
        return cls(epoch=epoch, slots=slots, cards=tuple(read), owners=slot_map.owner)

    def same_layout(self, other: View) -> bool:
        """Whether ``other`` places every key where this one does and reads the same cards."""
        return self.owners == other.owners and self.cards == other.cards


class GatewayReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a gateway in cluster mode says of itself (``gateways/<id>``, under its lease)."""

    epoch: int  # of the view it applied
    fingerprint: str = ""  # its key layout fingerprint: gateways of one epoch must agree
    drained: tuple[str, ...] = ()  # cards the view has draining that this gateway holds nothing of
    peer: str = ""  # HOST:PORT other gateways pull from (peer_advertise or peer_listen); "": it serves no peers


@dataclass(frozen=True, slots=True)
class Observed:
    """What a gateway reads each poll, at one revision of the registry."""

    view: View | None
    alive: frozenset[str]  # serials of the cards an agent reports alive now
    gateways: dict[str, GatewayReport]


class RegistryUnavailable(KvgateError, ConnectionError):
    """etcd did not answer within the call's bound (or refused); says which call."""


class LeaderEntry(msgspec.Struct, frozen=True):
    """The election's first candidate: its key, what it posted (the agent's name) and when it was created."""

    key: bytes
    name: str
    create_revision: int


class RegistryConflict(KvgateError, ValueError):
    """A change that does not apply to the registry as it is now (unknown serial, a state that cannot
    follow, a view published over a newer one); says why."""


_encoder = msgspec.json.Encoder()
_card_decoder = msgspec.json.Decoder(CardRecord)
_view_decoder = msgspec.json.Decoder(View)
_report_decoder = msgspec.json.Decoder(GatewayReport)


ROOT: Final = b"/kvgate/"  # every cluster's keys are under ROOT + its name + "/"


def etcd_client(endpoints: Sequence[str]) -> Etcd3Client:
    """A client of ``endpoints`` (not connected yet) that makes each call once and reconnects quickly.

    gRPC waits up to 2 minutes between reconnects to an endpoint that failed: after an etcd outage an agent
    must be back well within a liveness TTL of etcd's return (or its cards would look dead for longer), and
    a gateway should see new views as soon as etcd answers.  The options go on the client's channel
    options, which etcd3aio 0.3 keeps in a private attribute: where that changes, the default backoff stays.
    """
    client = Etcd3Client(list(endpoints), rpc_max_attempts=1)
    options = getattr(getattr(client, "_manager", None), "grpc_options", None)
    if isinstance(options, list):
        options += [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                    ("grpc.max_reconnect_backoff_ms", 1000)]
    return client


async def _watch_stream(client: Etcd3Client, key: bytes, end: bytes | None, wake: Callable[[], None]) -> None:
    """One etcd watch of ``key`` (to ``end``): ``wake()`` at each response, until the stream ends or breaks
    (its ``grpc.RpcError`` raised) or the caller is cancelled; the stream is closed either way.

    On the client's Watch stub, not ``etcd3aio``'s ``watch()``: that one reconnects by itself (a warning per
    attempt, twice per watch, through an etcd outage), and gives gRPC a request generator that waits forever,
    so each stream an outage broke left its request task pending on a call nobody holds: garbage collected
    later as asyncio's "Task was destroyed but it is pending!".  Here the requests end with the stream, and
    a broken watch is the caller's to make again (the follower does, after a poll).
    """
    from etcd3aio._protobuf import WatchCreateRequest, WatchRequest  # etcd3aio 0.3; see the docstring

    closed = asyncio.Event()

    async def requests() -> AsyncIterator[Any]:
        yield WatchRequest(create_request=WatchCreateRequest(key=key, range_end=end or b""))
        await closed.wait()

    if client.watch is None:
        raise RegistryUnavailable("the etcd client is not connected")
    call = client.watch._stub.Watch(requests())  # noqa: SLF001 (see the docstring)
    try:
        async for _ in call:
            wake()
    finally:
        closed.set()
        call.cancel()


class Registry:
    """The registry of one cluster in etcd (module docstring), over a connected ``Etcd3Client``."""

    def __init__(self, client: Etcd3Client, cluster: str = "default", call_timeout_s: float = CALL_TIMEOUT_S):
        if not cluster or "/" in cluster:
            raise ValueError(f"cluster name {cluster!r}: a non-empty name without '/'")
        self.client = client
        self.prefix = ROOT + cluster.encode() + b"/"
        self.call_timeout_s = call_timeout_s
        # every call made, its time, and the ones that failed (status and metrics)
        self.calls = 0
        self.call_seconds = 0.0
        self.failed_calls = 0

    @property
    def _kv(self) -> KVService:
        if self.client.kv is None:
            raise RegistryUnavailable("the etcd client is not connected")
        return self.client.kv

    @property
    def _lease(self) -> LeaseService:
        if self.client.lease is None:
            raise RegistryUnavailable("the etcd client is not connected")
        return self.client.lease

    def _card_key(self, serial: str) -> bytes:
        if not serial or "/" in serial:
            raise ValueError(f"card serial {serial!r}: a non-empty name without '/'")
        return self.prefix + b"cards/" + serial.encode()

    async def _call(self, what: str, coro):
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await coro
        except grpc.aio.AioRpcError as e:  # what etcd3aio passes on as it is: a lapsed lease (NOT_FOUND), a stream
            self.failed_calls += 1
            raise RegistryUnavailable(f"etcd {what}: {e.code().name}: {e.details() or 'no detail'}") from None
        except (TimeoutError, EtcdError, grpc.RpcError) as e:
            self.failed_calls += 1
            raise RegistryUnavailable(f"etcd {what}: {type(e).__name__}: {str(e) or 'no answer'} "
                                      f"(bound {self.call_timeout_s:g} s)") from None
        finally:
            self.calls += 1
            self.call_seconds += time.perf_counter() - t0

    async def exists(self) -> bool:
        """Whether etcd holds anything of this cluster: a card, a view, a report of an agent or a gateway."""
        resp = await self._call("look for the cluster", self._kv.get(
            self.prefix, prefix_range_end(self.prefix), count_only=True, max_attempts=1))
        return resp.count > 0

    async def clusters(self) -> list[str]:
        """The names of the clusters etcd holds anything of: one keys-only read of every cluster's keys (a
        command's question, never a gateway's poll)."""
        resp = await self._call("list the clusters", self._kv.get(
            ROOT, prefix_range_end(ROOT), keys_only=True, max_attempts=1))
        return sorted({kv.key[len(ROOT):].split(b"/", 1)[0].decode(errors="replace") for kv in resp.kvs})

    # ---- cards -----------------------------------------------------------------

    async def cards(self) -> list[CardRecord]:
        """Every registered card, by serial."""
        start = self.prefix + b"cards/"
        resp = await self._call("read cards", self._kv.get(start, prefix_range_end(start), max_attempts=1))
        return sorted((_card_decoder.decode(kv.value) for kv in resp.kvs), key=lambda r: r.serial)

    async def card(self, serial: str) -> CardRecord | None:
        found = await self._card_raw(serial)
        return None if found is None else found[0]

    async def _card_raw(self, serial: str) -> tuple[CardRecord, bytes] | None:
        """The card's record and its stored bytes (what a change compares), or None."""
        resp = await self._call(f"read card {serial}", self._kv.get(self._card_key(serial), max_attempts=1))
        if not resp.kvs:
            return None
        return _card_decoder.decode(resp.kvs[0].value), resp.kvs[0].value

    async def register(self, record: CardRecord) -> bool:
        """Add a card (state ``joining``); False when its serial is registered already (left as it is)."""
        key = self._card_key(record.serial)
        kv = self._kv
        record = msgspec.structs.replace(record, state=CardState.JOINING)
        resp = await self._call(f"register card {record.serial}", kv.txn(
            [kv.txn_compare_version(key, 0)], [kv.txn_op_put(key, _encoder.encode(record))], max_attempts=1))
        return bool(resp.succeeded)

    async def set_address(self, serial: str, address: str) -> CardRecord:
        """Where gateways reach the card from now on (a moved mount, a server on another port, the primary
        a resharded Redis Cluster moved the card's slot to); the record as written.  The card keeps its
        serial, state and objects: each gateway finds it at ``address`` by its label."""
        found = await self._card_raw(serial)
        if found is None:
            raise RegistryConflict(f"no card with serial {serial!r} in the registry")
        record, raw = found
        if record.state is CardState.RETIRED:
            raise RegistryConflict(f"card {serial} is retired: register it again instead")
        if address == record.address:
            return record
        new = msgspec.structs.replace(record, address=address, kind=kind_of(address))
        key = self._card_key(serial)
        kv = self._kv
        resp = await self._call(f"change card {serial}", kv.txn(
            [kv.txn_compare_value(key, raw)], [kv.txn_op_put(key, _encoder.encode(new))], max_attempts=1))
        if not resp.succeeded:
            raise RegistryConflict(f"card {serial} changed meanwhile: read it again")
        return new

    async def set_state(self, serial: str, state: CardState, guard: Sequence[Any] = ()) -> CardRecord:
        """Move the card to ``state`` if that may follow its state now; the record as written.

        ``guard``: more compares the change needs (the leader's: ``leadership``)."""
        found = await self._card_raw(serial)
        if found is None:
            raise RegistryConflict(f"no card with serial {serial!r} in the registry")
        record, raw = found
        if state == record.state:
            return record
        if state not in NEXT_STATES[record.state]:
            raise RegistryConflict(f"card {serial} is {record.state.value}: it cannot become {state.value}")
        new = msgspec.structs.replace(record, state=state)
        key = self._card_key(serial)
        kv = self._kv
        resp = await self._call(f"change card {serial}", kv.txn(
            [kv.txn_compare_value(key, raw), *guard], [kv.txn_op_put(key, _encoder.encode(new))],
            max_attempts=1))
        if not resp.succeeded:
            raise RegistryConflict(f"card {serial} changed meanwhile{' or the leader changed' if guard else ''}: "
                                   "read it again")
        return new

    # ---- the view ----------------------------------------------------------------

    async def view(self) -> View | None:
        """The view the leader published last, or None before the first."""
        resp = await self._call("read the view", self._kv.get(self.prefix + b"view", max_attempts=1))
        return _view_decoder.decode(resp.kvs[0].value) if resp.kvs else None

    async def publish(self, view: View, guard: Sequence[Any] = ()) -> None:
        """Publish ``view``; its epoch must be the published one's plus one (the first: 1)."""
        key = self.prefix + b"view"
        kv = self._kv
        current = await self.view()
        expected = 0 if current is None else current.epoch
        if view.epoch != expected + 1:
            raise RegistryConflict(f"view epoch {view.epoch} does not follow the published epoch {expected}")
        compare = (kv.txn_compare_version(key, 0) if current is None
                   else kv.txn_compare_value(key, _encoder.encode(current)))
        resp = await self._call(f"publish view {view.epoch}", kv.txn(
            [compare, *guard], [kv.txn_op_put(key, _encoder.encode(view))], max_attempts=1))
        if not resp.succeeded:
            raise RegistryConflict(f"view {view.epoch} not published: another view was published meanwhile"
                                   f"{' or the leader changed' if guard else ''}")

    async def publish_next(self, slots: int, guard: Sequence[Any] = ()) -> tuple[list[CardRecord], View | None]:
        """What the leader (and ``kvgate cluster publish``) does: make the joining cards active, then publish
        the next view if its layout differs from the published one's; (the cards made active, the view
        published or None).

        A joining card becomes active at once: it takes its slots from the first view that has it either
        way (``TAKES_SLOTS``), and nothing has to happen on it first (its slots' misses ask the cards of
        before while the gateways' movers settle); ``joining`` only says "registered, in no view yet".
        """
        activated = []
        for r in await self.cards():
            if r.state is CardState.JOINING:
                activated.append(await self.set_state(r.serial, CardState.ACTIVE, guard))
        records = await self.cards()
        current = await self.view()
        view = View.of((current.epoch if current else 0) + 1, records, slots)
        if current is not None and current.slots == slots and current.same_layout(view):
            return activated, None
        await self.publish(view, guard)
        return activated, view

    # ---- what gateways read and report ----------------------------------------------

    async def observe(self) -> Observed:
        """The view, the cards reported alive and the gateways' reports, in one read (one revision)."""
        resp = await self._call("read the registry", self._kv.get(
            self.prefix, prefix_range_end(self.prefix), max_attempts=1))
        view, alive, gateways = None, set(), {}
        n = len(self.prefix)
        for kv in resp.kvs:
            name = kv.key[n:]
            try:
                if name == b"view":
                    view = _view_decoder.decode(kv.value)
                elif name.startswith(b"alive/"):
                    alive.add(name[6:].decode())
                elif name.startswith(b"gateways/"):
                    gateways[name[9:].decode()] = _report_decoder.decode(kv.value)
            except (msgspec.DecodeError, UnicodeDecodeError) as e:
                if name == b"view":  # the one value a gateway cannot do without: say so, do not guess
                    raise RegistryConflict(f"the published view is not readable: {e}") from None
        return Observed(view=view, alive=frozenset(alive), gateways=gateways)

    async def changes(self) -> AsyncIterator[None]:
        """One item per change of the view or of a card's liveness report (a watch: unbounded by design;
        it can miss what happened while it was down, so its readers poll as well).  Raises
        ``RegistryUnavailable`` when the watch breaks."""
        if self.client.watch is None:
            raise RegistryUnavailable("the etcd client is not connected")
        alive = self.prefix + b"alive/"
        queue: asyncio.Queue[BaseException | None] = asyncio.Queue(maxsize=1)

        def wake() -> None:
            if queue.empty():  # one pending wake is as good as many
                queue.put_nowait(None)

        async def follow(key: bytes, end: bytes | None) -> None:
            try:
                await _watch_stream(self.client, key, end, wake)
                why: BaseException = RegistryUnavailable("etcd watch: the stream ended")
            except (EtcdError, grpc.RpcError, OSError) as e:
                why = RegistryUnavailable(f"etcd watch: {type(e).__name__}: {e}")
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(why)

        tasks = [asyncio.create_task(follow(self.prefix + b"view", None)),
                 asyncio.create_task(follow(alive, prefix_range_end(alive)))]
        try:
            while True:
                item = await queue.get()
                if item is not None:
                    raise item
                yield None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their streams closed before the watch ends

    # ---- leases, liveness and reports ------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd rounds short ones up to its minimum, about 2 s)."""
        resp = await self._call(f"grant a {ttl_s} s lease", self._lease.grant(ttl_s, max_attempts=1))
        return int(resp.ID)

    async def keep_alive(self, lease: int) -> int:
        """Renew ``lease`` once; the seconds it has left (0: it lapsed, its keys are gone)."""
        call = self._lease.keep_alive(lease)

        async def first() -> int:
            async for resp in call:
                return int(resp.TTL)
            return 0

        try:
            return await self._call(f"keep lease {lease:x} alive", first())
        finally:
            call.cancel()

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key under it goes at once."""
        await self._call(f"revoke lease {lease:x}", self._lease.revoke(lease, max_attempts=1))

    async def _put(self, what: str, key: bytes, doc: Any, lease: int) -> None:
        await self._call(what, self._kv.put(key, _encoder.encode(doc), lease=lease, max_attempts=1))

    async def _docs(self, what: str, folder: bytes) -> dict[str, Any]:
        start = self.prefix + folder
        resp = await self._call(what, self._kv.get(start, prefix_range_end(start), max_attempts=1))
        docs = {}
        for kv in resp.kvs:
            try:
                docs[kv.key[len(start):].decode()] = msgspec.json.decode(kv.value)
            except msgspec.DecodeError:  # a writer's bug: kept (it is there), but as nothing it says
                docs[kv.key[len(start):].decode()] = None
        return docs

    async def report_alive(self, lease: int, serial: str, doc: dict[str, Any]) -> None:
        """``alive/<serial>`` = ``doc`` ({"agent", "address"}) under ``lease``."""
        self._card_key(serial)  # checks the serial
        await self._put(f"report card {serial} alive", self.prefix + b"alive/" + serial.encode(), doc, lease)

    async def withdraw_alive(self, serial: str) -> None:
        self._card_key(serial)
        await self._call(f"withdraw card {serial}'s liveness",
                         self._kv.delete(self.prefix + b"alive/" + serial.encode(), max_attempts=1))

    async def alive(self) -> dict[str, dict[str, Any]]:
        """Serial -> {"agent", "address"} of every card an agent reports alive."""
        return await self._docs("read alive cards", b"alive/")

    async def report_agent(self, lease: int, name: str, doc: dict[str, Any]) -> None:
        """``agents/<name>`` = ``doc`` under ``lease``."""
        if not name or "/" in name:
            raise ValueError(f"agent name {name!r}: a non-empty name without '/'")
        await self._put(f"report agent {name}", self.prefix + b"agents/" + name.encode(), doc, lease)

    async def agents(self) -> dict[str, dict[str, Any]]:
        """Name -> report of every agent whose lease holds."""
        return await self._docs("read agents", b"agents/")

    async def report_gateway(self, lease: int, gateway: str, doc: GatewayReport | dict[str, Any]) -> None:
        """``gateways/<id>`` = ``doc`` (a ``GatewayReport``) under ``lease`` (the gateway's)."""
        if not gateway or "/" in gateway:
            raise ValueError(f"gateway id {gateway!r}: a non-empty name without '/'")
        await self._put(f"report gateway {gateway}", self.prefix + b"gateways/" + gateway.encode(), doc, lease)

    async def gateway_reports(self) -> dict[str, dict[str, Any]]:
        """Gateway id -> its ``GatewayReport`` as a dict, of every gateway whose lease holds."""
        return await self._docs("read gateway reports", b"gateways/")

    # ---- the leader ----------------------------------------------------------------------

    @property
    def election_prefix(self) -> bytes:
        return ELECTION_PREFIX + self.prefix + b"leader/"

    async def campaign(self, lease: int, name: str) -> bytes:
        """Stand for leader under ``lease`` (once per lease: a put again keeps the candidate's place);
        the candidate's key.  It leads when ``leader_entry`` returns it."""
        key = self.election_prefix + f"{lease:016x}".encode()
        await self._call(f"campaign as {name}", self._kv.put(key, name.encode(), lease=lease, max_attempts=1))
        return key

    async def resign(self, key: bytes) -> None:
        await self._call("resign", self._kv.delete(key, max_attempts=1))

    async def leader_entry(self) -> LeaderEntry | None:
        """The candidate that leads (created first), or None when nobody stands."""
        start = self.election_prefix
        resp = await self._call("read the leader", self._kv.get(
            start, prefix_range_end(start), limit=1, sort_order=SortOrder.ASCEND, sort_target=SortTarget.CREATE,
            max_attempts=1))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return LeaderEntry(kv.key, kv.value.decode(errors="replace"), int(kv.create_revision))

    async def leader(self) -> str | None:
        """The leading agent's name, or None."""
        entry = await self.leader_entry()
        return None if entry is None else entry.name

    def leadership(self, entry: LeaderEntry) -> list[Any]:
        """The compare that fences the leader's writes: its candidate key still stands (a candidate created
        after it cannot lead while it does), so a leader whose lease lapsed unseen writes nothing."""
        return [self._kv.txn_compare_create_revision(entry.key, entry.create_revision)]
