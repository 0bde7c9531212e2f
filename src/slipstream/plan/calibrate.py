"""Measure the machine at hand, so the cost model predicts for it and not for a datasheet.

Three figures, each measured the way the model uses it:

* ``matmul_flops_per_s``: dense fp32 matmul throughput of this CPU with torch at a
  fixed thread count (1 by default: one core per rank, as on the emulated cluster);
* ``step_phases``: forward / backward / optimizer time of one worker with no
  communication (the physical floor of a data-parallel step, docs/measuring.md),
  from which the model's achievable-MFU factor follows;
* ``codec_compute_s``: the local compute time of a gradient codec on a bucket
  (no communication), like the sync policy measures it;
* the link: :func:`slipstream.sync.probe.probe_link` on a process group
  (alpha-beta fit of all-reduce), converted by :func:`link_from_probe`.

Example::

    flops = matmul_flops_per_s(threads=1)          # e.g. 3.1e10 on one core
    ph = step_phases(model, x, y, threads=1)        # ph.forward_s, ph.backward_s, ph.optimizer_s
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..network.link import Link, allreduce_bytes, allreduce_steps


@dataclass(frozen=True)
class StepPhases:
    forward_s: float
    backward_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _threads(n: int | None):
    import torch

    class _Ctx:
        def __enter__(self):
            self.old = torch.get_num_threads()
            if n is not None:
                torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)

    return _Ctx()


def matmul_flops_per_s(threads: int | None = 1, n: int = 1024, repeats: int = 7) -> float:
    """Median fp32 FLOP/s of an n x n x n matmul (2 n^3 FLOPs) at ``threads`` threads."""
    import torch

    with _threads(threads):
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def step_phases(model: Any, x: Any, y: Any, threads: int | None = 1, steps: int = 10, warmup: int = 3,
                lr: float = 0.01) -> StepPhases:
    """Median forward, backward and SGD-step times of ``model`` on one batch, no communication."""
    import torch
    import torch.nn.functional as F

    with _threads(threads):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        fw, bw, op = [], [], []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= warmup:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
                op.append(t3 - t2)
    return StepPhases(statistics.median(fw), statistics.median(bw), statistics.median(op))


def codec_compute_s(name: str, numel: int, layout: Any = None, threads: int | None = 1, repeats: int = 5,
                    **options: Any) -> float:
    """Local compute time of codec ``name`` reducing ``numel`` values on a one-rank wire.

    The least disturbed of ``repeats`` runs after the first (later runs have warm-start
    state, as in steady state). ``allreduce`` costs nothing here: DDP reduces in place.
    """
    if name == "allreduce":
        return 0.0
    import torch

    from ..sync.compress import Wire, make_codec

    with _threads(threads):
        codec = make_codec(name, **options)
        solo = Wire(None, size=1)
        x = torch.randn(numel)
        times = []
        for _ in range(repeats):
            y = x.clone()
            t0 = time.perf_counter()
            codec.reduce(y, solo, "bucket", layout)
            times.append(time.perf_counter() - t0)
    return min(times[1:]) if len(times) > 1 else times[0]


def link_from_probe(figures: Link, fabric: str = "probed") -> Link:
    """The planner's link (any group size) from a measured one (:func:`slipstream.sync.probe.probe_link`).

    probe_link fits ``t = alpha + 2(n-1)/n * S / bytes_per_s``: the fitted bandwidth is already
    the achieved one, so the link's efficiency is 1; the latency is spread over the ring's
    2(n-1) steps (:meth:`Link.measured`) so that :meth:`Link.allreduce_s` gives back alpha for
    an empty payload. Dropped: the group size and samples, which tie it to the probed group.

    Example::

        link_from_probe(Link.measured(2, 2e-4, 117e6)).allreduce_s(0, 2)   # 2e-4
    """
    return Link(bytes_per_s=float(figures.effective_bytes_per_s), hop_latency_s=float(figures.hop_latency_s),
                efficiency=1.0, fabric=fabric)


def fit_alpha_beta(samples: list[tuple[float, float]], ranks: int, fabric: str = "probed") -> Link:
    """Least-squares fit of ``t = alpha + 2(n-1)/n * S / bw`` over (payload bytes, seconds) pairs.

    More robust than a two-point fit when one size is disturbed (a shaped link's token bucket,
    delayed acknowledgements): every size pulls on the line. A negative intercept is clamped to 0.

    >>> round(fit_alpha_beta([(1e6, 0.011), (2e6, 0.021), (4e6, 0.041)], 2).effective_bytes_per_s / 1e6)
    100
    """
    n = max(2, int(ranks))
    xs = [allreduce_bytes(s, n) for s, _ in samples]
    ys = [t for _, t in samples]
    k = len(xs)
    if k < 2:
        raise ValueError("fit_alpha_beta needs at least two sizes")
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    alpha = max(0.0, my - slope * mx)
    return Link(bytes_per_s=1.0 / slope, hop_latency_s=alpha / allreduce_steps(n), efficiency=1.0, fabric=fabric)


def load_link(path: str, rate: str | None = None) -> Link:
    """A measured link from a JSON file: probe_link's figures (``{"ranks", "alpha_s", "bytes_per_s"}``,
    optionally ``"sweep": [[bytes, seconds], ...]`` for the five-size fit), or a result file of
    benchmarks/plan_validation.py, whose link ``rate`` (e.g. "1gbit") is taken.
    """
    import json

    from ..errors import ConfigError

    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--link-calibration: cannot read {path}: {exc}") from None
    if isinstance(doc, dict) and "rates" in doc:
        rates = doc["rates"]
        if rate not in rates:
            raise ConfigError(f"--link-calibration: {path} has links {', '.join(rates)}; --network names {rate!r}")
        doc = rates[rate]["probe"]
    try:
        if doc.get("sweep"):
            return fit_alpha_beta([tuple(x) for x in doc["sweep"]], int(doc.get("ranks", 2)))
        return link_from_probe(Link.measured(int(doc["ranks"]), float(doc["alpha_s"]), float(doc["bytes_per_s"])))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(f"--link-calibration: {path} has no probe figures (ranks, alpha_s, bytes_per_s)") from None
