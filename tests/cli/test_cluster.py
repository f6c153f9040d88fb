"""``kvgate cluster``'s answers to a newcomer, against a real etcd: tables that show what the registry holds
escaped and with whole serials at 80 columns, a cluster name that names nothing, a retire that needs a drain
first, and a register whose advice is one of its own flags."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from etcd3aio import Etcd3Client

from kvgate.cluster.registry import CardRecord, CardState, Registry, View
from tests.cluster.common import ETCD, EtcdServer, labelled_card
from tests.helpers import run_kvgate

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")]
CLUSTER = "t"
SERIAL = "0123456789abcdef0123456789abcdef"  # as long as a label's serial
# What a hostile or broken writer of the registry could put in a serial or an address: a terminal title
# (OSC), a colour (CSI), a one-byte CSI, a right-to-left override and a newline that starts a forged row.
HOSTILE = "ev\x1b]0;owned\x07il\x1b[31m\x9b2J\u202e\nforged-row"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def _registry(etcd: EtcdServer, what, cluster: str = CLUSTER):
    async def main():
        async with Etcd3Client([etcd.endpoint]) as client:
            return await what(Registry(client, cluster, call_timeout_s=5))

    return asyncio.run(main())


def _flags(etcd: EtcdServer, cluster: str = CLUSTER) -> list[str]:
    return ["--etcd-endpoints", etcd.endpoint, "--cluster-name", cluster]


def test_tables_show_control_characters_escaped_and_serials_whole_at_80_columns(etcd: EtcdServer) -> None:
    long_path = "/mnt/shared/a-rather-long-directory-name/for-the-cards/of-host-7/card-directory"
    records = [CardRecord(serial=SERIAL, kind="directory", address=long_path, state=CardState.ACTIVE,
                          capacity=123 << 30),
               CardRecord(serial=HOSTILE, kind="kvgate", address=f"kvgate://10.0.0.7:7000/{HOSTILE}",
                          state=CardState.ACTIVE)]

    async def write(reg: Registry) -> None:
        for r in records:
            await reg.register(r)
        await reg.publish(View.of(1, records, 64))

    _registry(etcd, write, cluster="shown")
    for action in ("cards", "view", "status"):
        r = run_kvgate("cluster", action, *_flags(etcd, "shown"), env={"COLUMNS": "80"})
        assert r.returncode == 0, r.stderr
        out = r.stdout
        for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
            assert raw not in out, (action, raw, out)
        assert not any(line.lstrip().startswith("forged-row") for line in out.splitlines()), (action, out)
        if action != "status":
            assert max(len(line) for line in out.splitlines()) <= 80, out
            assert re.search(rf"(^|\s){SERIAL}(\s|$)", out), f"the serial is cut or folded: {out}"
            joined = "".join(line.strip() for line in out.splitlines())
            assert r"ev\x1b]0;owned\x07il\x1b[31m\x9b2J\u202e\x0aforged-row" in joined, out
            if action == "cards":  # the address under the serial: its folded lines join up
                assert joined.count(long_path) == 1, f"the path folds, whole: {out}"
        else:
            assert r"\x0aforged-row" in out, out
        assert "123.0 GiB" in out or action != "cards", out  # a size in units, not 132070244352


def test_status_of_a_cluster_etcd_does_not_hold_says_so_and_names_those_it_does(etcd: EtcdServer) -> None:
    _registry(etcd, lambda reg: reg.register(CardRecord(serial="a" * 32, kind="directory", address="/a")))
    r = run_kvgate("cluster", "status", *_flags(etcd, "typo"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no cluster named 'typo'" in r.stderr and etcd.endpoint in r.stderr, r.stderr
    assert re.search(r"clusters there: .*\bt\b", r.stderr), r.stderr
    assert r.stdout == ""
    r = run_kvgate("cluster", "status", "--json", *_flags(etcd, "typo"))
    assert r.returncode == 1 and "no cluster named 'typo'" in r.stderr
    for action in ("cards", "view"):
        r = run_kvgate("cluster", action, *_flags(etcd, "typo"))
        assert r.returncode == 1 and f"kvgate cluster {action}: no cluster named 'typo'" in r.stderr, r.stderr
    r = run_kvgate("cluster", "status", *_flags(etcd))
    assert r.returncode == 0 and "registered: " in r.stdout, r.stderr


def test_retiring_a_card_in_service_says_to_drain_it_first_with_the_command(etcd: EtcdServer,
                                                                             tmp_path: Path) -> None:
    rec = labelled_card(tmp_path / "card")

    async def in_service(reg: Registry) -> None:
        await reg.register(rec)  # joining: it may be retired at once, having held nothing
        await reg.set_state(rec.serial, CardState.ACTIVE)

    _registry(etcd, in_service)
    r = run_kvgate("cluster", "retire", rec.serial, *_flags(etcd))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"is active: it cannot become retired; drain it first (kvgate cluster drain {rec.serial} " \
           f"--etcd-endpoints {etcd.endpoint} --cluster-name {CLUSTER})" in r.stderr, r.stderr
    # the only card: a drain is refused without --force (puts would have nowhere to go)
    assert run_kvgate("cluster", "drain", rec.serial, "--force", *_flags(etcd)).returncode == 0
    r = run_kvgate("cluster", "retire", rec.serial, *_flags(etcd))
    assert r.returncode == 1 and "it is draining: it can be retired once the leader marks it drained" in r.stderr


def test_register_suggests_its_own_flags_not_a_gateways_config_key(etcd: EtcdServer, tmp_path: Path) -> None:
    r = run_kvgate("cluster", "register", str(tmp_path / "missing"), *_flags(etcd))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "card directory does not exist" in r.stderr and "create_card_dirs" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    from kvgate.cards import DirectoryCard
    from kvgate.cards.network.server import CardExporter

    (tmp_path / "served").mkdir()
    (tmp_path / "token").write_text("s3cret\n")
    server = CardExporter([DirectoryCard(str(tmp_path / "served"))], "127.0.0.1", 0, token="s3cret").start()
    try:
        (url,) = server.urls().values()
        r = run_kvgate("cluster", "register", url, *_flags(etcd))
        assert r.returncode == 2 and "pass --token-file FILE" in r.stderr, r.stderr
        r = run_kvgate("cluster", "register", url, "--token-file", str(tmp_path / "token"), *_flags(etcd))
        assert r.returncode == 0 and "registered (joining" in r.stdout, r.stderr
    finally:
        server.stop()
