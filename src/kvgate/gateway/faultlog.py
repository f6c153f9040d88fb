"""The log line that names a client's in-place region when a fault there kills the gateway.

An in-place region (``kvgate.gateway.shm``: a client that could stop the
gateway anyway) is read, hashed and written in place, so a client that
shrinks its file under the mapping turns the next load or store there into
SIGBUS.  With the compiled helper (``kvgate/_faults.c``, built by ``pip
install`` / ``make install`` where a C compiler is; loaded by
``kvgate.memguard``), the copies and hashes the gateway makes of such memory
run under its guard and survive that: the request fails (``MemoryFault``),
the gateway goes on.  A fault anywhere else (a load no guard covers, or one
where the helper is not built) still kills the process, which cannot be
caught in Python; what this module does is say so.

The first in-place region mapped installs the helper's SIGBUS/SIGSEGV handler
(which also makes the guards work: ``memguard.guarded``); an unguarded fault
writes one line to stderr (the gateway's log) before the process dies of the
signal::

    kvgate: SIGBUS at 0x7f.. in the in-place region of session 7 (pid 1234, /dev/shm/...): its client shrank
    the file under the mapping; the gateway dies (in_place_regions: false guards against this)

Without the helper, ``faulthandler`` says "Fatal Python error: Bus error" and
each in-place region's address range is logged (info) when it is mapped, so
the fault's address can be matched by hand.  ``faulthandler`` is enabled
either way (the helper hands the signal on to it: every thread's Python
stack).

Who calls: ``shm.Region`` (``note`` when it maps an in-place region,
``forget`` once it is unmapped), from the loop or a pool thread; a lock
keeps the table's slots, the handler reads it without one (the C file says
why a torn read is harmless).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import sys
import threading

from kvgate import memguard

log = logging.getLogger("kvgate.shm")


def _load() -> ctypes.CDLL | None:
    lib = memguard.faults
    if lib is None:
        return None
    lib.kvgate_fault_set.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p]
    lib.kvgate_fault_set.restype = None
    lib.kvgate_fault_clear.argtypes = [ctypes.c_int]
    lib.kvgate_fault_clear.restype = None
    lib.kvgate_fault_install.argtypes = [ctypes.c_int]
    lib.kvgate_fault_install.restype = ctypes.c_int
    return lib


_lib = _load()
_lock = threading.Lock()
_free: list[int] = list(range(_lib.kvgate_fault_slots() - 1, -1, -1)) if _lib is not None else []
_label_bytes = _lib.kvgate_fault_label_bytes() if _lib is not None else 0
_installed = False


def _install() -> bool:
    """Under the lock: faulthandler on, then the helper's handler (which hands on to it); whether the
    helper is in place."""
    global _installed, _lib
    if not _installed:
        _installed = True
        if not faulthandler.is_enabled():
            try:
                faulthandler.enable(file=sys.stderr, all_threads=True)
            except (ValueError, OSError, AttributeError):  # no usable stderr
                pass
        if _lib is not None and _lib.kvgate_fault_install(2) != 0:
            log.warning("cannot install the fault handler that names in-place regions: %s",
                        os.strerror(ctypes.get_errno()))
            _lib = None
        if _lib is None:
            log.info("in-place regions: the fault helper (kvgate/_faults*.so) is not built here; a "
                     "region shrunk by its client kills the gateway with faulthandler's 'Bus error' only, and "
                     "each in-place region's address range is logged when it is mapped")
    return _lib is not None


def shown(text: str) -> str:
    """``text`` with control and non-ASCII characters escaped: a client chose the region's path."""
    return "".join(c if " " <= c < "\x7f" else repr(c)[1:-1] for c in text)


def note(start: int, size: int, session: int, pid: int | None, path: str) -> int | None:
    """Remember that ``[start, start + size)`` is session ``session``'s in-place region (its client's
    ``pid``, file ``path``); the slot to ``forget``, or None when there is no helper or its table is full."""
    label = f"session {session} (pid {pid if pid is not None else '?'}, {shown(path)})"
    with _lock:
        helper = _install()
        slot = _free.pop() if helper and _free else None
        if slot is not None:
            raw = label.encode()[: _label_bytes - 1]
            _lib.kvgate_fault_set(slot, start, start + size, raw)  # type: ignore[union-attr]
    (log.debug if slot is not None else log.info)(
        "in-place region of %s mapped at %#x-%#x: a SIGBUS there means its client shrank the file", label, start,
        start + size)
    return slot


def forget(slot: int | None) -> None:
    """The region of ``slot`` (from ``note``) is unmapped."""
    if slot is None:
        return
    with _lock:
        _lib.kvgate_fault_clear(slot)  # type: ignore[union-attr]
        _free.append(slot)
