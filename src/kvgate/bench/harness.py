"""Figures 1-5 of ``kvgate bench``: real gateways, a client's registered region, and the raw baselines beside them.

The bench starts its own gateways (real ``kvgate serve`` processes, as an
engine would talk to) and moves bytes the way engines do: through a
/dev/shm file the client registers, so the gateway reads and writes the
engine's memory in place.

    A  RAM tier twice the working set       -> figure 1 (RAM get), the same
                                               get into plain buffers, and over
                                               TCP (inline bytes) against a raw
                                               loopback socket
    B  RAM tier off (``--max-bytes 0``)     -> figures 2-5 (card get warm, also
                                               into plain buffers, and cold,
                                               card put, lookup)

Plain buffers (``kvgate.bench.plain``) are numpy arrays of the bench's own,
outside any registered region: how SGLang's and LMCache's host pools and
plain Python users call ``get_many``.
"""

from __future__ import annotations

import glob
import mmap
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvgate.bench import BenchError
from kvgate.bench.baselines import (
    can_drop_caches,
    direct_ok,
    drop_caches,
    loopback_pair,
    on_threads,
    read_files,
    read_files_direct,
    read_files_verified,
    write_files,
    write_files_verified,
)
from kvgate.bench.measure import Contender, Plan, Series, figure, measure, ratio
from kvgate.bench.plain import plain_card_get_warm, plain_get
from kvgate.bench.processes import GatewayProcess, free_port
from kvgate.cards.objectformat import header_size, padded_size
from kvgate.client import Client
from kvgate.keys import encode_namespace, full_key, key_digest

NAMESPACE = "kvgate-bench"
LOOKUP_KEYS = 1000
LOOKUP_OBJECT_SIZE = 4096
RAM_PAGE_SIZE = 256 << 10  # the gateway's default ram_page_size, to size tier A
READY_S = 60.0  # gateways started together import and touch their RAM tiers on the same cores


def bench_gateway(name: str, workdir: str, sockdir: str, *, max_bytes: int, threads: int, card_capacity: int,
                  cards: int = 1, tcp: bool = False, extra: Sequence[str] = ()) -> GatewayProcess:
    """A gateway of the bench: socket in ``sockdir``, cards and log in ``workdir``, in the bench's session
    (a Ctrl-C or hang-up at the terminal reaches the gateways too, not only the bench).

    One card: card-<name>; several: card-<name>-0 .. card-<name>-<N-1>, each a directory card of its own.
    """
    card_dirs = ([os.path.join(workdir, f"card-{name}")] if cards == 1 else
                 [os.path.join(workdir, f"card-{name}-{i}") for i in range(cards)])
    flags = [
        # TCP needs a port of its own: --port 0 turns the listener off
        "--storage-devices", *card_dirs, "--max-bytes", str(max_bytes), "--port", str(free_port() if tcp else 0),
        "--metrics-port", "0", "--socket", os.path.join(sockdir, f"{name}.sock"), "--card-capacity", str(card_capacity),
        "--thread-pool-size", str(threads), "--log-level", "warning", *extra,
    ]
    return GatewayProcess(workdir, flags, name=name, log_path=os.path.join(workdir, f"gateway-{name}.log"),
                          new_session=False)


def stop_gateways(gateways: Iterable[GatewayProcess], died: list[str]) -> list[Exception]:
    """Stop every gateway, even after one fails to stop; the failures.  Adds to ``died`` the log tails of
    those that had exited on their own."""
    errors = []
    for g in gateways:
        note = g.exit_note()
        if note is not None:
            died.append(note)
        try:
            g.stop()
        except Exception as e:  # noqa: BLE001 - stop the others anyway
            errors.append(e)
    return errors


