"""``auto`` says what it chose, per group of buckets, in one console line at decision time
(issue #46 item 5), and ``stats()`` carries the same line for the report.

One process, no process group: the control wire of one rank agrees with itself, and the
observed step is given by hand (its ready times resolved already), on a slow fake link.
"""

from __future__ import annotations

import logging
import re

import torch

from slipstream.network.link import Link
from slipstream.process.timing import HostClock
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import AutoPolicy, codec_label, decision_line
from slipstream.sync.codec_costs import CodecTiming
from slipstream.sync.compress import make_codec
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.options import SyncOptions
from slipstream.sync.policy import BucketInfo, decide

SLOW = Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=12.5e6)  # 100 Mbit/s
# Three 256x256 matrices (PowerSGD's ground) and one small bias bucket, in backward order.
SHAPES = {0: (256, 256), 1: (256, 256), 2: (256, 256), 3: (64,)}


def _observed_step() -> StepRecord:
    step = StepRecord(t_backward_start=(0.0, None))
    for i, shape in SHAPES.items():
        step.numel[i] = int(torch.Size(shape).numel())
        step.itemsize[i], step.keys[i] = 4, i
        step.ready_s[i] = 0.001 * (i + 1)
    step.span_s, step.resolved = 0.5, True
    return step


def _fixed_costs(self, order, step, clock, device, layouts, part, parts, wire_model):
    """Each codec's compute on a bucket: 0.1 ms, not timed (on 2 loaded cores one bf16 cast of
    these buckets was measured at 0.03 ms and at 48 ms, which flips the decision)."""
    return {(i, n): 0.0 if n == "allreduce" else 1e-4 for i in order for n in self.candidates}, {}, {}


def test_auto_prints_its_choice_per_bucket_group_once_on_the_console(caplog, monkeypatch):
    monkeypatch.setattr(CodecTiming, "time_slice", _fixed_costs)
    options = SyncOptions.parse("auto", {"rank": 1, "verify_steps": 0})
    auto = AutoPolicy(options, ControlWire(None), world_size=2, link=SLOW, prober=lambda: SLOW)
    codecs = {n: make_codec(n, **options.codec_kwargs(n)) for n in options.auto_candidates}
    layouts = {i: layout_from_shapes([torch.Size(s)]) for i, s in SHAPES.items()}
    with caplog.at_level(logging.INFO, logger="slipstream.sync"):
        assert not auto.observe(_observed_step(), 1, HostClock(), torch.device("cpu"), layouts, codecs)  # DDP's first
        assert auto.observe(_observed_step(), 2, HostClock(), torch.device("cpu"), layouts, codecs)
    console = [r.getMessage() for r in caplog.records if getattr(r, "slipstream_console", False)]
    assert len(console) == 1, console  # one line, shown without any logging configuration
    line = console[0]
    assert line == auto.decision_line == auto.figures()["sync_decision_line"]
    # Each codec chosen, with its rank, its bucket count and their bytes; the predicted step
    # against all-reduce's; the measured link; why.
    for codec in set(auto.choices.values()):
        count = sum(1 for c in auto.choices.values() if c == codec)
        assert re.search(rf"{codec_label(codec, codecs[codec])} for {count}( buckets?)? \(\d+\.\d [kM]B\)", line), line
    assert "powersgd rank 1" in line, line  # 100 Mbit/s: the matrices are worth compressing
    assert re.search(r"predicted [\d.]+ ms per backward\+sync against [\d.]+ ms with all-reduce", line), line
    assert "on the measured link (2 ranks, latency 0.10 ms, 0.100 Gbit/s)" in line, line
    assert line.endswith(auto.decision.reason) or "left out" in line, line


def test_the_line_groups_buckets_by_codec_largest_first():
    buckets = [BucketInfo(0, 3_000_000, 0.010, layout_from_shapes([torch.Size((1000, 3000))])),
               BucketInfo(1, 50_000, 0.011, None)]
    codecs = {n: make_codec(n, **({"rank": 1} if n == "powersgd" else {})) for n in ("allreduce", "powersgd")}
    costs = {(b.index, n): 0.0 for b in buckets for n in codecs}
    d = decide(buckets, Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=125e6), 2, costs, codecs)
    assert d.choices == {0: "powersgd", 1: "allreduce"}, d.explain()
    line = decision_line(d, codecs, {0: 4, 1: 4})
    assert line.startswith("sync auto: powersgd rank 1 for 1 bucket (12.0 MB), allreduce for 1 (0.2 MB): predicted "), line
    assert decision_line(d, codecs, {0: 4, 1: 4}, level="hierarchical").startswith(
        "sync auto: powersgd rank 1 for 1 bucket (12.0 MB), allreduce for 1 (0.2 MB) on the hierarchical level: "), line
