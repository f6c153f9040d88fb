"""``Reconnector``: the lazily (re)connected gateway session every integration holds, with its back-off.

Fake clients and a fake clock for the class itself; then each integration's holder against a
socket nobody listens on (no gateway, no engine).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvgate.integrations import reconnect
from kvgate.integrations.ratelimit import RateLimitedLog
from kvgate.integrations.reconnect import Backoff, GatewayDown, Reconnector
from kvgate.integrations.settings import TierSettings
from tests.helpers import wait_until


class FakeClient:
    """Stands in for ``kvgate.client.Client``: ``call`` blocks until the client is aborted or closed."""

    def __init__(self, n: int):
        self.n = n
        self.broken = False
        self.closed = False
        self._woken = threading.Event()

    def abort(self) -> None:
        self.broken = True
        self._woken.set()

    def close(self) -> None:
        self.abort()
        self.closed = True

    def call(self, wait_s: float = 5.0) -> str:
        if self._woken.wait(wait_s):
            raise ConnectionError("aborted")
        return "answered"


class Opener:
    """An open function that fails while ``fail`` is set, and counts its calls."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = 0
        self.made: list[FakeClient] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> FakeClient:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(5)
        if self.fail:
            raise ConnectionRefusedError(f"refused #{self.calls}")
        self.made.append(FakeClient(len(self.made)))
        return self.made[-1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reconnector(opener: Opener, clock: Clock | None = None, **kw) -> Reconnector[FakeClient]:
    return Reconnector("/run/gw.sock", opener, closed_message="shutting down",
                       clock=clock if clock is not None else time.monotonic, **kw)


def test_tries_are_half_a_second_apart_doubling_to_ten_and_a_success_starts_over() -> None:
    clock, opener = Clock(), Opener(fail=True)
    r = reconnector(opener, clock)
    tried_at = []
    end = clock.now + 60
    while clock.now < end:
        before = opener.calls
        with pytest.raises(GatewayDown):
            r.get()
        if opener.calls > before:
            tried_at.append(clock.now)
        clock.now = round(clock.now + 0.05, 2)
    gaps = [round(b - a, 2) for a, b in zip(tried_at, tried_at[1:])]
    assert gaps[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0] and set(gaps[5:]) == {10.0}, gaps

    opener.fail = False
    clock.now = tried_at[-1] + 10.0
    assert r.get() is opener.made[0]
    assert r.backoff.delay_s == 0.5  # a success starts the back-off over
    opener.made[0].broken = True
    opener.fail = True
    with pytest.raises(GatewayDown):
        r.get()
    t = clock.now
    clock.now = t + 0.4
    with pytest.raises(GatewayDown, match="next try in 0.1 s"):
        r.get()
    calls = opener.calls
    clock.now = t + 0.5
    with pytest.raises(GatewayDown, match="refused"):
        r.get()
    assert opener.calls == calls + 1


def test_during_the_back_off_get_refuses_at_once_naming_the_target_and_the_wait() -> None:
    clock, opener = Clock(), Opener(fail=True)
    downs: list[Exception] = []
    r = reconnector(opener, clock, on_down=downs.append)
    with pytest.raises(GatewayDown, match="refused #1") as failed:
        r.get()
    assert isinstance(failed.value.__cause__, ConnectionRefusedError)
    assert [str(e) for e in downs] == ["refused #1"]
    clock.now += 0.2
    with pytest.raises(GatewayDown) as refused:
        r.get()
    assert str(refused.value) == "gateway /run/gw.sock unreachable; next try in 0.3 s"
    assert opener.calls == 1 and len(downs) == 1  # no connect tried, nothing more logged
    assert isinstance(refused.value, ConnectionError)


def test_a_held_client_is_reused_and_a_broken_one_closed_and_replaced() -> None:
    opener = Opener()
    ups: list[int] = []
    r = reconnector(opener, on_up=lambda: ups.append(1))
    first = r.get()
    assert r.get() is first and r.client is first and opener.calls == 1 and ups == [1]
    first.broken = True
    second = r.get()
    assert second is not first and first.closed and not second.closed
    assert opener.calls == 2 and ups == [1, 1]
    r.drop()  # a call failed: forget the session, reconnect next time
    assert second.closed and r.client is None
    assert r.get() is opener.made[2]


def test_two_threads_asking_at_once_open_one_session() -> None:
    opener = Opener()
    opener.release.clear()
    r = reconnector(opener)
    got: list[FakeClient] = []
    threads = [threading.Thread(target=lambda: got.append(r.get())) for _ in range(2)]
    for t in threads:
        t.start()
    assert opener.entered.wait(5)
    time.sleep(0.05)  # the second thread is waiting for the first one's connect
    opener.release.set()
    for t in threads:
        t.join(5)
    assert opener.calls == 1 and len(got) == 2 and got[0] is got[1]


def test_abort_unblocks_a_thread_in_a_call_and_refuses_new_calls() -> None:
    opener = Opener()
    r = reconnector(opener)
    client = r.get()
    outcome: list[object] = []
    in_call = threading.Event()

    def call() -> None:
        in_call.set()
        try:
            outcome.append(client.call(wait_s=10))
        except ConnectionError as e:
            outcome.append(e)

    t = threading.Thread(target=call)
    t.start()
    assert in_call.wait(5)
    time.sleep(0.02)
    t0 = time.monotonic()
    r.abort()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 1.0
    assert isinstance(outcome[0], ConnectionError)
    with pytest.raises(GatewayDown, match="^shutting down$"):
        r.get()
    assert opener.calls == 1 and r.closed
    r.close()
    assert client.closed and r.client is None


def test_close_from_another_thread_while_a_thread_is_connecting_returns_at_once() -> None:
    opener = Opener()
    opener.release.clear()
    r = reconnector(opener)
    result: list[object] = []

    def get() -> None:
        try:
            result.append(r.get())
        except GatewayDown as e:
            result.append(e)

    t = threading.Thread(target=get)
    t.start()
    assert opener.entered.wait(5)
    t0 = time.monotonic()
    r.close()  # does not wait for the connect in progress
    assert time.monotonic() - t0 < 0.5
    opener.release.set()
    t.join(5)
    # the session that connect made is not handed out, and not left open
    assert isinstance(result[0], GatewayDown) and str(result[0]) == "shutting down"
    assert opener.made[0].closed and r.client is None
    with pytest.raises(GatewayDown, match="shutting down"):
        r.get()
    assert opener.calls == 1


def test_close_while_a_thread_calls_get_in_a_loop() -> None:
    opener = Opener()
    r = reconnector(opener)
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                r.get().broken = True  # every get opens a new session
            except GatewayDown:
                return
            except BaseException as e:  # anything else is a bug
                errors.append(e)
                return

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.05)
    r.close()
    t.join(5)
    stop.set()
    assert not t.is_alive() and not errors
    assert all(c.closed for c in opener.made), "a session outlived close()"


