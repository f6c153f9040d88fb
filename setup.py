"""The compiled parts of kvgate, both optional, plain C (no Python headers, loaded with ctypes through
``kvgate.native``): ``kvgate/_faults`` (copies and hashes of a client's in-place region that survive the
client shrinking it, and the log line naming a region a fault elsewhere killed the gateway in) and
``kvgate/_probe`` (a card index's probe of a batch of digests, for lookups).  Without a C compiler the
install goes on and the gateway uses the pure-Python fallbacks (kvgate.gateway.faultlog says what the first
costs; the second is the numpy probe, 100-200 us slower per 1,000 keys).  Everything else about the
package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvgate._faults", ["src/kvgate/_faults.c"], optional=True),
                   Extension("kvgate._probe", ["src/kvgate/_probe.c"], optional=True)])
