"""KvgateL2Adapter walked through LMCache's own tests of its L2 adapter interface, against a real gateway; run with .venv-lmcache/bin/python.

    python lmcache_l2_conformance.py SOCKET OUT.json

What each group of cases follows (LMCache 0.5.6):

- ``check_mode_test_l2_adapter``: the L2 adapter test LMCache's wheel ships
  (``lmcache.v1.check.check_mode_test_l2_adapter``, what ``lmcache check``'s
  ``test_l2_adapter`` mode runs): its ``_test_single_adapter`` is run as is on
  this adapter, and every validation line it prints must be whole (n/n);
- ``TestEventFd*`` .. ``TestClose*``: LMCache's contract tests of
  ``L2AdapterInterface`` (its repository's
  ``tests/v1/distributed/test_mock_l2_adapter.py``, "written based on the
  L2AdapterInterface contract defined in base.py ... only public methods"),
  with its bandwidth-simulation tests left out (a mock's own feature);
- ``TestDeleteRespectsLocks``: LMCache's convention for ``delete`` on keys a
  lookup locked, from its native connector adapter's tests of that name ("Same
  convention as the S3 / Valkey / Bigtable / HFBucket adapters: ``delete()``
  skips keys with a non-zero lock refcount"; 0.5.6's S3 adapter documents it
  the same way): a locked key survives a delete, a delete after its unlock
  deletes it, byte accounting moves only for what was deleted;
- ``TestDelete``: its fs adapter's delete tests
  (``tests/v1/distributed/l2_adapters/test_fs_l2_adapter_delete.py``): listeners
  told once per key actually deleted.  kvgate's ``delete`` is asynchronous (it
  runs on the adapter's lookup thread, never blocking LMCache's thread on the
  gateway; LMCache's base class asks the notification "once the deletion
  completes"), so these cases wait for the notification where the fs tests
  read it at once; a lookup submitted after a delete runs after it.

Writes {"lmcache": version, "cases": {name: "ok" | "FAIL: ..."}} to OUT.json;
the exit status is 0 whatever the cases found (the test reads them).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import sys
import time
import traceback

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kvgate.integrations.lmcache import KvgateL2Adapter, KvgateL2AdapterConfig  # noqa: E402

SOCKET = ""
cases: dict[str, object] = {}
results: dict[str, str] = {}
_model = [0]


def case(fn):
    cases[fn.__qualname__.replace(".", "::")] = fn
    return fn


def model_name() -> str:
    """A model of each adapter's own (LMCache's keys name their model): nothing one case stored is seen by
    another (the namespaces differ)."""
    _model[0] += 1
    return f"conformance-model-{os.getpid()}-{_model[0]}"


def new_adapter(l1: L1MemoryDesc | None = None) -> KvgateL2Adapter:
    cfg = KvgateL2AdapterConfig.from_dict({"kvgate.socket": SOCKET, "kvgate.io_timeout": 5,
                                           "kvgate.lookup_timeout": 5})
    ad = KvgateL2Adapter(cfg, l1_memory_desc=l1)
    ad.test_model = model_name()  # type: ignore[attr-defined]
    return ad


def with_adapter(fn):
    """The mock adapter tests' ``adapter`` fixture: a new adapter, closed after the case."""
    def run():
        ad = new_adapter()
        try:
            fn(ad)
        finally:
            ad.close()
    run.__qualname__ = fn.__qualname__
    return run


def create_object_key(ad: KvgateL2Adapter, chunk_id: int) -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(chunk_id), model_name=ad.test_model, kv_rank=0)


def create_memory_obj(size: int = 1024, fill_value: float = 1.0) -> TensorMemoryObj:
    raw = torch.empty(size, dtype=torch.float32)
    raw.fill_(fill_value)
    meta = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.float32, address=0, phy_size=size * 4,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def wait_for_event_fd(fd: int, timeout: float = 5.0) -> bool:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if poll.poll(timeout * 1000):
        try:
            os.read(fd, 8)
        except BlockingIOError:
            pass
        return True
    return False


def store(ad, keys, objs) -> None:
    """Store and wait for the task (every case's first step)."""
    tid = ad.submit_store_task(keys, objs)
    done: dict = {}
    deadline = time.monotonic() + 10
    while tid not in done:
        assert time.monotonic() < deadline, "store task did not complete"
        wait_for_event_fd(ad.get_store_event_fd(), 0.5)
        done.update(ad.pop_completed_store_tasks())
    assert done[tid].is_successful(), done[tid]


