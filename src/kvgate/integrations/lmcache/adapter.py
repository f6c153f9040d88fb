"""``KvgateL2Adapter``: an LMCache (0.5.6) L2 adapter that keeps KV chunks in a kvgate gateway.

LMCache's storage controllers call the adapter from their own threads and
must never wait on the gateway: every ``submit_*`` only queues the task and
returns its id.  Background threads, each with its own gateway sessions
(``Client`` objects, one per namespace), run the tasks and signal the three
event fds LMCache polls.

- Dialog marks: a lookup carries every chunk of one request from its first
  on, so there the adapter asks the gateway for the request's dialog mark
  and remembers each chunk's dialog and position for the store that follows
  (``marks``): a conversation's chunks, every kv rank's, go to its card, and
  a shared system prompt is learned as a head.
- Store: ``put_many`` per namespace and run of one dialog; the task succeeds
  when every object was stored.
- Lookup and lock: ``hold_many`` per namespace: what is found is held on
  its card by the gateway (not evicted) until unlocked, for at most the
  gateway's hold time (a minute) and within its caps.  Unlock releases a key
  once LMCache has unlocked it as often as it locked it, on the session
  that holds it (the lookup thread's).  A gateway without holds (an older
  version) answers lookups with ``exists_many`` and locks nothing: an object
  found may then be evicted before it is loaded, and the load reports that
  key as failed (LMCache recomputes it).  A load never delivers other bytes:
  a key names the same bytes everywhere, and a load whose size differs from
  the L1 buffer fails.
- Load: ``get_many`` straight into the L1 buffers.
- Delete (LMCache's eviction): a key a lookup locked and LMCache has not
  unlocked is skipped, not deleted, as LMCache's own adapters do (S3,
  Valkey, Bigtable: "``delete()`` skips any key whose refcount is > 0");
  a later delete after the unlock deletes it.  Only what was deleted is
  reported to LMCache's listeners.
- A gateway that is down or stuck costs failed stores, lookup misses and
  failed loads (each call bounded by kvgate.io_timeout / lookup_timeout),
  one warning line per 30 s, and a reconnect with backoff.

Copies: when LMCache's L1 arena is a /dev/shm file mapping (``lmcache server
--no-l1-use-lazy --shm-name NAME``), it is registered with the gateway and
every transfer is one copy, made by the gateway, between its own memory and
L1.  Otherwise (the default lazy L1 is anonymous memory) objects are staged
through the session's shared-memory region: one more copy each way, made here.
Finding that mapping: ``l1``; the worker threads' gateway sessions: ``sessions``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvgate.client import MARK_KEYS, Client, DialogMark, GatewayError, ObjectTooLarge
from kvgate.integrations.lmcache.l1 import map_l1
from kvgate.integrations.lmcache.marks import ChunkMarks
from kvgate.integrations.lmcache.sessions import GatewayDown, Sessions
from kvgate.integrations.lmcache.settings import (
    PARAM_KEYS,
    AdapterSettings,
    key_bytes,
    parse_params,
    plugin_logger,
    split_by_namespace,
)
from kvgate.integrations.markcache import MarkCache
from kvgate.integrations.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

logger = plugin_logger()


class KvgateL2AdapterConfig(L2AdapterConfigBase):
    """adapter_params of the plugin: the ``kvgate.*`` keys (see ``settings.PARAM_KEYS``)."""

    def __init__(self, settings: AdapterSettings, params: dict[str, Any]):
        self.settings = settings
        self.params = dict(params)

    @classmethod
    def from_dict(cls, d: dict) -> "KvgateL2AdapterConfig":
        return cls(parse_params(d), d)

    @classmethod
    def help(cls) -> str:
        return "kvgate L2 adapter params:\n" + "\n".join(f"- {k}: {v}" for k, v in PARAM_KEYS.items())


class KvgateL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter storing objects in a kvgate gateway (see the module docstring)."""

    config_class_name = "KvgateL2AdapterConfig"

    def __init__(self, config: KvgateL2AdapterConfig | dict, l1_memory_desc: "L1MemoryDesc | None" = None):
        super().__init__(max_capacity_bytes=0)
        if not isinstance(config, KvgateL2AdapterConfig):
            config = KvgateL2AdapterConfig.from_dict(dict(config))
        self.config = config
        self.settings = config.settings
        self._base_ns = self.settings.tier.namespace
        self._log = RateLimitedLog(logger)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._store_done: dict[L2TaskId, L2StoreResult] = {}
        self._lookup_done: dict[L2TaskId, Bitmap] = {}
        self._load_done: dict[L2TaskId, Bitmap] = {}
        self._locked: dict[Any, int] = {}  # ObjectKey -> lookups that locked it and have not unlocked it
        self._pinned: dict[Any, int] = {}  # ObjectKey -> lookups submitted and not run yet: a delete skips them
        self._holds = True  # the gateway holds what lookups find (False: an older gateway without holds)
        self._marks = ChunkMarks()  # each looked-up chunk's dialog and position, for its store
        self._mark_cache = MarkCache()
        self._gateway_marks = True  # False: an older gateway without dialog_mark (chunks go unmarked)
        # delete's byte accounting: the size of the last object stored (LMCache's chunks of one layout
        # are all one size); a map of every key stored would grow without bound
        self._object_bytes = 0
        self._seen_ns: set[str] = set()  # namespaces whose store and load sessions were asked to open
        self._down = False
        self._down_since = 0.0
        self.counters = {"stores": 0, "stored": 0, "store_failed": 0, "lookups": 0, "lookup_hits": 0,
                         "loads": 0, "loaded": 0, "load_failed": 0, "bytes_stored": 0, "bytes_loaded": 0,
                         "mark_calls": 0, "stored_marked": 0}

        # LMCache's L1 arena: zero copy when it is a /dev/shm file mapping the gateway can map too
        self._l1_region: tuple[str, int, int] | None = None
        self._l1_view: memoryview | None = None
        self._l1_said = False  # logged that a gateway took L1 (when a session registered it, not before)
        if l1_memory_desc is not None and self.settings.register_l1 and not self._tcp:
            mapped = map_l1(int(l1_memory_desc.ptr))
            if mapped is not None:
                self._l1_region, self._l1_view = mapped
            else:
                logger.info("kvgate: LMCache's L1 arena (0x%x) is not a /dev/shm file mapping: objects are "
                            "staged through a shared-memory session region (one copy each way here)",
                            int(l1_memory_desc.ptr))

        t = self.settings.tier
        self._store_q: queue.SimpleQueue = queue.SimpleQueue()
        self._lookup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue = queue.SimpleQueue()

        def sessions(name: str, timeout: float, bulk: bool) -> Sessions:
            return Sessions(name, timeout, tier=t, bulk=bulk, l1=self._l1, log=self._log,
                            on_down=self._gateway_failed, on_up=self._gateway_ok)

        self._sessions = [sessions("store", t.io_timeout, True), sessions("lookup", t.lookup_timeout, False)]
        self._sessions += [sessions(f"load{i}", t.io_timeout, True) for i in range(self.settings.load_workers)]
        self._threads = [threading.Thread(target=self._loop, args=(self._store_q, self._sessions[0]),
                                          name="kvgate-l2-store", daemon=True),
                         threading.Thread(target=self._loop, args=(self._lookup_q, self._sessions[1]),
                                          name="kvgate-l2-lookup", daemon=True)]
        self._threads += [threading.Thread(target=self._loop, args=(self._load_q, s), name=f"kvgate-l2-{s.name}",
                                           daemon=True) for s in self._sessions[2:]]
        for th in self._threads:
            th.start()
        logger.info("kvgate L2 adapter: gateway %s, namespace %s|r<rank>|g<group>[|s<salt digest>], "
                    "retention %s, %s", t.target, self._base_ns or "lmcache|<model>", t.retention,
                    f"L1 {self._l1_region[0]} to register with the gateway at the first store or load"
                    if self._l1_region else ("over TCP: bytes travel inline" if self._tcp else
                                             "objects staged through a session region"))

    @property
    def _tcp(self) -> bool:
        return "kvgate.address" in self.config.params

    def _l1(self) -> tuple[str, memoryview] | None:
        """L1's /dev/shm file and this process's view of it, for the bulk sessions to register (None: not
        registered: objects are staged through a session region)."""
        if self._l1_region is None or self._l1_view is None:
            return None
        return self._l1_region[0], self._l1_view

    # ---- event fds ---------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---- submit / query (LMCache's threads: queue and return) ---------------------------

    def _task_id(self) -> L2TaskId:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def submit_store_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        tid = self._task_id()
        self._store_q.put((self._run_store, tid, list(keys), list(objects)))
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._store_done = self._store_done, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list["ObjectKey"],
                                    group_layout_descs: "dict[int, MemoryLayoutDesc] | None" = None) -> L2TaskId:
        tid = self._task_id()
        keys = list(keys)
        with self._lock:  # pinned until the lookup ran (and locked what it found): a delete meanwhile skips them
            for k in keys:
                self._pinned[k] = self._pinned.get(k, 0) + 1
        self._lookup_q.put((self._run_lookup, tid, keys, None))
        return tid

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookup_done.pop(task_id, None)

    def submit_unlock(self, keys: list["ObjectKey"]) -> None:
        unlocked = []
        with self._lock:
            for k in keys:
                n = self._locked.get(k, 0)
                if n <= 1:
                    if self._locked.pop(k, None) is not None:
                        unlocked.append(k)
                else:
                    self._locked[k] = n - 1
        if unlocked:  # released by the lookup thread: its sessions hold them
            self._lookup_q.put((self._run_unlock, 0, unlocked, None))

    def submit_load_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        tid = self._task_id()
        self._load_q.put((self._run_load, tid, list(keys), list(objects)))
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._load_done.pop(task_id, None)

    def delete(self, keys: list["ObjectKey"]) -> None:
        """LMCache's eviction (its thread): queue the delete of ``keys`` but those a lookup locked and
        LMCache has not unlocked, or a lookup submitted before has yet to look up (it will lock them)."""
        with self._lock:
            keys = [k for k in keys if k not in self._locked and k not in self._pinned]
        if keys:
            self._lookup_q.put((self._run_delete, 0, keys, None))

    def report_status(self) -> dict:
        with self._lock:
            locked = len(self._locked)
        return {"is_healthy": not self._down, "type": "KvgateL2Adapter", "gateway": self.settings.target,
                "gateway_down_for_s": round(time.monotonic() - self._down_since, 1) if self._down else 0.0,
                "l1_registered": self._l1_region[0] if self._l1_region else None,
                "zero_copy_sessions": sum(s.zero_copy for s in self._sessions), "locked_key_count": locked,
                "lock_held_by_gateway": False, **self.counters}

    def close(self) -> None:
        for s in self._sessions:
            s.abort()  # wake a call stuck on a frozen gateway
        for q in (self._store_q, self._lookup_q):
            q.put(None)
        for _ in self._sessions[2:]:
            self._load_q.put(None)
        for th in self._threads:
            th.join(timeout=5)
        for s in self._sessions:
            s.close()
        self._l1_view = None
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            try:
                efd.close()
            except Exception:
                pass

    # ---- the worker threads ----------------------------------------------------------------

    def _loop(self, q: queue.SimpleQueue, sessions: Sessions) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, tid, keys, objects = item
            try:
                fn(sessions, tid, keys, objects)
            except BaseException as e:  # never lose a task: LMCache waits for every one
                logger.exception("kvgate L2 adapter: task %s failed unexpectedly: %s", tid, e)
                if fn == self._run_store:
                    self._finish_store(tid, False, 0)
                elif fn == self._run_lookup:
                    self._finish(self._lookup_done, self._lookup_efd, tid, Bitmap(len(keys)))
                elif fn == self._run_load:
                    self._finish(self._load_done, self._load_efd, tid, Bitmap(len(keys)))

    def _gateway_failed(self, why: str) -> None:
        if not self._down:
            self._down = True
            self._down_since = time.monotonic()
        self._log.warning("down", "kvgate: gateway %s unavailable: %s; LMCache goes on without it (store "
                          "failures, lookup misses) and the adapter reconnects", self.settings.target, why)

    def _gateway_ok(self) -> None:
        """After a session opened (a worker thread): says once when L1 is first registered with a gateway."""
        if self._l1_region is not None and not self._l1_said and any(s.zero_copy for s in self._sessions):
            with self._lock:
                said, self._l1_said = self._l1_said, True
            if not said:
                logger.info("kvgate: LMCache's L1 %s registered with the gateway %s: transfers are one copy by "
                            "the gateway", self._l1_region[0], self.settings.target)
        if self._down:
            self._down = False
            logger.info("kvgate: gateway %s reachable again after %.1f s", self.settings.target,
                        time.monotonic() - self._down_since)

    def _call(self, sessions: Sessions, namespace: str, what: str, fn) -> Any:
        """fn(client) on this namespace's session; None (logged) when the gateway fails."""
        try:
            client = sessions.get(namespace)
        except GatewayDown:
            return None
        try:
            return fn(client)
        except GatewayError as e:
            self._log.warning(f"refused-{what}", "kvgate: the gateway refused a %s: %s", what, e)
            if e.code in ("ENGINE_BUSY", "NOT_AUTHORIZED", "UNSALTED_REFUSED", "BAD_VERSION"):
                sessions.drop(namespace)
            return None
        except (ValueError, TypeError) as e:  # an argument refused before anything was sent
            self._log.warning(f"bad-{what}", "kvgate: a %s was refused: %s", what, e)
            return None
        except Exception as e:  # OSError, TimeoutError, a broken frame: reconnect next time
            sessions.drop(namespace)
            if not sessions.closed:
                self._gateway_failed(f"{what} failed ({type(e).__name__}: {e})")
            return None

    def _finish(self, done: dict, efd, tid: L2TaskId, result: Any) -> None:
        with self._lock:
            done[tid] = result
        efd.notify()

    def _finish_store(self, tid: L2TaskId, ok: bool, nbytes: int) -> None:
        self._finish(self._store_done, self._store_efd, tid, L2StoreResult(ok, nbytes))

    def _run_store(self, sessions: Sessions, tid: L2TaskId, keys: list, objects: list) -> None:
        self.counters["stores"] += 1
        ok = True
        nbytes = 0
        marked = 0
        stored_keys: list = []
        stored_sizes: list[int] = []
        retention = self.settings.tier.retention
        for ns, idx in split_by_namespace(keys, self._base_ns).items():
            kb = [key_bytes(keys[i]) for i in idx]
            bufs = [objects[i].byte_array for i in idx]
            for run, dialog, position in self._marks.runs(kb):
                res = self._call(sessions, ns, "store", lambda c: c.put_many(
                    [kb[j] for j in run], [bufs[j] for j in run], retention=retention, dialog=dialog,
                    position=position))
                if res is None:
                    ok = False
                    continue
                for j, stored in zip(run, res):
                    if stored:
                        stored_keys.append(keys[idx[j]])
                        stored_sizes.append(len(bufs[j]))
                        nbytes += len(bufs[j])
                        marked += dialog is not None
                    else:
                        ok = False
        if stored_keys:
            self._object_bytes = stored_sizes[-1]
            self._notify_keys_stored(stored_keys, stored_sizes)
        self.counters["stored"] += len(stored_keys)
        self.counters["stored_marked"] += marked
        self.counters["bytes_stored"] += nbytes
        if not ok:
            self.counters["store_failed"] += 1
        self._finish_store(tid, ok, nbytes)

    def _run_lookup(self, sessions: Sessions, tid: L2TaskId, keys: list, _objects: Any) -> None:
        found: list = []
        bitmap: Bitmap | None = None
        try:
            bitmap = self._look_up(sessions, keys, found)
        finally:  # what it found is locked as its pins go, at once: no delete slips in between
            with self._lock:
                for k in found if bitmap is not None else ():  # failed: LMCache is told none was found
                    self._locked[k] = self._locked.get(k, 0) + 1
                for k in keys:
                    n = self._pinned.pop(k, 0)
                    if n > 1:
                        self._pinned[k] = n - 1
        self.counters["lookup_hits"] += len(found)
        self._finish(self._lookup_done, self._lookup_efd, tid, bitmap)

    def _look_up(self, sessions: Sessions, keys: list, found: list) -> Bitmap:
        """Hold ``keys`` in the gateway; the bitmap of those present, each of them appended to ``found``."""
        self.counters["lookups"] += 1
        bitmap = Bitmap(len(keys))
        dm: list[DialogMark | None] = [None]  # the request's mark, asked on its first row
        noted: list[list[bytes] | None] = [None]  # the last row remembered in ChunkMarks
        for ns, idx in split_by_namespace(keys, self._base_ns).items():
            if ns not in self._seen_ns:
                # open the bulk sessions now (connect, register L1), not in the first store or restore
                self._seen_ns.add(ns)
                self._store_q.put((self._run_open, 0, [ns], None))
                for _ in self._sessions[2:]:
                    self._load_q.put((self._run_open, 0, [ns], None))
            kb = [key_bytes(keys[i]) for i in idx]
            res = self._call(sessions, ns, "lookup", lambda c: self._lookup_row(c, kb, dm, noted))
            for i, present in zip(idx, res or ()):
                if present:
                    bitmap.set(i)
                    found.append(keys[i])
        return bitmap

    def _lookup_row(self, c: Client, row: list[bytes], dm: list[DialogMark | None],
                    noted: list[list[bytes] | None]) -> list[bool]:
        """Hold one row of a lookup (one kv rank and object group's chunks, from the first), under the
        request's dialog mark, asked on the first row and remembered for the stores."""
        if dm[0] is None:
            dm[0] = self._mark(c, row)
        if dm[0] is None:
            return self._hold(c, row)
        if row != noted[0]:  # rows of one request (kv ranks, object groups) share their chunk keys
            self._marks.note(row, dm[0])
            noted[0] = row
        present: list[bool] = []
        for start, end, dialog in dm[0].spans(0, len(row)):
            present += self._hold(c, row[start:end], dialog)
        return present

    def _mark(self, c: Client, row: list[bytes]) -> DialogMark | None:
        if not self._gateway_marks or not row:
            return None
        lead = row[: MARK_KEYS + 1]
        dm = self._mark_cache.get(lead[-1])
        if dm is not None:
            return dm
        self.counters["mark_calls"] += 1
        try:
            dm = c.dialog_mark(lead)
        except GatewayError as e:
            if e.code != "UNKNOWN_OP":
                raise
            self._gateway_marks = False
            logger.warning("kvgate L2 adapter: the gateway has no dialog marks (an older version): chunks are "
                           "placed by their keys, not by conversation; upgrade the gateway")
            return None
        if dm.mark is not None:
            self._mark_cache.put(lead[-1], dm)
        return dm

    def _hold(self, c: Client, bkeys: list[bytes], dialog: bytes | None = None) -> list[bool]:
        if self._holds:
            try:
                return c.hold_many(bkeys, dialog=dialog)
            except GatewayError as e:
                if e.code != "UNKNOWN_OP":
                    raise
                self._holds = False
                logger.warning("kvgate L2 adapter: the gateway cannot hold objects (an older version): lookups "
                               "lock nothing, and an object evicted between a lookup and its load is recomputed; "
                               "upgrade the gateway")
        return c.exists_many(bkeys, dialog=dialog)

    def _run_unlock(self, sessions: Sessions, _tid: L2TaskId, keys: list, _objects: Any) -> None:
        if not self._holds:
            return
        for ns, idx in split_by_namespace(keys, self._base_ns).items():
            self._call(sessions, ns, "unlock", lambda c: c.release_many([key_bytes(keys[i]) for i in idx]))

    def _run_load(self, sessions: Sessions, tid: L2TaskId, keys: list, objects: list) -> None:
        self.counters["loads"] += 1
        bitmap = Bitmap(len(keys))
        loaded: list = []
        nbytes = 0
        for ns, idx in split_by_namespace(keys, self._base_ns).items():
            kb = [key_bytes(keys[i]) for i in idx]
            bufs = [objects[i].byte_array for i in idx]
            for dialog, part in self._marks.by_dialog(kb).items():
                res = self._call(sessions, ns, "load", lambda c: self._get_fitting(
                    c, [kb[j] for j in part], [bufs[j] for j in part], dialog))
                for j, got in zip(part, res or ()):
                    # a miss (evicted since the lookup) or an object of another size fails this key
                    if got is not None and len(got) == len(bufs[j]):
                        bitmap.set(idx[j])
                        loaded.append(keys[idx[j]])
                        nbytes += len(bufs[j])
        if loaded:
            self._notify_keys_accessed(loaded)
        self.counters["loaded"] += len(loaded)
        self.counters["bytes_loaded"] += nbytes
        if len(loaded) < len(keys):
            self.counters["load_failed"] += len(keys) - len(loaded)
        self._finish(self._load_done, self._load_efd, tid, bitmap)

    @staticmethod
    def _get_fitting(client: Client, kbytes: list[bytes], bufs: list, dialog: bytes | None = None) -> list:
        """get_many into ``bufs``; an object larger than its buffer is a miss for that key alone."""
        out: list = [None] * len(kbytes)
        todo = list(range(len(kbytes)))
        while todo:
            try:
                got = client.get_many([kbytes[j] for j in todo], into=[bufs[j] for j in todo], dialog=dialog)
            except ObjectTooLarge as e:  # refused before anything was sent: drop that key, ask again
                todo.pop(e.index)
                continue
            for j, g in zip(todo, got):
                out[j] = g
            break
        return out

    def _run_open(self, sessions: Sessions, _tid: int, namespaces: list, _objects: Any) -> None:
        for ns in namespaces:
            try:
                sessions.get(ns)
            except GatewayDown:  # logged; the next task tries again
                pass

    def _run_delete(self, sessions: Sessions, _tid: int, keys: list, _objects: Any) -> None:
        deleted: list = []
        for ns, idx in split_by_namespace(keys, self._base_ns).items():
            kb = [key_bytes(keys[i]) for i in idx]
            for dialog, part in self._marks.by_dialog(kb).items():
                res = self._call(sessions, ns, "delete", lambda c: self._delete_present(c, [kb[j] for j in part],
                                                                                     dialog))
                deleted += [keys[idx[j]] for j, gone in zip(part, res or ()) if gone]
        if deleted:
            self._notify_keys_deleted(deleted, [self._object_bytes] * len(deleted))

    @staticmethod
    def _delete_present(c: Client, kb: list[bytes], dialog: bytes | None) -> list[bool]:
        """Delete the keys that exist; per key, whether it was there (deleted).  Only those are reported
        to LMCache's listeners, whose byte accounting a key deleted twice, or never stored, would drive
        below zero (``delete_many`` answers a count, not which keys)."""
        present = c.exists_many(kb, dialog=dialog)
        there = [k for k, p in zip(kb, present) if p]
        if there:
            c.delete_many(there, dialog=dialog)
        return present


__all__ = ["KvgateL2Adapter", "KvgateL2AdapterConfig"]
