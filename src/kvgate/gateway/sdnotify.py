"""Telling systemd (or any service manager speaking its notify protocol) what the gateway is doing.

A unit with ``Type=notify`` starts the gateway with ``NOTIFY_SOCKET`` set;
the gateway sends ``READY=1`` once it listens (so units ordered after it, an
engine, start against a gateway that answers), ``RELOADING=1`` then
``READY=1`` around a SIGHUP, and ``STOPPING=1`` when it begins to stop.
Without ``NOTIFY_SOCKET`` nothing is sent.  A datagram on a local socket: it
never blocks the loop for long, and a failure is logged once, never raised.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvgate.gateway")
_failed = False


def notify(*lines: str) -> bool:
    """Send ``lines`` (``READY=1``, ``STATUS=...``) as one message; whether it was sent."""
    global _failed
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(1.0)
            s.connect(path)
            s.sendall("\n".join(lines).encode())
    except OSError as e:
        if not _failed:
            log.warning("could not tell the service manager %s at NOTIFY_SOCKET=%s: %s", lines[0],
                        os.environ.get("NOTIFY_SOCKET"), e)
            _failed = True
        return False
    return True
