"""The guard under which the gateway touches in-place client memory, and the error a shrunk region is.

In-place memory is the shared region of a client that could stop the gateway
anyway (``kvgate.gateway.shm``): the gateway reads into it, hashes it and writes
from it in user space, one pass, where a guarded region goes through the kernel
(``kvgate.memcopy``).  The client can still shrink its file under the mapping,
and a load or store in a page shrunk away is SIGBUS.  The compiled helper
(``kvgate/_faults.c``, built by ``make install`` where a C compiler is; None
here without it) runs ``memcpy`` and XXH3 updates under a guard: a SIGBUS
there jumps back out of the call, which returns -1, and this module raises
``MemoryFault``: that request fails, the gateway goes on.  The guard works once
the helper's handler is installed (``kvgate.gateway.faultlog``, with the first
in-place region mapped: ``guarded``); before, and without the helper, the
calls here touch the memory unguarded, as a client of the gateway's own user
is trusted to leave its region alone.

What is here: the in-place ranges (``add_in_place_memory``), the guarded copy
of ``(destination, source, length)`` spans (``copy_spans``, for
``kvgate.memcopy.copy``), and the payload hash of in-place memory
(``hasher_for``, ``hash_with``: XXH3-64 as ``kvgate.keys.payload_hasher``, by
python-xxhash's own C functions, which its extension exports).  Any thread may
call them; nothing here blocks beyond the copy or hash itself (ctypes releases
the GIL for it).
"""

from __future__ import annotations

import ctypes
import errno
import threading
from typing import Any

import numpy as np

from kvgate import native
from kvgate.errors import KvgateError

_CHAR = ctypes.c_char


class Ranges:
    """Address ranges ``(start, end)`` of mappings, replaced whole under a lock, so a reader takes ``spans``
    without one.  A range is added before its mapping is handed out and removed only after it is unmapped:
    a reader never misses memory of the kind (a stale range only slows a copy down)."""

    def __init__(self) -> None:
        self.spans: tuple[tuple[int, int], ...] = ()
        self._lock = threading.Lock()

    def add(self, start: int, size: int) -> None:
        with self._lock:
            self.spans = (*self.spans, (start, start + size))

    def remove(self, start: int, size: int) -> None:
        """Forget one range ``add`` added."""
        with self._lock:
            left = list(self.spans)
            if (start, start + size) in left:
                left.remove((start, start + size))
            self.spans = tuple(left)


_in_place = Ranges()  # every mapping of in-place client memory


class MemoryFault(KvgateError, OSError):
    """A copy met memory that is not there: a mapped file was shrunk under its mapping."""


def region_gone(detail: str = "") -> MemoryFault:
    """The error of a kernel copy (or write) that met client memory no longer there (EFAULT)."""
    return MemoryFault(errno.EFAULT, f"memory of a shared region is gone ({detail}the file was shrunk under its "
                                     "mapping)")


def _load_faults() -> ctypes.CDLL | None:
    """The compiled helper (``kvgate/_faults.c``), or None where no C compiler built it."""
    lib = native.load("_faults", use_errno=True)
    if lib is None:
        return None
    lib.kvgate_guarded_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.kvgate_guarded_copy.restype = ctypes.c_int
    lib.kvgate_guarded_copy_spans.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.kvgate_guarded_copy_spans.restype = ctypes.c_int
    lib.kvgate_guarded_hash.argtypes = [ctypes.c_void_p] * 6 + [ctypes.POINTER(ctypes.c_uint64)]
    lib.kvgate_guarded_hash.restype = ctypes.c_int
    lib.kvgate_guarded_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.kvgate_guarded_update.restype = ctypes.c_int
    lib.kvgate_fault_installed.argtypes = []
    lib.kvgate_fault_installed.restype = ctypes.c_int
    return lib


faults = _load_faults()


def _load_xxh3() -> Any:
    """python-xxhash's own XXH3 functions (its extension exports them), for hashes under the guard; None
    where this build of it does not export them."""
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]
        lib = ctypes.CDLL(_xxhash.__file__)
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        return lib
    except (ImportError, OSError, AttributeError):
        return None


_xxh3 = _load_xxh3() if faults is not None else None


def _xxh3_update(lib: Any) -> Any:
    """XXH3's update as python-xxhash hashes with: its x86 dispatcher's (AVX2 where the CPU has it), where it
    exports one.  The plain exported ``XXH3_64bits_update`` is its generic build: 19 GiB/s in cache here
    against the dispatcher's 40, and 0.82 of python-xxhash's speed on 2 MiB out of cache."""
    return getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update


_xxh3_fns = tuple(ctypes.cast(fn, ctypes.c_void_p).value for fn in (
    _xxh3.XXH3_64bits_reset, _xxh3_update(_xxh3), _xxh3.XXH3_64bits_digest)) if _xxh3 is not None else None


class _ThreadHash(threading.local):
    """One XXH3 state and digest slot per thread, for ``hash_with``'s one-call hashes (pool threads live as
    long as the gateway: never freed)."""

    def __init__(self) -> None:
        self.state = _xxh3.XXH3_createState() if _xxh3 is not None else None
        self.out = ctypes.c_uint64()
        self.ref = ctypes.byref(self.out)


