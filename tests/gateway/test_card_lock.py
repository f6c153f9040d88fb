"""One card, several gateways: only with shared_storage on every one of them.

Real gateway processes on real directory cards and a real redis-server: a
second gateway on a card another one holds refuses to start with one line
naming the card, the holder and the fix; shared gateways share; a SIGKILLed
holder frees the card at once.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers import run_kvgate, wait_until
from tests.processes import REDIS_SERVER, RedisServer

SERVE_FLAGS = ["--port", "0", "--metrics-port", "0", "--max-bytes", "0", "--card-capacity", "1G",
               "--thread-pool-size", "2", "--shared-memory-size", "8M"]


def refused_start(tmp_path, card: str, *flags: str) -> str:
    """Start a gateway on ``card`` that must refuse; returns its one-line error."""
    r = run_kvgate("serve", "--storage-devices", card, "--socket", str(tmp_path / "refused.sock"), *SERVE_FLAGS,
                   *flags, cwd=str(tmp_path))
    assert r.returncode == 2, f"a second gateway on {card} started (or failed otherwise): {r.stderr}"
    lines = [ln for ln in r.stderr.splitlines() if "cannot start" in ln]
    assert len(lines) == 1, r.stderr
    assert not (tmp_path / "refused.sock").exists()
    return lines[0]


def test_second_gateway_on_a_directory_card_refuses_to_start(gateway_factory, tmp_path) -> None:
    first = gateway_factory(name="first")
    with first.client("mine") as c:
        assert c.put_many([b"a", b"b"], [b"1", b"2"]) == [True, True]
    line = refused_start(tmp_path, first.card)
    assert first.card in line and f"pid {first.pid}" in line, line
    assert "shared_storage: true on every gateway" in line and "another card" in line, line
    # The refused gateway touched nothing; the first one is whole and still alone on its card.
    with first.client("mine") as c:
        assert c.get_many([b"a", b"b"]) == [b"1", b"2"]
    # clean of the first deletes its own objects; no other gateway can have any on its card.
    assert run_kvgate("clean", "--socket", first.socket).returncode == 0
    assert first.stats()["cards"][0]["objects"] == 0
    assert first.alive()


def test_shared_gateways_share_a_card_and_an_exclusive_one_does_not_mix(gateway_factory, tmp_path) -> None:
    card = str(tmp_path / "card")
    shared = ["--storage-devices", card, "--shared-storage", "true"]
    a = gateway_factory(shared, name="a")
    b = gateway_factory(shared, name="b")
    with a.client("ns") as c:
        assert c.put_many([b"k"], [b"v"], retention="long") == [True]
    with b.client("ns") as c:
        assert c.get_many([b"k"]) == [b"v"]  # same card: b finds what a wrote
    line = refused_start(tmp_path, card)  # shared_storage false
    assert "holding it shared" in line and "shared_storage: true on every gateway" in line, line
    # start_clean on an exclusive gateway would have deleted what a and b hold
    refused_start(tmp_path, card, "--start-clean", "true")
    with a.client("ns") as c:
        assert c.get_many([b"k"]) == [b"v"]


def test_a_shared_gateway_is_refused_by_an_exclusive_holder(gateway_factory, tmp_path) -> None:
    first = gateway_factory(name="alone")
    line = refused_start(tmp_path, first.card, "--shared-storage", "true")
    assert f"pid {first.pid}" in line and "holding it exclusively" in line, line


def test_a_killed_holder_frees_its_directory_card_at_once(gateway_factory, tmp_path) -> None:
    first = gateway_factory(name="victim")
    with first.client("ns") as c:
        assert c.put_many([b"k"], [b"v"], retention="long") == [True]
    first.kill(signal.SIGKILL)
    t0 = time.monotonic()
    second = gateway_factory(["--storage-devices", first.card], name="heir")
    assert time.monotonic() - t0 < 15  # started, not waited out
    second.wait_scanned()
    with second.client("ns") as c:
        assert c.get_many([b"k"]) == [b"v"]


def test_a_card_that_appears_held_by_another_gateway_is_not_used(gateway_factory, tmp_path) -> None:
    """A pending entry's directory shows up, but another gateway holds that card: logged, not used."""
    wanted = tmp_path / "wanted"
    waiting = gateway_factory(["--storage-devices", str(wanted)], name="waiting", create_cards=False)
    assert waiting.stats()["cards"] == [] or not any(c["active"] for c in waiting.stats()["cards"])
    # Another gateway holds the card, then the card moves to where the first one waits for it.
    holder = gateway_factory(["--storage-devices", str(tmp_path / "elsewhere")], name="holder")
    (tmp_path / "elsewhere").rename(wanted)
    wait_until(lambda: "is not used" in waiting.log(), 20, lambda: f"no 'is not used' line:\n{waiting.log()}")
    line = next(ln for ln in waiting.log().splitlines() if "is not used" in ln)
    assert str(wanted) in line and f"pid {holder.pid}" in line, line
    assert not any(c["active"] for c in waiting.stats()["cards"])
    time.sleep(2.5)  # the point: said once, not again at the next checks every second
    assert waiting.log().count("is not used") == 1


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")
def test_redis_card_lease(gateway_factory, tmp_path) -> None:
    srv = RedisServer(tmp_path / "redis").start()
    try:
        first = gateway_factory(["--storage-devices", srv.url], name="r1")
        with first.client("ns") as c:
            assert c.put_many([b"k"], [b"v"], retention="long") == [True]
        line = refused_start(tmp_path, srv.url)
        assert srv.url in line and f"pid {first.pid}" in line and "shared_storage: true" in line, line
        line = refused_start(tmp_path, srv.url, "--shared-storage", "true")
        assert "holding it exclusively" in line, line
        # killed on this host: its lease names a dead pid, so the next gateway takes it at once
        first.kill(signal.SIGKILL)
        t0 = time.monotonic()
        second = gateway_factory(["--storage-devices", srv.url], name="r2")
        assert time.monotonic() - t0 < 10, "waited for the dead gateway's lease to run out"
        with second.client("ns") as c:
            assert c.get_many([b"k"]) == [b"v"]
        second.stop()  # a clean stop gives the lease back
        a = gateway_factory(["--storage-devices", srv.url, "--shared-storage", "true"], name="r3")
        b = gateway_factory(["--storage-devices", srv.url, "--shared-storage", "true"], name="r4")
        assert a.alive() and b.alive()
        line = refused_start(tmp_path, srv.url)
        assert "holding it shared" in line, line
    finally:
        srv.kill()
