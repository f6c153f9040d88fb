"""The staging region of the SGLang backend: page slots in a /dev/shm file the gateway maps.

SGLang's host pool is anonymous process memory (``torch.empty``), which the gateway cannot
map, so pages pass through memory that both sides map: a file this backend creates, registers
with the gateway and unlinks at once, so that nothing is left behind when the process dies.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets

#: Most bytes a staging region holds; a larger batch is moved in several rounds.
STAGING_BYTES = 64 << 20
#: Pages per batch SGLang sends (STORAGE_BATCH_SIZE): no region needs more slots.
MAX_BATCH_PAGES = 128


class StagingRegion:
    """A /dev/shm file mapped here and by the gateway: page slots that the gateway reads and
    writes in place.  The file is unlinked as soon as the gateway has mapped it, so nothing is
    left behind when the process dies; both mappings live until closed."""

    def __init__(self, nbytes: int):
        path = f"/dev/shm/kvgate-sglang-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path: str | None = path
        self.view = memoryview(self.mm)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = nbytes

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None

    def close(self) -> None:
        self.unlink()
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):  # a view still exported: the mapping goes with the process
            pass