def lookup(ad, keys) -> list[bool]:
    tid = ad.submit_lookup_and_lock_task(keys, {})
    deadline = time.monotonic() + 10
    while (bm := ad.query_lookup_and_lock_result(tid)) is None:
        assert time.monotonic() < deadline, "lookup task did not complete"
        wait_for_event_fd(ad.get_lookup_and_lock_event_fd(), 0.5)
    return [bm.test(i) for i in range(len(keys))]


def keys_present(ad, keys) -> list[bool]:
    """Look up and unlock at once: per key, whether it is there."""
    present = lookup(ad, keys)
    ad.submit_unlock([k for k, p in zip(keys, present) if p])
    return present


def load(ad, keys, objs) -> list[bool]:
    tid = ad.submit_load_task(keys, objs)
    deadline = time.monotonic() + 10
    while (bm := ad.query_load_result(tid)) is None:
        assert time.monotonic() < deadline, "load task did not complete"
        wait_for_event_fd(ad.get_load_event_fd(), 0.5)
    return [bm.test(i) for i in range(len(keys))]


class Recorder:
    """A duck-typed ``L2AdapterListener`` (as LMCache's fs delete tests use)."""

    def __init__(self) -> None:
        self.stored: list = []
        self.accessed: list = []
        self.deleted: list = []

    def on_l2_keys_stored(self, keys, sizes) -> None:
        self.stored.extend(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys) -> None:
        self.accessed.extend(keys)

    def on_l2_keys_deleted(self, keys) -> None:
        self.deleted.extend(keys)


