"""Which network interface gloo binds on a host with several (``GLOO_SOCKET_IFNAME``).

gloo binds the interface its host name resolves to unless GLOO_SOCKET_IFNAME names
one; on a node with an Ethernet and an InfiniBand/RoCE port that is often the wrong
one, and every gloo group of a run (an NCCL run's control and checkpoint groups too)
then fails to connect. :func:`configure` picks the interface that holds the local
address the kernel routes to the rendezvous host through, as NCCL's own choice
favours the interface that reaches its peers, and never replaces a user's setting.

Split from runtime.py, which calls :func:`configure` before the first group starts.

Example::

    configure(world_size=16, local_rank=0, master_addr="10.1.0.1", master_port=29500)
    os.environ.get("GLOO_SOCKET_IFNAME")   # "ib0" on a host whose ib0 reaches 10.1.0.1
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Mapping, Sequence

from ..log import CONSOLE

log = logging.getLogger(__name__)


def interface_addresses() -> dict[str, tuple[str, ...]]:
    """Every network interface of this host and its addresses (IPv4 and IPv6), read from the kernel.

    IPv4 from the SIOCGIFADDR ioctl (an interface's primary address), IPv6 from
    /proc/net/if_inet6. :func:`init` reads interfaces only through this function.

    Example::

        interface_addresses()   # {"lo": ("127.0.0.1", "::1"), "eth0": ("192.0.2.2", "fd00::2", ...)}
    """
    import fcntl
    import struct

    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in found:
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address (or the interface went away)
                continue
            found[name].append(socket.inet_ntoa(raw[20:24]))
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 6 and fields[5] in found:
                    found[fields[5]].append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:  # no IPv6 on this host
        pass
    return {name: tuple(addrs) for name, addrs in found.items()}


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach ``host`` (None: unresolvable or unroutable).

    A UDP socket's connect() only chooses the route; nothing is sent.

    Example::

        route_source("10.0.0.1", 29500)   # "10.0.0.7", this host's address on the interface towards it
    """
    try:
        infos = socket.getaddrinfo(host, port or 29500, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None


def _outside_interfaces(interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    """The interfaces with an address other than loopback."""
    def outside(addr: str) -> bool:
        ip = _ip(addr)
        return ip is not None and not ip.is_loopback

    return [name for name, addrs in interfaces.items() if any(outside(a) for a in addrs)]


def choose(source: str | None, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface gloo should bind: the one holding ``source`` (the address that reaches the
    rendezvous host), when the host has more than one interface with a non-loopback address.

    None when gloo's own choice is safe (one such interface), or when the rendezvous is
    reached over loopback (one node) or by no interface listed.

    Example::

        choose("10.1.0.5", {"lo": ("127.0.0.1",), "eth0": ("192.0.2.2",), "ib0": ("10.1.0.5",)})  # "ib0"
    """
    candidates = _outside_interfaces(interfaces)
    src = _ip(source) if source is not None else None
    if len(candidates) < 2 or src is None or src.is_loopback:
        return None
    return next((name for name in candidates if any(_ip(a) == src for a in interfaces[name])), None)


_GLOO_INTERFACE_NOTE = ""


def note() -> str:
    """How gloo picked its network interface in this process, for an error about a gloo
    connection ("" before :func:`init`, or when nothing was decided).

    Example::

        raise TrainingFailed(f"checkpoint group failed: {exc}{gloo_interface.note()}")
    """
    return _GLOO_INTERFACE_NOTE


def configure(world_size: int, local_rank: int, master_addr: str, master_port: int) -> None:
    """Set GLOO_SOCKET_IFNAME for this process (never over the user's) when the host has several
    interfaces: the one that reaches the rendezvous host. Every gloo group of the run (also the
    control and checkpoint groups of an NCCL run) reads it when created."""
    global _GLOO_INTERFACE_NOTE
    if world_size < 2:
        return
    mine = os.environ.get("GLOO_SOCKET_IFNAME")
    if mine:
        _GLOO_INTERFACE_NOTE = f"; gloo used GLOO_SOCKET_IFNAME={mine}, as set"
        return
    interfaces = interface_addresses()
    name = choose(route_source(master_addr, master_port), interfaces)
    if name is None:
        others = sorted(_outside_interfaces(interfaces))
        if len(others) > 1:
            _GLOO_INTERFACE_NOTE = (f"; this host has interfaces {', '.join(others)} and none was chosen for gloo: "
                                    "set GLOO_SOCKET_IFNAME to the one that reaches the other nodes")
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    _GLOO_INTERFACE_NOTE = (f"; gloo used interface {name}, chosen as the one that reaches the rendezvous host "
                            f"{master_addr}: set GLOO_SOCKET_IFNAME to override")
    if local_rank == 0:  # once per node
        log.info("slipstream: gloo uses interface %s (it reaches the rendezvous host %s; "
                 "set GLOO_SOCKET_IFNAME to choose another)", name, master_addr, extra=CONSOLE)
