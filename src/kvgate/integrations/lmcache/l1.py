"""LMCache's L1 arena as the gateway can see it: the /dev/shm file mapping that holds it, if any.

When ``lmcache server`` keeps L1 in a /dev/shm file (``--no-l1-use-lazy --shm-name NAME``), the
adapter registers that file with the gateway, which then copies objects straight between its
memory and L1.  Reads ``/proc/self/maps``; imports no LMCache.
"""

from __future__ import annotations

import ctypes

__all__ = ["find_shm_mapping", "map_l1"]


def find_shm_mapping(ptr: int) -> tuple[str, int, int] | None:
    """(path, start, size) of the /dev/shm file mapping (at file offset 0) that holds ``ptr``."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            path = parts[5].strip()
            if path.startswith("/dev/shm/") and int(parts[2], 16) == 0 and "rw" in parts[1]:
                # the file may be mapped in several adjacent pieces: take the whole run from lo
                end = hi
                for other in lines:
                    p = other.split(maxsplit=5)
                    if len(p) == 6 and p[5].strip() == path:
                        a, b = (int(x, 16) for x in p[0].split("-"))
                        if a == end and int(p[2], 16) == end - lo:
                            end = b
                return path, lo, end - lo
            return None
    return None


def map_l1(ptr: int) -> tuple[tuple[str, int, int], memoryview] | None:
    """The /dev/shm mapping that holds L1's first byte ``ptr`` (``find_shm_mapping``) and a byte
    view of all of it (the mapping a registered session's copies go through); None if L1 is not
    in a /dev/shm file (the default lazy L1 is anonymous memory)."""
    found = find_shm_mapping(ptr)
    if found is None:
        return None
    _, start, size = found
    return found, memoryview((ctypes.c_ubyte * size).from_address(start)).cast("B")