def eventually(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def settle(ad) -> None:
    """Wait until the adapter's lookup thread has run what was queued before (a lookup queued now runs after
    it): what a synchronous delete would have done is done."""
    keys_present(ad, [create_object_key(ad, 987654321)])


# ---- the shipped check: lmcache.v1.check.check_mode_test_l2_adapter ------------------------------


@case
def check_mode_test_l2_adapter():
    from lmcache.v1.check import check_mode_test_l2_adapter as shipped

    n, obj_size = 5, 1024
    l1_buffer = torch.empty(2 * n * obj_size, dtype=torch.bfloat16)
    ad = new_adapter(shipped._create_l1_memory_desc(l1_buffer))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            shipped._test_single_adapter(ad, ad.test_model, n, l1_buffer=l1_buffer, obj_size=obj_size,
                                         kv_dtype=torch.bfloat16)
    finally:
        ad.close()
    text = out.getvalue()
    counts = re.findall(r"Validation(?: \((?:loaded|content)\))?: (\d+)/(\d+)", text)
    assert len(counts) == 4 and all(a == b for a, b in counts), text
    assert "FAIL" not in text and "Batch store OK" in text, text


# ---- test_mock_l2_adapter.py: the L2AdapterInterface contract -------------------------------------


class TestEventFdInterface:
    @case
    @with_adapter
    def test_event_fds_are_valid_and_different(ad):
        fds = [ad.get_store_event_fd(), ad.get_lookup_and_lock_event_fd(), ad.get_load_event_fd()]
        assert all(isinstance(fd, int) and fd >= 0 for fd in fds) and len(set(fds)) == 3, fds


class TestStoreInterface:
    @case
    @with_adapter
    def test_submit_store_task_signals_event_fd(ad):
        tid = ad.submit_store_task([create_object_key(ad, 1)], [create_memory_obj()])
        assert isinstance(tid, int)
        assert wait_for_event_fd(ad.get_store_event_fd())

    @case
    @with_adapter
    def test_pop_completed_store_tasks_returns_completed_then_clears(ad):
        tid = ad.submit_store_task([create_object_key(ad, 1)], [create_memory_obj()])
        assert wait_for_event_fd(ad.get_store_event_fd())
        completed = ad.pop_completed_store_tasks()
        assert tid in completed and completed[tid].is_successful(), completed
        assert ad.pop_completed_store_tasks() == {}

    @case
    @with_adapter
    def test_submit_multiple_store_tasks(ad):
        tids = [ad.submit_store_task([create_object_key(ad, i)], [create_memory_obj(fill_value=float(i))])
                for i in range(3)]
        assert len(set(tids)) == 3
        completed: dict = {}
        deadline = time.monotonic() + 10
        while len(completed) < 3 and time.monotonic() < deadline:
            wait_for_event_fd(ad.get_store_event_fd(), 0.5)
            completed.update(ad.pop_completed_store_tasks())
        assert all(completed[t].is_successful() for t in tids), completed

    @case
    @with_adapter
    def test_store_batch_of_objects(ad):
        store(ad, [create_object_key(ad, i) for i in range(5)], [create_memory_obj(fill_value=float(i))
                                                                  for i in range(5)])


class TestLookupAndLockInterface:
    @case
    @with_adapter
    def test_lookup_signals_event_fd(ad):
        tid = ad.submit_lookup_and_lock_task([create_object_key(ad, 1)], {})
        assert isinstance(tid, int) and wait_for_event_fd(ad.get_lookup_and_lock_event_fd())

    @case
    @with_adapter
    def test_lookup_nonexistent_existing_and_mixed(ad):
        assert lookup(ad, [create_object_key(ad, 999)]) == [False]
        store(ad, [create_object_key(ad, 1)], [create_memory_obj()])
        assert lookup(ad, [create_object_key(ad, 1)]) == [True]
        assert lookup(ad, [create_object_key(ad, 1), create_object_key(ad, 999)]) == [True, False]

    @case
    @with_adapter
    def test_query_lookup_result_unknown_task_and_once_only(ad):
        assert ad.query_lookup_and_lock_result(99999) is None
        tid = ad.submit_lookup_and_lock_task([create_object_key(ad, 1)], {})
        assert wait_for_event_fd(ad.get_lookup_and_lock_event_fd())
        assert ad.query_lookup_and_lock_result(tid) is not None
        assert ad.query_lookup_and_lock_result(tid) is None


class TestUnlockInterface:
    @case
    @with_adapter
    def test_unlock_never_raises(ad):
        ad.submit_unlock([create_object_key(ad, 1)])  # never locked
        store(ad, [create_object_key(ad, 1)], [create_memory_obj()])
        assert lookup(ad, [create_object_key(ad, 1)]) == [True]
        ad.submit_unlock([create_object_key(ad, 1)])


class TestLoadInterface:
    @case
    @with_adapter
    def test_load_signals_event_fd_and_nonexistent_is_zero(ad):
        tid = ad.submit_load_task([create_object_key(ad, 999)], [create_memory_obj()])
        assert isinstance(tid, int) and wait_for_event_fd(ad.get_load_event_fd())
        bm = ad.query_load_result(tid)
        assert bm is not None and bm.test(0) is False
        assert ad.query_load_result(tid) is None
        assert ad.query_load_result(99999) is None

    @case
    @with_adapter
    def test_load_existing_key_copies_data(ad):
        store(ad, [create_object_key(ad, 1)], [create_memory_obj(size=100, fill_value=42.0)])
        dst = create_memory_obj(size=100, fill_value=0.0)
        assert load(ad, [create_object_key(ad, 1)], [dst]) == [True]
        assert torch.all(dst.tensor == 42.0)


class TestEndToEndWorkflow:
    @case
    @with_adapter
    def test_store_lookup_load_unlock_workflow(ad):
        keys = [create_object_key(ad, i) for i in range(5)]
        store(ad, keys, [create_memory_obj(size=64, fill_value=float(i * 10)) for i in range(5)])
        assert lookup(ad, keys) == [True] * 5
        dst = [create_memory_obj(size=64, fill_value=0.0) for _ in keys]
        assert load(ad, keys, dst) == [True] * 5
        assert all(torch.all(d.tensor == float(i * 10)) for i, d in enumerate(dst))
        ad.submit_unlock(keys)


class TestCloseInterface:
    @case
    def test_close_with_and_without_operations():
        new_adapter().close()
        ad = new_adapter()
        store(ad, [create_object_key(ad, 1)], [create_memory_obj()])
        ad.close()


# ---- the delete convention: a locked key survives a delete -----------------------------------------


class TestDeleteRespectsLocks:
    @case
    @with_adapter
    def test_delete_skips_locked_key(ad):
        key = create_object_key(ad, 1)
        store(ad, [key], [create_memory_obj()])
        assert lookup(ad, [key]) == [True]  # locked
        ad.delete([key])
        assert keys_present(ad, [key]) == [True], "a delete removed a key a lookup had locked"

    @case
    @with_adapter
    def test_delete_locked_key_succeeds_after_unlock(ad):
        key = create_object_key(ad, 1)
        store(ad, [key], [create_memory_obj()])
        assert lookup(ad, [key]) == [True]
        ad.delete([key])
        ad.submit_unlock([key])
        ad.delete([key])
        assert keys_present(ad, [key]) == [False]

    @case
    @with_adapter
    def test_delete_partial_lock_batch(ad):
        """Only the unlocked key goes, and only its bytes are freed (kvgate reports a deleted key's size as
        that of the last object stored: LMCache's chunks of one layout are one size, so the sizes here are
        equal, where LMCache's test varies them to catch a misaligned batch)."""
        rec = Recorder()
        ad.register_listener(rec)
        keys = [create_object_key(ad, i) for i in range(3)]
        store(ad, keys, [create_memory_obj(size=100, fill_value=float(i)) for i in range(3)])
        assert lookup(ad, keys) == [True] * 3
        before = ad.get_usage().total_bytes_used
        ad.submit_unlock([keys[1]])
        ad.delete(keys)
        assert keys_present(ad, keys) == [True, False, True]
        assert rec.deleted == [keys[1]], rec.deleted
        assert before - ad.get_usage().total_bytes_used == 400

    @case
    @with_adapter
    def test_delete_locked_key_preserves_usage(ad):
        key = create_object_key(ad, 1)
        store(ad, [key], [create_memory_obj(size=100)])
        assert lookup(ad, [key]) == [True]
        stored = ad.get_usage().total_bytes_used
        assert stored > 0
        ad.delete([key])
        settle(ad)
        assert ad.get_usage().total_bytes_used == stored

    @case
    @with_adapter
    def test_delete_skips_a_key_a_lookup_queued_before_it_locks(ad):
        """A lookup submitted before the delete (not finished yet) locks the key first: the delete skips it."""
        key = create_object_key(ad, 1)
        store(ad, [key], [create_memory_obj()])
        tid = ad.submit_lookup_and_lock_task([key], {})
        ad.delete([key])
        deadline = time.monotonic() + 10
        while (bm := ad.query_lookup_and_lock_result(tid)) is None:
            assert time.monotonic() < deadline
            wait_for_event_fd(ad.get_lookup_and_lock_event_fd(), 0.5)
        assert bm.test(0) is True
        ad.submit_unlock([key])
        assert keys_present(ad, [key]) == [True]


# ---- test_fs_l2_adapter_delete.py ------------------------------------------------------------------


class TestDelete:
    @case
    @with_adapter
    def test_delete_removes_keys_and_notifies(ad):
        rec = Recorder()
        ad.register_listener(rec)
        k1, k2 = create_object_key(ad, 1), create_object_key(ad, 2)
        store(ad, [k1, k2], [create_memory_obj(size=25), create_memory_obj(size=25)])
        assert dict(rec.stored) == {k1: 100, k2: 100}
        assert ad.get_usage().total_bytes_used == 200
        ad.delete([k1])
        eventually(lambda: rec.deleted == [k1], f"listeners told {rec.deleted}, not [k1]")
        assert ad.get_usage().total_bytes_used == 100
        assert keys_present(ad, [k1, k2]) == [False, True]

    @case
    @with_adapter
    def test_delete_missing_key_is_noop(ad):
        rec = Recorder()
        ad.register_listener(rec)
        ad.delete([create_object_key(ad, 0xFF)])
        settle(ad)
        assert rec.deleted == [] and ad.get_usage().total_bytes_used == 0, (rec.deleted, ad.get_usage())

    @case
    @with_adapter
    def test_double_delete_is_idempotent(ad):
        rec = Recorder()
        ad.register_listener(rec)
        k = create_object_key(ad, 1)
        store(ad, [k], [create_memory_obj(size=10)])
        ad.delete([k])
        ad.delete([k])
        settle(ad)
        assert rec.deleted == [k], rec.deleted
        assert ad.get_usage().total_bytes_used == 0

    @case
    @with_adapter
    def test_empty_key_list_is_noop(ad):
        rec = Recorder()
        ad.register_listener(rec)
        ad.delete([])
        settle(ad)
        assert rec.deleted == []

    @case
    @with_adapter
    def test_load_after_delete_is_miss(ad):
        rec = Recorder()
        ad.register_listener(rec)
        k = create_object_key(ad, 1)
        store(ad, [k], [create_memory_obj(size=4)])
        ad.delete([k])
        settle(ad)
        assert load(ad, [k], [create_memory_obj(size=4, fill_value=0.0)]) == [False]
        assert rec.accessed == []

    @case
    def test_delete_after_close_does_not_raise():
        ad = new_adapter()
        rec = Recorder()
        ad.register_listener(rec)
        ad.close()
        ad.delete([create_object_key(ad, 1)])
        assert rec.deleted == []


if __name__ == "__main__":
    import lmcache

    SOCKET, out = sys.argv[1], sys.argv[2]
    for name, fn in cases.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - every case is reported, the next one runs
            results[name] = f"FAIL: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        print(f"{name}: {results[name].splitlines()[0]}", file=sys.stderr, flush=True)
    version = getattr(lmcache, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("lmcache")
    with open(out, "w") as f:
        json.dump({"lmcache": version, "cases": results}, f)
