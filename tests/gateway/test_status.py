"""Status against real gateway processes: the status file, HTTP /metrics and prewarm, figures
per namespace, and config errors at `kvgate serve` (the other commands: tests/cli/test_main.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request

import pytest

from tests.helpers import card_serial, free_port, logged_fingerprint, run_kvgate, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

NS = "status-ns"


def _metric(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in Prometheus text (``labels`` as written, e.g. '{tier="ram"}')."""
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"no sample {name}{labels} in:\n{text}"
    return float(m.group(1))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _read_when(path: str, pred, timeout: float = 5.0) -> str:
    return wait_until(lambda: (text := _read(path)) and pred(text) and text, timeout,
                      lambda: f"status file {path} not as expected:\n{_read(path)}")


def test_status_file(gateway_factory, tmp_path) -> None:
    status = str(tmp_path / "status" / "kvgate.prom")
    gw = gateway_factory(["--status-file", status])
    # written within ~2 s of the gateway accepting connections (it is rewritten every second)
    text = _read_when(status, lambda t: "kvgate_storage_groups_active" in t, timeout=2.5)
    serial = card_serial(gw.card)
    fp = logged_fingerprint(gw.log())
    assert f'kvgate_storage_group_active{{group="{serial}"}} 1.0' in text
    assert f'kvgate_storage_group_read_only{{group="{serial}"}} 0.0' in text
    assert re.search(r"^kvgate_storage_groups_active 1\.0$", text, re.M)
    assert f'kvgate_key_layout_info{{fingerprint="{fp}"}} 1.0' in text
    assert 'kvgate_key_placement_info{placement="dialog"} 1.0' in text
    assert re.search(r"^kvgate_worker_oldest_io_age_seconds [0-9.e+-]+$", text, re.M)
    for name in ("kvgate_sets_total", "kvgate_gets_total", "kvgate_hits_total", "kvgate_misses_total",
                 "kvgate_bytes_read_total", "kvgate_bytes_written_total", "kvgate_evictions_total"):
        for tier in ("ram", "long"):
            assert _metric(text, name, f'{{tier="{tier}"}}') == 0.0
    assert _metric(text, "kvgate_corrupt_objects_total") == 0.0
    assert _metric(text, "kvgate_io_timeouts_total") == 0.0

    with gw.client(NS) as c:
        assert c.put_many([b"a", b"b"], [b"x" * 1000, b"y" * 2000]) == [True, True]
        assert c.get_many([b"a", b"missing"]) == [b"x" * 1000, None]
    text = _read_when(status, lambda t: 'kvgate_sets_total{tier="ram"} 2.0' in t, timeout=5.0)
    assert _metric(text, "kvgate_sets_total", '{tier="long"}') == 2.0
    assert _metric(text, "kvgate_hits_total", '{tier="ram"}') == 1.0
    assert _metric(text, "kvgate_misses_total", '{tier="ram"}') == 1.0
    assert _metric(text, "kvgate_misses_total", '{tier="long"}') == 1.0
    assert _metric(text, "kvgate_bytes_written_total", '{tier="long"}') == 3000.0
    assert _metric(text, "kvgate_tier_objects", '{tier="long"}') == 2.0
    assert _metric(text, "kvgate_storage_group_objects", f'{{group="{serial}"}}') == 2.0
    assert _metric(text, "kvgate_shared_head_blocks") == 0.0
    with gw.client(NS) as c:  # three conversations behind one two-block system prompt
        for conv in range(3):
            c.dialog_mark([b"sys-0", b"sys-1", b"conv-%d" % conv])
    text = _read_when(status, lambda t: "kvgate_shared_head_blocks 2.0" in t, timeout=5.0)
    assert _metric(text, "kvgate_shared_head_blocks_learned_total") == 2.0
    assert _metric(text, "kvgate_shared_head_blocks_replaced_total") == 0.0
    assert _metric(text, "kvgate_shared_head_blocks_refused_total") == 0.0
    assert _metric(text, "kvgate_shared_head_sync_errors_total") == 0.0
    # rewritten atomically: no temp file left next to it
    assert os.listdir(os.path.dirname(status)) == ["kvgate.prom"]


