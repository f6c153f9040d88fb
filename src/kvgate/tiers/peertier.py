"""A peer gateway as a tier of the store (``kvgate.tiers.contract``): read only, last in the list.

A peer serves what its own tiers hold (its RAM tier first) on its
``peer_listen`` address, in the network card's wire (``kvgate.cards.network``):
so this tier is a ``NetworkCard`` on ``kvgate://HOST:PORT/peer`` (``kvgates://``, TLS, with
``peer_tls_ca_file``), and every
object it pulls is verified as any card read is (header, key, length, payload
hash) before a byte of it is reported present.  It keeps nothing (``keeps``
is empty) and knows nothing without asking (``known`` says UNKNOWN), so the
store asks it only for keys no tier of its own holds: never on a local hit.

Deadlines: every call is bounded by ``peer_timeout_ms``; past it the batch
is abandoned (``Abandon``: nothing more is written into the destinations)
and its keys are misses, so the engine recomputes.  A peer that dies or
lies mid-pull costs a recompute, never a wrong byte.  Calls run on threads
of the tier's own, never on the card I/O pool: a slow peer never delays a
card read.

What it serves is copied into the RAM tier by the store (``promote``), so
the engine's next load of it is local.

What the peer said it lacks is not asked again for ``NEGATIVE_S``: a lookup
of a new prompt is repeated at every scheduler step until it is answered, and
each would otherwise cost a round trip to every peer.  The keys it answered
absent (a lookup's ``False``, a pull's ``missing``) are kept by digest,
at most ``NEGATIVE_KEPT``, the oldest dropped first; within ``NEGATIVE_S`` a
lookup or a read of one is a miss without I/O (``negative_hits``).  A failed
or skipped call teaches nothing: only an answer is kept.

A peer whose engines run the same model another way is not asked: the two
gateways tell each other what their namespaces stand for (``Namespaces``:
``kvgate.keys.NamespaceBook``, the inputs each engine declared in its hello)
at the first call and every ``NAMESPACES_S`` after, on the tier's threads
while calls go on.  When a request's namespace is not among the peer's but
one of the same model is, the peer is refused for it: its keys are misses
without a round trip (``namespace_refused``), and the log names the
difference once (``dtype (float16 here, bfloat16 there)``).  Its keys could
never match anyway (the namespace is in every key); this says why, and
spares the lookups.  A peer that holds the namespace's objects on a card
while its engines now run another is refused all the same.
"""

from __future__ import annotations

import asyncio
import logging
import ipaddress
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import numpy as np

from kvgate.cards import ObjectMeta
from kvgate.cards.network import NetworkCard
from kvgate.cards.network import wire as w
from kvgate.cards.objectformat import BufferTooSmall, Header
from kvgate.config import Config
from kvgate.keys import NAMESPACES_KEPT, NamespaceBook, key_digests, split_full_key
from kvgate.memcopy import Abandon
from kvgate.tiers.contract import STORAGE, UNKNOWN, GetItem, Known, PutItem
from kvgate.tiers.counters import TierCounters
from kvgate.tiers.io import IoPool
from kvgate.types import Retention, SizeCode

log = logging.getLogger("kvgate.peers")

PEER_SERIAL = "peer"  # what a peer's listener answers to in the hello: kvgate://HOST:PORT/peer
PEER_THREADS = 2  # calls to one peer at once: a lookup and a pull
SIZES_KEPT = 1 << 16  # object sizes a peer's lookups told, kept for the reads that follow them
# After a failed call a peer is left alone this long, doubling while it keeps failing: a peer that is
# down (or a host that drops packets) must not cost every lookup its deadline.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# How long a key the peer answered absent stays absent without asking it again: long enough to spare the
# peer the lookups a new prompt repeats at each scheduler step (tens of milliseconds apart) until it is
# answered, short enough that a block the peer stores now is pulled at the next turn of the conversation
# (seconds later at the soonest).
NEGATIVE_S = 2.0
NEGATIVE_KEPT = 100_000  # keys remembered absent, per peer (about 180 bytes each: 18 MB full); the oldest go first
# How often two peers tell each other their namespaces again (their engines may change: a restart with another
# dtype); a namespace new here is told at once.
NAMESPACES_S = 30.0
NAMESPACES_TOLD = 16  # of ours, the latest declared, told a peer (a gateway's engine uses a few)
SAID_KEPT = 1024  # differences logged (and verdicts), remembered so that each is logged once
_UNJUDGED = object()


