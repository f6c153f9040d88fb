"""The one compiled part of kvgate, optional: ``kvgate/_faults`` (plain C, no Python headers, loaded with
ctypes by ``kvgate.memguard``): copies and hashes of a client's in-place region that survive the client
shrinking it, and the log line naming a region a fault elsewhere killed the gateway in.  Without a C compiler
the install goes on and the gateway uses the pure-Python fallback (kvgate.gateway.faultlog says what that
costs).  Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvgate._faults", ["src/kvgate/_faults.c"], optional=True)])