def test_a_back_off_shared_by_two_sessions_refuses_both() -> None:
    clock, shared = Clock(), Backoff()
    a = reconnector(Opener(fail=True), clock, backoff=shared)
    b_opener = Opener()
    b = reconnector(b_opener, clock, backoff=shared)
    with pytest.raises(GatewayDown):
        a.get()
    with pytest.raises(GatewayDown, match="next try in 0.5 s"):
        b.get()
    assert b_opener.calls == 0
    clock.now += 0.5
    assert b.get() is b_opener.made[0]


def test_backoff_alone() -> None:
    b = Backoff()
    assert b.left(5.0) == 0.0
    delays = []
    for _ in range(7):
        b.failed(5.0)
        delays.append(b.left(5.0))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    b.succeeded()
    b.failed(20.0)
    assert b.left(20.0) == 0.5 and b.left(21.0) == 0.0


# ---- each integration's holder, against a socket nobody listens on -----------------------------

def nowhere(tmp_path) -> TierSettings:
    return TierSettings.build(socket=str(tmp_path / "nobody.sock"), connect_timeout=0.2, io_timeout=0.5,
                              lookup_timeout=0.5)


def test_the_integrations_raise_the_one_gateway_down() -> None:
    from kvgate.integrations.lmcache import sessions
    from kvgate.integrations.sglang import link
    from kvgate.integrations.vllm import connection

    assert link.GatewayDown is sessions.GatewayDown is connection.GatewayDown is reconnect.GatewayDown
    assert issubclass(link.GatewayLink, Reconnector) and issubclass(connection.TierConnection, Reconnector)


