"""TLS between peer gateways: a listener with ``peer_tls_cert_file``/``peer_tls_key_file``, pullers with
``peer_tls_ca_file`` (real gateway processes, as tests/gateway/test_peers.py).

A puller that trusts the listener's CA pulls, verified, and neither the token nor a payload can be read on
the wire; a puller without TLS, or one trusting another CA, gets misses, each side's log says why, the
listener counts the failed handshakes and serves the others on.  The config refuses, naming the key, a
certificate without its key (or the reverse) and files it cannot read or load.  Certificates come from
``trustme`` (a throwaway CA per test), as the card servers' TLS tests make theirs.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from pathlib import Path

import pytest
import trustme
from rich.console import Console

from kvgate import statview
from kvgate.config import ConfigError, from_mapping
from kvgate.gateway.peerserve import PeerServer
from kvgate.gateway.status import render
from kvgate.tiers.peertier import PeerTier
from tests.helpers import GatewayProcess, Relay, free_port, pulled_from_ram, tls_files, wait_until

NS = "peer-tls-ns"
TOKEN = "a-peer-token-nobody-may-read"
MARK = b"PEER-TLS-PAYLOAD-MARK-"


def data(i: int, size: int = 300_000) -> bytes:
    return (MARK + b"%d-" % i) * (size // (len(MARK) + 3))


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, str]:
    """A CA, the listener's certificate (for 127.0.0.1) and key, another CA, and the peer token."""
    out = tls_files(trustme.CA(), tmp_path, "peer")
    token = tmp_path / "peer.token"
    token.write_text(TOKEN + "\n")
    return {**out, "token": str(token)}


def serving(tmp_path: Path, pems: dict[str, str], port: int) -> GatewayProcess:
    return GatewayProcess(tmp_path, ["--max-bytes", "32M", "--shared-memory-size", "16M",
                                     "--peer-listen", f"127.0.0.1:{port}", "--peer-token-file", pems["token"],
                                     "--peer-tls-cert-file", pems["cert"], "--peer-tls-key-file", pems["key"]],
                          card=tmp_path / "card-a", name="A")


def pulling(tmp_path: Path, pems: dict[str, str], port: int, name: str, *tls: str) -> GatewayProcess:
    return GatewayProcess(tmp_path, ["--max-bytes", "32M", "--shared-memory-size", "16M",
                                     "--peers", f"127.0.0.1:{port}", "--peer-token-file", pems["token"],
                                     "--peer-timeout-ms", "3000", *tls],
                          card=tmp_path / f"card-{name.lower()}", name=name)


def peer_row(gw: GatewayProcess) -> dict:
    (row,) = gw.stats()["peers"]
    return row


@pytest.mark.slow
def test_over_tls_a_peer_pulls_and_the_wire_shows_neither_token_nor_payload(tmp_path: Path, pems) -> None:
    port = free_port()
    a = serving(tmp_path, pems, port)
    a.start()
    relay = Relay(port)  # B pulls through it: every byte on the wire is kept
    b = pulling(tmp_path, pems, relay.port, "B", "--peer-tls-ca-file", pems["ca"])
    try:
        b.start()
        pulled_from_ram(a, b, NS, 5, data)
        row = peer_row(b)
        assert row["hits"] == 5 and row["failures"] == 0, row
        # (A counts an object once it is sent: B may hold it a moment before)
        wait_until(lambda: a.stats()["peer_listen"]["served_objects"] == 5, 10, "A counted the 5 objects served")
        got = a.stats()["peer_listen"]
        assert got["tls"] and got["tls_failed"] == 0 and got["refused"] == 0, got
        assert f"peers kvgates://127.0.0.1:{port}/peer" in a.log()
        assert "travel in the clear" not in a.log()  # (loopback: no warning either way)
        with relay.lock:
            seen = bytes(relay.seen)
        assert len(seen) > 5 * len(data(0))  # the objects went through the relay...
        assert TOKEN.encode() not in seen and MARK not in seen  # ...and could not be read there
    finally:
        b.cleanup()
        relay.close()
        a.cleanup()


