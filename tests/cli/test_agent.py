"""``kvgate cluster serve``'s flags: what an agent is made with, and the mistakes refused before it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvgate.cli.agent import agent_from
from kvgate.cli.cluster import add_arguments


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["serve", *argv])


def test_an_export_beyond_loopback_needs_a_token_and_takes_it_from_its_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="0.0.0.0 is not loopback: give a token file"):
        agent_from(_args("--export", "0.0.0.0:7001"))
    with pytest.raises(ValueError, match="--token-file: .* is empty"):
        (tmp_path / "empty").write_text("\n")
        agent_from(_args("--export", "0.0.0.0:7001", "--token-file", str(tmp_path / "empty")))
    (tmp_path / "token").write_text("t0ken\n")
    agent = agent_from(_args("--export", "0.0.0.0:7001", "--token-file", str(tmp_path / "token")))
    assert agent.exporter is not None and agent.exporter.token == "t0ken"
    assert agent_from(_args("--export", "127.0.0.1:7001")).exporter.token is None, "loopback: no token needed"


def test_an_export_with_a_certificate_serves_tls_and_registers_kvgates_addresses(tmp_path: Path) -> None:
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    pem = tmp_path / "server.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    agent = agent_from(_args("--export", "127.0.0.1:7001", "--tls-cert", str(pem)))
    assert agent.exporter is not None and agent.exporter.tls is not None
    agent.exporter.by_serial["serial"] = None  # type: ignore[assignment]  (a card it serves, by serial)
    assert agent.exporter.urls() == {"serial": "kvgates://127.0.0.1:7001/serial"}
    with pytest.raises(ValueError, match="--tls-cert .* go with --export"):
        agent_from(_args("--tls-cert", str(pem)))
    with pytest.raises(ValueError, match="cannot load a certificate"):
        agent_from(_args("--export", "127.0.0.1:7001", "--tls-cert", str(tmp_path / "missing.pem")))
