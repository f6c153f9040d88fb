"""vLLM's CPU tier file after its engine (``kvgate.integrations.vllm.cputier``), with real processes standing in
for engine cores (it imports no vLLM): a killed engine's file is removed by the next engine's start, a live
engine's never, and a clean exit takes the mark with the file vLLM removed.  The real engine's case is in
tests/integrations/test_vllm_readme.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from kvgate.shmowners import SHM_DIR, owned_files
from tests.helpers import kvgate_env

pytestmark = pytest.mark.slow  # engine cores are processes

# An "engine core": vLLM's file (made as vLLM makes it), the tier's claim, then waits for a line on stdin;
# "unlink" on stdin removes its file first, as vLLM's clean shutdown does.
ENGINE = textwrap.dedent("""
    import os, sys
    from kvgate.integrations.vllm.cputier import claim_cpu_tier
    region = f"/dev/shm/vllm_offload_{sys.argv[1]}.mmap"
    fd = os.open(region, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    print(claim_cpu_tier(region), flush=True)
    if sys.stdin.readline().strip() == "unlink":
        os.unlink(region)
""")


class Engine:
    def __init__(self):
        self.engine_id = f"test-{secrets.token_hex(6)}"
        self.region = f"{SHM_DIR}/vllm_offload_{self.engine_id}.mmap"
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, self.engine_id], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=kvgate_env())
        self.mark = self.proc.stdout.readline().strip()

    def finish(self, line: str = "") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.wait(10) == 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def engines():
    started: list[Engine] = []
    yield lambda: started.append(Engine()) or started[-1]
    for e in started:
        if e.proc.poll() is None:
            e.kill()
        for path in (e.region, e.mark):
            if os.path.exists(path):
                os.unlink(path)


def test_a_killed_engines_tier_file_is_removed_at_the_next_start_and_a_live_ones_kept(engines) -> None:
    running = engines()
    killed = engines()
    assert os.path.basename(killed.mark).startswith(f"kvgate-vllm.{killed.proc.pid}.")
    assert os.path.basename(killed.mark).endswith(f".vllm_offload_{killed.engine_id}.mmap")
    killed.kill()  # as `vllm serve` kills its engine core at every Ctrl-C: vLLM's cleanup never runs
    assert os.path.exists(killed.region) and os.path.exists(killed.mark)

    restarted = engines()
    assert not os.path.exists(killed.region) and not os.path.exists(killed.mark)
    for e in (running, restarted):
        assert os.path.exists(e.region) and os.path.exists(e.mark)

    # A clean exit that removed vLLM's file takes the mark with it; one that did not leaves both for the next.
    running.finish("unlink")
    assert not os.path.exists(running.mark)
    restarted.finish()
    assert os.path.exists(restarted.region) and os.path.exists(restarted.mark)
    engines()
    assert not os.path.exists(restarted.region) and not os.path.exists(restarted.mark)
    assert all(f.pid != restarted.proc.pid for f in owned_files("vllm"))
