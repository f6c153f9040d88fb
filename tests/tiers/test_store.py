"""TieredStore (``kvgate.tiers.store``): the RAM tier in front of the cards, in process, on real
directory cards.

Where a put's retention puts an object, what a get answers from each tier,
and the one rule every question follows: a key is present when the RAM tier
holds it, any card's index holds it (whatever the dialog), or its own card
for the request's dialog has it unindexed (another gateway wrote it).  The
same rules against real gateways: tests/gateway/test_answers_agree.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from pathlib import Path
from typing import AsyncIterator

import pytest

from kvgate.cards import ObjectMeta
from kvgate.config import Config
from kvgate.keys import dialog_digest, encode_namespace, full_key
from kvgate.tiers.io import IoPool
from kvgate.tiers.store import GetItem, PutItem, TieredStore
from kvgate.types import Retention, SizeCode
from tests.helpers import wait_until_async
from tests.tiers.test_late_reads import DEADLINE_S, SIZE, Slowed

NS = encode_namespace("store-ns")
DIALOG = dialog_digest(b"a dialog")


def fk(key: bytes) -> bytes:
    return full_key(NS, key)


def payload(key: bytes, size: int = 10_000) -> bytes:
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


@contextlib.asynccontextmanager
async def started_store(tmp_path: Path, n_cards: int = 1, **cfg) -> AsyncIterator[TieredStore]:
    """A started store over ``n_cards`` directory cards in ``tmp_path``, their start-up scans done."""
    dirs = [tmp_path / f"card{i}" for i in range(n_cards)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    cfg = {"max_bytes": 8 << 20, "card_capacity": 64 << 20, "thread_pool_size": 2, "storage_slots": 16 * n_cards,
           **cfg}
    store = TieredStore(Config(storage_devices=[str(d) for d in dirs], **cfg),
                        IoPool(cfg["thread_pool_size"]))
    await store.start()
    try:
        await wait_until_async(lambda: all(mc.life.scanned for mc in store.cards.set.cards), 10, "every card's start-up scan")
        yield store
    finally:
        await store.stop()


async def put(store: TieredStore, keys: list[bytes], retention: Retention, dialog: bytes = DIALOG) -> list[bool]:
    items = [PutItem(fk(k), memoryview(payload(k)), ObjectMeta(dialog, i, time.time_ns())) for i, k in enumerate(keys)]
    return await store.put(items, retention)


def test_a_put_reaches_the_tiers_its_retention_names(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path) as store:
            assert await put(store, [b"long"], Retention.LONG) == [True]
            assert await put(store, [b"short"], Retention.SHORT) == [True]
            assert await put(store, [b"none"], Retention.NONE) == [False]
            mc = store.cards.set.cards[0]
            assert store.ram.pages.contains(fk(b"long")) and fk(b"long") in mc.index and mc.card.exists(fk(b"long"))
            assert store.ram.pages.contains(fk(b"short")) and not mc.card.exists(fk(b"short"))
            assert not store.ram.pages.contains(fk(b"none")) and not mc.card.exists(fk(b"none"))
            assert (store.counters.ram.sets, store.counters.long.sets) == (2, 1)
        # A restart keeps what reached a card, and only that.
        async with started_store(tmp_path) as store:
            assert await store.exists([fk(b"long"), fk(b"short"), fk(b"none")], DIALOG) == [True, False, False]

    asyncio.run(main())


def test_get_answers_ram_and_card_hits_and_says_miss_and_too_small(tmp_path: Path) -> None:
    size = len(payload(b"x"))

    async def get(store: TieredStore, key: bytes, room: int) -> tuple[int, int, bytes]:
        dest = memoryview(bytearray(room))
        sizes, needed = await store.get([GetItem(fk(key), DIALOG, dest)])
        return sizes[0], needed[0], dest.tobytes()[: max(sizes[0], 0)]

    async def main() -> None:
        async with started_store(tmp_path) as store:
            assert await put(store, [b"in-ram", b"on-card"], Retention.LONG) == [True, True]
            store.ram.pages.delete(fk(b"on-card"))  # on the card only
            assert await get(store, b"in-ram", size + 100) == (size, 0, payload(b"in-ram"))
            assert store.counters.ram.hits == 1 and store.counters.long.gets == 0, "a RAM hit asks no card"
            assert await get(store, b"on-card", size + 100) == (size, 0, payload(b"on-card"))
            assert store.counters.long.hits == 1
            assert await get(store, b"never-put", size) == (SizeCode.MISS, 0, b"")
            assert await get(store, b"in-ram", size - 1) == (SizeCode.TOO_SMALL, size, b"")
            assert await get(store, b"on-card", size - 1) == (SizeCode.TOO_SMALL, size, b"")
            # a destination too small takes nothing away: both still read whole
            assert await get(store, b"on-card", size) == (size, 0, payload(b"on-card"))

    asyncio.run(main())


def test_lookup_counts_leading_keys_present_in_ram_or_on_any_card(tmp_path: Path) -> None:
    async def main() -> None:
        async with started_store(tmp_path, n_cards=2) as store:
            keys = [b"k%d" % i for i in range(8)]
            # Two dialogs whose objects live on different cards.
            d1, d2 = DIALOG, next(d for d in (dialog_digest(b"d%d" % i) for i in range(100))
                                  if store.cards.set.layout.card_for(fk(b"k1"), d) is not store.cards.set.layout.card_for(fk(b"k1"), DIALOG))
            assert await put(store, [b"k0"], Retention.SHORT) == [True]  # RAM only
            assert await put(store, [b"k1"], Retention.LONG, d1) == [True]
            assert await put(store, [b"k2"], Retention.LONG, d2) == [True]
            for k in (b"k1", b"k2"):
                store.ram.pages.delete(fk(k))  # on a card only: the one of its dialog, not the one asked with
            home = store.cards.set.layout.card_for(fk(b"k3"), DIALOG)
            home.card.write(fk(b"k3"), memoryview(payload(b"k3")), ObjectMeta(DIALOG, 3, time.time_ns()))  # unindexed
            assert await put(store, keys[5:], Retention.LONG) == [True] * 3  # k4 is never stored
            for ask in (d1, d2):  # k3 is found only on its card for the dialog asked with
                found_k3 = ask == DIALOG
                assert await store.lookup([fk(k) for k in keys], ask) == (4 if found_k3 else 3)
                assert await store.exists([fk(k) for k in keys], ask) == [True, True, True, found_k3, False] + [True] * 3
            assert await store.lookup([fk(k) for k in keys[5:]], DIALOG) == 3
            assert await store.lookup([fk(b"k4")] + [fk(k) for k in keys[:4]], DIALOG) == 0

    asyncio.run(main())


def test_a_prewarm_read_past_its_deadline_leaves_the_reused_reservation_alone(tmp_path: Path) -> None:
    """Prewarm reads into a RAM reservation; when its deadline passes the reservation is aborted and its
    pages go to the next object: the late read must not overwrite that object."""
    old, new = payload(b"old", SIZE), payload(b"new", SIZE)
    meta = ObjectMeta()

    async def main() -> None:
        async with started_store(tmp_path, io_timeout_ms=int(DEADLINE_S * 1000), thread_pool_size=1) as store:
            assert await store.put([PutItem(b"old", memoryview(old), meta)], Retention.LONG) == [True]
            store.ram.pages.delete(b"old")  # on the card only: prewarm reads it into a reservation
            slowed = Slowed(store.cards.set.cards[0].card, "_read_in_place")  # into our own memory
            assert await store.prewarm([b"old"], meta.dialog) == 0  # the deadline passed
            assert store.ram.pages.free_pages == store.ram.pages.total_pages  # the reservation was given back
            # The next object of the same size gets the same pages.
            assert await store.put([PutItem(b"new", memoryview(new), meta)], Retention.SHORT) == [True]
            assert await asyncio.to_thread(slowed.done.wait, 30), "the slowed read never ended"
            await asyncio.sleep(0.1)  # the point: any late delivery would have landed by now
            dest = memoryview(bytearray(SIZE))
            sizes, _ = await store.get([GetItem(b"new", meta.dialog, dest)])
            assert sizes == [SIZE]
            assert dest.tobytes() == new, "the late read overwrote the object now in its pages"

    asyncio.run(main())


def test_a_put_whose_card_is_removed_while_it_writes_is_stored_on_the_keys_new_card(tmp_path: Path) -> None:
    """``kvgate cards remove`` in the middle of a write: the writer is told stored, and it is (elsewhere)."""

    async def main() -> None:
        async with started_store(tmp_path, n_cards=2) as store:
            home = store.cards.set.layout.card_for(fk(b"k0"), DIALOG)
            entered, release = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            write_many = home.card.write_many

            def held_write(*args, **kw):  # runs on the card's I/O thread
                loop.call_soon_threadsafe(entered.set)
                asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
                return write_many(*args, **kw)

            home.card.write_many = held_write
            keys = [b"k0", b"k1", b"k2"]
            putting = asyncio.ensure_future(put(store, keys, Retention.LONG))
            await asyncio.wait_for(entered.wait(), 10)
            remove = asyncio.ensure_future(store.cards.set.remove(home.serial))
            await asyncio.sleep(0.05)
            release.set()
            await remove
            assert await putting == [True] * 3
            other = store.cards.set.layout.card_for(fk(b"k0"), DIALOG)
            assert other is not None and other is not home
            assert all(fk(k) in other.index for k in keys)
            for k in keys:
                store.ram.pages.delete(fk(k))  # on the card only
            items = [GetItem(fk(k), DIALOG, memoryview(bytearray(10_000))) for k in keys]
            sizes, _ = await store.get(items)
            assert sizes == [10_000] * 3
            assert [bytes(it.dest) for it in items] == [payload(k) for k in keys]

    asyncio.run(main())


def test_a_get_whose_copy_the_mover_just_let_go_reads_the_new_copy(tmp_path: Path) -> None:
    """A read found the key in an old card's index; before it ran, the mover copied the object to its new
    card and deleted the old copy.  The read misses there, and is made again where the index now says."""
    from tests.tiers.common import background_deletes_done

    async def main() -> None:
        async with started_store(tmp_path, n_cards=2) as store:
            assert await put(store, [b"k"], Retention.LONG) == [True]
            store.ram.pages.delete(fk(b"k"))  # on its card only
            old = store.cards.set.layout.card_for(fk(b"k"), DIALOG)
            (new,) = [mc for mc in store.cards.set.cards if mc is not old]
            entered, release = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            read_many_into = old.card.read_many_into

            def held_read(*args, **kw):  # runs on the old card's I/O thread
                loop.call_soon_threadsafe(entered.set)
                asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
                return read_many_into(*args, **kw)

            old.card.read_many_into = held_read
            dest = memoryview(bytearray(20_000))
            getting = asyncio.ensure_future(store.get([GetItem(fk(b"k"), DIALOG, dest)]))
            await asyncio.wait_for(entered.wait(), 10)
            # What the mover does: the object lands on its new card, and the old copy goes.
            meta = ObjectMeta(DIALOG, 0, time.time_ns())
            (stored,) = await new.write([(fk(b"k"), memoryview(payload(b"k")), meta)])
            assert store.cards.set.note_written(new, [fk(b"k")], [stored], [len(payload(b"k"))], [meta])[0]
            await background_deletes_done(old)
            release.set()
            sizes, _ = await getting
            assert sizes == [len(payload(b"k"))]
            assert dest[: sizes[0]].tobytes() == payload(b"k")

    asyncio.run(main())


def test_lent_objects_stay_unchanged_until_given_back_and_never_pin_more_than_a_share_of_ram(tmp_path: Path) -> None:
    """``lend_ram``: a lent object's pages keep its bytes while it is replaced and the tier is written over;
    past ``LEND_SHARE`` of the tier nothing more is lent (a stalled reply cannot starve puts of pages)."""
    from kvgate.tiers.ramtier import LEND_SHARE

    async def main() -> None:
        async with started_store(tmp_path, max_bytes=8 << 20) as store:
            size = len(payload(b"x"))
            keys = [f"lend-{i}".encode() for i in range(400)]  # 400 x 10 kB in 8 MiB of 256 KiB pages: 32 fit
            assert all(await put(store, keys[:20], Retention.SHORT))
            loans = store.lend_ram([fk(k) for k in keys[:20]], [size] * 20)
            lent = [i for i, loan in enumerate(loans) if loan is not None]
            assert lent and len(lent) < 20, "the share was never reached, or nothing was lent"
            assert store.ram.pages.pinned_bytes <= store.ram.pages.capacity * LEND_SHARE
            assert store.lend_ram([fk(keys[0])], [size - 1]) == [None], "a size that changed is not lent"
            # replace every lent object and write the rest of the tier over: puts still find pages
            items = [PutItem(fk(k), memoryview(b"\xee" * size), ObjectMeta(DIALOG, 0, time.time_ns()))
                     for k in keys[:20]]
            assert all(await store.put(items, Retention.SHORT))
            for at in range(20, 80, 10):  # three times what the unpinned pages hold, a batch that fits at a time
                assert all(await put(store, keys[at : at + 10], Retention.SHORT))
            for i in lent:
                assert b"".join(bytes(v) for v in loans[i].views) == payload(keys[i])
            store.return_ram(loans)
            assert store.ram.pages.pinned_bytes == 0

    asyncio.run(main())


def test_card_objects_are_lent_as_open_files_while_cached_at_their_size_within_the_limit(tmp_path: Path) -> None:
    """``lend_files``: an object wholly in the page cache is lent as its file, open, with the header that
    says where its payload is and what it hashes to; the file keeps the object after its name is
    removed.  Not lent (None, and no file left open): an object the cache dropped, one at another size
    than asked, and any past ``files_lent_max``.  Lent ones count as hits; ``return_files`` closes them."""
    import os

    from kvgate.keys import payload_hash

    async def main() -> None:
        async with started_store(tmp_path, max_bytes=0) as store:
            size = len(payload(b"x"))
            keys = [f"file-{i}".encode() for i in range(4)]
            assert all(await put(store, keys, Retention.LONG))
            card = store.cards.set.cards[0].card
            cold = card.object_path(fk(keys[3]))
            fd = os.open(cold, os.O_RDONLY)
            os.fsync(fd)  # clean pages only are dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            hits = store.counters.long.hits
            files = await store.lend_files([fk(k) for k in keys], DIALOG, [size, size + 1, size, size])
            assert files[1] is None, "a size that changed is not lent"
            assert files[3] is None, "an object the page cache does not hold is not lent"
            assert store.files_lent == 2 and store.counters.long.hits == hits + 2
            for i in (0, 2):
                f = files[i]
                os.unlink(card.object_path(fk(keys[i])))  # evicted while lent: the open file still has it
                body = os.pread(f.fd, f.header.payload_len, f.header.payload_offset)
                assert body == payload(keys[i]) and payload_hash(body) == f.header.payload_hash
            store.return_files([f for f in files if f is not None])
            assert store.files_lent == 0
            for f in files:
                if f is not None:
                    with pytest.raises(OSError):
                        os.fstat(f.fd)
            store.cards.files_lent_max = 1
            assert all(await put(store, keys[:2], Retention.LONG))
            files = await store.lend_files([fk(k) for k in keys[:2]], DIALOG, [size, size])
            assert files[0] is not None and files[1] is None and store.files_lent == 1
            store.return_files([files[0]])
            assert store.files_lent == 0

    asyncio.run(main())


def test_files_a_card_opens_after_its_deadline_are_closed_when_the_call_ends(tmp_path: Path) -> None:
    """A card that opens the files and then stalls past ``io_timeout_ms``: ``lend_files`` answers with
    nothing lent (the get reads them the usual way), and the files opened late are closed once the call
    ends, not left open in the gateway."""
    import os
    import threading

    from tests.tiers.test_late_reads import SLOW_S

    def objects_open(card_dir: Path) -> int:
        n = 0
        for f in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{f}").startswith(str(card_dir)) and not f.endswith(".lock")
            except OSError:
                pass
        return n

    async def main() -> None:
        async with started_store(tmp_path, max_bytes=0, io_timeout_ms=int(DEADLINE_S * 1000)) as store:
            keys = [f"late-{i}".encode() for i in range(4)]
            assert all(await put(store, keys, Retention.LONG))
            card = store.cards.set.cards[0].card
            opened = threading.Event()
            real = card.open_cached_many

            def open_then_stall(full_keys, guard):
                out = real(full_keys, guard)
                opened.set()
                time.sleep(SLOW_S)
                return out

            card.open_cached_many = open_then_stall
            before = objects_open(tmp_path / "card0")
            size = len(payload(b"x"))
            assert await store.lend_files([fk(k) for k in keys], DIALOG, [size] * 4) == [None] * 4
            assert opened.is_set() and objects_open(tmp_path / "card0") >= before + 4  # held by the stalled call
            assert store.files_lent == 0
            await wait_until_async(lambda: objects_open(tmp_path / "card0") == before, 10,
                                   "the late call's files closed")

    asyncio.run(main())


def test_size_hints_come_from_the_ram_tier_and_the_card_indexes_without_touching_a_card(tmp_path: Path) -> None:
    """Sizes of a request's keys: a RAM-tier object's, an indexed card object's on either card (whatever
    its placement for the request's dialog), None for a key nobody knows and for one past its ttl."""
    async def main() -> None:
        async with started_store(tmp_path, n_cards=2, ttl=3600) as store:
            sizes = {b"ram": 100, b"card-a": 3000, b"card-b": 70_000}
            other = next(d for d in (dialog_digest(b"dialog %d" % i) for i in range(100))
                         if store.cards.set.layout.card_for(fk(b"card-b"), d) is not store.cards.set.layout.card_for(fk(b"card-a"), DIALOG))
            items = [PutItem(fk(k), memoryview(payload(k, n)), ObjectMeta(other if k == b"card-b" else DIALOG, 0,
                                                                          time.time_ns()))
                     for k, n in sizes.items()]
            assert all(await store.put(items[:1], Retention.SHORT))
            assert all(await store.put(items[1:], Retention.LONG))
            store.ram.pages.delete(fk(b"card-a"))
            store.ram.pages.delete(fk(b"card-b"))
            old = PutItem(fk(b"old"), memoryview(payload(b"old")), ObjectMeta(DIALOG, 0, time.time_ns() - 7200 * 10**9))
            assert all(await store.put([old], Retention.LONG))
            store.ram.pages.delete(fk(b"old"))
            keys = [fk(k) for k in (b"card-b", b"absent", b"ram", b"card-a", b"old")]
            assert fk(b"card-b") not in store.cards.set.layout.card_for(fk(b"card-a"), DIALOG).index  # on the other card
            for dialog in (DIALOG, other):
                assert store.size_hints(keys, dialog) == [70_000, None, 100, 3000, None]

    asyncio.run(main())


