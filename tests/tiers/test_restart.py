"""In process: a card's index snapshot is written at stop, loaded at start, then checked against the card.

Real directory cards.  What the check must get right: an object deleted
behind the gateway's back is dropped, one written behind its back is
indexed, and neither waits for a read; a snapshot that is corrupt, torn or
another card's is ignored with a log line (the card is then scanned whole).
An object the snapshot lists but that is broken on the card is a miss at its
first read, deleted and counted: the header is what a read trusts.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import xxhash

from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.config import Config
from kvgate.keys import dialog_digest, full_key, key_digest
from kvgate.tiers import restart
from kvgate.tiers.cardset import CardSet
from kvgate.tiers.finder import KeyFinder
from kvgate.tiers.rows import split_digest
from tests.helpers import as_newer_format
from tests.tiers.common import card_set

SIZE = 4096
N = 64


def _payload(k: bytes) -> bytes:
    return hashlib.sha256(k).digest() * (SIZE // 32)


def _key(i: int) -> bytes:
    return full_key(b"ns", b"block-%d" % i)


def _config(tmp_path: Path, cards: list[str], **kw) -> Config:
    return Config(storage_devices=[str(tmp_path / c) for c in cards], card_capacity=64 << 20, storage_slots=16, **kw)


async def _started(cfg: Config) -> CardSet:
    for loc in cfg.storage_devices:
        Path(loc).mkdir(exist_ok=True)
    cards = card_set(cfg)
    await cards.start()
    return cards


async def _holding(cfg: Config, keys: list[bytes]) -> CardSet:
    """Started, checked, and ``keys`` written to its first card."""
    cards = await _started(cfg)
    await _scanned(cards)
    await _write(cards, keys)
    return cards


async def _scanned(cards: CardSet) -> None:
    for _ in range(1000):
        if all(mc.life.scanned for mc in cards.cards):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the start-up check did not end")


async def _write(cards: CardSet, keys: list[bytes]) -> None:
    dialog = dialog_digest(b"one conversation")
    mc = cards.cards[0]
    items = [(k, memoryview(_payload(k)), ObjectMeta(dialog, i, time.time_ns())) for i, k in enumerate(keys)]
    for (k, p, m), stored in zip(items, await mc.write(items)):
        assert isinstance(stored, int) and cards.note_written(mc, [k], [stored], [len(p)], [m])[0]


async def _reads_back(cards: CardSet, k: bytes) -> bool:
    mc, entry = KeyFinder(cards).find(k, cards.cards[0])
    if mc is None or entry is None:
        return False
    dest = memoryview(bytearray(SIZE))
    (r,) = await mc.read([(k, dest)])
    if r.header is None:
        mc.catalog.note_failed_read(k, r)
        return False
    assert dest.tobytes() == _payload(k), "a wrong byte"
    return True


def test_the_snapshot_is_loaded_then_checked_against_the_card(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "kvgate.long")

    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        cards = await _holding(cfg, [_key(i) for i in range(N)])
        used = cards.cards[0].used
        await cards.stop()  # a clean stop writes the snapshot
        assert (tmp_path / "card" / "kvgate-index").is_file()

        other = DirectoryCard(str(tmp_path / "card"))  # behind the gateway's back:
        assert other.delete(_key(3))  # one object deleted
        late = full_key(b"ns", b"written-by-another-gateway")
        other.write(late, memoryview(_payload(late)), ObjectMeta(created_ns=time.time_ns()))  # one added

        caplog.clear()
        cards = await _started(cfg)
        mc = cards.cards[0]
        # Loaded before the card serves: the snapshot as it was, the check not run yet.
        assert mc.life.keeper.loaded == N and len(mc.index) == N and mc.used == used and not mc.life.scanned
        assert _key(3) in mc.index and late not in mc.index
        assert "index snapshot of 64 objects" in caplog.text
        await _scanned(cards)
        assert _key(3) not in mc.index, "deleted behind its back: dropped by the check"
        assert late in mc.index, "written behind its back: found by the check"
        assert len(mc.index) == N and mc.used == used  # one object gone, one of the same size found
        assert "64 from its snapshot, 1 found on the card, 1 gone from it" in caplog.text
        assert all([await _reads_back(cards, _key(i)) for i in range(N) if i != 3])
        assert await _reads_back(cards, late)
        figures = cards.hooks.usage.snapshot()["ns"]
        assert figures["card_objects"] == N and figures["card_bytes"] == mc.used
        await cards.stop()

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["flipped byte", "torn", "another card's"])
def test_an_unusable_snapshot_is_ignored_with_a_log_line(tmp_path: Path, caplog, damage: str) -> None:
    caplog.set_level(logging.INFO, "kvgate.long")

    async def main() -> None:
        cfg = _config(tmp_path, ["card", "spare"])
        cards = await _started(cfg)
        await _scanned(cards)
        mc = next(c for c in cards.cards if c.location.endswith("card"))
        items = [(_key(i), memoryview(_payload(_key(i))), ObjectMeta(created_ns=time.time_ns())) for i in range(N)]
        for (k, p, m), stored in zip(items, await mc.write(items)):
            assert cards.note_written(mc, [k], [stored], [len(p)], [m])[0]
        await cards.stop()
        snap = tmp_path / "card" / "kvgate-index"
        raw = bytearray(snap.read_bytes())
        victim, held = "card", N
        if damage == "flipped byte":
            raw[len(raw) // 2] ^= 0x40
            snap.write_bytes(bytes(raw))
        elif damage == "torn":
            snap.write_bytes(bytes(raw[: len(raw) - 100]))
        else:  # the card's snapshot on the spare card (a card cloned, a label replaced)
            shutil.copyfile(snap, tmp_path / "spare" / "kvgate-index")
            victim, held = "spare", 0

        caplog.clear()
        cards = await _started(cfg)
        mc = next(c for c in cards.cards if c.location.endswith(victim))
        reason = {"flipped byte": "its hash does not match", "torn": "its hash does not match",
                  "another card's": "written for card"}[damage]
        assert f"{mc.where} ({mc.serial}): index snapshot ignored: {reason}" in caplog.text
        assert mc.life.keeper.loaded == 0 and len(mc.index) == 0
        await _scanned(cards)
        assert len(mc.index) == held, "the whole card scanned instead"
        await cards.stop()

    asyncio.run(main())


def test_broken_objects_the_snapshot_lists_are_misses_at_their_first_read(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        cards = await _holding(cfg, [_key(i) for i in range(8)])
        await cards.stop()
        card = DirectoryCard(str(tmp_path / "card"))
        with open(card.object_path(_key(1)), "r+b") as f:  # a flipped bit in the header
            f.seek(20)
            b = f.read(1)
            f.seek(20)
            f.write(bytes([b[0] ^ 0x10]))
        path = card.object_path(_key(2))  # rewritten in place by a newer kvgate's format
        Path(path).write_bytes(as_newer_format(Path(path).read_bytes(), _key(2)))

        cards = await _started(cfg)
        await _scanned(cards)
        mc = cards.cards[0]
        assert _key(1) in mc.index and _key(2) in mc.index, "names on the card: the check opens no object"
        assert not await _reads_back(cards, _key(1))
        assert not os.path.exists(card.object_path(_key(1))) and _key(1) not in mc.index, "deleted"
        assert not await _reads_back(cards, _key(2))
        assert os.path.exists(path) and _key(2) not in mc.index, "a miss here, left for the newer gateway"
        assert await mc.probe_prefix([_key(0), _key(2)]) == 1, "and never offered again"
        assert all([await _reads_back(cards, _key(i)) for i in (0, 3, 4, 5, 6, 7)])
        await cards.stop()

    asyncio.run(main())


def test_the_index_is_saved_now_and_then_and_after_a_full_scan(tmp_path: Path, monkeypatch, caplog) -> None:
    """A gateway that never stops cleanly still leaves a recent snapshot behind."""
    caplog.set_level(logging.INFO, "kvgate.long")
    monkeypatch.setattr(restart, "SAVE_EVERY_S", 0.2)

    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        card = DirectoryCard(cfg.storage_devices[0])
        card.open()
        for i in range(20):  # on the card before the first start: no snapshot yet
            card.write(_key(i), memoryview(_payload(_key(i))), ObjectMeta(created_ns=time.time_ns()))
        cards = await _started(cfg)
        await _scanned(cards)
        snap = Path(cfg.storage_devices[0]) / "kvgate-index"
        for _ in range(300):  # written right after the check ends
            if "written after the start-up check" in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert snap.exists() and "written after the start-up check" in caplog.text
        first = snap.stat().st_mtime_ns
        await _write(cards, [_key(i) for i in range(20, 30)])
        for _ in range(300):  # the log line comes after the file is in place
            await asyncio.sleep(0.02)
            if "written periodically" in caplog.text:
                break
        assert snap.stat().st_mtime_ns != first and "written periodically" in caplog.text
        got = restart.decode(snap.read_bytes(), cards.cards[0].serial, 1)
        assert len(got.rows) == 30
        await cards._tasks.cancel()  # a crash: nothing more is written
        await cards.cards[0].life.close()

    asyncio.run(main())


def test_a_snapshot_row_knows_its_dialog_and_place_in_eviction(tmp_path: Path) -> None:
    """Reloaded, the index evicts as it would have (reused blocks last) and the mover places by dialog."""
    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        keys = [_key(i) for i in range(N)]
        cards = await _holding(cfg, keys)
        mc = cards.cards[0]
        for k in keys[:8]:
            mc.catalog.note_hit(k, SIZE)  # the dialog's head is read again: it is the last to go
        before = [mc.index.digest(r) for r in mc.catalog.policy.hottest_first().tolist()]
        entry = mc.index.get(keys[5])
        await cards.stop()
        cards = await _started(cfg)
        mc = cards.cards[0]
        assert [mc.index.digest(r) for r in mc.catalog.policy.hottest_first().tolist()] == before
        assert mc.index.get(keys[5]) == entry
        victim = mc.index.digest(mc.catalog.policy.choose_victim())
        assert victim == mc.index.rows.digest(mc.index.row(victim)) and victim not in before[:8]
        await cards.stop()

    asyncio.run(main())


def test_decode_refuses_what_is_not_a_whole_snapshot_of_this_card() -> None:
    with pytest.raises(restart.SnapshotUnusable, match="truncated"):
        restart.decode(b"KVGINDEX", "serial", 1)
    with pytest.raises(restart.SnapshotUnusable, match="bad magic"):
        restart.decode(b"x" * 200, "serial", 1)
    head = restart.encode_head("serial", 2)
    body = head + restart.encode_tail([], 0, len(head))
    whole = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    assert len(restart.decode(whole, "serial", 2).rows) == 0
    with pytest.raises(restart.SnapshotUnusable, match="num_dbs 2, now 1"):
        restart.decode(whole, "serial", 1)
    with pytest.raises(restart.SnapshotUnusable, match="written for card serial"):
        restart.decode(whole, "other", 2)


def test_a_scan_whose_header_reads_fail_stops_with_a_log_line_and_keeps_what_it_indexed(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """Headers are read one batch ahead of the indexing: a failed read stops the scan, and the read
    already under way is let go without an unretrieved error."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(restart, "CHECK_HEADERS", 8)

    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        card = DirectoryCard(cfg.storage_devices[0])
        card.open()
        for i in range(N):
            card.write(_key(i), memoryview(_payload(_key(i))), ObjectMeta(created_ns=time.time_ns()))
        calls = 0
        real = DirectoryCard.stored_objects

        def failing(self, digests):
            nonlocal calls
            calls += 1
            if calls == 4:
                raise OSError(5, "Input/output error")
            return real(self, digests)

        monkeypatch.setattr(DirectoryCard, "stored_objects", failing)
        cards = await _started(cfg)
        for _ in range(500):
            if "index scan stopped" in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert "index scan stopped: [Errno 5] Input/output error" in caplog.text
        mc = cards.cards[0]
        assert 0 < len(mc.index) < N and not mc.life.scanned  # what the reads before the failure found
        indexed = [i for i in range(N) if _key(i) in mc.index]
        assert all([await _reads_back(cards, _key(i)) for i in indexed])
        await cards.stop()

    asyncio.run(main())
    gc.collect()  # an abandoned future's unretrieved error is logged when it is collected
    assert "never retrieved" not in caplog.text