_thread_hash = _ThreadHash()


def u8(buf: Any) -> np.ndarray:
    """``buf`` as a flat uint8 array (no copy)."""
    return buf if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1 else \
        np.frombuffer(buf, dtype=np.uint8)


def address(b: np.ndarray) -> int:
    """Where the first byte of ``b`` is (0 when it has none)."""
    if not b.size:
        return 0
    try:
        return ctypes.addressof(_CHAR.from_buffer(b))  # a quarter of the time of __array_interface__
    except TypeError:  # read-only (bytes)
        return b.__array_interface__["data"][0]


def overlaps(ranges: tuple[tuple[int, int], ...], addrs: list[int], bufs: list[np.ndarray]) -> bool:
    """Whether any of ``bufs`` (starting at ``addrs``) has a byte in ``ranges``."""
    for lo, b in zip(addrs, bufs):
        hi = lo + b.size
        for a, e in ranges:
            if lo < e and a < hi:
                return True
    return False


def in_place_ranges() -> tuple[tuple[int, int], ...]:
    """The in-place ranges now (``add_in_place_memory``)."""
    return _in_place.spans


def copy_spans(spans: list[tuple[int, int, int]]) -> bool:
    """Copy ``(destination, source, length)`` spans under the guard, one call for all; False where the guard
    is not on (nothing copied: the caller copies them its usual way).  ``MemoryFault`` where a page is gone."""
    if faults is None:
        return False
    if len(spans) == 1:
        done = faults.kvgate_guarded_copy(*spans[0])
    else:
        flat = [v for span in spans for v in span]
        done = faults.kvgate_guarded_copy_spans((ctypes.c_size_t * len(flat))(*flat), len(spans))
    if done == -1:
        raise region_gone()
    return done == 0


def add_in_place_memory(start: int, size: int) -> None:
    """Say that ``[start, start + size)`` is mapped from a file of a client trusted with it (copied and hashed in
    place, under the guard where the helper is built)."""
    _in_place.add(start, size)


def remove_in_place_memory(start: int, size: int) -> None:
    """Forget one range ``add_in_place_memory`` added; only once that mapping is gone."""
    _in_place.remove(start, size)


_guard_on = False  # the helper's handler is installed (it stays so)


def guarded() -> bool:
    """Whether in-place memory is copied and hashed under the guard now (the helper built, its handler
    installed: ``kvgate.gateway.faultlog`` installs it with the first in-place region)."""
    global _guard_on
    if not _guard_on and faults is not None:
        _guard_on = bool(faults.kvgate_fault_installed())
    return _guard_on


def _guardedaddress(buf: Any) -> tuple[int, int] | None:
    """(address, length) of ``buf`` when it is in-place memory to hash under the guard; None otherwise."""
    ranges = _in_place.spans
    if not ranges or _xxh3_fns is None or not guarded():
        return None
    b = u8(buf)
    if not b.size:
        return None
    lo = address(b)
    hi = lo + b.size
    for a, e in ranges:
        if lo < e and a < hi:
            return lo, b.size
    return None


class GuardedHash:
    """The payload hash (XXH3-64, as ``kvgate.keys.payload_hasher``) of memory a client may shrink under it:
    ``update`` raises ``MemoryFault`` where a page is gone, instead of SIGBUS.  Python-xxhash's own C
    function runs inside the helper's guard (``kvgate_guarded_update``)."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = _xxh3.XXH3_createState()
        if not self._state:
            raise MemoryError("XXH3_createState")
        _xxh3.XXH3_64bits_reset(self._state)

    def update(self, buf: Any) -> None:
        b = u8(buf)
        if b.size and faults.kvgate_guarded_update(_xxh3_fns[1], self._state, address(b), b.size) == -1:
            raise region_gone()

    def intdigest(self) -> int:
        return _xxh3.XXH3_64bits_digest(self._state)

    def __del__(self) -> None:
        if self._state:
            _xxh3.XXH3_freeState(self._state)
            self._state = None


def hasher_for(buf: Any, make: Any) -> Any:
    """The hasher to hash ``buf`` with: a ``GuardedHash`` where ``buf`` is in-place memory and the guard is on,
    else ``make()`` (``kvgate.keys.payload_hasher``)."""
    return GuardedHash() if _guardedaddress(buf) is not None else make()


def hash_with(buf: Any, make: Any) -> int:
    """The hash ``make()`` makes of ``buf`` (``kvgate.keys.payload_hasher``), under the guard where ``buf`` is
    in-place memory (``MemoryFault`` where a page of it is gone)."""
    where = _guardedaddress(buf)
    if where is not None:
        t = _thread_hash
        if faults.kvgate_guarded_hash(*_xxh3_fns, t.state, *where, t.ref) == -1:  # type: ignore[union-attr]
            raise region_gone()
        return t.out.value
    h = make()
    h.update(buf)
    return h.intdigest()
