"""Cards that join, drain and leave a running gateway while a client writes and restores without pause.

Real gateway process, real directory cards, the real ``kvgate cards`` command
and a real SIGHUP after an edited config.  Every restore is checked byte for
byte; a restore that comes back short counts as failed.  Bars: no wrong byte
ever; no failed restore while a card joins or drains cleanly; no call waits
longer than ``io_timeout_ms``; a drained card leaves holding nothing that is
not also on the card that took it over.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import run_kvgate, wait_until

pytestmark = pytest.mark.slow

IO_TIMEOUT_MS = 2000
BLOCK = 16 << 10
BLOCKS = 4  # per dialog


def _block(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * (BLOCK // 32)


class Traffic(threading.Thread):
    """Writes a new dialog, then restores a random earlier one, over and over; counts what went wrong."""

    def __init__(self, gw) -> None:
        super().__init__(daemon=True)
        self.gw = gw
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.dialogs: list[int] = []
        self.restores = 0
        self.failed: list[tuple[str, int, int]] = []  # (phase, dialog, blocks restored)
        self.wrong = 0
        self.slowest = 0.0
        self.phase = "start"
        self.error: BaseException | None = None
        self.error_phase = ""

    @staticmethod
    def keys(d: int) -> list[bytes]:
        return [b"dlg%05d-blk%d" % (d, i) for i in range(BLOCKS)]

    def _timed(self, fn, *args, **kw):
        t = time.monotonic()
        out = fn(*args, **kw)
        self.slowest = max(self.slowest, time.monotonic() - t)
        return out

    def run(self) -> None:
        rng = random.Random(7)
        try:
            with self.gw.client(namespace="changes") as c:
                d = 0
                while not self.stop.is_set():
                    keys = self.keys(d)
                    mark = b"dialog-%d" % d
                    assert all(self._timed(c.put_many, keys, [_block(k) for k in keys], dialog=mark, position=0))
                    with self.lock:
                        self.dialogs.append(d)
                    d += 1
                    old = rng.choice(self.dialogs)
                    keys = self.keys(old)
                    got = self._timed(c.get_many, keys, dialog=b"dialog-%d" % old)
                    n = 0
                    for k, g in zip(keys, got):
                        if g is None:
                            break
                        if bytes(g) != _block(k):
                            self.wrong += 1
                        n += 1
                    self.restores += 1
                    if n < BLOCKS:
                        self.failed.append((self.phase, old, n))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.error_phase = self.phase


def _cards(gw) -> dict:
    out = run_kvgate("cards", "list", "--json", "--socket", gw.socket)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _objects(card: Path) -> set[str]:
    return {p.name for p in card.glob("db*/*/*") if not p.name.startswith(".")}


def test_cards_join_drain_and_leave_while_a_client_writes_and_restores(tmp_path: Path, gateway_factory) -> None:
    cards = {n: tmp_path / n for n in "abcd"}
    for p in cards.values():
        p.mkdir()
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"storage_devices: [{cards['a']}, {cards['b']}]\nio_timeout_ms: {IO_TIMEOUT_MS}\n")
    gw = gateway_factory(["--config", str(config)], start=False)
    i = gw.argv.index("--storage-devices")  # the config file names the cards, so SIGHUP can change them
    del gw.argv[i : i + 2]
    gw.start()
    gw.wait_scanned()
    traffic = Traffic(gw)
    traffic.start()
    try:
        wait_until(lambda: len(traffic.dialogs) > 30, 60, "some dialogs written")

        traffic.phase = "join"
        out = run_kvgate("cards", "add", str(cards["c"]), "--socket", gw.socket)
        assert out.returncode == 0, out.stderr
        listed = _cards(gw)
        assert listed["generation"] == 1 and len(listed["cards"]) == 3
        joined = next(c for c in listed["cards"] if c["location"] == str(cards["c"]))
        assert joined["state"] == "serving" and joined["slots"] > 0
        wait_until(lambda: _cards(gw)["cards"][2]["objects"] > 0, 60, "objects copied to the joined card")

        traffic.phase = "drain"
        serial_a = next(c["serial"] for c in listed["cards"] if c["location"] == str(cards["a"]))
        out = run_kvgate("cards", "drain", serial_a, "--socket", gw.socket)
        assert out.returncode == 0, out.stderr
        wait_until(lambda: all(c["serial"] != serial_a for c in _cards(gw)["cards"]), 60, "the drained card left")
        left_on_a = _objects(cards["a"])
        elsewhere = _objects(cards["b"]) | _objects(cards["c"])
        assert left_on_a <= elsewhere, "the drained card left with objects no other card holds"

        traffic.phase = "undrain"
        serial_b = next(c["serial"] for c in _cards(gw)["cards"] if c["location"] == str(cards["b"]))
        assert run_kvgate("cards", "drain", serial_b, "--socket", gw.socket).returncode == 0
        assert run_kvgate("cards", "undrain", serial_b, "--socket", gw.socket).returncode == 0
        assert {c["state"] for c in _cards(gw)["cards"]} == {"serving"}

        traffic.phase = "sighup"
        config.write_text(f"storage_devices: [{cards['b']}, {cards['c']}, {cards['d']}]\n"
                          f"io_timeout_ms: {IO_TIMEOUT_MS}\n")
        os.kill(gw.pid, signal.SIGHUP)
        wait_until(lambda: any(c["location"] == str(cards["d"]) for c in _cards(gw)["cards"]), 60,
                   "the card of the new entry joined")
        time.sleep(1.0)  # traffic on the new layout

        traffic.phase = "remove"
        failed_before_remove = list(traffic.failed)
        serial_c = next(c["serial"] for c in _cards(gw)["cards"] if c["location"] == str(cards["c"]))
        assert run_kvgate("cards", "remove", serial_c, "--socket", gw.socket).returncode == 0
        assert all(c["serial"] != serial_c for c in _cards(gw)["cards"])
        time.sleep(1.0)  # restores of what was only on the removed card now miss; nothing else may
        out = run_kvgate("cards", "drain", "no-such-serial", "--socket", gw.socket)
        assert out.returncode == 1 and "no card with serial" in out.stderr
    finally:
        traffic.stop.set()
        traffic.join(30)
    assert traffic.error is None, f"{traffic.error!r} in phase {traffic.error_phase}; log:\n{gw.log()[-4000:]}"
    assert traffic.wrong == 0, "a wrong byte reached the client"
    assert failed_before_remove == [], f"restores failed while cards joined or drained: {failed_before_remove}"
    assert traffic.restores > 50, traffic.restores
    assert traffic.slowest < IO_TIMEOUT_MS / 1000, f"a call waited {traffic.slowest:.2f} s"
    assert "card set generation" in gw.log()
