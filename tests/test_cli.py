"""`kvgate stat` / `kvgate clean` with no gateway there: one line naming the address tried."""

from __future__ import annotations

import pytest

from tests.helpers import free_port, run_kvgate

pytestmark = pytest.mark.slow


def test_stat_names_the_default_socket_it_tried(tmp_path):
    # The default socket follows XDG_RUNTIME_DIR: a user who set it must see where we looked.
    res = run_kvgate("stat", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert res.returncode == 2
    assert f"{tmp_path}/kvgate-5557.sock" in res.stderr
    assert "Traceback" not in res.stderr


def test_clean_names_the_address_it_tried():
    port = free_port()
    res = run_kvgate("clean", "--address", f"127.0.0.1:{port}")
    assert res.returncode == 2
    assert f"127.0.0.1:{port}" in res.stderr and "refused" in res.stderr.lower()
    assert "Traceback" not in res.stderr
