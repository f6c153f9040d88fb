"""kvgate's compiled helpers: plain C, no Python headers, loaded with ctypes; None where one is not built.

setup.py builds each as an optional extension in place (``make install``): a machine without a C compiler
installs without them, and each user keeps a pure-Python path that does the same, slower.

- ``kvgate/_faults.c``: copies and hashes of in-place client memory that survive the client shrinking it
  (``kvgate.memguard``, ``kvgate.gateway.faultlog``);
- ``kvgate/_probe.c``: a card index's probe of a whole batch of digests (``kvgate.tiers.rows``);
- ``kvgate/_copy.c``: a client's copy of a get's pieces out of the gateway's mapped RAM arena
  (``kvgate.client.crossmem``).

Three others are CPython extensions, imported where they are used rather than loaded here:
``kvgate/_keys.c`` reads Python lists and makes bytes objects (``kvgate.keys``); ``kvgate/_recent.c``
hashes Python objects (``kvgate.tiers.eviction``'s ``RecentKeys``), ``kvgate/_mini.c`` keeps them (the
referee's miniature caches, ``kvgate.tiers.eviction.miniature``).
"""

from __future__ import annotations

import ctypes
import glob
import os


def load(stem: str, *, keep_gil: bool = False, use_errno: bool = False) -> ctypes.CDLL | None:
    """The helper ``kvgate/<stem>*.so``, or None where it is not built (or does not load).

    ``keep_gil``: calls hold the GIL (``ctypes.PyDLL``), for calls of a few microseconds on the event
    loop: releasing it would let another thread take it, and the loop wait for it back.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    kind = ctypes.PyDLL if keep_gil else ctypes.CDLL
    for path in sorted(glob.glob(os.path.join(here, f"{stem}*.so"))):
        try:
            return kind(path, use_errno=use_errno)
        except OSError:
            continue
    return None
