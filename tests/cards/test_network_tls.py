"""kvgates:// cards: a card server with a TLS certificate and the gateways that check it.

Certificates come from ``trustme`` (a throwaway CA, made per test run).  A relay between client and
server records every byte on the wire, which is how the tests see that neither the token nor a payload
can be read there over TLS (and that both can without it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import trustme

from kvgate.cards import CardUnavailable, DirectoryCard, NetworkCard, ObjectMeta, make_card
from kvgate.cards.network.server import CardExporter, tls_server_context
from kvgate.config import Config
from kvgate.keys import full_key
from tests.helpers import Relay, tls_files, wait_until

TOKEN = "a-card-token-nobody-may-read"


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def pems(ca, tmp_path: Path) -> dict[str, str]:
    return tls_files(ca, tmp_path)


@pytest.fixture
def local(tmp_path: Path) -> DirectoryCard:
    card = DirectoryCard(str(tmp_path / "card"))
    card.open()
    return card


def round_trip(c: NetworkCard, n: int = 6) -> None:
    for i in range(n):
        size = (5 << 20) + 3 if i == 0 else 1000 * (i + 1)
        data = np.resize(np.frombuffer(b"PAYLOAD-MARK-%d-" % i, np.uint8), size)
        k = full_key(b"ns", b"k%d" % i)
        c.write(k, memoryview(data), ObjectMeta(position=i))
        got = np.zeros(size, np.uint8)
        h = c.read_into(k, memoryview(got))
        assert h.payload_len == size and np.array_equal(got, data), i


@pytest.mark.parametrize("tls", [True, False])
def test_over_tls_neither_the_token_nor_a_payload_can_be_read_on_the_wire(pems, local, tls: bool) -> None:
    ctx = tls_server_context(pems["cert"], pems["key"]) if tls else None
    token_file = Path(pems["ca"]).with_name("token")
    token_file.write_text(TOKEN)
    with CardExporter([local], token=TOKEN, tls=ctx) as ex:
        url = ex.urls()[local.serial]
        assert url.startswith("kvgates://" if tls else "kvgate://")
        relay = Relay(ex.port)
        try:
            through = url.replace(f":{ex.port}/", f":{relay.port}/")
            c = NetworkCard(through, io_timeout_ms=5000, token_file=str(token_file), tls_ca_file=pems["ca"])
            assert c.open() == local.serial
            round_trip(c)
            for _ in range(3):  # an idle connection stays usable: nothing unasked arrives on it
                assert c.exists(full_key(b"ns", b"k1"))
            assert ex.requests["hello"] == 1, "one connection for every call of this thread"
            c.close()
        finally:
            relay.close()
        with relay.lock:
            seen = bytes(relay.seen)
    assert len(seen) > 5 << 20
    if tls:
        assert TOKEN.encode() not in seen and b"PAYLOAD-MARK" not in seen and local.serial.encode() not in seen
    else:  # what TLS is for: without it, both are there for anyone listening
        assert TOKEN.encode() in seen and b"PAYLOAD-MARK" in seen


def test_a_plain_client_of_a_tls_server_is_told_to_use_kvgates(pems, local) -> None:
    with CardExporter([local], tls=tls_server_context(pems["cert"], pems["key"])) as ex:
        plain = ex.urls()[local.serial].replace("kvgates://", "kvgate://")
        with pytest.raises(CardUnavailable, match="speaks TLS: reach its cards as kvgates://"):
            NetworkCard(plain, io_timeout_ms=3000).open()
        ok = NetworkCard(ex.urls()[local.serial], io_timeout_ms=3000, tls_ca_file=pems["ca"])
        assert ok.open() == local.serial, "the server goes on serving"
        ok.close()


def test_a_tls_client_of_a_plain_server_is_told_it_does_not_serve_tls(local) -> None:
    with CardExporter([local]) as ex:
        url = ex.urls()[local.serial].replace("kvgate://", "kvgates://")
        with pytest.raises(CardUnavailable, match="does it serve TLS"):
            NetworkCard(url, io_timeout_ms=3000).open()


def test_a_certificate_the_gateway_does_not_trust_is_refused_naming_card_tls_ca_file(pems, local, ca,
                                                                                      tmp_path) -> None:
    with CardExporter([local], tls=tls_server_context(pems["cert"], pems["key"])) as ex:
        url = ex.urls()[local.serial]
        with pytest.raises(CardUnavailable, match=r"not trusted by the system's trusted CAs \(set card_tls_ca_file"):
            NetworkCard(url, io_timeout_ms=3000).open()
        with pytest.raises(CardUnavailable, match="not trusted by the CAs in card_tls_ca_file"):
            NetworkCard(url, io_timeout_ms=3000, tls_ca_file=pems["other_ca"]).open()
        # a certificate for another host name, from the trusted CA: the URL's host is checked too
        other = ca.issue_cert("cards.example.com")
        key, cert = tmp_path / "other.key", tmp_path / "other.pem"
        other.private_key_pem.write_to_path(str(key))
        other.cert_chain_pems[0].write_to_path(str(cert))
    with CardExporter([local], tls=tls_server_context(str(cert), str(key))) as ex:
        with pytest.raises(CardUnavailable, match="not trusted.*(?i:hostname|IP address mismatch)"):
            NetworkCard(ex.urls()[local.serial], io_timeout_ms=3000, tls_ca_file=pems["ca"]).open()


def test_bad_certificate_files_are_named(pems, tmp_path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match=f"--tls-cert {junk}: cannot load"):
        tls_server_context(str(junk))
    with pytest.raises(ValueError, match=f"card_tls_ca_file {junk}"):
        make_card("kvgates://127.0.0.1:1/serial", Config(card_tls_ca_file=str(junk)))
    assert make_card("kvgates://127.0.0.1:1/serial", Config(card_tls_ca_file=pems["ca"])).tls is not None
    assert make_card("kvgate://127.0.0.1:1/serial", Config()).tls is None


@pytest.mark.slow  # starts a gateway
def test_a_gateway_stores_on_and_restores_from_a_kvgates_card(gateway_factory, pems, local) -> None:
    with CardExporter([local], tls=tls_server_context(pems["cert"], pems["key"])) as ex:
        url = ex.urls()[local.serial]
        gw = gateway_factory(["--storage-devices", url, "--max-bytes", "0", "--card-tls-ca-file", pems["ca"]],
                             create_cards=False)
        wait_until(lambda: [c for c in gw.stats()["cards"] if c["active"]], 20, gw.log)
        keys = [b"block-%d" % i for i in range(6)]
        blocks = [os.urandom((2 << 20) + i) for i in range(6)]
        with gw.client("ns") as c:
            assert c.put_many(keys, blocks, retention="long") == [True] * 6
            assert c.get_many(keys) == blocks
        assert len(list(DirectoryCard(local.location).scan())) == 6


def test_a_server_stopped_with_tls_connections_open_ends_them_quietly(pems, local, caplog) -> None:
    import logging

    ex = CardExporter([local], tls=tls_server_context(pems["cert"], pems["key"])).start()
    cards = [NetworkCard(ex.urls()[local.serial], io_timeout_ms=3000, tls_ca_file=pems["ca"]) for _ in range(3)]
    for c in cards:
        assert c.open() == local.serial
    with caplog.at_level(logging.DEBUG, logger="kvgate.cards.network.server"):
        ex.stop()
    assert "failed" not in caplog.text and "Traceback" not in caplog.text, caplog.text
    with pytest.raises(CardUnavailable):
        cards[0].check()


@pytest.mark.slow  # starts a card server process
def test_the_tls_benchmark_runs_and_reports_every_figure(tmp_path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "card_tls.py"
    r = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path / "b"), "--seconds", "0.2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert {"read, kvgates://", "write, kvgates://", "TLS encrypt + decrypt, in memory"} <= set(out)
    assert all(f["best_gib_s"] > 0 for f in out.values()) and 0 < out["read, kvgates://"]["ratio"]
    assert not (tmp_path / "b").exists()