def test_a_snapshot_saved_in_many_steps_while_keys_are_written_loads_every_row(tmp_path: Path, monkeypatch) -> None:
    """The saver reuses one record buffer for every step: each step's rows reach the card as they were
    encoded, even when the index grows past its size at the start of the save between two steps."""
    monkeypatch.setattr(restart, "SAVE_ROWS", 7)  # 64 and 128 rows: a short last step

    async def main() -> None:
        cfg = _config(tmp_path, ["card"])
        cards = await _holding(cfg, [_key(i) for i in range(N)])
        mc = cards.cards[0]
        late = [_key(N + i) for i in range(N)]
        writes = asyncio.ensure_future(_write(cards, late))  # lands between the save's steps
        assert await mc.life.keeper.save("in a test")
        snap = restart.decode((tmp_path / "card" / "kvgate-index").read_bytes(), mc.serial, cfg.num_dbs)
        digests = {(int(r["lo"]), int(r["hi"])) for r in snap.rows}
        every = {split_digest(key_digest(k)) for k in [_key(i) for i in range(2 * N)]}
        assert {split_digest(key_digest(_key(i))) for i in range(N)} <= digests <= every
        await writes
        await cards.stop()  # saves again, all 2N rows
        cards = await _started(cfg)
        mc = cards.cards[0]
        assert mc.life.keeper.loaded == 2 * N and len(mc.index) == 2 * N
        assert all([await _reads_back(cards, k) for k in [_key(i) for i in range(2 * N)]])
        await cards.stop()

    asyncio.run(main())
