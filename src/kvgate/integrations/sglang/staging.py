"""The SGLang backend's copies: pages between SGLang's host pool and the gateway's RAM.

SGLang's host pool is anonymous process memory (``torch.empty``), which the
gateway cannot map, and a page of the ``layer_first`` layout is 2 x layers
separate fragments.  A store moves a page as: pool fragments -> one
contiguous slot of a staging region (a /dev/shm file this backend creates,
registers with the gateway and unlinks at once) -> the gateway's RAM tier,
two copies by ``memmove`` (no Python ``bytes`` in between; the gather into
the slot is the copy that any object store needs for a fragmented page).  A
load is a get into the pages' fragments (``Pieces`` of the pool): where the
gateway lends its memory to this process, one copy straight into them
(``process_vm_readv`` takes a list of destinations); otherwise two, through
the session's region.

``StagingRegion`` is that file; ``load_pages`` and ``store_pages`` are the two directions,
a store larger than the region in several rounds.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from typing import TYPE_CHECKING

import numpy as np

from kvgate.client import Pieces

if TYPE_CHECKING:
    from kvgate.client import DialogMark
    from kvgate.integrations.sglang.failures import FailureLog
    from kvgate.integrations.sglang.link import GatewayLink
    from kvgate.integrations.sglang.pools import RegisteredPool

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


# ---- moving pages through a staging region (caller holds link.lock, after link.begin()) ----

def _rounds(link: GatewayLink, pool: RegisteredPool, n: int) -> list[tuple[int, int]]:
    stage = link.staging
    assert stage is not None
    per = min(MAX_BATCH_PAGES, stage.size // pool.slot_bytes)
    if per < 1:  # cannot happen once the pool is registered (the region is fitted to it)
        raise ValueError(f"a page of host pool {pool.name!r} ({pool.page_bytes} bytes) is larger than the "
                         f"staging region ({stage.size} bytes)")
    return [(r0, min(n, r0 + per)) for r0 in range(0, n, per)]


def load_pages(link: GatewayLink, pool: RegisteredPool, skeys: list[bytes], ptrs: np.ndarray, sizes: np.ndarray,
               dm: DialogMark, position: int, out: list, log: FailureLog) -> None:
    """Read ``skeys`` into the pool's pages (``ptrs``/``sizes``: their fragments, a row a page), each page
    straight into its fragments (a get into ``Pieces`` of the pool's memory: one copy where the client
    reads the gateway's memory, with no Python step per fragment; else through the session region).  A
    stored object of the wrong size (another geometry under the same key) is a miss: a shorter one has
    filled the first fragments of a page reported not loaded, which SGLang does not use.  Sets ``out[i]``
    per page loaded."""
    if not skeys:
        return
    lo, hi = int(ptrs.min()), int((ptrs + sizes).max())
    span = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
    pages = Pieces(span, ptrs - lo, sizes)
    for start, end, dialog in dm.spans(position, len(skeys)):
        got = link.budget().get_many(skeys[start:end], into=pages[start:end], dialog=dialog)
        for i, size in zip(range(start, end), got):
            if size is None:
                continue
            if size != pool.page_bytes:
                log.warn_once(f"size-{pool.name}", "kvgate backend: a stored page of pool %r is %d bytes, this "
                              "pool's %d: ignored (a namespace shared by engines with different layouts?)",
                              pool.name, size, pool.page_bytes)
                continue
            out[i] = True


def store_pages(link: GatewayLink, pool: RegisteredPool, skeys: list[bytes], ptrs: np.ndarray, sizes: np.ndarray,
                dm: DialogMark, position: int, out: list, retention: str) -> None:
    """Store the pool's pages under ``skeys`` (``ptrs``/``sizes``: their fragments, a row a page): each
    page's fragments are gathered into a staging slot that the gateway reads in place.  Sets ``out[i]``
    per page stored."""
    stage = link.staging
    slot, f = pool.slot_bytes, pool.fragments
    ptrs, sizes = ptrs.ravel().tolist(), sizes.ravel().tolist()
    for r0, r1 in _rounds(link, pool, len(skeys)):
        for i in range(r0, r1):
            dst = stage.base + (i - r0) * slot
            for k in range(i * f, (i + 1) * f):
                ctypes.memmove(dst, ptrs[k], sizes[k])
                dst += sizes[k]
        views = [stage.view[(i - r0) * slot:(i - r0) * slot + pool.page_bytes] for i in range(r0, r1)]
        try:
            for start, end, dialog in dm.spans(position + r0 if position >= 0 else -1, r1 - r0):
                stored = link.budget().put_many(
                    skeys[r0 + start:r0 + end], views[start:end], retention=retention,
                    dialog=dialog, position=position + r0 + start if position >= 0 else -1)
                out[r0 + start:r0 + end] = [bool(x) for x in stored]
        finally:
            for v in views:
                v.release()