@pytest.mark.slow
def test_a_plain_peer_or_one_trusting_another_ca_gets_misses_and_the_listener_serves_on(tmp_path: Path,
                                                                                         pems) -> None:
    port = free_port()
    a = serving(tmp_path, pems, port)
    plain = pulling(tmp_path, pems, port, "Plain")
    other = pulling(tmp_path, pems, port, "Other", "--peer-tls-ca-file", pems["other_ca"])
    good = pulling(tmp_path, pems, port, "Good", "--peer-tls-ca-file", pems["ca"])
    gws = [a, plain, other, good]
    try:
        for gw in gws:
            gw.start()
        keys = [f"m{i}".encode() for i in range(3)]
        with a.client(NS) as c:
            assert c.put_many(keys, [data(i) for i in range(3)], retention="short") == [True] * 3
        for gw in (plain, other):
            with gw.client(NS) as c:
                assert c.lookup(keys) == 0 and c.get_many(keys) == [None] * 3
            assert peer_row(gw)["failures"] >= 1 and peer_row(gw)["hits"] == 0, peer_row(gw)
        # each puller's log says why, naming what to set
        assert "this peer listener speaks TLS: set peer_tls_ca_file" in plain.log(), plain.log_tail()
        assert ("the peer's TLS certificate is not trusted by the CAs in peer_tls_ca_file "
                f"({pems['other_ca']}): unable to get local issuer certificate") in other.log(), other.log_tail()
        # the listener counted and logged both (a refused certificate: once the puller's alert is in), sent
        # nothing but the refusal, and serves a peer it may
        wait_until(lambda: a.stats()["peer_listen"]["tls_failed"] >= 2, 10, "A counted 2 failed handshakes")
        assert a.stats()["peer_listen"]["served_objects"] == 0
        said = ("spoke plain kvgate to this TLS listener", "TLS handshake failed")
        wait_until(lambda: all(s in a.log() for s in said), 10, lambda: f"A logged {said}: {a.log_tail()}")
        assert "kvgate_peer_listen_tls_failed_total" in render(a.stats()).decode()
        con = Console(width=100, record=True, color_system=None)
        con.print(statview.view(a.stats()))
        assert re.search(r"\d+ refused, \d+ TLS", con.export_text()), con.export_text()  # kvgate stat says so too
        with good.client(NS) as c:
            assert c.get_many(keys) == [data(i) for i in range(3)]
        wait_until(lambda: a.stats()["peer_listen"]["served_objects"] == 3, 10, "A counted the 3 objects served")
    finally:
        for gw in reversed(gws):
            gw.cleanup()


# ---- config and start, in this process ----------------------------------------------------------


def _config(tmp_path: Path, **keys: str):
    return from_mapping({"storage_devices": [str(tmp_path / "card")], "peer_listen": "127.0.0.1:5600",
                         "peers": ["127.0.0.1:5601"], "peer_token_file": str(tmp_path / "peer.token"), **keys})


def test_the_config_refuses_peer_tls_keys_that_cannot_work_naming_the_key(tmp_path: Path, pems) -> None:
    other_key = tmp_path / "other.key"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = str(tmp_path / "missing.pem")
    cases = [
        ({"peer_tls_cert_file": pems["cert"]}, "config key 'peer_tls_cert_file': set peer_tls_key_file too"),
        ({"peer_tls_key_file": pems["key"]}, "config key 'peer_tls_key_file': it is the key of peer_tls_cert_file, "
                                             "which is unset"),
        ({"peer_tls_cert_file": missing, "peer_tls_key_file": pems["key"]},
         f"config key 'peer_tls_cert_file': cannot read {missing}: No such file or directory"),
        ({"peer_tls_cert_file": pems["cert"], "peer_tls_key_file": missing},
         f"config key 'peer_tls_key_file': cannot read {missing}"),
        ({"peer_tls_cert_file": str(junk), "peer_tls_key_file": pems["key"]},
         f"config key 'peer_tls_cert_file': {junk} holds no PEM certificate"),
        ({"peer_tls_cert_file": pems["cert"], "peer_tls_key_file": str(junk)},
         f"config key 'peer_tls_key_file': {junk} holds no PEM private key"),
        ({"peer_tls_cert_file": pems["cert"], "peer_tls_key_file": str(other_key)},
         f"config key 'peer_tls_key_file': {other_key} is not the private key of the certificate in {pems['cert']}"),
        ({"peer_tls_ca_file": missing}, f"config key 'peer_tls_ca_file': cannot read {missing}"),
        ({"peer_tls_ca_file": str(junk)}, f"config key 'peer_tls_ca_file': cannot load {junk} as PEM certificates"),
    ]
    for keys, message in cases:
        with pytest.raises(ConfigError) as e:
            _config(tmp_path, **keys)
        assert message in str(e.value), (keys, str(e.value))
    cfg = _config(tmp_path, peer_tls_cert_file=pems["cert"], peer_tls_key_file=pems["key"],
                  peer_tls_ca_file=pems["ca"])
    assert cfg.peer_tls_ca_file == pems["ca"]
    # separate trust: card_tls_ca_file is not a peer's CA, and a peer with peer_tls_ca_file is kvgates://
    plain = PeerTier(_config(tmp_path, card_tls_ca_file=pems["ca"]), "127.0.0.1:5601")
    tls = PeerTier(cfg, "127.0.0.1:5601")
    try:
        assert plain.card.tls is None and plain.card.location == "kvgate://127.0.0.1:5601/peer"
        assert tls.card.tls is not None and tls.card.location == "kvgates://127.0.0.1:5601/peer"
    finally:
        plain.close()
        tls.close()