def test_buffer_cache_reuses_by_size_within_its_bound() -> None:
    from kvgate.tiers.staging import BufferCache

    cache = BufferCache(keep=3 << 20)
    a, b = cache.take([1 << 20, 2 << 20])
    cache.give([a, b])
    assert cache.kept == 3 << 20
    again = cache.take([2 << 20, 1 << 20])
    assert again[0] is b and again[1] is a and cache.kept == 0
    extra = cache.take([1 << 20])[0]
    cache.give([*again, extra])  # 4 MiB given back, 3 MiB kept: the last one is let go
    assert cache.kept == 3 << 20
    cache.give([memoryview(bytearray(0))])
    assert cache.kept == 3 << 20


@pytest.mark.parametrize("guarded", [True, False])
def test_a_put_from_client_memory_with_no_ram_copy_is_written_by_the_card_unstaged(tmp_path: Path,
                                                                                   guarded: bool) -> None:
    """RAM tier off: a directory card writes the client's region itself, guarded (through the kernel, hashed
    as read back) or not (hashed in place); the bytes and the hash are right."""
    import os
    import uuid

    from kvgate.gateway import shm

    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    size, keys = 600_000, [b"c0", b"c1", b"c2"]
    try:
        os.ftruncate(fd, size * len(keys))
        for i, k in enumerate(keys):
            os.pwrite(fd, payload(k, size), i * size)
        region = shm.map_client_region(path, os.getuid(), guarded)

        async def main() -> None:
            async with started_store(tmp_path, max_bytes=0) as store:
                taken: list[list[int]] = []
                take = store.cards.staging.take

                async def counted_take(sizes: list[int]) -> list[memoryview]:
                    taken.append(sizes)
                    return await take(sizes)

                store.cards.staging.take = counted_take  # type: ignore[method-assign]
                items = [PutItem(fk(k), region.slice(i * size, size), ObjectMeta(DIALOG, i, time.time_ns()), True)
                         for i, k in enumerate(keys)]
                assert await store.put(items, Retention.LONG) == [True] * 3
                for it in items:
                    it.src.release()
                assert taken == [] and store.cards.staging.budget.used == 0  # nothing staged
                assert not any(store.ram.pages.contains(fk(k)) for k in keys)
                gets = [GetItem(fk(k), DIALOG, memoryview(bytearray(size))) for k in keys]
                sizes, _ = await store.get(gets)
                assert sizes == [size] * 3
                assert [bytes(g.dest) for g in gets] == [payload(k, size) for k in keys]

        asyncio.run(main())
        region.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_put_whose_staging_faults_still_lets_every_other_card_write_finish_first(tmp_path: Path) -> None:
    """A client region shrunk under one card's staging fails the put, but only once every other card's
    write has ended: those read the RAM tier's pinned copies, which must stay pinned until then."""
    import os
    import threading
    import uuid

    from kvgate.gateway import shm
    from kvgate.keys import dialog_digest
    from kvgate.memcopy import MemoryFault

    path = f"/dev/shm/kvgate-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    big = 3 << 20  # over the 2 MiB RAM tier: no RAM copy, so staged for its card
    try:
        os.ftruncate(fd, big)
        region = shm.map_client_region(path, os.getuid())

        async def main() -> None:
            async with started_store(tmp_path, n_cards=2, max_bytes=2 << 20) as store:
                dialogs = [dialog_digest(b"d%d" % i) for i in range(64)]
                by_card: dict[int, bytes] = {}
                for d in dialogs:
                    by_card.setdefault(id(store.cards.set.layout.card_for(fk(b"x"), d)), d)
                (x, dx), (y, dy) = [(mc, by_card[id(mc)]) for mc in store.cards.set.cards]
                y.card.writes_client_memory = False  # as a Redis card: its source is staged
                loop = asyncio.get_running_loop()
                entered, ended = asyncio.Event(), []
                release = threading.Event()
                write_many = x.card.write_many

                def held_write(*args, **kw):
                    loop.call_soon_threadsafe(entered.set)
                    release.wait(10)
                    out = write_many(*args, **kw)
                    ended.append(time.monotonic())
                    return out

                x.card.write_many = held_write
                src = region.slice(0, big)
                os.ftruncate(fd, 0)  # the client shrinks its region: the staging copy faults
                items = [PutItem(fk(b"small"), memoryview(payload(b"small")), ObjectMeta(dx, 0, time.time_ns())),
                         PutItem(fk(b"big"), src, ObjectMeta(dy, 0, time.time_ns()), True)]
                putting = asyncio.ensure_future(store.put(items, Retention.LONG))
                await asyncio.wait_for(entered.wait(), 10)
                await asyncio.sleep(0.2)  # the staging fault has happened by now
                assert not putting.done()  # waits for x's write
                release.set()
                try:
                    await putting
                    raise AssertionError("the put of a shrunk region succeeded")
                except MemoryFault:
                    raised = time.monotonic()
                src.release()
                assert ended and ended[0] <= raised
                assert x.card.exists(fk(b"small")) and not y.card.exists(fk(b"big"))
                out = memoryview(bytearray(10_000))
                assert x.card.read_into(fk(b"small"), out).payload_len == 10_000
                assert bytes(out) == payload(b"small")

        asyncio.run(main())
        region.close()
    finally:
        os.close(fd)
        os.unlink(path)
