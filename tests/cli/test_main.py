"""The `kvgate` command (``kvgate.cli``): stat, clean, fingerprint and cards against a real gateway
process, and what each says when it cannot do its job.  `kvgate serve`'s config errors:
tests/gateway/test_status.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from kvgate.cli import main
from kvgate.client import GatewayError
from tests.helpers import card_serial, free_port, logged_fingerprint, run_kvgate

NS = "cli-ns"


# ---- stat ------------------------------------------------------------------------------------


def test_kvgate_stat(gateway) -> None:
    gw = gateway
    with gw.client(NS) as c:
        assert c.put_many([b"s1"], [b"z" * 5000]) == [True]
    serial = card_serial(gw.card)
    r = run_kvgate("stat", "--socket", gw.socket, env={"COLUMNS": "250"})  # wide enough for whole serials
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tiers" in out and "cards" in out
    assert re.search(r"\bram\b", out) and re.search(r"\blong\b", out)
    assert serial in out and "serving" in out  # the word `kvgate cards` says
    assert logged_fingerprint(gw.log()) in out
    assert re.search(r"reads at (realtime|normal) priority", out)

    r = run_kvgate("stat", "--socket", gw.socket, "--json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert set(snap["tiers"]) == {"ram", "long"}
    assert snap["tiers"]["long"]["sets"] == 1 and snap["tiers"]["ram"]["objects"] == 1
    assert [c["serial"] for c in snap["cards"]] == [serial]
    assert snap["cards"][0]["active"] is True and snap["cards"][0]["objects"] == 1
    assert snap["gateway"]["pid"] == gw.pid

    r = run_kvgate("stat", "--socket", gw.socket + ".nope")
    assert r.returncode != 0 and "cannot reach" in r.stderr


def test_stat_counts_the_engines_presence_checks_as_lookups(gateway) -> None:
    # vLLM's tier, SGLang's backend and LMCache's adapter ask exists_many (LMCache: lookup-and-lock),
    # never lookup: `kvgate stat` said "lookups 0" under an engine asking thousands of times.
    with gateway.client(NS) as c:
        assert c.put_many([b"x1"], [b"z" * 100]) == [True]
        assert c.exists_many([b"x1", b"x2"]) == [True, False]
        assert c.lookup([b"x1", b"x2"]) == 1
    r = run_kvgate("stat", "--socket", gateway.socket, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["lookups"] == 2
    assert "lookups 2" in run_kvgate("stat", "--socket", gateway.socket, env={"COLUMNS": "200"}).stdout


@pytest.mark.slow  # runs the command
def test_stat_names_the_default_socket_it_tried(tmp_path):
    # The default socket follows XDG_RUNTIME_DIR: a user who set it must see where we looked.
    res = run_kvgate("stat", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert res.returncode == 2
    assert f"{tmp_path}/kvgate-5557.sock" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # runs a gateway
def test_a_bare_serve_stat_and_an_engines_default_meet_with_tcp_off_too(tmp_path):
    # One rule (kvgate.config.default_socket_path) for the gateway, every command and every integration:
    # with XDG_RUNTIME_DIR set (any systemd login) and the TCP listener off, `kvgate serve` without
    # --socket, `kvgate stat` without --socket and an engine's tier without kvgate.socket all meet.
    # (--port 0 used to name the socket kvgate-0.sock, and the integrations required kvgate.socket.)
    import subprocess
    import sys

    from tests.helpers import kvgate_env, wait_until

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "card").mkdir()
    env = kvgate_env({"XDG_RUNTIME_DIR": str(run)})
    gw = subprocess.Popen([sys.executable, "-m", "kvgate", "serve", "--port", "0", "--metrics-port", "0",
                           "--max-bytes", "64M", "--card-capacity", "1G", "--shared-memory-size", "8M",
                           "--storage-devices", str(tmp_path / "card")],
                          cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (run / "kvgate-5557.sock").exists() or gw.poll() is not None, 30, "the socket")
        assert gw.poll() is None, gw.stderr.read().decode()
        r = run_kvgate("stat", "--json", env={"XDG_RUNTIME_DIR": str(run)})
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["gateway"]["pid"] == gw.pid
        code = ("from kvgate.integrations.settings import TierSettings; from kvgate.client import Client\n"
                "s = TierSettings.build()\n"
                "with Client.connect(s.target, namespace='ns', want_shm=False) as c: print(s.target)")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(run / "kvgate-5557.sock")
    finally:
        gw.terminate()
        gw.wait(15)


# ---- clean -----------------------------------------------------------------------------------


def test_kvgate_clean_deletes_every_object_of_every_namespace(gateway) -> None:
    gw = gateway
    keys = [b"k%d" % i for i in range(10)]
    with gw.client("a", engine_id="e") as c:
        assert c.put_many(keys, [b"a%d" % i * 1000 for i in range(10)]) == [True] * 10
        assert c.put_many([b"short"], [b"s"], retention="short") == [True]
    with gw.client("b", engine_id="e") as c:
        assert c.put_many(keys[:4], [b"b"] * 4) == [True] * 4
    r = run_kvgate("clean", "--socket", gw.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "deleted 15 objects", r.stdout
    with gw.client("a", engine_id="e") as c:
        assert c.lookup(keys) == 0
        assert c.get_many(keys + [b"short"]) == [None] * 11
    with gw.client("b", engine_id="e") as c:
        assert c.lookup(keys[:4]) == 0
    st = gw.stats()
    assert st["cards"][0]["objects"] == 0 and st["tiers"]["ram"]["objects"] == 0
    label_and_lock = ("kvgate-card.json", "kvgate-card.lock")
    objects = [f for _, _, files in os.walk(gw.card) for f in files if f not in label_and_lock]
    assert objects == []


@pytest.mark.slow  # runs the command
def test_clean_names_the_address_it_tried():
    port = free_port()
    res = run_kvgate("clean", "--address", f"127.0.0.1:{port}")
    assert res.returncode == 2
    assert f"127.0.0.1:{port}" in res.stderr and "refused" in res.stderr.lower()
    assert "Traceback" not in res.stderr


# ---- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_in_log_matches_cli(gateway) -> None:
    gw = gateway
    fp = logged_fingerprint(gw.log())
    r = run_kvgate("fingerprint", "--storage-devices", gw.card)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == fp
    with gw.client(NS) as c:
        assert c.fingerprint == fp
    # another placement is another layout
    r = run_kvgate("fingerprint", "--storage-devices", gw.card, "--key-placement", "stripe")
    assert r.returncode == 0 and re.fullmatch(r"[0-9a-f]{16}", r.stdout.strip()) and r.stdout.strip() != fp


@pytest.mark.parametrize("card, says", [("missing*", "nothing matches"), ("unlabelled", "has no readable label")])
def test_fingerprint_of_a_card_it_cannot_read_says_why(tmp_path, capsys, card: str, says: str) -> None:
    (tmp_path / "unlabelled").mkdir()  # a directory no gateway has used: no serial yet
    assert main(["fingerprint", "--storage-devices", str(tmp_path / card)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / card) in err and says in err, err


# ---- cards -----------------------------------------------------------------------------------


def test_kvgate_cards_list_shows_the_gateways_cards(gateway) -> None:
    gw = gateway
    with gw.admin() as c:
        try:
            c.cards("list")
        except GatewayError as e:  # the op reaches the gateway in a change of its own
            pytest.skip(f"this gateway does not serve the cards op yet: {e.code}: {e.message}")
    serial, fp = card_serial(gw.card), logged_fingerprint(gw.log())
    r = run_kvgate("cards", "list", "--socket", gw.socket, "--json")
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["fingerprint"] == fp
    assert [c["serial"] for c in reply["cards"]] == [serial]
    r = run_kvgate("cards", "--socket", gw.socket, env={"COLUMNS": "250"})  # list is the default action
    assert r.returncode == 0, r.stderr
    assert serial in r.stdout and fp in r.stdout


def test_kvgate_cards_help_names_every_action(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["cards", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for word in ("list", "add", "drain", "undrain", "remove", "--now", "--json", "SIGHUP"):
        assert word in out, (word, out)


def test_a_token_file_that_cannot_be_read_is_named_not_taken_for_an_unreachable_gateway(tmp_path, capsys) -> None:
    assert main(["stat", "--socket", str(tmp_path / "gw.sock"), "--token-file", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "--token-file: cannot read" in err and "cannot reach" not in err