def test_the_default_policy_says_which_order_chose_each_ram_eviction(gateway_factory) -> None:
    """The RAM tier's adaptive policy counts its evictions by order, in stats and on /metrics."""
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport), "--max-bytes", "4M"])
    keys = [f"r{i}".encode() for i in range(160)]
    with gw.client(NS) as c:
        for i in range(0, 160, 16):
            assert c.put_many(keys[i:i + 16], [bytes([i % 251]) * 65536] * 16) == [True] * 16
        ram = c.stats()["tiers"]["ram"]
    assert ram["evictions"] > 50, ram
    assert ram["prefix_order_evictions"] + ram["recency_order_evictions"] == ram["evictions"], ram
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert (_metric(text, "kvgate_ram_order_evictions_total", '{order="prefix"}')
            + _metric(text, "kvgate_ram_order_evictions_total", '{order="recency"}')) == ram["evictions"]


def test_http_metrics_and_prewarm(gateway_factory) -> None:
    mport = free_port()
    args = ["--metrics-port", str(mport), "--max-bytes", "64M"]
    gw = gateway_factory(args, name="writer")
    keys = [f"p{i}".encode() for i in range(6)]
    datas = [bytes([i]) * (100_000 + i) for i in range(6)]
    with gw.client(NS) as c:
        assert c.put_many(keys, datas) == [True] * 6
    assert gw.stop() == 0

    # a fresh gateway on the same card: RAM is empty
    gw = gateway_factory(args, card=gw.card, name="prewarmed")
    base = f"http://127.0.0.1:{mport}"
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    serial = card_serial(gw.card)
    fp = logged_fingerprint(gw.log())
    for needle in (f'kvgate_storage_group_active{{group="{serial}"}} 1.0', "kvgate_storage_groups_active 1.0",
                   f'kvgate_key_layout_info{{fingerprint="{fp}"}} 1.0', 'kvgate_key_placement_info{placement="dialog"}',
                   "kvgate_worker_oldest_io_age_seconds", 'kvgate_hits_total{tier="ram"}', 'kvgate_sets_total{tier="long"}',
                   "kvgate_files_lent_objects_total 0.0", "kvgate_files_lent_open 0.0"):
        assert needle in text, needle
    assert _metric(text, "kvgate_tier_objects", '{tier="ram"}') == 0.0

    body = json.dumps({"namespace": NS, "keys": [k.decode() for k in keys]}).encode()
    req = urllib.request.Request(f"{base}/v1/cache/prewarm", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        answer = json.loads(r.read())
    assert answer == {"in_ram": 6, "asked": 6}
    st = gw.stats()
    assert st["tiers"]["ram"]["objects"] == 6
    assert st["tiers"]["ram"]["used_bytes"] == sum(len(d) for d in datas)
    with gw.client(NS) as c:
        assert c.get_many(keys) == datas
        st = c.stats()
    assert st["tiers"]["ram"]["hits"] == 6 and st["tiers"]["long"]["gets"] == 0
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert _metric(text, "kvgate_hits_total", '{tier="ram"}') == 6.0
    assert _metric(text, "kvgate_tier_objects", '{tier="ram"}') == 6.0

    # bad prewarm requests are 400s, unknown paths 404s; the gateway goes on
    for bad in (b"not json", b"[]", json.dumps({"keys": ["a"]}).encode(), json.dumps({"namespace": NS}).encode()):
        req = urllib.request.Request(f"{base}/v1/cache/prewarm", data=bad, method="POST")
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=10)
        assert ei.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(f"{base}/nope", timeout=10)
    assert ei.value.code == 404
    assert gw.alive()