@pytest.mark.parametrize("host,tls,warned", [("0.0.0.0", False, True), ("127.0.0.1", False, False),
                                             ("0.0.0.0", True, False)])
def test_a_plain_listener_beyond_loopback_warns_once_that_the_token_travels_in_the_clear(
        tmp_path: Path, pems, caplog, host: str, tls: bool, warned: bool) -> None:
    Path(pems["token"]).write_text(TOKEN)
    keys = {"peer_tls_cert_file": pems["cert"], "peer_tls_key_file": pems["key"]} if tls else {}
    cfg = from_mapping({"storage_devices": [str(tmp_path / "card")], "peer_listen": f"{host}:{free_port()}",
                        "peer_token_file": pems["token"], **keys})

    async def main() -> None:
        server = PeerServer(cfg, store=None)  # type: ignore[arg-type]  # (no connection: no store asked)
        await server.start()
        await server.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.peers"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "travel in the clear" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "set peer_tls_cert_file and peer_tls_key_file" in said[0]


def test_a_tls_puller_at_a_plain_listener_is_told_and_a_stalled_handshake_ends_at_hello_timeout(
        tmp_path: Path, pems, caplog) -> None:
    """In this process: listeners without a store (no request reaches one), a ``PeerTier`` as a gateway's."""
    Path(pems["token"]).write_text(TOKEN)
    base = {"storage_devices": [str(tmp_path / "card")], "peer_token_file": pems["token"], "hello_timeout": "1s"}
    plain_port, tls_port = free_port(), free_port()
    plain_cfg = from_mapping({**base, "peer_listen": f"127.0.0.1:{plain_port}"})
    tls_cfg = from_mapping({**base, "peer_listen": f"127.0.0.1:{tls_port}", "peer_tls_cert_file": pems["cert"],
                            "peer_tls_key_file": pems["key"]})
    puller = from_mapping({**base, "peers": [f"127.0.0.1:{plain_port}"], "peer_tls_ca_file": pems["ca"]})

    async def main() -> None:
        plain, tls = PeerServer(plain_cfg, store=None), PeerServer(tls_cfg, store=None)  # type: ignore[arg-type]
        await plain.start()
        await tls.start()
        tier = PeerTier(puller, f"127.0.0.1:{plain_port}")
        try:
            (got,) = await asyncio.to_thread(tier.card.exists_many, [b"k"])
            assert "TLS handshake with the peer failed" in str(got) and "peer_tls_ca_file" in str(got), got
            assert plain.status()["refused"] == 1, plain.status()
            # a handshake begun and never finished: closed within hello_timeout, and no accept waits on it
            stalled = socket.create_connection(("127.0.0.1", tls_port), timeout=5)
            stalled.sendall(b"\x16\x03\x01")
            t0 = time.monotonic()
            ctx = ssl.create_default_context(cafile=pems["ca"])
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", tls_port), timeout=5),
                                 server_hostname="127.0.0.1") as other:  # (its handshake done meanwhile)
                assert other.version() in ("TLSv1.2", "TLSv1.3")
            assert await asyncio.to_thread(stalled.recv, 1) == b""
            assert 0.5 < time.monotonic() - t0 < 4
            stalled.close()
            assert tls.status()["timed_out"] == 1 and tls.status()["connections"] == 0, tls.status()
        finally:
            tier.close()
            await plain.close()
            await tls.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.peers"):
        asyncio.run(main())
    assert any("a TLS handshake at a plain peer listener (no peer_tls_cert_file here)" in r.getMessage()
               for r in caplog.records), caplog.text