def host_port(address: str) -> tuple[str, int | None]:
    """``HOST:PORT``, ``[V6]:PORT``, a bare host or a bare IPv6 address -> (host as compared, port or None).

    An IP address is written in its one canonical form (an IPv4-mapped IPv6 address as the IPv4 one), a
    name in lower case: ``10.0.0.1`` and ``::ffff:10.0.0.1`` are one host, a name and its address are not
    (nothing is resolved)."""
    text = address.strip()
    host, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end > 0:
            host, rest = text[1:end], text[end + 1:]
            if rest.startswith(":") and rest[1:].isdigit():
                port = int(rest[1:])
    elif text.count(":") == 1:
        h, _, p = text.partition(":")
        host = h
        if p.isdigit():
            port = int(p)
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host.lower().rstrip("."), port
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip), port


class PeerTier:
    """One peer gateway (``peers`` entry ``address``), read through its ``peer_listen``."""

    medium = STORAGE
    keeps: frozenset[Retention] = frozenset()
    probes = True
    promote = True

    def __init__(self, cfg: Config, address: str, namespaces: NamespaceBook | None = None) -> None:
        self.address = address
        self.host, self.port = host_port(address)  # as a request's source names it (``PeerSet.for_source``)
        self.name = f"peer {address}"
        self.counters = TierCounters()
        self.timeout = cfg.peer_timeout_ms / 1000
        scheme = "kvgates" if cfg.peer_tls_ca_file else "kvgate"  # TLS: checked against peer_tls_ca_file only
        self.card = NetworkCard(f"{scheme}://{address}/{PEER_SERIAL}", io_timeout_ms=cfg.peer_timeout_ms,
                                max_object_bytes=cfg.max_frame_bytes, token_file=cfg.peer_token_file,
                                tls_ca_file=cfg.peer_tls_ca_file, tls_ca_key="peer_tls_ca_file", server_name="peer",
                                timeout_key="peer_timeout_ms", serves_it="a gateway with peer_listen")
        self.io = IoPool(PEER_THREADS, name="kvgate-peer")
        self.failures = 0  # calls that failed or ran past the deadline
        self.skipped = 0  # calls not made: the peer failed a moment ago (backoff)
        self._backoff = 0.0
        self._quiet_until = 0.0  # time.monotonic() before which the peer is not asked
        self._sizes: dict[bytes, int] = {}  # key -> payload size, as the peer's lookups said (``sizes``)
        self._said: str | None = None  # the last failure logged (each new one once)
        # digests of keys the peer answered absent -> time.monotonic() until which they are taken as absent
        # without asking it; in the order they were learnt, so the oldest (and the first to lapse) go first
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self.negative_hits = 0  # keys answered absent from ``_absent``, not asked of the peer
        self.lookups = 0  # keys the peer answered lookups of (``find``: its exists_many)
        # what namespaces stand for, ours (the gateway's engines') and the peer's as it last told (module docstring)
        self.namespaces = namespaces if namespaces is not None else NamespaceBook()
        self._theirs: dict[str, dict] = {}
        self._verdicts: dict[str, tuple[str, str] | None] = {}  # our namespace -> foreign() against _theirs
        self._told = -1  # the version of our book the peer was last told (-1: never)
        self._told_at = 0.0  # time.monotonic() of that
        self._telling: asyncio.Task | None = None
        self._differences_said: set[tuple[str, str]] = set()
        self.namespace_refused = 0  # keys not asked: the peer runs their namespace's model another way
        self.namespace_difference = ""  # the last difference found (for the status)

    def close(self) -> None:
        if self._telling is not None:
            self._telling.cancel()
        self.card.close()
        self.io.shutdown(wait=False)

    def _resting(self) -> bool:
        """Whether the peer failed a moment ago: then it is not asked (its keys are misses) until its
        backoff ends."""
        if self._quiet_until and time.monotonic() < self._quiet_until:
            self.skipped += 1
            return True
        return False

    async def _call(self, fn, *args):
        """``fn(*args)`` on the tier's threads within the deadline; None when it failed, ran past it, or the
        peer is resting after a failure."""
        if self._resting():
            return None
        try:
            result = await asyncio.wait_for(self.io.run(fn, *args), self.timeout)
        except (OSError, asyncio.TimeoutError) as e:
            self._failed(e)
            return None
        self._answered()
        return result

    def _answered(self) -> None:
        self._backoff, self._quiet_until = 0.0, 0.0

    def _failed(self, e: BaseException) -> None:
        self.failures += 1
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2 or BACKOFF_FIRST_S)
        self._quiet_until = time.monotonic() + self._backoff
        why = str(e) or type(e).__name__
        if why != self._said:
            self._said = why
            log.warning("peer %s: %s (its objects are misses; asked again in %.0f s)", self.address, why,
                        self._backoff)

    # ---- what the peer said it lacks ---------------------------------------------------

    def _unknown(self, fkeys: list[bytes]) -> list[int]:
        """The positions of the keys to ask the peer about: all but those it answered absent less than
        ``NEGATIVE_S`` ago (each of those counted in ``negative_hits``)."""
        absent = self._absent
        if not absent:  # (no digests to compute: nothing the peer lacked lately)
            return list(range(len(fkeys)))
        now = time.monotonic()
        while absent:  # the lapsed go, oldest first (all lapse after the same NEGATIVE_S)
            digest, until = next(iter(absent.items()))
            if until > now:
                break
            del absent[digest]
        if not absent:
            return list(range(len(fkeys)))
        get = absent.get
        ask = [i for i, d in enumerate(key_digests(fkeys)) if get(d, 0.0) <= now]
        self.negative_hits += len(fkeys) - len(ask)
        return ask

    def _learn_absent(self, fkeys: list[bytes]) -> None:
        """The peer answered that it lacks ``fkeys``: take them as absent for ``NEGATIVE_S``."""
        absent = self._absent
        until = time.monotonic() + NEGATIVE_S
        for d in key_digests(fkeys):
            if d in absent:
                absent.move_to_end(d)
            absent[d] = until
        while len(absent) > NEGATIVE_KEPT:
            absent.popitem(last=False)

    # ---- what the peer's namespaces are -------------------------------------------------

    def _refused(self, first: bytes, n: int) -> bool:
        """Whether the peer is not asked for ``n`` keys of one request (one namespace: that of ``first``,
        the first key): it runs that namespace's model another way (module docstring).  Starts telling the
        peer our namespaces when that is due; never waits for it.  One verdict per namespace and answer
        of the peer: a lookup pays a dict lookup, whatever the peer told."""
        book = self.namespaces
        if book.version and (self._told != book.version or time.monotonic() - self._told_at >= NAMESPACES_S):
            self._tell()
        if not self._theirs:
            return False
        namespace = split_full_key(first)[0].decode(errors="replace")
        found = self._verdicts.get(namespace, _UNJUDGED)
        if found is _UNJUDGED:
            found = book.foreign(namespace, self._theirs)
            if len(self._verdicts) >= SAID_KEPT:
                self._verdicts.clear()
            self._verdicts[namespace] = found
        if found is None:
            return False
        other, why = found
        self.namespace_refused += n
        self.namespace_difference = f"{namespace!r} vs {other!r}: {why}"
        if (namespace, other) not in self._differences_said:
            if len(self._differences_said) >= SAID_KEPT:
                self._differences_said.clear()
            self._differences_said.add((namespace, other))
            log.warning("peer %s refused for namespace %r: its engines run the same model in namespace %r, which "
                        "differs in %s; neither gateway can use the other's KV of it, so the peer is not asked for "
                        "it (checked again every %.0f s)", self.address, namespace, other, why, NAMESPACES_S)
        return True

    def _tell(self) -> None:
        """Start telling the peer our namespaces (``Namespaces``), keeping its answer; one at a time."""
        if self._telling is not None or (self._quiet_until and time.monotonic() < self._quiet_until):
            return  # (one at a time; none to a peer resting after a failure)
        self._telling = asyncio.get_running_loop().create_task(self._exchange())

    async def _exchange(self) -> None:
        version, ours = self.namespaces.version, self.namespaces.items()
        ours = dict(list(ours.items())[-NAMESPACES_TOLD:])
        try:
            theirs = await asyncio.wait_for(self.io.run(self.card.ask, w.Namespaces(ours)), self.timeout)
        except Exception as e:  # (a peer of a version without the request refuses it: then nothing is known)
            log.debug("peer %s: namespaces not told: %s", self.address, e)
            theirs = self._theirs
        finally:
            self._telling = None
            self._told, self._told_at = version, time.monotonic()
        if isinstance(theirs, dict) and theirs is not self._theirs:  # (at most NAMESPACES_KEPT of them kept)
            kept = [(k, v) for k, v in list(theirs.items())[:NAMESPACES_KEPT]
                    if isinstance(k, str) and isinstance(v, dict)]
            self._theirs, self._verdicts = dict(kept), {}

    # ---- presence -----------------------------------------------------------------

    def known(self, fkeys: list[bytes], dialog: bytes) -> Known:
        return Known(np.full(len(fkeys), UNKNOWN, np.int8))

    async def find(self, fkeys: list[bytes], dialog: bytes, urgent: bool = False) -> list[bool]:
        """Asked of the peer, which answers with each present object's size where it knows it: kept for
        ``sizes``, so the read that follows a lookup is sized right, not probed first.  Keys it answered
        absent a moment ago (``NEGATIVE_S``) are not asked again."""
        if not fkeys:
            return []
        out = [False] * len(fkeys)
        if self._refused(fkeys[0], len(fkeys)):
            return out
        ask = self._unknown(fkeys)
        if not ask:
            return out
        sub = fkeys if len(ask) == len(fkeys) else [fkeys[i] for i in ask]
        got = await self._call(self.card.exists_many, sub)
        if got is None:
            return out
        self.lookups += len(sub)
        errors = [r for r in got if isinstance(r, BaseException)]
        if errors:
            self._failed(errors[0])
        else:
            self._said = None
        absent = []
        for i, k, r in zip(ask, sub, got):
            if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
                if len(self._sizes) >= SIZES_KEPT:
                    self._sizes.clear()  # (a cache of hints: dropping it costs a size probe each)
                self._sizes[k] = r
                out[i] = True
            elif r is True:
                out[i] = True
            elif r is False:
                absent.append(k)
        if absent:
            self._learn_absent(absent)
        return out

    async def probe_prefix(self, fkeys: list[bytes], dialog: bytes, known: Known, start: int, end: int,
                           urgent: bool = False) -> int:
        found = await self.find(fkeys[start:end], dialog, urgent)
        return found.index(False) if False in found else len(found)

    def prepare(self, fkeys, known, present, urgent: bool = False) -> None:
        pass

    def sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        """What the peer's last lookups said (``find``), without asking it again."""
        get = self._sizes.get
        return [get(k) for k in fkeys]

    async def find_sizes(self, fkeys: list[bytes], dialog: bytes) -> list[int | None]:
        return [None] * len(fkeys)  # a prewarm reads this gateway's own tiers only

    # ---- reads ----------------------------------------------------------------------

    async def read_into(self, items: list[GetItem], urgent: bool = False, own: bool = False, gets: bool = True,
                        ) -> tuple[list[int], list[int], list[ObjectMeta | None]]:
        """Pull each item into its dest, verified; an empty dest asks for the size (``TOO_SMALL`` with it),
        which the peer's lookup answers without sending the object."""
        n = len(items)
        sizes: list[int] = [SizeCode.MISS] * n
        needed = [0] * n
        metas: list[ObjectMeta | None] = [None] * n
        c = self.counters if gets else TierCounters()
        c.gets += n
        if n and self._refused(items[0].fkey, n):
            c.misses += n
            return sizes, needed, metas
        sizing = [i for i, it in enumerate(items) if not len(it.dest)]
        pulling = [i for i, it in enumerate(items) if len(it.dest)]
        if sizing:
            found = await self.find([items[i].fkey for i in sizing], b"")
            for i, f in zip(sizing, found):
                size = self._sizes.get(items[i].fkey) if f else None
                if size:
                    sizes[i], needed[i] = SizeCode.TOO_SMALL, size
                elif size == 0:
                    sizes[i] = 0
            c.misses += len(sizing)
        if pulling:
            ask = self._unknown([items[i].fkey for i in pulling])
            c.misses += len(pulling) - len(ask)  # answered absent a moment ago: not asked again
            if len(ask) < len(pulling):
                pulling = [pulling[j] for j in ask]
        if pulling:
            results = await self._pull([items[i] for i in pulling], own)
            failure: BaseException | None = None
            missing: list[bytes] = []
            for i, r in zip(pulling, results):
                if isinstance(r, Header):
                    sizes[i], metas[i] = r.payload_len, r.meta
                    c.hits += 1
                    self.counters.bytes_read += r.payload_len
                    continue
                c.misses += 1
                if isinstance(r, BufferTooSmall):
                    sizes[i], needed[i] = SizeCode.TOO_SMALL, r.needed
                elif isinstance(r, LookupError):  # missing is an answer, not a failure
                    missing.append(items[i].fkey)
                elif r is not None:
                    failure = failure or r
            if missing:
                self._learn_absent(missing)
            if failure is not None:  # (once a batch: a lost connection fails every item of it)
                self._failed(failure)
            elif any(r is not None for r in results):
                self._answered()
        return sizes, needed, metas

    async def _pull(self, items: list[GetItem], own: bool) -> list[Header | BaseException | None]:
        """``read_many_into`` on the tier's threads within the deadline; past it (or when the call failed) the
        destinations are abandoned (nothing more lands in them) and every item is None."""
        if self._resting():
            return [None] * len(items)
        guard = Abandon(own)
        try:
            return await asyncio.wait_for(
                self.io.run(self.card.read_many_into, [(it.fkey, it.dest) for it in items], guard), self.timeout)
        except BaseException as e:
            guard.abandon()  # from here on nothing more lands in the destinations
            if not isinstance(e, (OSError, asyncio.TimeoutError)):
                raise
            self._failed(e)
            return [None] * len(items)

    async def write(self, items: list[PutItem], retention: Retention,
                    sources: dict[int, memoryview] | None = None) -> list[bool]:
        return [False] * len(items)  # read only: a peer's tiers are its own

    # ---- dropping: a peer's objects are its own ---------------------------------------------

    async def delete(self, fkeys: list[bytes], dialog: bytes) -> int:
        return 0

    async def clean(self) -> int:
        return 0

    async def clean_namespace(self, ns: bytes) -> int:
        return 0

    async def held_keys(self, chunk: int = 10_000) -> AsyncIterator[tuple[str, list[bytes]]]:
        return
        yield  # (an async generator that lists nothing: a peer publishes its own events)

    def status(self) -> dict:
        c = self.counters
        return {"address": self.address, "gets": c.gets, "hits": c.hits, "misses": c.misses,
                "bytes_read": c.bytes_read, "failures": self.failures, "skipped": self.skipped,
                "lookups": self.lookups, "negative_hits": self.negative_hits, "absent_kept": len(self._absent),
                "namespace_refused": self.namespace_refused, "namespace_difference": self.namespace_difference,
                "namespaces_known": len(self._theirs),
                "resting_s": round(max(0.0, self._quiet_until - time.monotonic()), 3)}
