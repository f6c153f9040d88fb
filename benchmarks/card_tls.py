"""What TLS costs a ``kvgates://`` card: warm batch reads and writes of one card served twice by a card
server in a process of its own, once plain (``kvgate://``) and once with a certificate (``kvgates://``),
in alternating rounds, beside the raw limit docs/benchmarks.md's other figures use: a memory copy of the same bytes
(``np.copyto``) and TLS's encryption and decryption of them in memory, in this process (what the two sides
must do).

32 objects of 2 MiB (page cache warm); certificates from ``trustme`` (the test extra).  Prints best and
median GiB/s of each figure and TLS's ratio to plain.

    .venv/bin/python benchmarks/card_tls.py --dir var/card-tls
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import numpy as np

from kvgate.bench.measure import Contender, measure, script_main
from kvgate.bench.processes import kvgate_env
from kvgate.cards import NetworkCard, ObjectMeta
from kvgate.cards.directory.card import DirectoryCard
from kvgate.keys import full_key

OBJECTS = 32
SIZE = 2 << 20

_SERVER = """
import sys, threading
from kvgate.cards.directory.card import DirectoryCard
from kvgate.cards.network.server import CardExporter, tls_server_context
card = DirectoryCard(sys.argv[1]); card.open()
plain = CardExporter([card], "127.0.0.1", 0).start()
tls = CardExporter([card], "127.0.0.1", 0, tls=tls_server_context(sys.argv[2])).start()
print(plain.urls()[card.serial], tls.urls()[card.serial], flush=True)
sys.stdin.read()
"""


def main() -> None:
    script_main(__doc__, "var/card-tls", 6.0, _run, width=34)


class _TlsPair:
    """A client and server TLS object over memory BIOs, for the encryption limit of this machine: ``send``
    encrypts on one side and decrypts on the other what a card server and a gateway do to each object (TLS 1.3,
    TLS_AES_256_GCM_SHA384 here, 16 KiB records), in one thread."""

    def __init__(self, cert: str, ca: str) -> None:
        sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        sctx.load_cert_chain(cert)
        cctx = ssl.create_default_context(cafile=ca)
        self.bios = [ssl.MemoryBIO() for _ in range(4)]
        self.c = cctx.wrap_bio(self.bios[0], self.bios[1], server_hostname="127.0.0.1")
        self.s = sctx.wrap_bio(self.bios[2], self.bios[3], server_side=True)
        for _ in range(10):
            for side in (self.c, self.s):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
            self.bios[2].write(self.bios[1].read())
            self.bios[0].write(self.bios[3].read())
        self.sink = bytearray(1 << 20)

    def send(self, data: np.ndarray) -> None:
        view = memoryview(data).cast("B")
        for off in range(0, len(view), 1 << 18):
            self.c.write(view[off : off + (1 << 18)])
            self.bios[2].write(self.bios[1].read())  # encrypted, then decrypted by the other side
            while True:
                try:
                    if not self.s.read(len(self.sink), self.sink):
                        break
                except ssl.SSLWantReadError:
                    break


def _check(results: list) -> None:
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        raise bad[0]


def _run(where: str, seconds: float) -> dict:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    pem, ca_pem = os.path.join(where, "server.pem"), os.path.join(where, "ca.pem")
    cert.private_key_and_cert_chain_pem.write_to_path(pem)
    ca.cert_pem.write_to_path(ca_pem)
    pair = _TlsPair(pem, ca_pem)
    card_dir = os.path.join(where, "card")
    DirectoryCard(card_dir, create_missing=True).open()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, card_dir, pem], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=kvgate_env())
    try:
        assert server.stdout is not None
        plain_url, tls_url = server.stdout.readline().split()
        cards = {"plain": NetworkCard(plain_url, io_timeout_ms=20000),
                 "tls": NetworkCard(tls_url, io_timeout_ms=20000, tls_ca_file=ca_pem)}
        for c in cards.values():
            c.open()
        keys = [full_key(b"card-tls", b"%d" % i) for i in range(OBJECTS)]
        data = np.random.default_rng(0).integers(0, 256, SIZE, np.uint8)
        meta = ObjectMeta(b"\0" * 16, 0, time.time_ns(), False)
        items = [(k, memoryview(data), meta) for k in keys]
        assert all(isinstance(r, int) for r in cards["plain"].write_many(items))
        bufs = [np.zeros(SIZE, np.uint8) for _ in keys]
        big = np.zeros(OBJECTS * SIZE, np.uint8)
        src = np.resize(data, OBJECTS * SIZE)

        def read(name: str):
            return lambda _r: _check(cards[name].read_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)]))

        def write(name: str):
            return lambda _r: _check(cards[name].write_many(items))

        rounds = {"budget_s": seconds, "min_rounds": 5, "max_rounds": 10_000}
        out: dict = {}
        for what, make in (("read", read), ("write", write)):
            series = measure([Contender(f"{what}, kvgate://", make("plain")),
                              Contender(f"{what}, kvgates://", make("tls"))], OBJECTS * SIZE, **rounds)
            for name, s in series.items():
                out[name] = s.to_json()
            plain, tls = series[f"{what}, kvgate://"], series[f"{what}, kvgates://"]
            out[f"{what}, kvgates://"].update(of=f"{what}, kvgate://", ratio=tls.best_gib_s / plain.best_gib_s,
                                             ratio_median=tls.median_gib_s / plain.median_gib_s)
        limits = measure([Contender("memory copy (np.copyto)", lambda _r: np.copyto(big, src)),
                          Contender("TLS encrypt + decrypt, in memory", lambda _r: pair.send(src))],
                         OBJECTS * SIZE, **rounds)
        for name, s in limits.items():
            out[name] = s.to_json()
        for c in cards.values():
            c.close()
        return out
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(10)


if __name__ == "__main__":
    main()
