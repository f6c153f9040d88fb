"""A restart on a card's index snapshot, against real gateway processes stopped and killed with real signals.

A clean stop (SIGTERM) writes the snapshot; the next start loads it before it
listens and checks it against the card in the background: objects deleted
and written behind the gateway's back while it was down are dropped and
found.  A gateway killed (SIGKILL) after its last snapshot leaves one that is
behind: the check finds what it lacks.  A card without one is scanned whole.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvgate.cards import DirectoryCard, ObjectMeta
from kvgate.keys import dialog_digest, encode_namespace, full_key
from tests.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NS = "restart-ns"
N = 200


def _value(i: int) -> np.ndarray:
    return np.full(4096, i % 251, np.uint8)


def _keys(start: int, stop: int) -> list[bytes]:
    return [b"block-%d" % i for i in range(start, stop)]


def _put(gw, start: int, stop: int) -> None:
    with gw.client(NS) as c:
        assert all(c.put_many(_keys(start, stop), [_value(i) for i in range(start, stop)], dialog=b"talk",
                              position=start))


def test_a_clean_stop_leaves_a_snapshot_the_next_start_loads_and_checks(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"], name="first")
    _put(gw, 0, N)
    assert gw.stop() == 0
    snapshot = os.path.join(gw.card, "kvgate-index")
    assert os.path.getsize(snapshot) > 71 * N
    assert f"index snapshot of {N} objects written at stop" in gw.log()

    card = DirectoryCard(gw.card)  # behind the gateway's back, while it is down:
    ns = encode_namespace(NS)
    assert card.delete(full_key(ns, b"block-7"))
    card.write(full_key(ns, b"late"), memoryview(_value(999).tobytes()),
               ObjectMeta(dialog_digest(b"other talk"), 0, time.time_ns()))

    again = gateway_factory(["--storage-devices", gw.card, "--max-bytes", "0"], name="again")
    st = again.wait_scanned()
    log = again.log()
    assert f"index snapshot of {N} objects" in log and "loaded in" in log
    assert f"{N} from its snapshot, 1 found on the card, 1 gone from it" in log
    assert st["cards"][0]["objects"] == N and st["cards"][0]["snapshot_rows_loaded"] == N
    with again.client(NS) as c:
        assert c.lookup(_keys(0, 20), dialog=b"talk") == 7, "the deleted block ends the prefix"
        assert c.exists_many([b"late", b"block-6", b"block-7"]) == [True, True, False]
        got = c.get_many([b"late", b"block-8"])
        assert bytes(got[0]) == _value(999).tobytes() and bytes(got[1]) == _value(8).tobytes()


def test_a_killed_gateway_leaves_a_snapshot_behind_and_the_check_finds_the_rest(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"], name="first")
    _put(gw, 0, N)
    assert gw.stop() == 0  # a snapshot of N objects
    gw.start()
    # Its check over (logged, then no save: nothing changed) before the next writes, which a save
    # after the check would otherwise put in the snapshot.
    wait_until(lambda: f"{N} from its snapshot, 0 found on the card" in gw.log(), 30, "the check after the restart")
    _put(gw, N, N + 50)
    gw.kill(signal.SIGKILL)  # the last 50 are in no snapshot
    assert "written at stop" not in gw.log().split("ready:")[-1]

    again = gateway_factory(["--storage-devices", gw.card, "--max-bytes", "0"], name="again")
    st = again.wait_scanned()
    assert st["cards"][0]["objects"] == N + 50
    assert f"{N} from its snapshot, 50 found on the card, 0 gone from it" in again.log()
    with again.client(NS) as c:
        assert c.lookup(_keys(0, N + 50), dialog=b"talk") == N + 50


def test_a_card_without_a_snapshot_is_scanned_whole(gateway_factory) -> None:
    gw = gateway_factory(["--max-bytes", "0"], name="first")
    _put(gw, 0, N)
    gw.kill(signal.SIGKILL)
    assert not os.path.exists(os.path.join(gw.card, "kvgate-index"))
    again = gateway_factory(["--storage-devices", gw.card, "--max-bytes", "0"], name="again")
    wait_until(lambda: "no snapshot: every header read" in again.log(), 30, "the scan of the whole card")
    assert "no index snapshot; scanning the card" in again.log()
    assert again.wait_scanned()["cards"][0]["objects"] == N
    # ... after which it has one, so a crash from now on costs a check, not a scan.
    wait_until(lambda: "written after the start-up check" in again.log(), 30, "the snapshot after the scan")
    assert os.path.exists(os.path.join(gw.card, "kvgate-index"))