def test_vllm_tier_connection_backs_off_and_logs_once(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from kvgate.integrations.vllm.connection import TierConnection

    s = nowhere(tmp_path)
    conn = TierConnection("stores", 0.5, settings=s, namespace="ns", engine_id="e", region_path=lambda: None,
                          region_view=memoryview(bytearray(8)), log=RateLimitedLog(logging.getLogger("vllm.kvgate")))
    with caplog.at_level(logging.WARNING, logger="vllm.kvgate"):
        with pytest.raises(GatewayDown):
            conn.get()
        with pytest.raises(GatewayDown, match=rf"gateway {s.target} unreachable; next try in 0\.\d s"):
            conn.get()
    assert sum("cannot connect to gateway" in r.getMessage() for r in caplog.records) == 1
    conn.abort()
    with pytest.raises(GatewayDown, match="the tier is shutting down"):
        conn.get()
    conn.close()


@pytest.mark.slow
def test_vllm_tier_sessions_say_once_that_the_gateway_is_back(gateway_factory, tmp_path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The tier's three sessions share one ``Outage``: a gateway that comes back is logged once, by the
    session that reconnects first, with how long it was gone (as SGLang's backend and LMCache's adapter
    log it); a session that reconnects later adds nothing."""
    from kvgate.integrations.vllm.connection import Outage, TierConnection

    gw = gateway_factory(start=False)
    s = TierSettings.build(socket=gw.socket, connect_timeout=1.0, io_timeout=2.0, lookup_timeout=2.0)
    outage = Outage()
    conns = [TierConnection(name, 2.0, settings=s, namespace="ns", engine_id="e", region_path=lambda: None,
                            region_view=memoryview(bytearray(8)), bulk=False, outage=outage,
                            log=RateLimitedLog(logging.getLogger("vllm.kvgate"))) for name in ("lookups", "stores")]
    with caplog.at_level(logging.INFO, logger="vllm.kvgate"):
        for c in conns:
            with pytest.raises(GatewayDown):
                c.get()
        gw.start()

        def connected(c: TierConnection) -> bool:
            try:
                return c.get() is not None
            except GatewayDown:  # the back-off (0.5 s) is not over yet
                return False

        for c in conns:
            wait_until(lambda: connected(c), 10, f"the {c.name} session never reconnected")
    back = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == 1, back
    assert back[0].startswith(f"kvgate: gateway {s.target} reachable again after ") and "(lookups)" in back[0]
    for c in conns:
        c.close()


def test_sglang_link_backs_off_and_reports_down_once(tmp_path) -> None:
    from kvgate.integrations.sglang.link import GatewayLink

    class Log:
        def __init__(self) -> None:
            self.down: list[str] = []

        def went_down(self, what: str, e: BaseException) -> None:
            self.down.append(what)

        def came_up(self, what: str) -> None:
            raise AssertionError("nothing to come up")

    log = Log()
    link = GatewayLink("loads", 0.5, 4, settings=nowhere(tmp_path), namespace="ns", engine_id="e",
                       slot_bytes=4096, log=log)  # type: ignore[arg-type]
    with link.lock:
        with pytest.raises(GatewayDown):
            link.begin()
        with pytest.raises(GatewayDown, match="unreachable; next try in"):
            link.get()
    assert log.down == ["loads"] and link.client is None
    link.abort()
    link.close()
    with pytest.raises(GatewayDown, match="the backend is closed"):
        link.get()


def test_lmcache_sessions_share_one_back_off_across_namespaces(tmp_path) -> None:
    from kvgate.integrations.lmcache.sessions import Sessions

    downs: list[str] = []
    sessions = Sessions("store", 0.5, tier=nowhere(tmp_path), bulk=True, l1=lambda: None,
                        log=RateLimitedLog(logging.getLogger("kvgate.lmcache")), on_down=downs.append,
                        on_up=lambda: None)
    with pytest.raises(GatewayDown):
        sessions.get("ns-a")
    with pytest.raises(GatewayDown, match="next try in"):
        sessions.get("ns-b")  # another namespace, the same gateway: not tried again
    assert len(downs) == 1 and downs[0].startswith("cannot connect (")
    sessions.drop("ns-a")
    sessions.drop("never-seen")
    sessions.abort()
    for ns in ("ns-a", "ns-c"):  # a namespace seen before, and a new one
        with pytest.raises(GatewayDown, match="the adapter is closing"):
            sessions.get(ns)
    assert sessions.closed
    sessions.close()
