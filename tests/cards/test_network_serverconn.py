"""The card server's read-ahead of a batch: which files it has the kernel read before their turn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgate.cards.network import serverconn as exportconn
from kvgate.cards.network.serverconn import ReadAhead


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(file size, advised length) of every WILLNEED, in order."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED and offset == 0
        calls.append((os.fstat(fd).st_size, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(exportconn.os, "posix_fadvise", record)
    return calls


def _files(tmp_path: Path, sizes: list[int]) -> list[str]:
    paths = []
    for i, size in enumerate(sizes):
        p = tmp_path / f"o{i}"
        p.write_bytes(b"x" * size)
        paths.append(str(p))
    return paths


def test_the_next_files_are_advised_up_to_the_window_and_each_once(tmp_path, advised, monkeypatch) -> None:
    monkeypatch.setattr(ReadAhead, "AHEAD_BYTES", 10_000)
    paths = _files(tmp_path, [4000] * 8)
    ahead = ReadAhead(paths)
    ahead.before_sending(0)
    assert len(advised) == 3, "files 0-2: 12,000 bytes reach the 10,000 window"
    assert all(size == length == 4000 for size, length in advised)
    ahead.before_sending(1)
    assert len(advised) == 4, "the window moved by one file: one more advised, none twice"
    for i in range(2, 8):
        ahead.before_sending(i)
    assert len(advised) == 8


def test_a_large_file_still_has_the_next_one_advised_and_a_missing_one_is_passed_over(tmp_path, advised,
                                                                                        monkeypatch) -> None:
    monkeypatch.setattr(ReadAhead, "AHEAD_BYTES", 1000)
    paths = _files(tmp_path, [5000, 5000, 5000])
    paths.insert(1, str(tmp_path / "gone"))
    ahead = ReadAhead(paths)
    ahead.before_sending(0)
    assert len(advised) == 1, "the missing file is passed over (its Item says so); the next one after"
    ahead.before_sending(1)
    assert len(advised) == 2, "file 2, the one after the missing one, before its turn"
