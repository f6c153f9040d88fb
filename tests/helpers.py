"""Real gateway processes for end-to-end tests, and the other helpers tests share.

``GatewayProcess`` is ``kvgate.bench.processes.GatewayProcess`` with the
tests' small default flags and test-only conveniences: it runs ``python -m
kvgate serve ...`` with PYTHONPATH set to this checkout's ``src``, captures
its stderr in a file, and waits until it answers.  The ``gateway_factory``
fixture in ``tests/conftest.py`` starts them and always stops them at
teardown.  ``free_port`` and ``kvgate_env`` are the package's, and ``freeze``
is ``tests/processes.py``'s, named here because most tests import them from here.

    gw = GatewayProcess(tmp_path, ["--max-bytes", "128M"]).start()
    with gw.client("ns") as c: ...
    gw.kill(signal.SIGKILL); gw.log()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing.process
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from kvgate.bench import processes
from kvgate.bench.processes import free_port, kvgate_env  # noqa: F401 - tests import them from here
from tests.processes import freeze  # noqa: F401 - tests import it from here

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")

# Small, fast defaults: no TCP or HTTP listener, a small RAM tier and small
# per-session shared-memory regions (each local engine session fallocates one).
DEFAULT_FLAGS: dict[str, list[str]] = {
    "--max-bytes": ["64M"],
    "--port": ["0"],
    "--metrics-port": ["0"],
    "--card-capacity": ["1G"],
    "--shared-memory-size": ["8M"],
    "--thread-pool-size": ["2"],
}


# ---- the README's commands (and the docs pages') ---------------------------------------

README = REPO / "README.md"


def peer_payload(i: int, size: int = 300_000) -> bytes:
    """Object ``i`` of the peer tests: distinct per ``i``, ``size`` bytes (rounded down to 256)."""
    return bytes([(i * 7 + j) % 251 for j in range(256)]) * (size // 256)


def pulled_from_ram(holder: "GatewayProcess", puller: "GatewayProcess", ns: str, n: int,
                    payload: Callable[[int], bytes] = peer_payload) -> list[bytes]:
    """Put ``n`` objects in ``holder``'s RAM tier only (retention short), then assert that a client of
    ``puller`` finds all of them, reads each back byte for byte, and misses a key nobody holds; the keys."""
    keys = [f"k{i}".encode() for i in range(n)]
    with holder.client(ns) as c:
        assert c.put_many(keys, [payload(i) for i in range(n)], retention="short") == [True] * n
    with puller.client(ns) as c:
        assert c.lookup(keys) == n
        assert c.get_many(keys) == [payload(i) for i in range(n)]
        assert c.get_many([b"nowhere"]) == [None]
    return keys


def tls_files(ca, tmp_path: Path, name: str = "server") -> dict[str, str]:
    """PEM files from a ``trustme.CA``: its certificate (``ca``), a certificate for 127.0.0.1 and localhost
    with its chain (``cert``) and key (``key``), and another CA's certificate (``other_ca``)."""
    import trustme  # noqa: PLC0415 - the TLS tests' dependency only

    cert = ca.issue_cert("127.0.0.1", "localhost")
    out = {"ca": tmp_path / "ca.pem", "cert": tmp_path / f"{name}.pem", "key": tmp_path / f"{name}.key",
           "other_ca": tmp_path / "other-ca.pem"}
    ca.cert_pem.write_to_path(str(out["ca"]))
    cert.private_key_pem.write_to_path(str(out["key"]))
    cert.cert_chain_pems[0].write_to_path(str(out["cert"]))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(out["cert"]), append=True)
    trustme.CA().cert_pem.write_to_path(str(out["other_ca"]))
    return {k: str(v) for k, v in out.items()}


