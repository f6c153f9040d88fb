"""What one card holds, as far as this gateway knows: per object its size, age, namespace and place in eviction.

Owned by one ``ManagedCard`` and used on the event loop only (no locks); it
does no I/O.  It answers lookups without touching the card; the object's
own header is what a read trusts, never an entry here (a read that finds
the object gone, corrupt or of another size drops or corrects the entry).
Entries come from this gateway's writes, from the card's snapshot of the
index at start and from the scan that checks that snapshot against the card
(``kvgate.tiers.restart``).

Compact: an object is a row of ``DigestRows`` keyed by the 16-byte digest
that names it on the card, not a Python object per key.  Measured on a
card of 100,000 objects of 4 KiB, the dict of entries and the per-key
policy cost about 1.1 KiB per object in the gateway's RSS; the columns here
(33 bytes) plus the eviction columns (``SampledPolicy``, 25 bytes), the
digest table, the dialog table and the policy's memory of recent keys come
to under 100 (``kvgate bench --objects``; docs/benchmarks.md, "A card of millions of
objects").  A digest collision would put two keys on one row; a read checks
the full key in the header, so it is a miss, never a wrong byte.

Keys, for the tiers' changes (``kvgate.tiers.events``): with ``keys`` (a
gateway with ``kv_events_endpoint`` set) each row also keeps its client key
(without the namespace: the row has its namespace id) in a ``uint8``
column of ``KEY_BYTES`` per row and a length column (length + 1; 0: not
known; ``UNKEPT``: too long to keep): 65 bytes a row, 65 MB per million rows (measured: 131 bytes a row
in all where 66 without keys).  Not numpy's ``S`` dtype:
it strips trailing NUL bytes, and vLLM's keys end in a 4-byte group index,
mostly zeros.  A key longer than ``KEY_BYTES`` is not kept (nor one whose
namespace shares the last namespace id), and its row's changes are not
emitted (``TierChanges.unkept`` counts such rows).  A put that replaces
a row notes ``stored`` only, not ``removed`` first.  Rows loaded from the card's
index snapshot at start have no key: they are not emitted until a put, a
probe, a read or a lookup of that key names it (``learn_key``: ``stored``
then).
Without ``keys`` there is no such column and no cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from kvgate.cards.objectformat import ObjectMeta
from kvgate.keys import NO_DIALOG, full_key, key_digest
from kvgate.tiers.events import CLEARED, KEY_BYTES, REMOVED, STORED, TierChanges
from kvgate.tiers.referee import Referee
from kvgate.tiers.rows import DigestRows, join_digest, key_digest_array, split_digest
from kvgate.tiers.sampled import SampledPolicy
from kvgate.tiers.usage import NamespaceUsage, namespace_of

EXPIRING: Final = 1  # past the ttl: a miss, its delete is under way
CHECKED: Final = 2  # seen on the card by the scan under way (kvgate.tiers.restart)
UNKEPT: Final = 0xFF  # key length column: the row's key is known but too long to keep (its changes are not noted)
OVERSIZE: Final = 0xFFFF_FFFF  # payload column value of an object whose sizes do not fit the columns
_MAX_NAMESPACES: Final = 0xFFFF


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One row, as a value (a copy: the row itself may move or change after)."""

    stored_bytes: int
    payload_len: int
    created_ns: int
    dialog: bytes  # the object's dialog mark: where placement puts it, should the card set change
    expiring: bool = False


