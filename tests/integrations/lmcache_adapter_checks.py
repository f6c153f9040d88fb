"""The kvgate L2 adapter against a real gateway, with LMCache's own classes; run with .venv-lmcache/bin/python.

    python lmcache_adapter_checks.py SCENARIO SOCKET-or-HOST:PORT OUT.json

Scenarios (each asserts; exit status 0 when every check held):
  roundtrip  store -> lookup-and-lock -> load into fresh TensorMemoryObjs (anonymous memory: staged copies)
             -> unlock; a key never stored misses; another rank/salt is another namespace; delete;
             a load of an object of another size fails that key.
  zerocopy   the same with L1 buffers inside a /dev/shm SharedMemory given as l1_memory_desc: the
             adapter registers it (report_status says so) and bytes still round-trip.
  dead       SOCKET has no gateway (and L1 is a /dev/shm file): every submit returns at once, tasks
             fail / miss, no exception.
  restart    (after 'roundtrip' wrote to the gateway, which the test restarts) a new adapter
             finds and loads what the first one stored.
  marks      conversations behind one system prompt, two kv ranks each: lookup, then a store of what
             missed, as LMCache does; every store is placed by the dialog mark its lookup took, and
             restores byte-identical.  The summary names each chunk's object (its digest) for the test
             to find on the cards.
Writes a JSON summary (timings, report_status) to OUT.json.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kvgate.integrations.lmcache import KvgateL2Adapter, KvgateL2AdapterConfig  # noqa: E402

CHUNK = 64 << 10  # bytes per object
SHAPE = torch.Size([2, 2, 64, 64])  # float32: 64 KiB


def mem_obj(raw: torch.Tensor) -> TensorMemoryObj:
    meta = MemoryObjMetadata(shape=SHAPE, dtype=torch.float32, address=raw.data_ptr(), phy_size=raw.numel(),
                             ref_count=1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def keys(n: int, rank: int = 0, salt: str = "", start: int = 0) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=f"chunk-{i}".encode().ljust(32, b"."), model_name="org/tiny-model", kv_rank=rank,
                      cache_salt=salt) for i in range(start, start + n)]


def payload(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g)


def wait(efd: int, poll, tid, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        r = poll(tid)
        if r is not None:
            return r
        left = deadline - time.monotonic()
        assert left > 0, f"task {tid} did not finish in {timeout} s"
        select.select([efd], [], [], min(left, 0.5))


def wait_store(ad: KvgateL2Adapter, tid, timeout: float = 20.0):
    done: dict = {}

    def poll(t):
        done.update(ad.pop_completed_store_tasks())
        return done.pop(t, None)
    return wait(ad.get_store_event_fd(), poll, tid, timeout)


def bits(bm, n: int) -> list[int]:
    return [1 if bm.test(i) else 0 for i in range(n)]


def gateway_holds(sock: str) -> int:
    """Objects the gateway holds for sessions (its stats, over an admin session)."""
    from kvgate.client import Client

    with Client.connect(sock, role="admin", want_shm=False, timeout=10) as c:
        return c.stats()["holds"]["objects"]


def adapter(sock: str, l1=None, **extra) -> KvgateL2Adapter:
    target = {"kvgate.address": sock} if ":" in sock and "/" not in sock else {"kvgate.socket": sock}
    cfg = KvgateL2AdapterConfig.from_dict({**target, "kvgate.io_timeout": 3,
                                           "kvgate.lookup_timeout": 1, **extra})
    return KvgateL2Adapter(cfg, l1_memory_desc=l1)


def roundtrip(sock: str, out: dict, buffers=None, l1=None) -> None:
    ad = adapter(sock, l1)
    try:
        n = 8
        ks = keys(n)
        src = buffers[:n] if buffers is not None else [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(n)]
        for i, b in enumerate(src):
            b.copy_(payload(i))
        fds = {ad.get_store_event_fd(), ad.get_lookup_and_lock_event_fd(), ad.get_load_event_fd()}
        assert len(fds) == 3, "the three event fds must be distinct"
        t0 = time.perf_counter()
        res = wait_store(ad, ad.submit_store_task(ks, [mem_obj(b) for b in src]))
        out["store_s"] = time.perf_counter() - t0
        assert res.is_successful() and res.bytes_transferred() == n * CHUNK, res

        probe = ks[:5] + keys(2, start=100) + keys(1, rank=1) + keys(1, salt="tenant-b")
        t0 = time.perf_counter()
        bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                  ad.submit_lookup_and_lock_task(probe, {}))
        out["lookup_s"] = time.perf_counter() - t0
        assert bits(bm, len(probe)) == [1] * 5 + [0] * 4, bits(bm, len(probe))
        assert ad.report_status()["locked_key_count"] == 5
        assert gateway_holds(sock) == 5  # the gateway keeps the five found on their card

        dst = buffers[n:2 * n] if buffers is not None else [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(n)]
        for b in dst:
            b.zero_()
        t0 = time.perf_counter()
        bm = wait(ad.get_load_event_fd(), ad.query_load_result, ad.submit_load_task(ks, [mem_obj(b) for b in dst]))
        out["load_s"] = time.perf_counter() - t0
        assert bits(bm, n) == [1] * n, bits(bm, n)
        for i, b in enumerate(dst):
            assert torch.equal(b, payload(i)), f"object {i} came back with other bytes"
        ad.submit_unlock(ks[:5])
        assert ad.report_status()["locked_key_count"] == 0
        deadline = time.monotonic() + 10  # released by the adapter's lookup thread, on the session that holds
        while gateway_holds(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gateway_holds(sock) == 0

        # a load buffer of another size: that key fails, the others load
        small = torch.zeros(CHUNK // 2, dtype=torch.uint8)
        meta = MemoryObjMetadata(shape=torch.Size([2, 2, 32, 64]), dtype=torch.float32, address=small.data_ptr(),
                                 phy_size=small.numel(), ref_count=1, fmt=MemoryFormat.KV_2LTD)
        odd = TensorMemoryObj(raw_data=small, metadata=meta, parent_allocator=None)
        bm = wait(ad.get_load_event_fd(), ad.query_load_result,
                  ad.submit_load_task(ks[:2], [odd, mem_obj(torch.zeros(CHUNK, dtype=torch.uint8))]))
        assert bits(bm, 2) == [0, 1], bits(bm, 2)

        # delete: the key is gone, a load of it fails cleanly
        ad.delete(ks[7:8])  # queued on the lookup thread: it runs before the lookup queued next
        bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                  ad.submit_lookup_and_lock_task(ks[6:8], {}))
        assert bits(bm, 2) == [1, 0], bits(bm, 2)
        junk = torch.full((CHUNK,), 7, dtype=torch.uint8)
        bm = wait(ad.get_load_event_fd(), ad.query_load_result, ad.submit_load_task(ks[7:8], [mem_obj(junk)]))
        assert bits(bm, 1) == [0] and bool((junk == 7).all()), "a missing object must fail and leave the buffer"
        usage = ad.get_usage()
        assert usage.total_bytes_used == 7 * CHUNK, usage
        out["status"] = ad.report_status()
        assert out["status"]["is_healthy"] and out["status"]["store_failed"] == 0
    finally:
        ad.close()


def zerocopy(sock: str, out: dict) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=16 * CHUNK + 4096)
    try:
        base = torch.frombuffer(shm.buf, dtype=torch.uint8)
        bufs = [base[4096 + i * CHUNK: 4096 + (i + 1) * CHUNK] for i in range(16)]
        l1 = L1MemoryDesc(ptr=base.data_ptr() + 4096, size=16 * CHUNK, align_bytes=4096)
        roundtrip(sock, out, buffers=bufs, l1=l1)
        st = out["status"]
        assert st["l1_registered"] == "/dev/shm/" + shm.name, st
        assert st["zero_copy_sessions"] >= 2, st  # the store and the load sessions registered it
        del base, bufs
    finally:
        shm.close()
        shm.unlink()


def restart(sock: str, out: dict) -> None:
    ad = adapter(sock)
    try:
        ks = keys(7)
        bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                  ad.submit_lookup_and_lock_task(ks, {}))
        assert bits(bm, 7) == [1] * 7, bits(bm, 7)
        dst = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in ks]
        bm = wait(ad.get_load_event_fd(), ad.query_load_result, ad.submit_load_task(ks, [mem_obj(b) for b in dst]))
        assert bits(bm, 7) == [1] * 7
        assert all(torch.equal(b, payload(i)) for i, b in enumerate(dst))
        ad.submit_unlock(ks)
    finally:
        ad.close()


def dead(sock: str, out: dict) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=4 * CHUNK)  # an L1 no gateway ever registers
    base = torch.frombuffer(shm.buf, dtype=torch.uint8)
    ad = adapter(sock, l1=L1MemoryDesc(ptr=base.data_ptr(), size=4 * CHUNK, align_bytes=4096))
    try:
        ks = keys(4)
        objs = [mem_obj(payload(i)) for i in range(4)]
        t0 = time.perf_counter()
        tids = [ad.submit_store_task(ks, objs), ad.submit_lookup_and_lock_task(ks, {}),
                ad.submit_load_task(ks, [mem_obj(torch.zeros(CHUNK, dtype=torch.uint8)) for _ in ks])]
        out["submit_s"] = time.perf_counter() - t0
        assert out["submit_s"] < 0.2, f"submitting took {out['submit_s']:.3f} s with no gateway"
        res = wait_store(ad, tids[0], 10)
        assert not res.is_successful(), res
        bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result, tids[1], 10)
        assert bits(bm, 4) == [0] * 4
        bm = wait(ad.get_load_event_fd(), ad.query_load_result, tids[2], 10)
        assert bits(bm, 4) == [0] * 4
        # more tasks while it is down (backoff): still answered promptly
        t0 = time.perf_counter()
        for _ in range(5):
            bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                      ad.submit_lookup_and_lock_task(ks, {}), 10)
            assert bits(bm, 4) == [0] * 4
        out["five_lookups_down_s"] = time.perf_counter() - t0
        st = ad.report_status()
        out["status"] = st
        assert st["is_healthy"] is False, st
    finally:
        ad.close()
        del base
        shm.close()
        shm.unlink()


def marks(sock: str, out: dict) -> None:
    from kvgate.integrations.lmcache.settings import key_bytes, namespace_for
    from kvgate.keys import encode_namespace, full_key, key_digest

    head, own, convs = 6, 3, 48

    def chunk(name: bytes, rank: int) -> ObjectKey:
        return ObjectKey(chunk_hash=name.ljust(32, b"."), model_name="org/tiny-model", kv_rank=rank)

    def request(c: int) -> list[ObjectKey]:  # LMCache's lookup: one row per kv rank, each from chunk 0
        names = [b"sys-%d" % i for i in range(head)] + [b"c%d-%d" % (c, i) for i in range(own)]
        return [chunk(n, rank) for rank in (0, 1) for n in names]

    def data(k: ObjectKey) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((bytes(k.chunk_hash), k.kv_rank)) & 0xFFFF_FFFF)
        return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g)

    def name(k: ObjectKey) -> str:
        return key_digest(full_key(encode_namespace(namespace_for(k)), key_bytes(k))).hex()

    ad = adapter(sock)
    try:
        heads_found = []
        for c in range(convs):
            ks = request(c)
            bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                      ad.submit_lookup_and_lock_task(ks, {}))
            hit = bits(bm, len(ks))
            heads_found.append(sum(hit))
            ad.submit_unlock([k for k, h in zip(ks, hit) if h])
            missing = [k for k, h in zip(ks, hit) if not h]
            res = wait_store(ad, ad.submit_store_task(missing, [mem_obj(data(k)) for k in missing]))
            assert res.is_successful(), (c, res)
        assert heads_found[0] == 0 and all(n == 2 * head for n in heads_found[1:]), heads_found
        for c in (0, convs - 1):  # restored whole, every byte
            ks = request(c)
            bm = wait(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                      ad.submit_lookup_and_lock_task(ks, {}))
            assert bits(bm, len(ks)) == [1] * len(ks), (c, bits(bm, len(ks)))
            dst = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in ks]
            bm = wait(ad.get_load_event_fd(), ad.query_load_result,
                      ad.submit_load_task(ks, [mem_obj(b) for b in dst]))
            assert bits(bm, len(ks)) == [1] * len(ks)
            assert all(torch.equal(b, data(k)) for k, b in zip(ks, dst)), f"conversation {c}: other bytes"
            ad.submit_unlock(ks)
        out["head"] = [name(k) for k in request(0) if bytes(k.chunk_hash).startswith(b"sys-")]
        out["convs"] = {c: [name(k) for k in request(c) if not bytes(k.chunk_hash).startswith(b"sys-")]
                        for c in range(convs)}
        out["status"] = st = ad.report_status()
        assert st["stored_marked"] == st["stored"] == convs * 2 * own + 2 * head, st
    finally:
        ad.close()


if __name__ == "__main__":
    scenario, sock, path = sys.argv[1:4]
    result: dict = {"scenario": scenario}
    {"roundtrip": roundtrip, "zerocopy": zerocopy, "dead": dead, "restart": restart,
     "marks": marks}[scenario](sock, result)
    with open(path, "w") as f:
        json.dump(result, f, default=str)
    print(f"{scenario}: ok {json.dumps(result, default=str)}", flush=True)