@pytest.mark.parametrize(
    "flags, yaml_text, key",
    [
        (["--max-bytes", "lots"], None, "max_bytes"),
        (["--max-frame-bytes", "1K"], None, "max_frame_bytes"),  # below the minimum
        (["--eviction-policy", "random"], None, "eviction_policy"),
        (["--shared-storage", "maybe"], None, "shared_storage"),
        ([], "max_byte: 1G\n", "max_byte"),
        ([], "ttl: forever\n", "ttl"),
        ([], "- just\n- a list\n", None),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path, flags, yaml_text, key) -> None:
    args = ["serve", "--storage-devices", str(tmp_path / "card"), "--port", "0", "--metrics-port", "0",
            "--socket", str(tmp_path / "s.sock"), *flags]
    if yaml_text is not None:
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_text(yaml_text)
        args += ["--config", str(cfg)]
    r = run_kvgate(*args)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    if key is not None:
        assert f"'{key}'" in lines[0], lines[0]
    else:
        assert "kvgate.yaml" in lines[0]
    assert not os.path.exists(tmp_path / "s.sock")
    assert not os.path.exists(tmp_path / "card"), "a refused config must not touch the card"


def test_prewarm_while_the_startup_scan_runs(gateway_factory, tmp_path) -> None:
    """Objects the start-up scan has not indexed yet are prewarmed too (lookups and gets see them already)."""
    from kvgate.cards import DirectoryCard, ObjectMeta
    from kvgate.keys import encode_namespace, full_key

    card_dir = str(tmp_path / "bigcard")
    card = DirectoryCard(card_dir)
    card.open()
    ns = encode_namespace(NS)
    for i in range(12000):  # enough files that the scan takes a while
        card.write(full_key(ns, b"filler-%d" % i), memoryview(b"f" * 8), ObjectMeta())
    targets = [b"t0", b"t1", b"t2"]
    for i, k in enumerate(targets):
        card.write(full_key(ns, k), memoryview(bytes([i]) * 5000), ObjectMeta())
    gw = gateway_factory(card=card_dir)
    with gw.client(NS) as c:
        n = c.prewarm(targets)
        scanned = c.stats()["cards"][0]["scanned"]
        if scanned:
            pytest.skip("the start-up scan finished before the prewarm could race it")
        assert c.lookup(targets) == 3
        assert n == 3
        st = c.stats()
        assert st["tiers"]["ram"]["objects"] == 3
        assert c.get_many(targets) == [bytes([i]) * 5000 for i in range(3)]
        assert c.stats()["tiers"]["ram"]["hits"] == 3


# ---- bad input at the HTTP listener and at start ----------------------------------------------------------


def _http(port: int, method: str, path: str, body: bytes | None = None, token: str | None = None):
    """-> (status, JSON body or text); never raises for an HTTP error status."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


def test_prewarm_with_bad_keys_is_a_400_naming_the_key(gateway_factory) -> None:
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport)])
    cases = [
        ({"namespace": NS, "keys": [""]}, "empty"),
        ({"namespace": NS, "keys": ["ok", "k" * 5000]}, "5000"),
        ({"namespace": NS, "keys_hex": ["zz"]}, "hexadecimal"),
        ({"namespace": "n" * 300, "keys": ["a"]}, "namespace"),
    ]
    for req, fragment in cases:
        status, answer = _http(mport, "POST", "/v1/cache/prewarm", json.dumps(req).encode())
        assert status == 400, (req, status, answer)
        assert fragment in answer["error"], answer
    status, answer = _http(mport, "POST", "/v1/cache/prewarm", json.dumps({"namespace": NS, "keys": ["a"]}).encode())
    assert status == 200 and answer == {"in_ram": 0, "asked": 1}
    assert gw.alive() and "Traceback" not in gw.log(), gw.log()


def _prewarm_corpus() -> list[tuple[bytes, str]]:
    """Bad prewarm bodies, each with what its 400's error must name."""
    from kvgate.gateway.operations import MAX_KEYS_PER_REQUEST

    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    deep = b"[" * 100_000 + b"]" * 100_000
    ok = {"namespace": NS, "keys": ["a"]}
    return [
        (j({"namespace": NS, "keys": "abc"}), "`$.keys`"),  # once split into 3 keys
        (j({"namespace": NS, "keys": {"a": 1}}), "`$.keys`"),
        (j({"namespace": NS, "keys": None}), "`$.keys`"),
        (j({"namespace": NS, "keys": [1]}), "`$.keys[0]`"),
        (j({"namespace": NS, "keys": ["a", ["b"]]}), "`$.keys[1]`"),
        (j({"namespace": NS, "keys": []}), "'keys' or 'keys_hex'"),
        (j({"namespace": NS}), "'keys' or 'keys_hex'"),
        (j({"namespace": NS, "keys": ["k" * 2000]}), "'keys'[0] is 2000 bytes"),
        (j({"namespace": NS, "keys": ["a", ""]}), "'keys'[1] is empty"),
        (j({"namespace": NS, "keys": ["k"] * (MAX_KEYS_PER_REQUEST + 1)}), f"at most {MAX_KEYS_PER_REQUEST}"),
        (j({"namespace": NS, "keys_hex": "00"}), "`$.keys_hex`"),
        (j({"namespace": NS, "keys_hex": [None]}), "`$.keys_hex[0]`"),
        (j({"namespace": NS, "keys_hex": ["00", "zz"]}), "'keys_hex'[1] is not hexadecimal"),
        (j({"namespace": NS, "keys_hex": ["0"]}), "'keys_hex'[0] is not hexadecimal"),
        (j({"namespace": NS, "keys_hex": [""]}), "'keys_hex'[0] is empty"),
        (j({"keys": ["a"]}), "`namespace`"),
        (j({"namespace": None, "keys": ["a"]}), "`$.namespace`"),
        (j({"namespace": 5, "keys": ["a"]}), "`$.namespace`"),
        (j({"namespace": "", "keys": ["a"]}), "'namespace' must not be empty"),
        (j({"namespace": "n" * 300, "keys": ["a"]}), "namespace is 300 bytes"),
        (j({**ok, "dialog": 5}), "`$.dialog`"),
        (j({**ok, "dialog": None}), "`$.dialog`"),
        (j({**ok, "dialog": ["x"]}), "`$.dialog`"),
        (j({**ok, "extra": 1}), "unknown field `extra`"),
        (j({**ok, "Keys": ["b"]}), "unknown field `Keys`"),
        (j([]), "Expected `object`, got `array`"),
        (j("keys"), "Expected `object`, got `str`"),
        (j(None), "Expected `object`, got `null`"),
        (j(7), "Expected `object`, got `int`"),
        (b"not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"namespace": "n", "keys": ["a"', "not valid JSON"),
        (rb'{"namespace": "\ud800", "keys": ["a"]}', "not valid JSON"),  # a lone surrogate
        (b'{"namespace": "n", "keys": ["\xff"]}', "not valid JSON"),  # not UTF-8
        (deep, "Expected `object`, got `array`"),
        (b'{"namespace": "n", "keys": ' + deep + b"}", "`$.keys[0]`"),
        (b'{"namespace": "n", "keys": ["a"], "dialog": ' + deep + b"}", "`$.dialog`"),
        (b'{"namespace": "n", "keys": ["a"], "x": ' + deep + b"}", "unknown field `x`"),
        (b'{"namespace": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b', "keys": ["a"]}', "`$.namespace`"),
    ]


def test_prewarm_corpus_of_bad_bodies_each_a_400_naming_the_field(gateway_factory) -> None:
    """Every bad body is a 400 whose error names the field (or says the body is not a JSON object), never
    a 200 that took it some other way nor a 500; the gateway serves on."""
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport)])
    for body, named in _prewarm_corpus():
        status, answer = _http(mport, "POST", "/v1/cache/prewarm", body)
        assert status == 400, (body[:80], status, answer)
        assert named in answer["error"], (body[:80], answer)
        assert "Traceback" not in answer["error"] and "RecursionError" not in answer["error"]
    ok = json.dumps({"namespace": NS, "keys": ["a"], "keys_hex": ["00ff"], "dialog": "d"}).encode()
    assert _http(mport, "POST", "/v1/cache/prewarm", ok) == (200, {"in_ram": 0, "asked": 2})
    assert _http(mport, "GET", "/metrics")[0] == 200
    with gw.client(NS) as c:
        assert c.put_many([b"k"], [b"v"]) == [True]
    assert gw.alive() and "Traceback" not in gw.log(), gw.log()


