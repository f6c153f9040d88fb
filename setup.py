"""The one compiled part of kvgate, optional: ``kvgate/gateway/_faultlog`` (plain C, no Python headers, loaded
with ctypes by ``kvgate.gateway.faultlog``).  Without a C compiler the install goes on and the gateway uses
faultlog's pure-Python fallback.  Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvgate.gateway._faultlog", ["src/kvgate/gateway/_faultlog.c"], optional=True)])
