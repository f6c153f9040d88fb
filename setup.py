"""The compiled parts of kvgate, all optional; kvgate keeps a pure-Python path for each where one is not built
(no C compiler, or no Python headers for the last):

- ``kvgate/_faults`` (plain C, loaded with ctypes through ``kvgate.native``): copies and hashes of a
  client's in-place region that survive the client shrinking it, and the log line naming a region a fault
  elsewhere killed the gateway in (kvgate.gateway.faultlog says what going without costs);
- ``kvgate/_probe`` (plain C, through ``kvgate.native``): a card index's probe of a batch of digests, for
  lookups (the numpy probe is 100-200 us slower per 1,000 keys);
- ``kvgate/_copy`` (plain C, through ``kvgate.native``): a client's scatter-gather copy of a get's pieces out
  of the gateway's RAM arena in one call (with ``ctypes.memmove``, a Python step of about 1 us a piece);
- ``kvgate/_keys`` (a CPython extension, imported by ``kvgate.keys``): a request's full keys and key
  digests in one C loop each (the Python loops take some 100 us more per 1,000 keys);
- ``kvgate/_recent`` (a CPython extension, imported by ``kvgate.tiers.eviction``): the eviction policies'
  test of whether a block was seen lately, one call per add or read (the Python probes take 4-7 us more);
- ``kvgate/_mini`` (a CPython extension, imported by ``kvgate.tiers.eviction``): the adaptive policy's
  miniature caches, one call per sampled reference (in Python they cost more than the policy they judge).

Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvgate._faults", ["src/kvgate/_faults.c"], optional=True),
                   Extension("kvgate._probe", ["src/kvgate/_probe.c"], optional=True),
                   Extension("kvgate._copy", ["src/kvgate/_copy.c"], optional=True),
                   Extension("kvgate._keys", ["src/kvgate/_keys.c"], optional=True),
                   Extension("kvgate._recent", ["src/kvgate/_recent.c"], depends=["src/kvgate/_bloom.h"],
                             optional=True),
                   Extension("kvgate._mini", ["src/kvgate/_mini.c"], depends=["src/kvgate/_bloom.h"], optional=True)])
