"""The ``--link`` value of an emulated cluster: ``RATE[,RTT][,LOSS]``, parsed and formatted (pure, no root).

RATE is shaped by tbf (:func:`tbf_args`); a round trip (RTT) or a loss needs the
userspace forwarder (:mod:`.forwarder`), which :class:`LinkSpec.needs_forwarder` says.
:mod:`.emulate` re-exports every name here.

Example::

    spec = parse_link("100mbit,40ms,0.1%")
    spec.bits_per_s, spec.rtt_s, spec.loss     # (100_000_000, 0.04, 0.001)
    str(spec)                                  # "100mbit,40ms,0.1%"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
_UNSHAPED = ("unshaped", "none", "off", "inf", "unlimited", "0")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}



def parse_rate(text: str | None) -> int | None:
    """A link rate in bits per second, or None for an unshaped link.

    Accepts tc-style (``1gbit``, ``200mbit``, ``5gbit``), short (``1g``,
    ``200m``) and ``unshaped``. Bytes per second are not accepted: ``mbps`` is
    read as megabits, the way network people write it.

    Example::

        parse_rate("200mbit")    # 200_000_000
        parse_rate("unshaped")   # None
    """
    if text is None or text.strip().lower() in _UNSHAPED:
        return None
    match = _RATE_RE.match(text)
    if not match:
        raise UsageError(f"--link must be a rate such as 1gbit, 200mbit or unshaped, optionally followed by "
                         f",RTT and ,LOSS ({LINK_SYNTAX}), got {text!r}")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if bits < 10_000:
        raise UsageError(f"--link rate must be at least 10kbit, got {text!r}")
    if bits > 400e9:
        raise UsageError(f"--link rate above 400gbit is not shaped meaningfully by tbf, got {text!r}")
    return int(bits)


_DELAY_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.IGNORECASE)
_LOSS_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*%\s*$")
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
MAX_RTT_S = 2.0
"""The largest round trip ``--link`` adds: beyond it every TCP timer, not the link, decides."""
LINK_SYNTAX = "RATE[,RTT][,LOSS], e.g. 100mbit,40ms,0.1%"


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link: rate per node each way, round trip added between two nodes, loss.

    ``rtt_s`` is the **round trip** added between any two nodes (half of it in
    each direction), what ``ping`` between them would show on top of the
    microseconds they have without it. ``loss`` is the probability that one
    packet is dropped, drawn for every packet in each direction. A link with
    neither is shaped by tbf alone (the bridge); with either, a userspace
    forwarder (:mod:`.forwarder`) carries the packets between nodes.

    Example::

        parse_link("100mbit,40ms,0.1%")   # LinkSpec(bits_per_s=100_000_000, rtt_s=0.04, loss=0.001)
    """

    bits_per_s: int | None
    rtt_s: float = 0.0
    loss: float = 0.0

    @property
    def needs_forwarder(self) -> bool:
        return self.rtt_s > 0 or self.loss > 0

    def __str__(self) -> str:
        return format_link(self)

    def describe(self) -> str:
        """For the log: ``"100mbit each way per node, 40 ms round trip, 0.1% loss per packet each way"``."""
        parts = [f"{format_rate(self.bits_per_s)} each way per node"]
        if self.rtt_s:
            parts.append(f"{self.rtt_s * 1e3:g} ms round trip between nodes")
        if self.loss:
            parts.append(f"{self.loss * 100:g}% loss per packet each way")
        return ", ".join(parts)