class CardIndex:
    """Rows by key digest, their eviction order (``policy``) and the bytes they take on the card (``used``).

    Its ``ManagedCard`` writes it; ``KeyFinder.find_many`` reads it for every
    lookup; all on the event loop, never blocking (no I/O).  A fresh one
    may be filled from a snapshot on a pool thread before the loop takes
    it over (``kvgate.tiers.restart``).

    Every row added or removed is counted in ``usage`` (per namespace), so
    the namespaces' card figures always add up to what the indexes hold.
    ``find`` answers a whole request's keys in one call.
    """

    COLUMNS: Final = {"payload": np.uint32, "head": np.uint16, "created": np.int64, "ns": np.uint16,
                      "flags": np.uint8}

    KEY_COLUMNS: Final = {"key": (np.uint8, KEY_BYTES), "klen": np.uint8}

    def __init__(self, usage: NamespaceUsage, policy: str = "prefix", keys: bool = False,
                 changes: TierChanges | None = None, tier: str | None = None, referee: Referee | None = None
                 ) -> None:
        """``keys``: keep each row's key, and note rows with a key added and removed in ``changes`` (kept
        as ``events``) as ``tier``, the card's serial once known (the module docstring).  ``referee``: the
        one an "adaptive" policy shares with its card set's other cards (``CardSet.referee``)."""
        self.keys = keys
        self.events = changes if changes is not None else TierChanges()
        self.tier = tier
        self._columns = {**self.COLUMNS, **SampledPolicy.ROW_COLUMNS, **(self.KEY_COLUMNS if keys else {})}
        self.rows = DigestRows(self._columns)
        self.policy = SampledPolicy(self.rows, policy, referee=referee)
        self.usage = usage
        self.used = 0
        self.changes = 0  # rows put or dropped since the index was made (what a snapshot is behind by)
        self.namespaces: list[bytes] = []
        self._ns_ids: dict[bytes, int] = {}
        # Sizes that do not fit the columns (a payload of 4 GiB or more), by digest: rare.
        self._big: dict[bytes, tuple[int, int]] = {}

    # ---- one key ------------------------------------------------------------------

    def row(self, digest: bytes) -> int:
        """The row of a key digest, or -1."""
        return self.rows.find1(*split_digest(digest))

    def get(self, fkey: bytes) -> IndexEntry | None:
        r = self.row(key_digest(fkey))
        return None if r < 0 else self.entry(r)

    def __contains__(self, fkey: object) -> bool:
        """Whether the full key ``fkey`` is indexed."""
        return isinstance(fkey, bytes) and self.row(key_digest(fkey)) >= 0

    def has(self, digest: bytes) -> bool:
        return self.row(digest) >= 0

    def sizes(self, row: int) -> tuple[int, int]:
        """(stored bytes, payload length) of a row."""
        rows = self.rows
        payload = rows.payload.item(row)
        if payload == OVERSIZE:
            return self._big[rows.digest(row)]
        return payload + rows.head.item(row), payload

    def entry(self, row: int) -> IndexEntry:
        rows = self.rows
        stored, payload = self.sizes(row)
        d = rows.dlg.item(row)
        dialog = join_digest(self.policy.dialogs.lo.item(d), self.policy.dialogs.hi.item(d)) if d >= 0 else NO_DIALOG
        return IndexEntry(stored, payload, rows.created.item(row), dialog, bool(rows.flags.item(row) & EXPIRING))

    def digest(self, row: int) -> bytes:
        return self.rows.digest(row)

    def namespace(self, row: int) -> bytes:
        return self.namespaces[self.rows.ns.item(row)]

    def set_namespaces(self, namespaces: list[bytes]) -> None:
        """The namespace table of an index filled in bulk (a snapshot's)."""
        self.namespaces[:] = namespaces
        self._ns_ids = {ns: i for i, ns in enumerate(namespaces)}

    def note_oversize(self, digest: bytes, stored: int, payload_len: int) -> None:
        """Sizes of a row whose payload column says ``OVERSIZE``."""
        self._big[digest] = (stored, payload_len)

    def _namespace_id(self, ns: bytes) -> int:
        i = self._ns_ids.get(ns)
        if i is None:
            # Past 65,535 namespaces on one card (clients choose them) the last id is shared:
            # only the per-namespace figures of those blur, never an object.
            i = len(self.namespaces)
            if i >= _MAX_NAMESPACES:
                return _MAX_NAMESPACES - 1
            self.namespaces.append(ns)
            self._ns_ids[ns] = i
        return i

    def put(self, fkey: bytes, stored: int, payload_len: int, meta: ObjectMeta, created_ns: int,
            tail: bool = False) -> int:
        """Index an object (replacing the key's row, if any); returns its row."""
        digest = key_digest(fkey)
        lo, hi = split_digest(digest)
        rows = self.rows
        r = rows.find1(lo, hi)
        again = r >= 0
        if again:
            self.pop_row(r, replaced=True)
        r = rows.add1(lo, hi)
        ns = namespace_of(fkey)
        self._set(r, digest, stored, payload_len, created_ns, self._namespace_id(ns))
        self.used += stored
        self.changes += 1
        self.usage.card_namespace(ns, stored, 1)
        self.policy.add(r, meta.dialog, meta.position, tail, again)
        if self.keys:
            rows.klen[r] = 0
            self.learn_key(r, fkey)
        return r

    # ---- keys (with ``keys`` only) ------------------------------------------------------

    def learn_key(self, r: int, fkey: bytes) -> None:
        """Row ``r`` holds ``fkey``: keep its key if it had none (noted as ``stored`` then).  Only with
        ``keys``; the caller checked that ``r`` is the row of ``fkey``'s digest."""
        rows = self.rows
        if rows.klen.item(r):
            return
        key = fkey[1 + fkey[0] :]
        if len(key) > KEY_BYTES or rows.ns.item(r) == _MAX_NAMESPACES - 1:
            # (past the namespace table, an id no longer names one namespace: no full key from it)
            rows.klen[r] = UNKEPT  # known: not tried again at each lookup of it
            self.events.unkept += 1
            return
        rows.key[r, : len(key)] = np.frombuffer(key, np.uint8)
        rows.klen[r] = len(key) + 1
        if self.tier is not None and self.events.listening:
            self.events.note(self.tier, STORED, fkey)

    def learn_keys(self, fkeys: list[bytes]) -> None:
        """``learn_key`` of each of ``fkeys`` this index holds (a probe found them on the card)."""
        if not self.keys:
            return
        for fkey, r in zip(fkeys, self.find_keys(fkeys).tolist()):
            if r >= 0:
                self.learn_key(r, fkey)

    def key_of(self, r: int) -> bytes | None:
        """The full key of row ``r``, None when not known (no ``keys``, loaded from a snapshot, too long)."""
        if not self.keys:
            return None
        n = self.rows.klen.item(r)
        if not n or n == UNKEPT:
            return None
        return full_key(self.namespaces[self.rows.ns.item(r)], self.rows.key[r, : n - 1].tobytes())

    def held_keys(self, start: int, stop: int) -> list[bytes]:
        """The full keys known of rows ``start`` to ``stop`` (rows without one left out): 10,000 rows
        take 3 ms at most (1,000,000 rows of 32-byte keys, in chunks of 10,000)."""
        if not self.keys:
            return []
        rows = self.rows
        stop = min(stop, rows.n)
        lens = rows.klen[start:stop]
        sel = np.flatnonzero((lens != 0) & (lens != UNKEPT))
        if not sel.size:
            return []
        raw = rows.key[start:stop][sel].tobytes()
        prefixes = [full_key(ns, b"") for ns in self.namespaces]
        out = []
        for j, (i, n, ns) in enumerate(zip(sel.tolist(), (lens[sel] - 1).tolist(),
                                           rows.ns[start:stop][sel].tolist())):
            at = j * KEY_BYTES
            out.append(prefixes[ns] + raw[at : at + n])
        return out

    def _set(self, r: int, digest: bytes, stored: int, payload_len: int, created_ns: int, ns_id: int) -> None:
        rows = self.rows
        head = stored - payload_len
        if payload_len >= OVERSIZE or not 0 <= head <= 0xFFFF:
            rows.payload[r] = OVERSIZE
            rows.head[r] = 0
            self._big[digest] = (stored, payload_len)
        else:
            rows.payload[r] = payload_len
            rows.head[r] = head
        rows.created[r] = created_ns
        rows.ns[r] = ns_id
        rows.flags[r] = CHECKED

    def pop(self, digest: bytes) -> bool:
        """Drop the row of ``digest``; False when there was none."""
        r = self.row(digest)
        if r < 0:
            return False
        self.pop_row(r)
        return True

    def pop_row(self, r: int, replaced: bool = False) -> None:
        """Drop row ``r`` (noted as ``removed`` unless a put ``replaced`` it)."""
        stored, _ = self.sizes(r)
        if self.rows.payload.item(r) == OVERSIZE:
            del self._big[self.rows.digest(r)]
        self.used -= stored
        self.changes += 1
        if self.keys and not replaced and self.tier is not None and self.events.listening:
            fkey = self.key_of(r)
            if fkey is not None:
                self.events.note(self.tier, REMOVED, fkey)
        self.usage.card_namespace(self.namespace(r), -stored, -1)
        self.policy.removing(r)
        self.rows.remove(r)

    def touch(self, r: int) -> None:
        self.policy.touch(r)

    # ---- many keys ------------------------------------------------------------------

    def put_many(self, fkeys: list[bytes], digests: np.ndarray, stored: list[int], payload_lens: list[int],
                 metas: list[ObjectMeta], created_ns: int) -> None:
        """``put`` of objects of distinct keys (``digests``: theirs, ``key_digest_array``), in one pass: the
        rows found and added at once, their columns set as arrays; only the eviction order takes each row
        in turn (its dialog chains link row to row), and that is most of the cost: 3.6-3.9 us an object
        for 256 or 1,024 objects where ``put`` takes 5.0-5.2, the same 7.5 for 32."""
        rows = self.rows
        again = self.find(digests) >= 0
        for i in np.flatnonzero(again).tolist():  # by digest, one by one: a removal may move another row
            self.pop_row(rows.find1(int(digests[i, 0]), int(digests[i, 1])), replaced=True)
        added = rows.add_many(np.ascontiguousarray(digests[:, 0]), np.ascontiguousarray(digests[:, 1]))
        stored_a = np.array(stored, np.int64)
        payload_a = np.array(payload_lens, np.int64)
        head = stored_a - payload_a
        big = (payload_a >= OVERSIZE) | (head < 0) | (head > 0xFFFF)
        rows.payload[added] = np.where(big, OVERSIZE, payload_a)
        rows.head[added] = np.where(big, 0, head)
        for i in np.flatnonzero(big).tolist():
            self._big[rows.digest(int(added[i]))] = (stored[i], payload_lens[i])
        rows.created[added] = [m.created_ns or created_ns for m in metas]
        namespaces = [namespace_of(k) for k in fkeys]
        ids = {ns: self._namespace_id(ns) for ns in dict.fromkeys(namespaces)}
        rows.ns[added] = [ids[ns] for ns in namespaces] if len(ids) > 1 else next(iter(ids.values()))
        rows.flags[added] = CHECKED
        self.used += int(stored_a.sum())
        self.changes += len(fkeys)
        for ns in ids:
            mine = stored_a if len(ids) == 1 else stored_a[[n == ns for n in namespaces]]
            self.usage.card_namespace(ns, int(mine.sum()), len(mine))
        add = self.policy.add
        for r, m, a in zip(added.tolist(), metas, again.tolist()):
            add(r, m.dialog, m.position, m.tail, a)
        if self.keys:
            rows.klen[added] = 0
            for r, k in zip(added.tolist(), fkeys):
                self.learn_key(r, k)

    def find(self, digests: np.ndarray) -> np.ndarray:
        """The rows of ``(n, 2)`` uint64 digests (``digest_array``); -1 where absent."""
        return self.rows.find(digests[:, 0], digests[:, 1])

    def find_keys(self, fkeys: list[bytes]) -> np.ndarray:
        return self.find(key_digest_array(fkeys))

    def stored_of(self, rows_: np.ndarray) -> np.ndarray:
        """Stored bytes of many rows (int64)."""
        rows = self.rows
        payload = rows.payload[rows_].astype(np.int64)
        out = payload + rows.head[rows_]
        big = np.flatnonzero(payload == OVERSIZE)
        for i in big.tolist():
            out[i] = self._big[rows.digest(int(rows_[i]))][0]
        return out

    def payload_of(self, rows_: np.ndarray) -> list[int]:
        """Payload lengths of many rows."""
        rows = self.rows
        out = rows.payload[rows_].tolist()
        for i, p in enumerate(out):
            if p == OVERSIZE:
                out[i] = self._big[rows.digest(int(rows_[i]))][1]
        return out

    def namespace_digests(self, ns: bytes) -> tuple[list[bytes], bool]:
        """The digests of the rows of namespace ``ns`` (one vectorised pass over the rows), and whether other
        namespaces may share its id (past ``_MAX_NAMESPACES`` on one card): then some of them may not be
        ``ns``'s, and the caller checks each object's full key before it deletes."""
        i = self._ns_ids.get(ns)
        full = len(self.namespaces) >= _MAX_NAMESPACES
        if i is None:
            if not full:
                return [], False
            i = _MAX_NAMESPACES - 1  # a namespace past the table shares the last id
        n = self.rows.n
        rows_ = np.flatnonzero(self.rows.ns[:n] == i)
        return self.rows.digests(rows_), full and i == _MAX_NAMESPACES - 1

    def clear(self) -> None:
        """Drop every row (the namespaces' figures with them)."""
        n = self.rows.n
        if n:
            ns = self.rows.ns[:n]
            stored = self.stored_of(np.arange(n))
            for i in np.unique(ns).tolist():
                mine = ns == i
                self.usage.card_namespace(self.namespaces[i], -int(stored[mine].sum()), -int(mine.sum()))
        self.rows = DigestRows(self._columns)
        self.policy = SampledPolicy(self.rows, self.policy.kind, referee=self.policy.referee)
        self._big.clear()
        self.used = 0
        if self.tier is not None and self.events.listening:
            self.events.note(self.tier, CLEARED, None)

    def __len__(self) -> int:
        return self.rows.n

    def __bool__(self) -> bool:
        return self.rows.n > 0

    def evictions_by_order(self) -> dict[str, int]:
        """Evictions its policy chose under each order ("adaptive" switches; zeros under the others)."""
        return dict(self.policy.tally.counts)

    def nbytes(self) -> int:
        """Memory of the columns and tables (allocated), for figures."""
        return self.rows.nbytes() + self.policy.dialogs.nbytes()
