"""The link model: ring collectives' bytes per rank, and the alpha-beta time of a link.

A core module with no dependency (no torch): the planner and ``slipstream plan``
use it without importing torch. One model for the whole project: :func:`slipstream.sync.probe.probe_link`
measures a :class:`Link`, :mod:`slipstream.sync.policy` and the sync engine
charge their collectives to it, and the planner (:mod:`slipstream.plan`) builds
one from a network SPEC or a calibration file.

Bytes one rank sends in a bandwidth-optimal ring (Patarasuk & Yuan 2009), for a
tensor of ``nbytes`` that each rank passes in:

========================  ==========================  =================
collective                bytes per rank              ring steps
========================  ==========================  =================
all-reduce                ``2(n-1)/n * nbytes``       ``2(n-1)``
reduce-scatter            ``(n-1)/n * nbytes``        ``n-1``
all-gather (of a shard)   ``(n-1) * nbytes``          ``n-1``
========================  ==========================  =================

The alpha-beta time of a collective is ``steps * hop_latency_s + bytes per
rank / (efficiency * bytes_per_s)``.

Example::

    allreduce_bytes(100e6, 4)                   # 150e6: each rank sends 1.5x the buffer
    link = Link(bytes_per_s=12.5e9, hop_latency_s=2e-6, efficiency=0.9, fabric="ib")
    link.allreduce_s(100e6, 512)                # 100 MB all-reduced over a 512-rank ring
    probed = Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=125e6)
    probed.seconds(4 << 20)                     # one all-reduce moving 4 MiB per rank, on its 2 ranks
"""

from __future__ import annotations

from dataclasses import dataclass


def allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` buffer over ``n`` ranks: ``2(n-1)/n * nbytes``.

    >>> allreduce_bytes(1000, 2), allreduce_bytes(1000, 4), allreduce_bytes(1000, 1)
    (1000.0, 1500.0, 0.0)
    """
    return 2 * (n - 1) / n * nbytes


def reduce_scatter_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of an ``nbytes`` buffer (each rank keeps 1/n): ``(n-1)/n * nbytes``.

    >>> reduce_scatter_bytes(1000, 4)
    750.0
    """
    return (n - 1) / n * nbytes


def all_gather_bytes(shard_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather of ``shard_bytes`` from every rank: ``(n-1) * shard_bytes``.

    The same as :func:`reduce_scatter_bytes` of the gathered buffer (``n * shard_bytes``).

    >>> all_gather_bytes(250, 4)
    750
    """
    return (n - 1) * shard_bytes


def allreduce_steps(n: int) -> int:
    """Ring steps (latencies paid one after the other) of an all-reduce over ``n`` ranks: ``2(n-1)``.

    >>> allreduce_steps(4)
    6
    """
    return 2 * (n - 1)


@dataclass(frozen=True)
class Link:
    """A link under the alpha-beta model: line rate, one-hop latency, achieved fraction.

    Ring all-reduce of S bytes over n ranks::

        t = 2(n-1) * hop_latency_s + 2(n-1)/n * S / (efficiency * bytes_per_s)

    ``ranks`` and ``samples`` describe a *measured* link (:meth:`measured`,
    :func:`slipstream.sync.probe.probe_link`): the group it was timed on, which
    :meth:`seconds`, :attr:`alpha_s` and :meth:`summary` refer to, and the
    (payload bytes, median seconds) points of the fit. A link from a network
    SPEC has ``ranks=0``: it fits any group, through the ``n`` of each method.
    """

    bytes_per_s: float
    hop_latency_s: float = 0.0
    efficiency: float = 1.0
    fabric: str = "tcp"
    ranks: int = 0
    samples: tuple[tuple[int, float], ...] = ()

    @classmethod
    def measured(cls, ranks: int, alpha_s: float, bytes_per_s: float, samples=(), fabric: str = "probed") -> "Link":
        """The link a probe fitted on ``ranks`` ranks: one all-reduce costs ``alpha_s + wire bytes / bytes_per_s``.

        ``bytes_per_s`` is already the achieved rate (efficiency 1); ``alpha_s`` is
        spread over the ring's ``2(ranks-1)`` steps, so :meth:`allreduce_s` on
        ``ranks`` ranks gives back ``alpha_s`` for an empty payload.

        Example::

            Link.measured(2, 1e-4, 125e6).allreduce_s(0, 2)   # 1e-4
        """
        hop = alpha_s / allreduce_steps(ranks) if ranks > 1 else 0.0
        return cls(bytes_per_s, hop, 1.0, fabric, int(ranks), tuple((s, t) for s, t in samples))

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bytes_per_s * self.efficiency

    @property
    def alpha_s(self) -> float:
        """Latency of one all-reduce on the link's own group of :attr:`ranks` ranks."""
        return allreduce_steps(self.ranks) * self.hop_latency_s if self.ranks > 1 else 0.0

    def transfer_s(self, nbytes: float, hops: int = 1) -> float:
        """Point-to-point: ``hops`` latencies plus ``nbytes`` at the achieved rate."""
        return hops * self.hop_latency_s + nbytes / self.effective_bytes_per_s

    def allreduce_s(self, nbytes: float, n: int) -> float:
        """Ring all-reduce of an ``nbytes`` buffer over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return allreduce_steps(n) * self.hop_latency_s + allreduce_bytes(nbytes, n) / self.effective_bytes_per_s

    def reduce_scatter_s(self, nbytes: float, n: int) -> float:
        """Ring reduce-scatter of an S-byte buffer (each rank ends with S/n); all-gather is the same."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.hop_latency_s + reduce_scatter_bytes(nbytes, n) / self.effective_bytes_per_s

    all_gather_s = reduce_scatter_s  # nbytes: the gathered buffer, n * each rank's shard

    def wire_s(self, wire_bytes: float, steps: int) -> float:
        """Time for a collective that sends ``wire_bytes`` per rank in ``steps`` ring steps."""
        return steps * self.hop_latency_s + wire_bytes / self.effective_bytes_per_s

    def seconds(self, payload_bytes: float, collectives: int = 1) -> float:
        """Time for ``collectives`` all-reduces on the link's own group moving ``payload_bytes`` per rank in all.

        ``payload_bytes`` are wire bytes (a codec's ``wire_bytes``), not buffer bytes.
        Needs a measured link (``ranks`` set); a one-rank group costs nothing.
        """
        if self.ranks == 0:
            raise ValueError("Link.seconds needs the group the link was measured on (ranks); "
                             "use allreduce_s(nbytes, n) or wire_s(wire_bytes, steps)")
        if self.ranks <= 1:
            return 0.0
        return collectives * self.alpha_s + payload_bytes / self.effective_bytes_per_s

    def describe(self) -> str:
        return (f"{self.bytes_per_s * 8 / 1e9:g} Gbit/s {self.fabric} (x{self.efficiency:.2f} achieved), "
                f"{self.hop_latency_s * 1e6:g} us/hop")

    def summary(self) -> str:
        """One line for logs: the measured group, its all-reduce latency and bandwidth."""
        if self.ranks == 0:
            return self.describe()
        if self.ranks <= 1:
            return "single rank"
        return (f"{self.ranks} ranks, latency {self.alpha_s * 1e3:.2f} ms, "
                f"{self.effective_bytes_per_s * 8 / 1e9:.3f} Gbit/s")


__all__ = ["Link", "all_gather_bytes", "allreduce_bytes", "allreduce_steps", "reduce_scatter_bytes"]