def readme_section(title: str, page: str = "README.md") -> str:
    """A page's ``## title`` section, up to the next ``## `` heading (its ``###`` subsections included).
    ``page`` is relative to the checkout's root: the README by default, or a docs page
    (``docs/integrations/lmcache.md``), where the depth the README links to lives."""
    text = (REPO / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def readme_commands(title: str, page: str = "README.md") -> list[tuple[dict[str, str], list[str]]]:
    """Every shell command of the ``sh`` blocks of a page's section (the README's by default), as written:
    (its leading ``NAME=value`` assignments, its words), a command being its lines up to one that does not
    end in a backslash and leaves no quote open (a JSON argument may span lines).  Tests run the README's
    commands from these, filling in only what must differ on a test machine (ports, paths, sizes), so the
    README cannot drift from what runs."""
    out: list[tuple[dict[str, str], list[str]]] = []
    for block in re.findall(r"```sh\n(.*?)```", readme_section(title, page), re.S):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            if line.endswith("\\"):
                continue
            try:
                words = shlex.split(pending.replace("\\\n", " "), comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            pending = ""
            env = {}
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words:
                out.append((env, words))
    return out


def venv_python(venv: str) -> Path:
    """The interpreter of one of the engine venvs the Makefile builds (``.venv-vllm``, ``.venv-sglang``...)."""
    return REPO / venv / "bin" / "python"


def run_json_script(python: Path, script: Path, args: Sequence[str | os.PathLike], out: Path, *,
                    env: dict[str, str] | None = None, timeout: float = 240,
                    cwd: str | os.PathLike | None = None) -> dict:
    """Run ``script`` under another venv's ``python`` (this checkout's ``src`` first on its path); it writes
    its findings as JSON to ``out``, returned with its stderr under ``"log"``.  A failed run fails the test
    with the script's output."""
    proc = subprocess.run([str(python), str(script), *map(str, args)], capture_output=True, text=True,
                          env=kvgate_env(env), timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, (f"{Path(script).name} {' '.join(map(str, args))} failed (rc {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(Path(out).read_text()) | {"log": proc.stderr}


def run_plan(python: Path, script: Path, workdir: Path, name: str, plan: dict, **kw) -> dict:
    """``run_json_script`` with a JSON plan file as its one argument; the plan's ``"out"`` is set here."""
    plan = {**plan, "out": str(workdir / f"{name}.json")}
    path = workdir / f"{name}.plan.json"
    path.write_text(json.dumps(plan))
    return run_json_script(python, script, [path], Path(plan["out"]), cwd=workdir, **kw)


def run_logged_plan(python: Path, script: Path, workdir: Path, name: str, plan: dict, *, env: dict[str, str],
                    timeout: float) -> dict:
    """``run_plan`` for an engine script (tests/integrations/vllm_engine.py) whose stdout and stderr go to
    ``workdir/<name>.log``, kept for a look after the test; ``env`` is its whole environment.  The plan's
    ``"out"`` is set here to ``workdir/<name>.json``.  Returns the results the script wrote there, with that
    log under ``"log"`` and their ``"results"`` (each with a ``"name"``) also ``"by_name"``.  A failed run (an
    exit code other than 0, or no results) fails the test with the log's tail."""
    out = workdir / f"{name}.json"
    plan_path = workdir / f"{name}.plan.json"
    plan_path.write_text(json.dumps({**plan, "out": str(out)}))
    log = workdir / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.run([str(python), str(script), str(plan_path)], stdout=f, stderr=subprocess.STDOUT,
                              env=env, cwd=str(workdir), timeout=timeout)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and out.exists(), f"engine run {name} failed (rc {proc.returncode}):\n{text[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = text
    result["by_name"] = {r["name"]: r for r in result["results"]}
    return result


def run_kvgate(*args: str, timeout: float = 30.0, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a ``kvgate`` CLI command to completion (stat, clean, fingerprint, serve that must fail...)."""
    return subprocess.run([sys.executable, "-m", "kvgate", *args], env=kvgate_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


# ---- waiting for something to happen ----------------------------------------------------


def _say(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; after ``timeout`` s fail
    saying ``what`` did not happen (a callable ``what`` is asked then, e.g. for a log's tail)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{_say(what)}: not within {timeout} s (last: {value!r})")
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
                           interval: float = 0.01) -> T:
    """``wait_until`` on an event loop: the loop runs on between polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{_say(what)}: not within {timeout} s (last: {value!r})")
        await asyncio.sleep(interval)
    return value


# ---- processes the suite starts ----------------------------------------------------------


class UnmarkedProcess(Exception):
    """A test not marked slow tried to start a process."""


class ProcessGuard:
    """Refuses to start a process (``subprocess``, ``multiprocessing``, ``os.fork``) while a test that
    is not marked ``slow`` runs: ``make test-fast`` must start none.  ``tests/conftest.py`` installs it
    for the session and says which test is running (``watching``)."""

    def __init__(self) -> None:
        self.test: str | None = None  # the running test not marked slow, if any
        self._undo: list[tuple[object, str, object]] = []

    def check(self, what: object) -> None:
        if self.test is not None:
            raise UnmarkedProcess(f"{self.test} starts a process ({what!r}) but is not marked slow: add "
                                  f"@pytest.mark.slow, or use a fixture of tests/conftest.py PROCESS_FIXTURES")

    @contextlib.contextmanager
    def watching(self, test: str | None) -> Iterator[None]:
        """While the block runs, ``test`` (a node id; None: a slow test) may start no process."""
        before, self.test = self.test, test
        try:
            yield
        finally:
            self.test = before

    def install(self) -> None:
        guard = self

        def wrap(owner: object, name: str, describe: Callable[..., object]) -> None:
            real = getattr(owner, name)

            def guarded(*args, **kwargs):
                guard.check(describe(*args))
                return real(*args, **kwargs)

            self._undo.append((owner, name, real))
            setattr(owner, name, guarded)

        wrap(subprocess.Popen, "_execute_child", lambda popen, args, *_: args)  # run, Popen, check_output...
        wrap(multiprocessing.process.BaseProcess, "start", lambda proc: proc)  # every start method
        wrap(os, "fork", lambda: "os.fork()")

    def uninstall(self) -> None:
        while self._undo:
            owner, name, real = self._undo.pop()
            setattr(owner, name, real)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def mapped_shm(pgid: int, prefixes: tuple[str, ...]) -> set[str]:
    """The /dev/shm files whose names start with one of ``prefixes`` that the processes of process group
    ``pgid`` (a server started in a session of its own, and its children) have mapped: the last word of each
    such line of their /proc/<pid>/maps.  A process that exits or cannot be read meanwhile is passed over."""
    wanted = tuple(f"/dev/shm/{prefix}" for prefix in prefixes)
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/maps") as f:
                found.update(line.split()[-1] for line in f if any(w in line for w in wanted))
        except (OSError, IndexError):
            continue
    return found


class GatewayProcess(processes.GatewayProcess):
    """A ``kvgate serve`` process for a test: small, fast default flags, in its own session.

    ``workdir``: where the card (``card`` unless given), its stderr and
    stdout logs and (when the path is short enough) the socket live, and its
    cwd.  ``args``: extra ``serve`` flags; a flag given here replaces the
    default of the same name.  ``create_cards``: off, a test sees what a
    missing card directory does.  ``python``: the interpreter it runs under (an engine's
    venv; default this one).  A killed or stopped one's session regions
    left in /dev/shm are removed.
    """

    _count = 0

    def __init__(self, workdir: str | os.PathLike, args: Sequence[str] = (), *, card: str | os.PathLike | None = None,
                 socket_path: str | os.PathLike | None = None, defaults: bool = True, name: str | None = None,
                 create_cards: bool = True, env: dict[str, str] | None = None,
                 python: str | os.PathLike | None = None):
        GatewayProcess._count += 1
        workdir = Path(workdir)
        name = name or f"gw{GatewayProcess._count}"
        flags: dict[str, list[str]] = dict(DEFAULT_FLAGS) if defaults else {}
        flags["--storage-devices"] = [str(card if card is not None else workdir / "card")]
        if socket_path is not None:
            flags["--socket"] = [str(socket_path)]
        for flag, values in processes.flag_groups(list(args)):
            flags[flag] = values
        if "--cluster-etcd-endpoints" in flags:  # cluster mode: the cards come from the registry
            del flags["--storage-devices"]
        super().__init__(workdir, [x for f, v in flags.items() for x in (f, *v)], name=name, cwd=workdir,
                         log_path=workdir / f"{name}.stderr.log", out_path=workdir / f"{name}.stdout.log",
                         create_cards=create_cards, env=env, python=str(python) if python is not None else None)
        self._shm_files: set[str] = set()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> int | None:
        """Send ``sig``; for SIGKILL/SIGTERM wait for the exit and return the exit code."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self._note_shm()
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                return self.proc.wait(timeout)
            finally:
                self._reap_shm()
        return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit in time); returns the exit code."""
        if not self.alive():
            return super().stop(timeout)
        self._note_shm()
        try:
            return super().stop(timeout)
        finally:
            self._reap_shm()

    def _note_shm(self) -> None:
        """Remember the session regions this process has mapped (a killed gateway leaves them)."""
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/kvgate-"):
                        self._shm_files.add(path.replace(" (deleted)", ""))
        except OSError:
            pass

    def _reap_shm(self) -> None:
        for path in self._shm_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._shm_files.clear()

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def client(self, namespace: str = "test-ns", **kwargs):
        from kvgate.client import Client

        kwargs.setdefault("timeout", 30.0)
        return Client.connect(self.socket, namespace=namespace, **kwargs)

    def ram_sets(self) -> int:
        """Objects stored into its RAM tier so far (engine stores are asynchronous: tests wait on this)."""
        return int(self.stats()["tiers"]["ram"]["sets"])

    def wait_ram_sets(self, n: int, timeout: float = 60.0) -> int:
        """Wait until at least ``n`` objects were stored (or ``timeout``); returns the count."""
        deadline = time.monotonic() + timeout
        while (sets := self.ram_sets()) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return sets


# ---- cards ------------------------------------------------------------------------------


def card_serial(card_dir: str | os.PathLike) -> str:
    """The serial in a directory card's label."""
    from kvgate.cards.directory.layout import LABEL_NAME

    return json.loads(Path(card_dir, LABEL_NAME).read_text())["serial"]


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes off ``sock`` (a test speaking the gateway's protocol by hand); fails if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the gateway closed the connection"
        buf += chunk
    return bytes(buf)


def read_reply(sock: socket.socket):
    """The gateway's next reply on ``sock``, and its body (b"" when it has none)."""
    from kvgate import protocol as p

    _kind, hlen, blen = p.parse_preamble(recv_exactly(sock, p.PREAMBLE_SIZE), 1 << 62)
    return p.decode_reply(recv_exactly(sock, hlen)), recv_exactly(sock, blen) if blen else b""


def hello_reply(socket_path, hello):
    """The gateway's reply to a hello a test writes by hand (a client checks its fields before sending)."""
    from kvgate import protocol as p

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(socket_path))
        s.sendall(p.encode_frame(hello, 0))
        return read_reply(s)[0]


class Relay:
    """A TCP relay to ``127.0.0.1:port`` that keeps every byte it passes, both ways (``seen``).

    ``cut``: called with the length of each piece the server sends before it is passed on; once it returns
    True that piece and everything after it on every connection are dropped and the connections closed (a
    test kills the server there: the client has part of a reply)."""

    def __init__(self, port: int, cut: Callable[[int], bool] | None = None) -> None:
        self.target = port
        self.cut = cut
        self.tripped = False
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            if self.tripped:
                a.close()
                continue
            try:
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                a.close()
                continue
            threading.Thread(target=self._pump, args=(a, b, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    if from_server and self.cut is not None and (self.tripped or self.cut(len(data))):
                        self.tripped = True
                        break
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def logged_fingerprint(log: str) -> str:
    """The key layout fingerprint a gateway logged at its start."""
    m = re.search(r"Key layout fingerprint ([0-9a-f]{16})\b", log)
    assert m, f"no fingerprint in the log:\n{log}"
    return m.group(1)


def object_files(card: Path) -> list[Path]:
    """The objects on a directory card (named by the key digest, in hex)."""
    return [p for p in card.rglob("*") if p.is_file() and re.fullmatch(r"[0-9a-f]{32}", p.name)]


# ---- the page cache ---------------------------------------------------------------------


def evict(path: str | os.PathLike) -> None:
    """Push a file out of the page cache (no root needed: it is clean once synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pages_cached(path: str | os.PathLike) -> int | None:
    """Pages of the file in the page cache; None where the kernel cannot say (no cachestat)."""
    from kvgate.cards.directory.directio import cached_pages

    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd)
    finally:
        os.close(fd)


def as_newer_format(obj: bytes, full_key: bytes) -> bytes:
    """``obj`` (a whole stored object) as a newer kvgate would write it: the format
    version one up, the header hash recomputed, so the header is whole."""
    import struct

    import xxhash

    from kvgate.cards.objectformat import FIXED_SIZE, VERSION

    out = bytearray(obj)
    struct.pack_into("<H", out, 4, VERSION + 1)
    struct.pack_into("<Q", out, FIXED_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(out[: FIXED_SIZE - 8]) + full_key))
    return bytes(out)


def run_threads(work: Callable[[int], None], n: int) -> None:
    """``work(t)`` for t in 0..n-1, each on a thread of its own, all at once; the first exception any raised
    is raised here, once they all ended."""
    import threading

    errors: list[BaseException] = []

    def one(t: int) -> None:
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