def parse_link(text: str | None) -> LinkSpec:
    """``--link RATE[,RTT][,LOSS]``: a :class:`LinkSpec`.

    RATE as :func:`parse_rate`; RTT (``40ms``, ``0.5s``, ``800us``) is the round
    trip added between two nodes, half each way, at most 2 s; LOSS (``0.1%``) the
    chance that a packet is lost, each way, below 100%. The parts after RATE are
    told apart by their units, so ``100mbit,1%`` is a loss without added delay.

    Example::

        parse_link("1gbit")              # LinkSpec(1_000_000_000, 0.0, 0.0): tbf only, as before
        parse_link("unshaped,20ms")      # LinkSpec(None, 0.02, 0.0)
    """
    if text is None:
        return LinkSpec(None)
    parts = text.split(",")
    bits = parse_rate(parts[0])
    rtt: float | None = None
    loss: float | None = None
    if len(parts) > 3:
        raise UsageError(f"--link must be {LINK_SYNTAX} (at most three parts), got {text!r}")
    for part in parts[1:]:
        if part.strip().endswith("%"):
            match = _LOSS_RE.match(part)
            value = float(match.group(1)) if match else None
            if loss is not None or value is None or not 0 <= value < 100:
                raise UsageError(
                    f"--link loss must be a percentage of packets lost each way, at least 0% and below 100% "
                    f"(e.g. 0.1%), once, in {LINK_SYNTAX}; got {part.strip()!r} in {text!r}")
            loss = value / 100
            continue
        match = _DELAY_RE.match(part)
        value = float(match.group(1)) * _DELAY_UNITS[match.group(2).lower()] if match else None
        if rtt is not None or value is None or not 0 <= value <= MAX_RTT_S:
            raise UsageError(
                f"--link delay is the round trip added between two nodes (half each way), from 0 to 2s "
                f"with a unit (us, ms, s), once, in {LINK_SYNTAX}; got {part.strip()!r} in {text!r}")
        rtt = round(value, 6)
    return LinkSpec(bits, rtt or 0.0, loss or 0.0)


def split_link_list(text: str) -> list[str]:
    """A comma list of ``--link`` values, where one value may hold commas itself.

    A part that starts with a round trip or a loss belongs to the value before it.

    Example::

        split_link_list("unshaped,1gbit,100mbit,40ms,0.1%")   # ["unshaped", "1gbit", "100mbit,40ms,0.1%"]
        split_link_list("2x2@1gbit,4ms:64M,2x1@200mbit")       # ["2x2@1gbit,4ms:64M", "2x1@200mbit"]
    """
    values: list[str] = []
    for part in text.split(","):
        head = part.split(":", 1)[0]
        if values and (_DELAY_RE.match(head) or _LOSS_RE.match(head)):
            values[-1] += "," + part
        elif part:
            values.append(part)
    return values


def format_link(spec: LinkSpec) -> str:
    """The ``--link`` text of a :class:`LinkSpec`; :func:`parse_link` reads it back.

    Example::

        format_link(LinkSpec(100_000_000, 0.04, 0.001))   # "100mbit,40ms,0.1%"
    """
    text = format_rate(spec.bits_per_s)
    if spec.rtt_s:
        text += f",{spec.rtt_s * 1e3:g}ms"
    if spec.loss:
        text += f",{spec.loss * 100:g}%"
    return text


def format_rate(bits_per_s: int | None) -> str:
    """``1_000_000_000`` -> ``"1gbit"``; None -> ``"unshaped"``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s >= scale and bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


def tbf_args(bits_per_s: int) -> list[str]:
    """``tc qdisc ... tbf`` parameters for a rate.

    burst: 4 ms of traffic at the rate, at least 128 KiB, so that one 64 KiB GSO
    segment always fits (a tbf burst smaller than a packet drops it).
    latency: 100 ms of queue before tbf drops, generous on purpose: a dropped
    packet costs TCP a retransmit timeout and would measure the loss-recovery of
    TCP rather than the bandwidth.

    Example::

        tbf_args(1_000_000_000)   # ['rate', '1000000000bit', 'burst', '500000', 'latency', '100ms']
    """
    burst_bytes = max(128 * 1024, int(bits_per_s / 8 * 0.004))
    return ["rate", f"{bits_per_s}bit", "burst", str(burst_bytes), "latency", "100ms"]


__all__ = ["LINK_SYNTAX", "MAX_RTT_S", "LinkSpec", "format_link", "format_rate", "parse_link", "parse_rate",
           "split_link_list", "tbf_args"]
