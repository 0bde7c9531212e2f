"""Networks: parse a network SPEC into a :class:`~slipstream.network.link.Link` per node.

The link model itself (alpha-beta times of ring collectives) is the core's,
:mod:`slipstream.network.link`; ``Link`` is re-exported here for the planner.

A network SPEC names the link between nodes::

    [K x] RATE [-FABRIC] [@LATENCY | ,RTT]

    25gbit-roce         one 25 Gbit/s RoCE NIC per node
    100gbit-ib          one 100 Gbit/s InfiniBand NIC per node
    8x400gbit-ib        eight 400 Gbit/s NICs per node (one per GPU, rail-optimised)
    1gbit               plain TCP over Ethernet
    200mbit@2ms         with an explicit one-hop latency
    100mbit,40ms        with a round trip between nodes, as ``--link RATE,RTT`` writes it

``,RTT`` is the round trip between two nodes (what ``ping`` shows; the emulated
cluster's ``--link 100mbit,40ms`` adds it), and a ring step is charged one whole
round trip: on TCP a ring step of gloo was measured to cost one (the probe's hop
latency at ``--link 100mbit,20ms`` was 20.6 ms, at ``100mbit,40ms,0.1%`` 42.1 ms;
BENCHMARKS.md, "Links with round trip and loss"). So ``100mbit,40ms`` is ``100mbit@40ms``;
the form is there so a ``--link`` value can be given as it is (a loss is not modelled).

Fabric defaults (one-hop latency, fraction of the line rate a ring achieves):
``ib`` 2 us / 0.90, ``roce`` 5 us / 0.85, ``tcp`` (default) 30 us / 0.80. A ring
that is right reaches about 0.9 of the link (docs/measuring.md); RoCE
and TCP lose a little more to congestion control and the kernel stack.

Example::

    net = parse_network("25gbit-roce")
    net.link.allreduce_s(100e6, 512)     # 100 MB all-reduced over a 512-rank ring
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..network.link import Link

FABRICS = {
    # name: (one-hop latency s, achieved fraction of line rate)
    "ib": (2e-6, 0.90),
    "roce": (5e-6, 0.85),
    "tcp": (30e-6, 0.80),
    "eth": (30e-6, 0.80),
}

_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SPEC_RE = re.compile(
    r"^(?:(?P<nics>\d+)\s*x\s*)?(?P<rate>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt])(?:bit|b)(?:ps|/s)?"
    r"(?:-(?P<fabric>[a-z]+))?(?:[@,](?P<lat>\d+(?:\.\d+)?)(?P<lat_unit>ns|us|ms|s))?$"
)
_LAT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Network:
    """Inter-node link of a node (all its NICs together) and how many GPUs share it."""

    spec: str
    link: Link  # per node: nics x rate
    nics: int = 1

    @property
    def gbit(self) -> float:
        return self.link.bytes_per_s * 8 / 1e9


def parse_network(spec: str) -> Network:
    """Parse a network SPEC (module docstring); raises ConfigError with the rule on bad input."""
    s = str(spec).strip().lower().replace(" ", "")
    m = _SPEC_RE.match(s)
    if not m:
        raise ConfigError(
            f"--network: expected [Kx]RATE[-FABRIC][@LATENCY|,RTT] such as 25gbit-roce, 100gbit-ib, 8x400gbit-ib, "
            f"1gbit, 200mbit@2ms, 100mbit,40ms (a round trip; no loss part); got {spec!r}"
        )
    fabric = m.group("fabric") or "tcp"
    if fabric not in FABRICS:
        raise ConfigError(f"--network: fabric must be one of {', '.join(FABRICS)}, got {fabric!r} in {spec!r}")
    nics = int(m.group("nics") or 1)
    rate_bit = float(m.group("rate")) * _UNITS[m.group("unit")]
    if rate_bit <= 0 or nics <= 0:
        raise ConfigError(f"--network: the rate must be > 0, got {spec!r}")
    latency, eff = FABRICS[fabric]
    if m.group("lat"):
        latency = float(m.group("lat")) * _LAT[m.group("lat_unit")]
    return Network(spec=spec, link=Link(nics * rate_bit / 8, latency, eff, fabric), nics=nics)


__all__ = ["FABRICS", "Link", "Network", "parse_network"]
