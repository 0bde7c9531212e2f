"""Sinks and the recorder on one process: Prometheus conventions, console, JSONL, MFU, timeline file."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch
from torch import nn

from slipstream.config import TrainConfig
from slipstream.errors import ConfigError
from slipstream.metrics import ConsoleSink, StepRecorder
from slipstream.metrics.timeline import load_events


def _scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams


def test_prometheus_binds_loopback_and_follows_naming_conventions():
    from slipstream.metrics.prometheus import PrometheusSink

    sink = PrometheusSink(rank=3, port=0)
    try:
        assert sink._server.server_address[0] == "127.0.0.1"
        assert sink.url.startswith("http://127.0.0.1:")
        sink.write({"step": 10, "samples": 640, "tokens": 0, "step_time_s": 0.25, "forward_s": 0.1, "loss": 1.5,
                    "sync_bytes_sent_total": 1000.0, "straggler_rank": 1, "straggler_slowdown": 0.4, "lr": 0.1})
        sink.write({"step": 20, "samples": 640, "step_time_s": 0.2, "sync_bytes_sent_total": 2500.0,
                    "straggler_rank": None})
        fams = _scrape(sink.url)
    finally:
        sink.close()
    # Counters are exposed with the _total suffix and count up by deltas.
    assert fams["slipstream_steps"].type == "counter"
    value = {s.name: s.value for s in fams["slipstream_steps"].samples}
    assert value["slipstream_steps_total"] == 20
    assert {s.name: s.value for s in fams["slipstream_comm_sent_bytes"].samples}["slipstream_comm_sent_bytes_total"] == 2500
    assert {s.name: s.value for s in fams["slipstream_samples"].samples}["slipstream_samples_total"] == 1280
    # Base units in names, low-cardinality labels.
    for name, fam in fams.items():
        assert name.startswith("slipstream_"), name
        assert not any(u in name for u in ("_ms", "_milliseconds", "_mb", "_kb")), name
        for s in fam.samples:
            assert set(s.labels) <= {"rank", "phase"}, (name, s.labels)
            assert s.labels["rank"] == "3"
    assert fams["slipstream_step_duration_seconds"].samples[0].value == pytest.approx(0.2)
    assert fams["slipstream_straggler_rank"].samples[0].value == -1  # recovered in the second record
    phase = {s.labels["phase"]: s.value for s in fams["slipstream_step_phase_seconds"].samples}
    assert phase["forward"] == pytest.approx(0.1)


def test_console_names_the_straggler_once(capsys):
    sink = ConsoleSink(total_steps=30, use_progress_bar=False)
    rec = {"step": 10, "loss": 1.0, "step_time_s": 0.1, "comm_exposed_s": 0.03, "straggler_rank": 1,
           "straggler_slowdown": 0.42, "straggler_message": "straggler: rank 1 is 42% slower than the median rank"}
    sink.write(rec)
    sink.write(dict(rec, step=20))
    sink.close()
    out = capsys.readouterr().out
    assert "straggler rank 1 +42%" in out and "comm 30%" in out
    assert out.count("rank 1 is 42% slower") == 1


def test_config_validates_metrics_fields():
    with pytest.raises(ConfigError, match="prometheus_port must be in 0..65535"):
        TrainConfig(prometheus_port=70000)
    with pytest.raises(ConfigError, match="peak_flops must be > 0"):
        TrainConfig(peak_flops=0)
    assert TrainConfig.from_env({"SLIPSTREAM_TIMELINE": "true", "SLIPSTREAM_PROMETHEUS_PORT": "9400"}).metrics.prometheus_port == 9400


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 50)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_recorder_mfu_memory_and_timeline_on_one_process(tmp_path):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = StepRecorder(rank=0, world_size=1, run_dir=str(tmp_path), log_every_steps=4, progress=False)
    rec.attach(model, TrainConfig(peak_flops=1e9, timeline=True))
    n_params = sum(p.numel() for p in model.parameters())
    assert rec.n_params == n_params
    for _ in range(8):
        ids = torch.randint(0, 50, (4, 12))
        rec.add_samples(4)
        rec.add_tokens(ids.numel())
        t = rec.begin("forward"); logits = model(ids); rec.end("forward", t)
        loss = nn.functional.cross_entropy(logits.view(-1, 50), ids.view(-1))
        rec.add_loss(loss)
        t = rec.begin("backward"); loss.backward(); rec.end("backward", t)
        with rec.timed("optimizer"):
            opt.step(); opt.zero_grad()
        with rec.timed("checkpoint"):
            pass
        rec.end_step(lr=0.1)
    rec.close()
    with open(tmp_path / "metrics" / "rank0.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        window_s = r["step_time_s"] * 4
        assert r["model_flops_per_s"] == pytest.approx(6 * n_params * 4 * 48 / window_s, rel=0.05)
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / 1e9)
        assert r["tokens_per_s"] > 0 and r["mem_rss_bytes"] > 0
        assert r["backward_s"] > 0 and r["checkpoint_s"] >= 0
    info = json.loads((tmp_path / "metrics" / "run.json").read_text())
    assert info["n_params"] == n_params and info["peak_flops"] == 1e9
    events = load_events(str(tmp_path / "timeline" / "rank0.json"))
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == set(range(1, 9))
    assert {"forward", "backward", "optimizer", "checkpoint"} <= {e["name"] for e in spans}


def test_profile_off_records_no_phases(tmp_path):
    model = nn.Linear(4, 2)
    rec = StepRecorder(rank=0, world_size=1, run_dir=str(tmp_path), log_every_steps=1, progress=False)
    rec.attach(model, TrainConfig(profile=False))
    assert rec.begin("forward") is None
    rec.add_loss(model(torch.randn(2, 4)).sum())
    record = rec.end_step()
    rec.close()
    assert "forward_s" not in record and record["loss"] is not None


def test_timeline_cut_short_still_loads(tmp_path):
    from slipstream.metrics.profiler import Span
    from slipstream.metrics.timeline import TimelineWriter

    tl = TimelineWriter(str(tmp_path / "rank0.json"), rank=0)
    tl.write_spans([Span("forward", 1.0, 0.5, 1)])
    tl._file.close()  # a crash: no closing bracket
    events = load_events(str(tmp_path / "rank0.json"))
    assert [e["name"] for e in events if e["ph"] == "X"] == ["forward"]
    assert os.path.getsize(tmp_path / "rank0.json") > 0


def test_profiler_phases_win_over_a_component_figure_of_the_same_name(tmp_path):
    model = nn.Linear(4, 2)
    rec = StepRecorder(rank=0, world_size=1, run_dir=None, log_every_steps=2, progress=False, sinks=[])
    rec.attach(model)
    rec.sources.append(lambda: {"data_wait_s": 123.0, "data_wait_s_total": 456.0})
    for _ in range(2):
        rec.add("data_wait_s", 99.0)  # a loader reporting its own wait, summed
        t = rec.begin("forward"); model(torch.randn(2, 4)); rec.end("forward", t)
        record = rec.end_step()
    assert record["data_wait_s"] < 1.0 and record["data_wait_s_total"] == 456.0
    assert record["data_wait_s"] + record["forward_s"] + record["other_s"] == pytest.approx(record["step_time_s"])
    rec.close()


def test_timeline_samples_steps_after_the_first_ones(tmp_path):
    from slipstream.metrics.profiler import Span
    from slipstream.metrics.timeline import TimelineWriter

    tl = TimelineWriter(str(tmp_path / "rank0.json"), rank=0, full_steps=5, sample_every=10)
    tl.write_spans([Span("forward", float(i), 0.1, i) for i in range(1, 41)])
    tl.close()
    steps = [e["args"]["step"] for e in load_events(str(tmp_path / "rank0.json")) if e["ph"] == "X"]
    assert steps == [1, 2, 3, 4, 5, 10, 20, 30, 40]


def _console_lines(capsys, total_steps, records):
    sink = ConsoleSink(total_steps=total_steps, use_progress_bar=False)
    for rec in records:
        sink.write(rec)
    sink.close()
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[slipstream] step")]


def test_console_line_has_step_of_total_eta_from_the_median_and_lr(capsys):
    # The first window (compile, warm-up) is slow: the ETA uses the median of the windows after it.
    recs = [{"step": 10, "loss": 2.0, "step_time_s": 1.0, "lr": 0.05},
            {"step": 20, "loss": 1.5, "step_time_s": 0.1, "lr": 0.05},
            {"step": 30, "loss": 1.2, "step_time_s": 0.3, "lr": 2.5e-4},
            {"step": 40, "loss": 1.1, "step_time_s": 0.1, "lr": 1e-5}]
    lines = _console_lines(capsys, 1000, recs)
    assert lines[0].startswith("[slipstream] step 10/1000 |") and "lr 0.05" in lines[0]
    assert "ETA 16m 30s" in lines[0]  # one window only: its own 1.0 s x 990 steps
    assert "ETA 1m 38s" in lines[1]  # 0.1 s x 980
    assert "ETA 3m 14s" in lines[2] and "lr 0.00025" in lines[2]  # median(0.1, 0.3) = 0.2 s x 970
    assert "ETA 1m 36s" in lines[3] and "lr 1e-05" in lines[3]  # median(0.1, 0.3, 0.1) = 0.1 s x 960


def test_console_line_without_a_known_total_prints_the_step_only(capsys):
    lines = _console_lines(capsys, None, [{"step": 10, "loss": 2.0, "step_time_s": 0.5, "lr": 0.1}])
    assert lines[0].startswith("[slipstream] step 10 |") and "/" not in lines[0].split("|")[0]
    assert "ETA" not in lines[0] and "lr 0.1" in lines[0]
    # The last step: nothing left to wait for.
    lines = _console_lines(capsys, 20, [{"step": 10, "step_time_s": 0.5}, {"step": 20, "step_time_s": 0.5}])
    assert "ETA 5s" in lines[0] and lines[1].startswith("[slipstream] step 20/20") and "ETA" not in lines[1]


def test_eta_text_covers_seconds_to_days():
    from slipstream.metrics.sinks import eta_text

    assert [eta_text(s) for s in (0.4, 59.6, 61, 3599, 3600 * 5 + 61, 86400 * 2 + 3600 * 3)] == [
        "0s", "1m 00s", "1m 01s", "59m 59s", "5h 01m", "2d 03h"]


def test_console_names_no_communication_share_for_one_process(capsys):
    sink = ConsoleSink(total_steps=30, use_progress_bar=False)
    sink.write({"step": 10, "loss": 1.0, "step_time_s": 0.1, "comm_exposed_s": 0.0, "world_size": 1})
    sink.write({"step": 20, "loss": 1.0, "step_time_s": 0.1, "comm_exposed_s": 0.01, "world_size": 2})
    sink.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "step" in line]
    assert "comm" not in lines[0] and "comm 10%" in lines[1], lines