def test_http_with_a_token_needs_it_on_loopback_too(gateway_factory, tmp_path) -> None:
    """With auth_token_file set, every path but /healthz needs the bearer token, loopback peers (root
    here) too: none or another one is a 401 saying which."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport), "--auth-token-file", str(token_file)])
    assert _http(mport, "GET", "/healthz") == (200, {"ok": True})
    prewarm = json.dumps({"namespace": NS, "keys": ["a"]}).encode()
    for token, says in ((None, "needs 'Authorization: Bearer <token>'"), ("wrong", "is not this gateway's"),
                        ("", "is not this gateway's")):
        for method, path, body in (("GET", "/metrics", None), ("POST", "/v1/cache/prewarm", prewarm)):
            status, answer = _http(mport, method, path, body, token=token)
            assert status == 401 and says in answer["error"] and "auth_token_file" in answer["error"], (
                token, path, status, answer)
    assert _http(mport, "GET", "/metrics", token="s3cret-token")[0] == 200
    assert _http(mport, "POST", "/v1/cache/prewarm", prewarm, token="s3cret-token") == (200, {"in_ram": 0, "asked": 1})
    assert gw.alive()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_idle_http_connections_are_bounded(gateway_factory) -> None:
    from kvgate.gateway.status import MAX_HTTP_CONNECTIONS

    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport)])
    before = _threads(gw.pid)
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", mport), timeout=10))
        # the ones past the cap are answered 503 and closed at once
        refused = 0
        for s in idle[MAX_HTTP_CONNECTIONS + 8:]:
            data = s.recv(4096)
            assert data.startswith(b"HTTP/1.0 503"), data
            refused += 1
        assert refused == 200 - MAX_HTTP_CONNECTIONS - 8
        threads = _threads(gw.pid)
        assert threads <= before + MAX_HTTP_CONNECTIONS, (before, threads)
        status, answer = _http(mport, "GET", "/healthz")
        assert status == 503 and "too many HTTP connections" in answer["error"]
    finally:
        for s in idle:
            s.close()
    # the slots come back as the idle ones close
    wait_until(lambda: _http(mport, "GET", "/healthz")[0] == 200, 10, "/healthz answered 200 again")
    assert gw.alive() and "Traceback" not in gw.log(), gw.log()


def test_http_beyond_loopback_needs_the_token(gateway_factory, tmp_path) -> None:
    r = run_kvgate("serve", "--storage-devices", str(tmp_path / "card"), "--port", "0", "--metrics-port",
                   str(free_port()), "--metrics-bind-address", "0.0.0.0", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2, r.stderr
    assert "metrics_bind_address" in r.stderr and "auth_token_file" in r.stderr and "Traceback" not in r.stderr

    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport), "--metrics-bind-address", "0.0.0.0",
                          "--auth-token-file", str(token_file)])
    assert _http(mport, "GET", "/healthz") == (200, {"ok": True})
    prewarm = json.dumps({"namespace": NS, "keys": ["a"]}).encode()
    for token in (None, "wrong", "s3cret-token-and-more", ""):
        status, answer = _http(mport, "GET", "/metrics", token=token)
        assert status == 401 and "Authorization: Bearer" in answer["error"], (token, status, answer)
        assert _http(mport, "POST", "/v1/cache/prewarm", prewarm, token=token)[0] == 401
    status, text = _http(mport, "GET", "/metrics", token="s3cret-token")
    assert status == 200 and "kvgate_storage_groups_active 1.0" in text
    assert _http(mport, "POST", "/v1/cache/prewarm", prewarm, token="s3cret-token") == (200, {"in_ram": 0, "asked": 1})
    assert gw.alive()


@pytest.mark.parametrize(
    "flags, yaml_bytes, named",
    [
        (["--port", "70000"], None, "'port'"),
        (["--metrics-port", "70000"], None, "'metrics_port'"),
        (["--port", "-1"], None, "'port'"),
        ([], b"max_bytes: 64M\nsocket: /tmp/caf\xe9.sock\n", "kvgate.yaml: not UTF-8"),
        (["--socket", "/tmp/" + "s" * 120 + ".sock"], None, "'socket'"),
    ],
)
def test_bad_start_input_is_one_line_and_exit_code_2(tmp_path, flags, yaml_bytes, named) -> None:
    args = ["serve", "--storage-devices", str(tmp_path / "card"), "--port", "0", "--metrics-port", "0",
            "--socket", str(tmp_path / "s.sock"), *flags]
    if yaml_bytes is not None:
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_bytes(yaml_bytes)
        args += ["--config", str(cfg)]
    r = run_kvgate(*args, timeout=20)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert named in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "card"), "a refused config must not touch the card"


def test_figures_per_namespace_in_stats_metrics_and_kvgate_stat(gateway_factory) -> None:
    """Two engines' namespaces on one gateway: what each holds in RAM and on the card, what each
    stored and read; the card figures come back from the card after a restart, eviction takes
    them down, and /metrics and `kvgate stat` show the same rows."""
    mport = free_port()
    gw = gateway_factory(["--metrics-port", str(mport), "--max-bytes", "64M"])
    with gw.client("vllm|model-a") as a, gw.client("sglang|model-b") as b:
        assert a.put_many([b"a%d" % i for i in range(3)], [b"x" * 10_000] * 3) == [True] * 3
        assert b.put_many([b"b0"], [b"y" * 20_000]) == [True]
        got = a.get_many([b"a0", b"a1", b"nope"])
        assert [len(g) if g is not None else None for g in got] == [10_000, 10_000, None]
    snap = gw.stats()
    na, nb = snap["namespaces"]["vllm|model-a"], snap["namespaces"]["sglang|model-b"]
    assert (na["ram_objects"], na["ram_bytes"], na["card_objects"]) == (3, 30_000, 3)
    assert (nb["ram_objects"], nb["ram_bytes"], nb["card_objects"]) == (1, 20_000, 1)
    assert (na["sets"], na["bytes_written"], na["gets"], na["hits"], na["bytes_read"]) == (3, 30_000, 3, 2, 20_000)
    assert (nb["sets"], nb["gets"], nb["hits"]) == (1, 0, 0)
    assert na["card_bytes"] + nb["card_bytes"] == snap["cards"][0]["used_bytes"]
    assert na["card_bytes"] > 30_000

    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert _metric(text, "kvgate_namespace_card_objects", '{namespace="vllm|model-a"}') == 3
    assert _metric(text, "kvgate_namespace_hits_total", '{namespace="vllm|model-a"}') == 2
    r = run_kvgate("stat", "--socket", gw.socket, env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "namespaces" in r.stdout and "vllm|model-a" in r.stdout and "sglang|model-b" in r.stdout

    gw.stop()  # after a restart the RAM tier is empty; the card's objects are counted by the scan
    gw.start()
    snap = gw.wait_scanned()
    na = snap["namespaces"]["vllm|model-a"]
    assert (na["ram_objects"], na["card_objects"], na["sets"]) == (0, 3, 0)
    with gw.client("vllm|model-a") as a:
        assert a.delete_many([b"a0", b"a1"]) == 2
    na = gw.stats()["namespaces"]["vllm|model-a"]
    assert (na["card_objects"], na["ram_objects"]) == (1, 0)
