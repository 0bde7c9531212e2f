"""The benchmark tables' machine limit: the pure formula, the report on old and new results, one real measurement."""

from __future__ import annotations

import json

import pytest

from benchmarks import report
from slipstream.network.link import allreduce_bytes


def _figures() -> dict:
    """Floor 100 ms, backward 60 ms; at 1 Gbit/s 1 MB of wire takes 8 ms."""

    def codec(compute_ms, wire_bytes, collectives=1):
        return {"compute_ms": compute_ms, "collectives_per_step": collectives,
                "wire_bytes_per_step": {"2": wire_bytes}}

    return {
        "workload": "toy", "floor_step_ms": 100.0, "backward_ms": 60.0,
        "codecs": {
            "allreduce": codec(0.0, 125e6),  # 1000 ms at 1 Gbit/s
            "bf16": codec(5.0, 62.5e6),  # 500 ms
            "powersgd": codec(20.0, 1e6, collectives=2),  # 8 ms
            "sign": codec(50.0, 0.5e6),  # 4 ms
        },
    }


def test_limit_takes_the_cheapest_codec_whose_wire_time_hides_under_backward():
    lim = report.machine_limit(_figures(), 2, 1.0)
    # powersgd (8 ms) and sign (4 ms) hide under 60 ms of backward; powersgd computes less
    assert lim["codec"] == "powersgd" and lim["hidden"]
    assert lim["limit_ms"] == pytest.approx(120.0) and lim["wire_ms"] == pytest.approx(8.0)


def test_limit_when_no_codec_hides_adds_the_least_unhidden_wire_time():
    lim = report.machine_limit(_figures(), 2, 0.01)  # 10 Mbit/s: 1 MB takes 800 ms
    # powersgd: 20 + (800 - 60) = 760; sign: 50 + (400 - 60) = 390; the 16/32-bit ones far worse
    assert lim["codec"] == "sign" and not lim["hidden"]
    assert lim["limit_ms"] == pytest.approx(100.0 + 390.0)


def test_limit_on_an_unshaped_link_is_the_floor_plus_the_cheapest_compute():
    lim = report.machine_limit(_figures(), 2, float("inf"))
    assert lim["codec"] == "allreduce" and lim["limit_ms"] == pytest.approx(100.0)
    assert report.machine_limit(_figures(), 2, report.link_gbit("unshaped"))["limit_ms"] == pytest.approx(100.0)


def test_limit_charges_per_message_latency_and_scales_to_the_cells_floor():
    # 30 ms per message: powersgd's two collectives take 68 ms > 60, sign's one 34 ms hides
    lim = report.machine_limit(_figures(), 2, 1.0, latency_s=0.030)
    assert lim["codec"] == "sign" and lim["limit_ms"] == pytest.approx(150.0)
    # the cell's floor runs at twice the one-process time: backward and compute scale with it
    lim = report.machine_limit(_figures(), 2, 1.0, floor_ms=200.0)
    assert lim["codec"] == "powersgd" and lim["limit_ms"] == pytest.approx(240.0)
    assert lim["backward_ms"] == pytest.approx(120.0) and lim["wire_ms"] == pytest.approx(8.0)
    assert report.machine_limit(_figures(), 4, 1.0) is None  # no figures for that world size


def _run(system, step_s, losses):
    return {
        "system": system, "repeat": 0, "steps": len(losses), "warmup_steps": 1, "losses": losses,
        "step_times_s": [step_s] * len(losses), "step_times_max_s": [step_s] * len(losses),
        "median_step_s": step_s, "wire_bytes_per_step_per_node": {"0": 1e6, "1": 1e6},
        "loopback_bytes_per_step_per_node": {"0": 0, "1": 0}, "sync_stats": None,
    }


def _results(with_figures: bool) -> dict:
    losses = [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.9, 0.8]
    doc = {
        "kind": "train", "workload": "toy", "topology": "2x1", "link": "1gbit", "world_size": 2,
        "samples_per_step": 128, "params": 1e6, "grad_bytes": 4e6, "errors": {},
        "runs": [_run("floor", 0.1, [2.0] * 8), _run("ddp", 0.4, losses), _run("slipstream:auto", 0.15, losses)],
    }
    out = {"meta": {"repeats": 1, "steps": 8}, "collectives": [], "train": [doc]}
    if with_figures:
        out["codec_cost"] = {"toy": _figures()}
    return out


def test_report_renders_old_results_without_a_limit_and_new_ones_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plots", lambda results, out: [])
    old = report.render(_results(False), tmp_path / "old", update_markdown=False)
    assert "| x limit |" in old and "not measured" in old
    assert "| ddp | 400 | 1.00 | 4.00 | - |" in old
    summary = json.loads((tmp_path / "old" / "summary.json").read_text())
    assert summary["train"][0]["machine_limit"] is None and summary["train"][0]["rows"][1]["x_limit"] is None

    new = report.render(_results(True), tmp_path / "new", update_markdown=False)
    # the cell's floor (100 ms) equals the figures' floor: limit 120 ms (floor + powersgd's 20 ms)
    assert "Machine limit: 120.0 ms = floor 100.0 ms + powersgd 20.0 ms" in new
    assert "| ddp | 400 | 1.00 | 4.00 | 3.33 |" in new
    rows = {r["system"]: r for r in json.loads((tmp_path / "new" / "summary.json").read_text())["train"][0]["rows"]}
    assert rows["slipstream:auto"]["x_limit"] == pytest.approx(1.25)
    assert rows["slipstream:auto"]["limit_ms"] == pytest.approx(120.0)


def test_a_real_measurement_of_the_mlp():
    from benchmarks import codec_cost

    fig = codec_cost.measure("mlp", world_sizes=(2, 4), codecs=("allreduce", "bf16"), repeats=2, warmup=1)
    assert 0 < fig["backward_ms"] < fig["floor_step_ms"]
    ar, bf = fig["codecs"]["allreduce"], fig["codecs"]["bf16"]
    assert ar["compute_ms"] == 0.0 and bf["compute_ms"] > 0 and ar["collectives_per_step"] == 1
    assert ar["wire_bytes_per_step"] == {"2": allreduce_bytes(fig["grad_bytes"], 2),
                                         "4": allreduce_bytes(fig["grad_bytes"], 4)}
    assert bf["wire_bytes_per_step"]["2"] == pytest.approx(ar["wire_bytes_per_step"]["2"] / 2)
    json.dumps(fig)  # stored in the results JSON as is


def test_retained_shares_on_the_resnet_example_fall_below_the_gate(capsys):
    """The figures behind auto's convergence gate, by the gate's own code: on the ResNet
    example's early steps PowerSGD keeps under the bar, the bf16 cast keeps everything."""
    from benchmarks import codec_cost
    from slipstream.sync.options import DEFAULTS

    shares = codec_cost.retained("resnet", (2,), ("allreduce", "bf16", "powersgd"))
    assert set(shares) == {2} and set(shares[2]) == {"bf16", "powersgd"}
    assert shares[2]["powersgd"] < DEFAULTS.min_retained < 0.999 < shares[2]["bf16"], shares
    assert codec_cost.main(["--workload", "resnet", "--retained-steps", "1", "--codecs", "bf16"]) == 0
    assert "step   1: bf16 1.000" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        codec_cost.main(["--retained-steps", "0"])
    assert bad.value.code == 2