class ShmRegion:
    """The client's own /dev/shm file, as an engine keeps its CPU KV tier.

    Allocated (``posix_fallocate``) and touched before anything is timed, so
    no figure pays first-touch page faults; registered with each gateway, so
    buffers inside it move with no copy on the client side.
    """

    def __init__(self, size: int):
        self.path = f"/dev/shm/kvgate-bench-{os.getpid()}"
        self.size = size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileExistsError:  # left by a dead bench that had our pid
            os.unlink(self.path)
            fd = os.open(self.path, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.array[:: mmap.PAGESIZE] = 0
        self.view = memoryview(self.mm)

    def slices(self, size: int, count: int) -> list[memoryview]:
        return [self.view[i * size : (i + 1) * size] for i in range(count)]

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self.view.release()
            self.mm.close()
        except BufferError:
            pass  # a slice is still referenced somewhere; the mapping goes with it (the file is gone already)


class Bench:
    """Everything one run of figures 1-5 owns: gateways, clients, region, scratch dirs; ``close`` undoes it all.

    Made and driven by ``kvgate.bench.command`` on the thread that runs the
    command: ``run`` blocks for the whole bench (it is the bench), handing raw
    baseline passes to ``pool``; ``close`` blocks until the gateways exited.
    ``progress`` is called on that thread between figures and must not block.
    """

    def __init__(self, plan: Plan, parent_dir: str, progress: Callable[[str], None]):
        self.plan = plan
        self.progress = progress
        self.parent_dir = parent_dir
        self.workdir = ""  # made by start(), under parent_dir
        self.sockdir = ""  # made by start(), under the temp dir
        self.died: list[str] = []  # log tails of gateways that were dead before close() stopped them
        self.gateways: list[GatewayProcess] = []
        self.clients: list[Client] = []
        self.region: ShmRegion | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.ns = encode_namespace(NAMESPACE)
        # Set by run(): what every figure shares.
        self.ram_client: Client
        self.card_client: Client
        self.tcp_client: Client  # the RAM gateway again, over TCP
        self.plain_clients: list[Client] = []  # one per gateway, with a session region: plain-buffer gets
        self.slices: list[memoryview] = []  # the batch's destinations (and put sources) in the region
        self.ref = np.empty(0, dtype=np.uint8)  # the batch's payload, outside the region
        self.timing: dict[str, Any] = {}

    @property
    def shm(self) -> ShmRegion:
        assert self.region is not None, "start() first"
        return self.region

    # -- setup / teardown --

    def start(self) -> tuple[Client, Client]:
        plan = self.plan
        ws = plan.pass_bytes
        os.makedirs(self.parent_dir, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="kvgate-bench-", dir=self.parent_dir)
        # Unix socket paths are limited to ~108 bytes: keep them short, apart from --dir.
        self.sockdir = tempfile.mkdtemp(prefix="kvgate-bench-")
        free = shutil.disk_usage(self.workdir).free
        if free < 4 * ws + (64 << 20):
            raise BenchError(f"{self.workdir}: {free >> 20} MiB free, the bench needs about {(4 * ws) >> 20} MiB")
        pages = -(-plan.object_size // RAM_PAGE_SIZE) * plan.batch
        card_capacity = max(8 << 30, 8 * ws)
        self.gateways = [
            bench_gateway("ram", self.workdir, self.sockdir, max_bytes=2 * pages * RAM_PAGE_SIZE,
                          threads=plan.threads, card_capacity=card_capacity, tcp=True),
            bench_gateway("card", self.workdir, self.sockdir, max_bytes=0, threads=plan.threads,
                          card_capacity=card_capacity),
        ]
        for g in self.gateways:  # both start at once: their imports and RAM-tier touching overlap
            g.spawn()
        size = max(ws, LOOKUP_KEYS * LOOKUP_OBJECT_SIZE)
        self.region = ShmRegion(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.pool = ThreadPoolExecutor(max_workers=plan.threads, thread_name_prefix="bench-raw")
        for g in self.gateways:
            g.wait_ready(READY_S)
            # No session region: every byte goes through our registered region, as an engine's would.
            c = Client.connect(g.socket, namespace=NAMESPACE, engine_id=f"kvgate-bench-{os.getpid()}",
                               want_shm=False, timeout=120)
            self.clients.append(c)
            c.register_region(self.region.path, self.region.mm)
        port = self.clients[0].stats()["gateway"]["port"]
        self.tcp_client = Client.connect(f"127.0.0.1:{port}", namespace=NAMESPACE,
                                         engine_id=f"kvgate-bench-{os.getpid()}", timeout=120)
        self.clients.append(self.tcp_client)
        for g in self.gateways:
            c = Client.connect(g.socket, namespace=NAMESPACE, engine_id=f"kvgate-bench-{os.getpid()}", timeout=120)
            self.plain_clients.append(c)
            self.clients.append(c)
        return self.clients[0], self.clients[1]

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except OSError:
                pass
        self.clients = []
        errors = stop_gateways(self.gateways, self.died)
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.region is not None:
            self.region.close()
        for d in (self.workdir, self.sockdir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        if errors:
            raise errors[0]

    # -- helpers --

    def _object_paths(self, card_dir: str, keys: list[bytes]) -> list[str]:
        """The card's files of ``keys``, in key order, found on disk as any reader would."""
        found = [p for p in glob.glob(os.path.join(card_dir, "db*", "*", "*"))
                 if ".tmp." not in os.path.basename(p) and os.path.isfile(p)]
        by_name = {os.path.basename(p): p for p in found}
        paths = []
        for k in keys:
            p = by_name.get(key_digest(full_key(self.ns, k)).hex())
            if p is None:
                raise BenchError(f"object {k!r} is not among the {len(found)} files under {card_dir}")
            paths.append(p)
        return paths

    @staticmethod
    def _check_got(got: list, size: int) -> None:
        for i, g in enumerate(got):
            if g is None:
                raise BenchError(f"object {i} missed")
            if len(g) != size:
                raise BenchError(f"object {i} came back with {len(g)} bytes, expected {size}")

    def _verify(self, ref: np.ndarray, what: str) -> None:
        got = self.shm.array[: ref.size]
        if not np.array_equal(got, ref):
            bad = int(np.argmax(got != ref))
            raise BenchError(f"{what}: wrong bytes at offset {bad} (object {bad // self.plan.object_size})")

    @property
    def thread_counts(self) -> list[int]:
        """The baselines run with the gateway's thread count and with one thread (once if they are equal)."""
        return list(dict.fromkeys((self.plan.threads, 1)))

    def raw_contenders(self, pass_fn: Callable[[int, int], None], before: Callable[[], None] | None = None,
                        after: Callable[[int], None] | None = None, kind: str = "raw") -> list[Contender]:
        """One contender per thread count, ``<kind><threads>``; ``pass_fn(round, threads)`` is one raw pass
        (``kind`` "verified": one that also hashes each payload; "direct": cold reads with O_DIRECT)."""
        return [Contender(f"{kind}{n}", lambda r, n=n: pass_fn(r, n), before, after) for n in self.thread_counts]

    def _direct_contenders(self, items: list[tuple[str, int, memoryview]]) -> list[Contender]:
        """Cold reads with O_DIRECT, one contender per thread count (none where O_DIRECT cannot read these)."""
        if not direct_ok(items):
            return []
        return self.raw_contenders(lambda _r, n: on_threads(self.pool, read_files_direct, items, n), drop_caches,
                                   kind="direct")

    def raw_figure(self, series: dict[str, Series], what: str) -> dict[str, Any]:
        """kvgate against the faster raw thread count: the physical limit is the best the machine does."""
        return figure(series, "kvgate", self.thread_counts, what)

    # -- figures --

    def run(self) -> dict[str, Any]:
        """Every figure, in order; returns ``{"figures": ..., "skipped": {figure: reason}}``."""
        self.progress("starting gateways")
        self.ram_client, self.card_client = self.start()
        ws = self.plan.pass_bytes
        self.slices = self.shm.slices(self.plan.object_size, self.plan.batch)
        # The payload, kept apart from the region: source of the copy baseline and of every check.
        self.ref = np.empty(ws, dtype=np.uint8)
        self.ref[:] = np.frombuffer(np.random.default_rng().bytes(ws), dtype=np.uint8)
        self.shm.array[:ws] = self.ref
        self.timing = dict(budget_s=self.plan.budget_s, min_rounds=self.plan.min_rounds,
                           max_rounds=self.plan.max_rounds)
        figures: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        self.progress("RAM-tier get")
        figures["ram_get"] = self._ram_get()
        self.progress("RAM-tier get into plain buffers")
        figures["plain_get"] = plain_get(self)
        self.progress("RAM-tier get over TCP")
        figures["tcp_get"] = self._tcp_get()
        self.progress("card get (warm)")
        figures["card_get_warm"], card_get, items = self._card_get_warm()
        self.progress("card get (warm) into plain buffers")
        figures["plain_card_get_warm"] = plain_card_get_warm(self, items)
        self.progress("card get (cold)")
        why = can_drop_caches()
        if why is None:
            figures["card_get_cold"] = self._card_get_cold(card_get, items)
        else:
            figures["card_get_cold"] = None
            skipped["card_get_cold"] = why
        self.progress("card put")
        figures["card_put"] = self._card_put()
        self.progress("lookup")
        os.sync()  # untimed: the put figure's writes reach the disk before lookups are timed, not during
        figures["lookup"] = self._lookup()
        self.progress("stopping gateways")
        return {"figures": figures, "skipped": skipped}

    def _ram_get(self) -> dict[str, Any]:
        """1. RAM tier into the registered region vs single-thread np.copyto into the same slices."""
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.ram_client
        keys = [f"ram-{i}".encode() for i in range(batch)]
        if not all(client.put_many(keys, slices, retention="short")):
            raise BenchError("the RAM-tier gateway did not store the batch (RAM tier too small?)")
        region[:ws] = 0
        self._check_got(client.get_many(keys, into=slices), osz)
        self._verify(ref, "RAM-tier get")
        src = [ref[i * osz : (i + 1) * osz] for i in range(batch)]
        dst = [region[i * osz : (i + 1) * osz] for i in range(batch)]

        def copy_pass(_r: int) -> None:
            for d, s in zip(dst, src):
                np.copyto(d, s)

        s = measure([Contender("kvgate", lambda _r: client.get_many(keys, into=slices)),
                     Contender("copyto", copy_pass)], ws, **self.timing)
        return ratio(s["kvgate"], {**s["copyto"].to_json(), "what": "np.copyto", "threads": 1})

    def _tcp_get(self) -> dict[str, Any]:
        """1b. The objects of 1 over TCP (inline bytes, one frame) vs a loopback socket moving the same bytes.

        The baseline sends the batch with ``sendall`` and receives it with
        ``recv_into`` straight into the same slices: what a TCP client of this
        machine's Python cannot beat.  The gateway also copies the objects out
        of its RAM tier into the reply, so a ratio of 1 is out of reach.
        """
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.tcp_client
        keys = [f"ram-{i}".encode() for i in range(batch)]  # stored by _ram_get
        region[:ws] = 0
        self._check_got(client.get_many(keys, into=slices), osz)
        self._verify(ref, "RAM-tier get over TCP")
        src = [ref[i * osz : (i + 1) * osz] for i in range(batch)]
        sender, receiver = loopback_pair()

        def send() -> None:
            for b in src:
                sender.sendall(b)

        def socket_pass(_r: int) -> None:
            assert self.pool is not None
            sending = self.pool.submit(send)
            for d in slices:
                view, got = d, 0
                while got < len(view):
                    n = receiver.recv_into(view[got:])
                    if not n:
                        raise BenchError("the loopback socket closed")
                    got += n
            sending.result()

        try:
            region[:ws] = 0
            socket_pass(0)
            self._verify(ref, "loopback socket")
            s = measure([Contender("kvgate", lambda _r: client.get_many(keys, into=slices)),
                         Contender("socket", socket_pass)], ws, **self.timing)
        finally:
            sender.close()
            receiver.close()
        return ratio(s["kvgate"], {**s["socket"].to_json(), "what": "loopback TCP sendall/recv_into",
                                   "threads": 1})

    def _card_get_warm(self) -> tuple[dict[str, Any], Callable[[int], None], list[tuple[str, int, memoryview]]]:
        """2. Card get, page cache warm, vs open+preadv+close of the same files into the same bytes."""
        osz, batch, ws = self.plan.object_size, self.plan.batch, self.plan.pass_bytes
        region, ref, slices, client = self.shm.array, self.ref, self.slices, self.card_client
        keys = [f"card-{i}".encode() for i in range(batch)]
        region[:ws] = ref
        if not all(client.put_many(keys, slices, retention="long")):
            raise BenchError("the card gateway did not store the batch")
        paths = self._object_paths(self.gateways[1].card_dirs[0], keys)
        items = [(p, os.path.getsize(p) - osz, d) for p, d in zip(paths, slices)]
        region[:ws] = 0
        read_files(items)  # warms the page cache, and proves the baseline moves the real bytes
        self._verify(ref, "raw read")
        region[:ws] = 0

        def card_get(_r: int) -> None:
            self._check_got(client.get_many(keys, into=slices), osz)

        card_get(0)
        self._verify(ref, "card get")
        s = measure([Contender("kvgate", card_get),
                     *self.raw_contenders(lambda _r, n: on_threads(self.pool, read_files, items, n)),
                     *self.raw_contenders(lambda _r, n: on_threads(self.pool, read_files_verified, items, n),
                                          kind="verified")],
                    ws, **self.timing)
        return self.raw_figure(s, "open+preadv+close"), card_get, items

    def _card_get_cold(self, card_get: Callable[[int], None], items: list[tuple[str, int, memoryview]]) -> dict[str, Any]:
        """3. As 2, with the page cache dropped before every pass of either side; few passes, they are slow."""
        n = self.plan.cold_rounds
        s = measure([Contender("kvgate", card_get, drop_caches),
                     *self.raw_contenders(lambda _r, t: on_threads(self.pool, read_files, items, t), drop_caches),
                     *self._direct_contenders(items)],
                    self.plan.pass_bytes, budget_s=0.0, min_rounds=n, max_rounds=n, warmup=False)
        self.shm.array[: self.plan.pass_bytes] = 0
        drop_caches()
        card_get(0)
        self._verify(self.ref, "cold card get")
        return self.raw_figure(s, "open+preadv+close")

    def _card_put(self) -> dict[str, Any]:
        """4. Write-through put from the region vs new files (temp name, pwritev, rename); fresh names each pass."""
        batch, client, slices = self.plan.batch, self.card_client, self.slices
        self.shm.array[: self.plan.pass_bytes] = self.ref

        def put_keys(r: int) -> list[bytes]:
            return [f"put-{r}-{i}".encode() for i in range(batch)]

        def card_put(r: int) -> None:
            if not all(client.put_many(put_keys(r), slices, retention="long")):
                raise BenchError("the card gateway did not store a put batch")

        scratch = os.path.join(self.workdir, "raw-write")
        os.makedirs(scratch)
        # A header as long as the card's (padded to a block), so both sides write files of the same size.
        header = memoryview(bytes(padded_size(header_size(full_key(self.ns, put_keys(0)[0])))))

        def raw_items(r: int) -> list[tuple[str, memoryview, memoryview]]:
            return [(os.path.join(scratch, f"{r}-{i}"), header, d) for i, d in enumerate(slices)]

        def raw_delete(r: int) -> None:
            for path, _h, _d in raw_items(r):
                os.unlink(path)

        # Both sides delete what a pass wrote (untimed), so the filesystem does not fill up.
        s = measure([Contender("kvgate", card_put, after=lambda r: client.delete_many(put_keys(r))),
                     *self.raw_contenders(lambda r, n: on_threads(self.pool, write_files, raw_items(r), n),
                                           after=raw_delete),
                     *self.raw_contenders(lambda r, n: on_threads(self.pool, write_files_verified, raw_items(r), n),
                                          after=raw_delete, kind="verified")],
                    self.plan.pass_bytes, **self.timing)
        return self.raw_figure(s, "open+pwritev+close+rename")

    def _lookup(self) -> dict[str, Any]:
        """5. Lookup of 1,000 stored keys: what an engine asks on every scheduling step."""
        client = self.card_client
        keys = [f"lookup-{i:04d}".encode() for i in range(LOOKUP_KEYS)]
        small = self.shm.slices(LOOKUP_OBJECT_SIZE, LOOKUP_KEYS)
        if not all(client.put_many(keys, small, retention="long")):
            raise BenchError("the card gateway did not store the lookup objects")

        def timed(ks: list[bytes], reps: int) -> np.ndarray:
            out = np.empty(reps)
            for i in range(reps):
                t0 = time.perf_counter()
                n = client.lookup(ks)
                out[i] = time.perf_counter() - t0
                if n != len(ks):
                    raise BenchError(f"lookup of {len(ks)} stored keys answered {n}")
            return out * 1e3

        timed(keys, 10)
        ms = timed(keys, self.plan.lookup_reps)
        one = timed(keys[:1], min(200, self.plan.lookup_reps))  # the fixed cost of a request, for scale
        return {
            "keys": LOOKUP_KEYS, "reps": len(ms), "count": LOOKUP_KEYS, "count_ok": True,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "best_ms": float(ms.min()), "one_key_p50_ms": float(np.percentile(one, 50)),
        }
