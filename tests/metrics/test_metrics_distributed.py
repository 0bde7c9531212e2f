"""Two gloo ranks through accelerate(): phases, exposed communication, straggler, sinks, no extra syncs."""

from __future__ import annotations

import json
import os

import pytest
from tests.metrics.metrics_workers import LOG_EVERY, SLEEP_S, STEPS

pytestmark = pytest.mark.distributed

PHASE_FIELDS = ("data_wait_s", "forward_s", "backward_s", "comm_exposed_s", "optimizer_s", "checkpoint_s", "other_s", "busy_s")


def test_every_log_record_has_the_step_breakdown(two_rank_run):
    for rank, res in enumerate(two_rank_run["results"]):
        recs = res["control"]["records"]
        assert [r["step"] for r in recs] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        for r in recs:
            for key in PHASE_FIELDS:
                assert r[key] >= 0.0, (rank, key, r)
            assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
            # The phases never add up to more than the measured step time.
            covered = sum(r[k] for k in PHASE_FIELDS if k not in ("other_s", "busy_s"))
            assert covered <= r["step_time_s"] * 1.001 + 1e-6
            assert r["mem_rss_bytes"] > 10 * 2**20
            assert r["sync_bytes_sent"] > 0 and r["sync_compression_ratio"] == 1.0
            assert r["loss"] > 0 and r["lr"] == 0.05 and r["grad_norm"] > 0
            assert r["samples"] == 16 * LOG_EVERY and r["tokens"] == 0


@pytest.mark.parametrize("which", ["control", "straggler"])  # with clipping / without (norm on log steps)
def test_no_host_readback_between_log_steps(two_rank_run, which):
    for res in two_rank_run["results"]:
        per_step = res[which]["items_per_step"]
        for step, n in enumerate(per_step, start=1):
            if step % LOG_EVERY:
                assert n == 0, f"step {step} read {n} tensor(s) back to the host"
        assert any(per_step[LOG_EVERY - 1 :: LOG_EVERY]), "log steps read the loss back"


def test_grad_norm_without_clipping_matches_the_reduced_gradients(two_rank_run):
    r0, r1 = (res["straggler"]["records"] for res in two_rank_run["results"])
    for a, b in zip(r0, r1):
        # Computed after the all-reduce: every rank sees the same gradients, so the same norm.
        assert a["grad_norm"] > 0 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_slow_rank_is_named_and_fast_rank_waits_in_communication(two_rank_run):
    r0, r1 = (res["straggler"]["records"] for res in two_rank_run["results"])
    last0 = r0[-1]
    assert last0["straggler_rank"] == 1, last0
    assert r1[-1]["straggler_rank"] == 1  # every rank knows
    # Named "by how much": the excess is the injected sleep, give or take the noise of a shared machine.
    assert SLEEP_S * 0.7 <= last0["straggler_excess_s"] <= SLEEP_S * 4, last0
    assert last0["straggler_slowdown"] > 0.3
    assert "rank 1" in last0["straggler_message"] and "slower" in last0["straggler_message"]
    assert last0["slowest_rank"] == 1 and len(last0["busy_s_ranks"]) == 2
    # The slow rank's extra time shows up in its forward; the fast rank spends it waiting for gradients.
    steady0, steady1 = r0[2:], r1[2:]
    fwd0 = sum(r["forward_s"] for r in steady0) / len(steady0)
    fwd1 = sum(r["forward_s"] for r in steady1) / len(steady1)
    comm0 = sum(r["comm_exposed_s"] for r in steady0) / len(steady0)
    comm1 = sum(r["comm_exposed_s"] for r in steady1) / len(steady1)
    assert fwd1 - fwd0 >= SLEEP_S * 0.8, (fwd0, fwd1)
    assert comm0 - comm1 >= SLEEP_S * 0.5, (comm0, comm1)
    # All-reduce evens out the step time: it does not tell the ranks apart.
    st0 = sum(r["step_time_s"] for r in steady0) / len(steady0)
    st1 = sum(r["step_time_s"] for r in steady1) / len(steady1)
    assert abs(st0 - st1) < SLEEP_S * 0.5


def test_no_straggler_named_without_one(two_rank_run):
    for res in two_rank_run["results"]:
        last = res["control"]["records"][-1]
        # A shared 2-core machine is noisy; what must not happen is a verdict
        # anywhere near the injected one (hundreds of percent).
        assert last["straggler_rank"] is None or last["straggler_slowdown"] < 0.5, last


def test_prometheus_endpoint_scraped_over_loopback(two_rank_run):
    from prometheus_client.parser import text_string_to_metric_families

    for rank, res in enumerate(two_rank_run["results"]):
        text = res["control"]["scraped"]
        assert text is not None
        with open(res["control"]["url"]) as f:
            assert f.read().startswith("http://127.0.0.1:")
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        lab = (("rank", str(rank)),)
        assert samples[("slipstream_steps_total", lab)] == STEPS
        assert samples[("slipstream_samples_total", lab)] == 16 * STEPS
        assert samples[("slipstream_comm_sent_bytes_total", lab)] > 0
        assert samples[("slipstream_step_duration_seconds", lab)] > 0
        assert samples[("slipstream_step_phase_seconds", (("phase", "forward"), ("rank", str(rank))))] > 0
        assert samples[("slipstream_memory_rss_bytes", lab)] > 0
        assert ("slipstream_straggler_rank", lab) in samples


def test_tensorboard_event_files_hold_the_scalars(two_rank_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = os.path.join(two_rank_run["base"], "control", "tensorboard", "rank0")
    acc = EventAccumulator(run_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "time/forward_s", "time/comm_exposed_s", "comm/sync_bytes_sent"} <= tags
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))


def test_timeline_is_a_chrome_trace_with_compute_and_comm_per_rank(two_rank_run):
    from slipstream.metrics.timeline import merge

    run_dir = os.path.join(two_rank_run["base"], "straggler")
    out = merge(run_dir)
    with open(out) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    for pid in (0, 1):
        names = {e["name"] for e in events if e["pid"] == pid}
        assert {"forward", "backward", "optimizer", "comm_exposed", "grad_sync"} <= names
        assert all(e["dur"] >= 0 and e["ts"] > 1e15 for e in events if e["pid"] == pid)  # wall-clock microseconds
        assert {e["tid"] for e in events if e["pid"] == pid and e["cat"] == "comm"} == {2}
    fwd1 = [e["dur"] for e in events if e["pid"] == 1 and e["name"] == "forward"]
    assert min(fwd1) >= SLEEP_S * 1e6 * 0.9  # the injected sleep is visible in rank 1's spans
    # Forward of step k on rank 1 comes before its backward.
    f = next(e for e in events if e["pid"] == 1 and e["name"] == "forward" and e["args"]["step"] == 3)
    b = next(e for e in events if e["pid"] == 1 and e["name"] == "backward" and e["args"]["step"] == 3)
    assert f["ts"] + f["dur"] <= b["ts"] + 1
