"""KvgateRemoteConnector against a real gateway, with LMCache's own classes; run with .venv-lmcache/bin/python.

    python lmcache_remote_checks.py SCENARIO SOCKET-or-HOST:PORT OUT.json

Built from LMCache 0.5.6's real LMCacheEngineConfig, LMCacheMetadata,
LocalCPUBackend (its CPU allocator: every object returned by a get was
allocated there) and CacheEngineKeys; the loop is a thread of its own, as
LMCache runs it.  Scenarios (each asserts; exit status 0 when all held):

  direct   the connector built as LMCache's DynamicConnectorAdapter builds it: put / batched_put
           (one gateway call per batch), exists / exists_sync / batched_contains /
           batched_async_contains, get / batched_get / batched_get_non_blocking into MemoryObjs with
           identical bytes (a partial chunk reshaped), a miss, another model / worker / tags -> miss,
           remove_sync, list.
  outage   stores, then prints "KILL" and waits for a line on stdin (the test SIGKILLs the gateway):
           exists False, get None, puts logged as failures, no exception, fast; prints "RESTART" and
           waits again (the test restarts the gateway on the same socket): works again.
  factory  LMCache's own path: RemoteBackend(plugin_name=...) -> CreateConnector -> ConnectorManager
           reading remote_storage_plugins / extra_config: batched_submit_put_task, contains,
           batched_contains, get_blocking, batched_get_blocking, batched_get_non_blocking.
Writes a JSON summary to OUT.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

from kvgate.client.async_client import AsyncClient  # noqa: E402
from kvgate.integrations.lmcache import KvgateRemoteConnector  # noqa: E402

MODEL = "org/tiny-model"
CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 32)  # (layers, 2, chunk, heads, head size): 8 KiB per float16 chunk

CALLS = {"exists_many": 0, "get_many": 0, "put_many": 0}


def _count(name: str) -> None:
    orig = getattr(AsyncClient, name)

    async def counted(self, *a, **kw):
        CALLS[name] += 1
        return await orig(self, *a, **kw)
    setattr(AsyncClient, name, counted)


for _n in CALLS:
    _count(_n)


def config(target: str, **extra) -> LMCacheEngineConfig:
    where = {"kvgate.address": target} if ":" in target and "/" not in target else {"kvgate.socket": target}
    ec = {"remote_storage_plugin.kvgate.module_path": "kvgate.integrations.lmcache",
          "remote_storage_plugin.kvgate.class_name": "KvgateRemoteConnector",
          "remote_storage_plugin.kvgate.kvgate.io_timeout": 3,
          "remote_storage_plugin.kvgate.kvgate.lookup_timeout": 1,
          "remote_storage_plugin.kvgate.kvgate.connect_timeout": 1,
          **{f"remote_storage_plugin.kvgate.{k}": v for k, v in where.items()}, **extra}
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=0.05,
                                             remote_storage_plugins=["kvgate"], extra_config=ec)


def metadata(worker: int = 0) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=2, local_world_size=2, worker_id=worker,
                           local_worker_id=worker, kv_dtype=torch.float16, kv_shape=KV_SHAPE,
                           chunk_size=CHUNK_TOKENS)


def key(i: int, model: str = MODEL, worker: int = 0, tags: dict | None = None) -> CacheEngineKey:
    return CacheEngineKey(model, 2, worker, 0x5EED0000 + i, torch.float16,
                          {f"lmcache.tag.{k}": v for k, v in (tags or {}).items()})


def start_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="lmcache-loop").start()
    return loop


def on(loop, coro, timeout: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def filled(backend: LocalCPUBackend, md: LMCacheMetadata, seed: int, tokens: int = CHUNK_TOKENS):
    obj = backend.allocate(md.get_shapes(tokens), md.get_dtypes(), busy_loop=False)
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(obj.byte_array),), dtype=torch.uint8, generator=g).numpy().tobytes()
    np.frombuffer(obj.byte_array, np.uint8)[:] = np.frombuffer(data, np.uint8)  # byte_array's format is '<B'
    return obj, data


def setup(target: str, worker: int = 0):
    cfg, md = config(target), metadata(worker)
    backend = LocalCPUBackend(cfg, md)
    loop = start_loop()
    conn = KvgateRemoteConnector(loop=loop, local_cpu_backend=backend, config=cfg)
    return cfg, md, backend, loop, conn


def check_round_trip(conn, backend, md, loop, out: dict) -> dict[int, bytes]:
    """Stores keys 0-3 (3 a partial chunk); checks lookups and gets; returns what was stored."""
    stored: dict[int, bytes] = {}
    obj, stored[0] = filled(backend, md, 0)
    before = dict(CALLS)
    on(loop, conn.put(key(0), obj))
    obj.ref_count_down()
    objs = []
    for i in (1, 2, 3):
        o, stored[i] = filled(backend, md, i, tokens=CHUNK_TOKENS if i < 3 else 5)
        objs.append(o)
    on(loop, conn.batched_put([key(1), key(2), key(3)], objs))
    for o in objs:
        o.ref_count_down()
    assert CALLS["put_many"] - before["put_many"] == 2, CALLS  # one per batch
    assert len(stored[3]) == len(stored[0]) * 5 // CHUNK_TOKENS

    assert on(loop, conn.exists(key(0))) is True
    assert conn.exists_sync(key(2)) is True
    before = dict(CALLS)
    assert conn.batched_contains([key(i) for i in range(6)]) == 4
    assert on(loop, conn.batched_async_contains("l1", [key(i) for i in range(4)])) == 4
    assert CALLS["exists_many"] - before["exists_many"] == 2, CALLS

    got = on(loop, conn.get(key(0)))
    assert got is not None and bytes(got.byte_array) == stored[0]
    assert got.get_shapes() == md.get_shapes(), got.get_shapes()
    got.ref_count_down()

    before = dict(CALLS)
    t = time.perf_counter()
    objs = on(loop, conn.batched_get([key(i) for i in (0, 1, 2, 3, 9)]))
    out["batched_get_ms"] = round((time.perf_counter() - t) * 1000, 2)
    assert CALLS["get_many"] - before["get_many"] == 1, CALLS
    assert objs[4] is None
    for i in range(4):
        assert objs[i] is not None and bytes(objs[i].byte_array) == stored[i], i
    assert list(objs[3].meta.shape)[2] == 5, objs[3].meta.shape  # the partial chunk: 5 tokens
    for o in objs[:4]:
        o.ref_count_down()

    pre = on(loop, conn.batched_get_non_blocking("l1", [key(0), key(1), key(8), key(2)]))
    assert [bytes(o.byte_array) for o in pre] == [stored[0], stored[1]]
    for o in pre:
        o.ref_count_down()
    return stored


def direct(target: str, out: dict) -> None:
    cfg, md, backend, loop, conn = setup(target)
    out["allocator"] = type(backend.memory_allocator).__name__
    stored = check_round_trip(conn, backend, md, loop, out)

    # misses: a key never stored, another model, another worker, other tags
    assert on(loop, conn.exists(key(7))) is False and on(loop, conn.get(key(7))) is None
    for other in (key(0, model="org/other-model"), key(0, worker=1), key(0, tags={"user": "b"})):
        assert on(loop, conn.exists(other)) is False, other
        assert on(loop, conn.get(other)) is None, other
    tagged, data = filled(backend, md, 50)
    on(loop, conn.put(key(5, tags={"user": "a"}), tagged))
    tagged.ref_count_down()
    assert on(loop, conn.exists(key(5, tags={"user": "a"}))) is True
    assert on(loop, conn.exists(key(5))) is False and on(loop, conn.exists(key(5, tags={"user": "b"}))) is False

    # another process's connector (worker 1 of the same engine) sees its own namespace only
    _, md1, backend1, loop1, conn1 = setup(target, worker=1)
    assert on(loop1, conn1.exists(key(0))) is True  # a key names its worker: worker 1 may read worker 0's
    assert on(loop1, conn1.exists(key(0, worker=1))) is False
    g = on(loop1, conn1.get(key(1)))
    assert g is not None and bytes(g.byte_array) == stored[1]
    g.ref_count_down()
    on(loop1, conn1.close())

    assert conn.remove_sync(key(2)) is True and on(loop, conn.exists(key(2))) is False
    assert on(loop, conn.list()) == []
    out["status"] = conn.report_status()
    on(loop, conn.close())
    assert on(loop, conn.exists(key(0))) is False  # closed: no reconnect


def outage(target: str, out: dict) -> None:
    cfg, md, backend, loop, conn = setup(target)
    stored = {}
    objs = []
    for i in range(3):
        o, stored[i] = filled(backend, md, 100 + i)
        objs.append(o)
    on(loop, conn.batched_put([key(i) for i in range(3)], objs))
    assert on(loop, conn.exists(key(0))) is True
    print("KILL", flush=True)
    sys.stdin.readline()

    t = time.perf_counter()
    answers = []
    for _ in range(5):
        answers.append(on(loop, conn.exists(key(0))))
        answers.append(on(loop, conn.get(key(1))))
        answers.append(conn.batched_contains([key(0), key(1)]))
        answers.append(on(loop, conn.batched_get([key(0), key(1)])))
        on(loop, conn.batched_put([key(10)], objs[:1]))
        on(loop, conn.put(key(11), objs[0]))
    out["twenty_calls_down_s"] = round(time.perf_counter() - t, 3)
    assert answers == [False, None, 0, [None, None]] * 5, answers
    assert conn.report_status()["is_healthy"] is False

    print("RESTART", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 20
    while not on(loop, conn.exists(key(0))):  # after the back-off, the connector reconnects
        assert time.monotonic() < deadline, "the connector did not come back"
        time.sleep(0.2)
    out["back_after_s"] = round(time.perf_counter() - t, 2)
    got = on(loop, conn.batched_get([key(0), key(1), key(2)]))
    assert [bytes(g.byte_array) for g in got] == [stored[0], stored[1], stored[2]]
    for g in got:
        g.ref_count_down()
    on(loop, conn.batched_put([key(12)], objs[:1]))
    assert on(loop, conn.exists(key(12))) is True
    for o in objs:
        o.ref_count_down()
    out["status"] = conn.report_status()
    assert out["status"]["outages"] == 1, out["status"]
    on(loop, conn.close())


def factory(target: str, out: dict) -> None:
    from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    cfg, md = config(target), metadata()
    backend = LocalCPUBackend(cfg, md)
    loop = start_loop()
    rb = RemoteBackend(cfg, md, loop, backend, "cpu", plugin_name="kvgate")
    assert isinstance(rb.connection, InstrumentedRemoteConnector), rb.connection
    inner = rb.connection.getWrappedConnector()
    assert isinstance(inner, KvgateRemoteConnector) and inner.plugin_name == "kvgate", inner
    out["connection"] = repr(rb.connection)

    stored = {}
    objs, keys = [], [key(20 + i) for i in range(4)]
    for i in range(4):
        o, stored[i] = filled(backend, md, 200 + i)
        objs.append(o)
    before = dict(CALLS)
    rb.batched_submit_put_task(keys, objs)
    deadline = time.monotonic() + 10  # the put runs on the loop; LMCache then drops the refs it took
    while inner.counters["stored"] < 4 or [o.get_ref_count() for o in objs] != [1] * 4:
        assert time.monotonic() < deadline, (inner.counters, [o.get_ref_count() for o in objs])
        time.sleep(0.02)
    assert CALLS["put_many"] - before["put_many"] == 1, CALLS

    assert rb.contains(keys[0]) is True and rb.contains(key(29)) is False
    assert rb.batched_contains(keys + [key(29)]) == 4
    got = rb.get_blocking(keys[1])
    assert got is not None and bytes(got.byte_array) == stored[1]
    got.ref_count_down()
    before = dict(CALLS)
    got = rb.batched_get_blocking(keys)
    assert CALLS["get_many"] - before["get_many"] == 1, CALLS
    assert [bytes(g.byte_array) for g in got] == [stored[i] for i in range(4)]
    for g in got:
        g.ref_count_down()
    pre = on(loop, rb.batched_get_non_blocking("l2", [keys[0], keys[1], key(29)]))
    assert [bytes(g.byte_array) for g in pre] == [stored[0], stored[1]]
    for g in pre:
        g.ref_count_down()
    assert on(loop, rb.batched_async_contains("l2", keys)) == 4
    assert rb.remove(keys[3]) is True and rb.contains(keys[3]) is False
    out["status"] = inner.report_status()
    rb.close()
    for o in objs:
        o.ref_count_down()


def main() -> None:
    scenario, target, out_path = sys.argv[1:4]
    out: dict = {}
    {"direct": direct, "outage": outage, "factory": factory}[scenario](target, out)
    out["calls"] = CALLS
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)
    print("OK", flush=True)
    os._exit(0)  # LMCache's threads (stats, loops) would keep the process alive


if __name__ == "__main__":
    main()
