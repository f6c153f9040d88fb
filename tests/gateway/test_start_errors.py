"""What a newcomer's first ``kvgate serve`` says when the config cannot work on this machine: one line naming
the key and the fix, exit 2, and nothing made on disk (real ``kvgate serve`` processes)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.tiers.ram import machine_memory
from tests.helpers import kvgate_env, run_kvgate

pytestmark = pytest.mark.slow  # every test runs kvgate serve


def _serve(tmp_path: Path, *flags: str, card: Path | None = None, **kw) -> subprocess.CompletedProcess:
    return run_kvgate("serve", "--storage-devices", str(card or tmp_path / "card"), "--port", "0",
                      "--metrics-port", "0", "--socket", str(tmp_path / "s.sock"), *flags, timeout=60, **kw)


def _one_line(r: subprocess.CompletedProcess) -> str:
    """The error line of a refused start (the log's INFO lines of what started before are not it)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_ram_tier_larger_than_the_machine_names_max_bytes_and_what_the_machine_has(tmp_path: Path) -> None:
    total, _ = machine_memory()
    if total >= 1 << 40:
        pytest.skip("this machine has 1 TiB of memory or more")
    line = _one_line(_serve(tmp_path, "--max-bytes", "1T"))
    assert "config key 'max_bytes': a RAM tier of 1 TiB is more than the machine's memory" in line, line
    assert "this machine has " in line and "available now" in line and "lower max_bytes" in line, line
    assert not (tmp_path / "card").exists() and not (tmp_path / "s.sock").exists()


def test_a_ram_tier_the_kernel_will_not_map_names_max_bytes(tmp_path: Path) -> None:
    total, _ = machine_memory()
    if total < 4 << 30:
        pytest.skip("needs 4 GiB of memory, so that only the address-space limit refuses the arena")

    def limited() -> None:  # what a `ulimit -v` (or a strict overcommit rule) does to the arena's mmap
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--storage-devices", str(tmp_path / "card"),
                        "--port", "0", "--metrics-port", "0", "--socket", str(tmp_path / "s.sock"),
                        "--max-bytes", "3G"], env=kvgate_env(), capture_output=True, text=True, timeout=60,
                       preexec_fn=limited)
    line = _one_line(r)
    assert "config key 'max_bytes': a RAM tier of 3 GiB cannot be mapped (Cannot allocate memory)" in line, line
    assert "this machine has " in line, line


def test_a_storage_device_that_is_a_file_is_refused_at_once_naming_it(tmp_path: Path, gateway_factory) -> None:
    not_a_dir = tmp_path / "card.img"
    not_a_dir.write_bytes(b"\0" * 4096)
    line = _one_line(_serve(tmp_path, card=not_a_dir))
    assert f"config key 'storage_devices': {not_a_dir}: this is a regular file, not a directory" in line, line
    assert "(or a redis:// or kvgate:// URL)" in line
    assert not_a_dir.read_bytes() == b"\0" * 4096

    gw = gateway_factory()
    r = run_kvgate("cards", "add", str(not_a_dir), "--socket", gw.socket)
    assert r.returncode == 1 and "this is a regular file, not a directory" in r.stderr, r.stdout + r.stderr
    with gw.admin() as c:
        assert [card["state"] for card in c.cards("list").cards] == ["serving"], "nothing pending"


def test_a_socket_in_a_directory_that_does_not_exist_is_refused_not_created(tmp_path: Path) -> None:
    sock = tmp_path / "no" / "such" / "dir" / "x.sock"
    r = run_kvgate("serve", "--storage-devices", str(tmp_path / "card"), "--port", "0", "--metrics-port", "0",
                   "--max-bytes", "0", "--socket", str(sock), "--create-card-dirs", "true", timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"config key 'socket': the directory of {sock} ({sock.parent}) does not exist" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists(), "no directory tree made out of a typo"


@pytest.mark.parametrize("flags, says", [
    (["--max-bytes", "-1G"], "config key 'max_bytes': a size cannot be negative, got '-1G'"),
    (["--card-capacity", "1"], "config key 'card_capacity': must be at least 4 KiB, got '1'"),
    (["--shared-memory-size", "1000"], "config key 'shared_memory_size': must be at least 1 MiB, got '1000'"),
])
def test_sizes_refused_by_name_and_in_units(tmp_path: Path, flags: list[str], says: str) -> None:
    line = _one_line(_serve(tmp_path, *flags))
    assert line == f"kvgate: {says}", line
    assert "usage:" not in line and not os.path.exists(tmp_path / "card")
