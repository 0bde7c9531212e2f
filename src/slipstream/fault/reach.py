"""Does an address answer? A two-second TCP probe that tells a cut link from a dead process.

A collective that times out looks the same from the inside whether the peer's
process died, froze, or its node lost the network. A TCP connect tells the
last apart: a host that is up answers at once, with a connection or a refusal
(RST) on a closed port, while a host behind a cut link, a failed switch or a
dropped route sends nothing back and the connect times out. ``ping`` would need
raw sockets (root); this needs nothing.

Example::

    answers("10.0.0.2", 29500)          # True: up; False: no answer in 2 s; None: cannot tell
    local_address_toward("10.0.0.1")    # "10.0.0.7": this host's address on the route there
"""

from __future__ import annotations

import errno
import socket

PROBE_TIMEOUT_S = 2.0

_NO_ROUTE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT)


def answers(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """True if ``host`` answers a TCP connect to ``port`` (accepted or refused), False if
    nothing comes back within ``timeout_s`` or no route exists, None if it cannot be told
    (a name that does not resolve, a bad port)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True  # the host is up; nothing listens on that port
    except (socket.timeout, TimeoutError):
        return False
    except OSError as exc:
        if exc.errno in _NO_ROUTE:
            return False
        return None


def local_address_toward(host: str, port: int = 9) -> str | None:
    """This host's address on the route to ``host`` (no packet is sent: a UDP socket's
    connect only picks the route), or None where there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None
