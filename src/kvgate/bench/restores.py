"""``kvgate bench --cards N``: long restores from a gateway with N directory cards, under each placement.

One gateway per placement (RAM tier off).  One dialog of ``--blocks``
objects restored by one get, and ``--restores`` dialogs restored at once by
as many client connections, page cache warm and cold, each against raw
``preadv`` of the very same files; and how many cards the dialog's blocks
landed on, read off the card directories.
"""

from __future__ import annotations

import glob
import mmap
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from kvgate.bench import BenchError
from kvgate.bench.baselines import can_drop_caches, direct_ok, drop_caches, on_threads, read_files, read_files_direct
from kvgate.bench.harness import NAMESPACE, READY_S, Bench, ShmRegion, bench_gateway
from kvgate.bench.measure import Contender, Plan, figure, measure
from kvgate.bench.processes import GatewayProcess
from kvgate.client import Client
from kvgate.keys import full_key, key_digest
from kvgate.placement import PLACEMENTS

CARDS_FIGURES = ("single_warm", "single_cold", "concurrent_warm", "concurrent_cold")
CARDS_SLOTS_MIN = 16
DIALOG_SHIFT = 4096  # dialog d's payload starts d * this many bytes into the random reference


def card_files(card_dirs: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Every object file on the cards, by file name (the key digest): (card index, path)."""
    out: dict[str, tuple[int, str]] = {}
    for i, d in enumerate(card_dirs):
        for p in glob.glob(os.path.join(d, "db*", "*", "*")):
            if ".tmp." not in os.path.basename(p) and os.path.isfile(p):
                out[os.path.basename(p)] = (i, p)
    return out


def placements_of(choice: str | None) -> list[str]:
    return list(PLACEMENTS) if choice in (None, "both") else [choice]


class CardsBench(Bench):
    """``--cards N``: one gateway per placement, each with N directory cards of its own.

    A dialog is ``blocks`` objects written with one dialog mark; a restore is
    one ``get_many`` of all its blocks, with that mark, into the registered
    region (zero copy).  Under dialog placement the blocks sit on one card,
    under stripe on (about) all N, and which cards they landed on is read off
    the card directories, not assumed.  Every restore figure runs alternately
    with raw ``preadv`` of the very same files into the same destinations.

    Driven as ``Bench`` is, from the command's thread; concurrent restores
    run one per thread of ``restore_pool``, each on a client of its own.
    """

    def __init__(self, plan: Plan, parent_dir: str, progress: Callable[[str], None], *, cards: int,
                 placements: Sequence[str], blocks: int, restores: int):
        super().__init__(plan, parent_dir, progress)
        self.cards = cards
        self.placements = list(placements)
        self.blocks = blocks
        self.restores = restores
        self.by_placement: dict[str, tuple[GatewayProcess, list[Client]]] = {}
        self.restore_pool: ThreadPoolExecutor | None = None

    @property
    def slots(self) -> int:
        return max(CARDS_SLOTS_MIN, 4 * self.cards)

    @property
    def dialog_bytes(self) -> int:
        return self.plan.object_size * self.blocks

    @property
    def thread_counts(self) -> list[int]:
        """Raw threads of the single restore: the gateway's pool size, all its card pools together, and 1."""
        t = self.plan.threads
        return list(dict.fromkeys((t, t * self.cards, 1)))

    # -- setup / teardown --

    def start(self) -> tuple[Client, Client]:  # type: ignore[override]
        plan = self.plan
        total = self.dialog_bytes * self.restores
        os.makedirs(self.parent_dir, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="kvgate-bench-", dir=self.parent_dir)
        self.sockdir = tempfile.mkdtemp(prefix="kvgate-bench-")
        free = shutil.disk_usage(self.workdir).free
        if free < total + (64 << 20):  # one placement's dialogs at a time: each is deleted before the next
            raise BenchError(f"{self.workdir}: {free >> 20} MiB free, the bench needs about {total >> 20} MiB "
                             "(lower --blocks, --restores or --object-size)")
        region_size = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
        shm_free = shutil.disk_usage("/dev/shm").free
        if shm_free < region_size + (64 << 20):
            raise BenchError(f"/dev/shm: {shm_free >> 20} MiB free, the destination region needs {region_size >> 20} MiB "
                             "(lower --blocks, --restores or --object-size)")
        card_capacity = max(8 << 30, 2 * total)
        for p in self.placements:
            g = bench_gateway(p, self.workdir, self.sockdir, max_bytes=0, threads=plan.threads,
                              card_capacity=card_capacity, cards=self.cards,
                              extra=["--storage-slots", str(self.slots), "--key-placement", p])
            self.gateways.append(g)
        for g in self.gateways:
            g.spawn()
        self.region = ShmRegion(region_size)
        self.pool = ThreadPoolExecutor(max_workers=max(self.thread_counts), thread_name_prefix="bench-raw")
        self.restore_pool = ThreadPoolExecutor(max_workers=self.restores, thread_name_prefix="bench-restore")
        # A gateway serves one engine: every connection names the same engine, as an engine's workers would.
        engine_id = f"kvgate-bench-{os.getpid()}"
        for p, g in zip(self.placements, self.gateways):
            g.wait_ready(READY_S)
            clients = []
            for _ in range(self.restores):
                c = Client.connect(g.socket, namespace=NAMESPACE, engine_id=engine_id, want_shm=False,
                                   timeout=120)
                self.clients.append(c)
                c.register_region(self.region.path, self.region.mm)
                clients.append(c)
            self.by_placement[p] = (g, clients)
        return self.clients[0], self.clients[0]

    def close(self) -> None:
        if self.restore_pool is not None:
            self.restore_pool.shutdown(wait=True)
        super().close()

    # -- helpers --

    def _expected(self, d: int) -> np.ndarray:
        """Dialog ``d``'s bytes: a window of the random reference, shifted per dialog so a mixed-up restore
        shows; a view, so checking a GiB of restores costs one compare, not a copy."""
        return self.ref[d * DIALOG_SHIFT : d * DIALOG_SHIFT + self.dialog_bytes]

    def _verify_dialogs(self, dialogs: Sequence[int], what: str) -> None:
        ws = self.dialog_bytes
        for d in dialogs:
            got, want = self.shm.array[d * ws : (d + 1) * ws], self._expected(d)
            # Compared 8 bytes at a time where the length allows (offsets are multiples of 8 anyway).
            wide = (got.view(np.uint64), want.view(np.uint64)) if ws % 8 == 0 else (got, want)
            if not np.array_equal(*wide):
                bad = int(np.argmax(got != want))
                raise BenchError(f"{what}: dialog {d}: wrong bytes at offset {bad} "
                                 f"(block {bad // self.plan.object_size})")

    def _card_trouble(self, p: str) -> str:
        """What the gateway counted against its cards, to explain a miss; empty when nothing."""
        _g, clients = self.by_placement[p]
        try:
            cards = clients[0].stats()["cards"]
        except Exception:  # noqa: BLE001 - only an explanation; the error it explains is what matters
            return ""
        bad = [f"{os.path.basename(c['location'])}: {c['timeouts']} I/O timeouts, {c['errors']} errors, "
               f"{'active' if c['active'] else 'OUT OF SERVICE'}"
               for c in cards if c["timeouts"] or c["errors"] or not c["active"]]
        return f" (gateway cards: {'; '.join(bad)})" if bad else ""

    # -- figures --

    def run(self) -> dict[str, Any]:
        """Both placements in turn; returns ``{"placements": {p: ...}, "skipped": {figure: reason}}``."""
        self.progress("starting gateways")
        self.start()
        size = self.dialog_bytes + self.restores * DIALOG_SHIFT
        self.ref = np.frombuffer(np.random.default_rng().bytes(size), dtype=np.uint8).copy()
        self.timing = {"budget_s": self.plan.budget_s, "min_rounds": self.plan.min_rounds,
                       "max_rounds": self.plan.max_rounds}
        skipped: dict[str, str] = {}
        why = can_drop_caches()
        if why is not None:
            skipped = {"single_cold": why, "concurrent_cold": why}
        out = {}
        for p in self.placements:
            try:
                out[p] = self._placement(p, cold=why is None)
            except BenchError as e:
                raise BenchError(f"{p} placement: {e}{self._card_trouble(p)}") from None
        self.progress("stopping gateways")
        return {"placements": out, "skipped": skipped}

    def _placement(self, p: str, cold: bool) -> dict[str, Any]:
        plan = self.plan
        osz, nb, nr, ws = plan.object_size, self.blocks, self.restores, self.dialog_bytes
        g, clients = self.by_placement[p]
        region = self.shm.array
        keys = [[f"dialog{d}-block{i:04d}".encode() for i in range(nb)] for d in range(nr)]
        marks = [f"kvgate-bench-dialog-{d}".encode() for d in range(nr)]
        view = self.shm.view
        slices = [[view[d * ws + i * osz : d * ws + (i + 1) * osz] for i in range(nb)] for d in range(nr)]

        self.progress(f"{p}: writing")
        for d in range(nr):  # one put per dialog, with its mark, as an engine offloads a finished prefill
            region[d * ws : (d + 1) * ws] = self._expected(d)
            if not all(clients[0].put_many(keys[d], slices[d], retention="long", dialog=marks[d], position=0)):
                raise BenchError(f"{p}: the gateway did not store dialog {d}")

        # Where the blocks landed, read off the card directories.
        files = card_files(g.card_dirs)
        items: list[list[tuple[str, int, memoryview]]] = []
        card_of: list[list[int]] = []
        for d in range(nr):
            its, cards = [], []
            for k, dest in zip(keys[d], slices[d]):
                found = files.get(key_digest(full_key(self.ns, k)).hex())
                if found is None:
                    raise BenchError(f"{p}: object {k!r} is on none of the {self.cards} cards ({len(files)} files)")
                its.append((found[1], os.path.getsize(found[1]) - osz, dest))
                cards.append(found[0])
            items.append(its)
            card_of.append(cards)
        single_per_card = [card_of[0].count(i) for i in range(self.cards)]
        all_per_card = [sum(c.count(i) for c in card_of) for i in range(self.cards)]
        dialogs_per_card = [sum(1 for c in card_of if i in c) for i in range(self.cards)]

        c0 = clients[0]
        rpool = self.restore_pool
        assert rpool is not None

        def single(_r: int) -> None:
            self._check_got(c0.get_many(keys[0], into=slices[0], dialog=marks[0]), osz)

        def restore(d: int) -> None:
            self._check_got(clients[d].get_many(keys[d], into=slices[d], dialog=marks[d]), osz)

        def concurrent(_r: int) -> None:
            for f in [rpool.submit(restore, d) for d in range(nr)]:
                f.result()

        def raw_concurrent(_r: int) -> None:
            for f in [rpool.submit(read_files, items[d]) for d in range(nr)]:
                f.result()

        def raw_single(before: Callable[[], None] | None) -> list[Contender]:
            return self.raw_contenders(lambda _r, n: on_threads(self.pool, read_files, items[0], n), before)

        # Untimed checks: the baseline moves the real bytes (and warms the page cache), and so do both restores.
        total = nr * ws
        region[:total] = 0
        raw_concurrent(0)
        self._verify_dialogs(range(nr), f"{p}: raw read")
        region[:total] = 0
        single(0)
        self._verify_dialogs([0], f"{p}: single restore")
        region[:total] = 0
        concurrent(0)
        self._verify_dialogs(range(nr), f"{p}: {nr} concurrent restores")

        what = "open+preadv+close"
        figures: dict[str, Any] = {}
        self.progress(f"{p}: single restore warm")
        s = measure([Contender("kvgate", single), *raw_single(None)], ws, **self.timing)
        figures["single_warm"] = figure(s, "kvgate", self.thread_counts, what)
        n = plan.cold_rounds
        cold_timing: dict[str, Any] = {"budget_s": 0.0, "min_rounds": n, "max_rounds": n, "warmup": False}
        self.progress(f"{p}: single restore cold")
        if cold:
            s = measure([Contender("kvgate", single, drop_caches), *raw_single(drop_caches),
                         *self._direct_contenders(items[0])], ws, **cold_timing)
            figures["single_cold"] = figure(s, "kvgate", self.thread_counts, what)
        else:
            figures["single_cold"] = None
        conc_what = f"{what}, one thread per dialog"
        self.progress(f"{p}: {nr} restores warm")
        s = measure([Contender("kvgate", concurrent), Contender(f"raw{nr}", raw_concurrent)], total, **self.timing)
        figures["concurrent_warm"] = figure(s, "kvgate", [nr], conc_what)
        self.progress(f"{p}: {nr} restores cold")
        if cold:
            def direct_concurrent(_r: int) -> None:
                for f in [rpool.submit(read_files_direct, items[d]) for d in range(nr)]:
                    f.result()

            direct = [Contender(f"direct{nr}", direct_concurrent, drop_caches)] if direct_ok(items[0]) else []
            s = measure([Contender("kvgate", concurrent, drop_caches), Contender(f"raw{nr}", raw_concurrent, drop_caches),
                         *direct], total, **cold_timing)
            figures["concurrent_cold"] = figure(s, "kvgate", [nr], conc_what)
            region[:total] = 0
            drop_caches()
            concurrent(0)
            self._verify_dialogs(range(nr), f"{p}: cold concurrent restores")
        else:
            figures["concurrent_cold"] = None

        # What the gateway itself counted per card (reads of every pass above, warm-up and checks included).
        index = {os.path.abspath(d): i for i, d in enumerate(g.card_dirs)}
        per_card = [{} for _ in range(self.cards)]
        for st in c0.stats()["cards"]:
            i = index.get(os.path.abspath(st["location"]))
            if i is not None:
                per_card[i] = {k: st[k] for k in ("objects", "hits", "misses", "bytes_read", "timeouts", "errors")}
        filesystems = len({os.stat(d).st_dev for d in g.card_dirs})
        for d in range(nr):  # untimed; the next placement starts from an empty disk
            c0.delete_many(keys[d], dialog=marks[d])
        return {
            "figures": figures,
            "cards_used": sum(1 for x in single_per_card if x),
            "single_blocks_per_card": single_per_card,
            "concurrent_cards_used": sum(1 for x in all_per_card if x),
            "concurrent_blocks_per_card": all_per_card,
            "concurrent_dialogs_per_card": dialogs_per_card,
            "gateway_cards": per_card,
            "card_filesystems": filesystems,
        }
