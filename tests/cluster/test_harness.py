"""Smoke test of the benchmark harness and `slipstream bench` (root: emulated cluster).

Checks the harness itself, not timings: every requested system and repeat is
in the results, the JSON is well-formed and self-consistent, the table and
plots are written, byte counters agree with what an all-reduce must send, and
no namespace is left behind.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.launch.emulate import list_namespaces
from tests.conftest import require_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def prefix(monkeypatch):
    p = f"ssh{secrets.token_hex(2)}-"
    monkeypatch.setenv("SLIPSTREAM_EMULATE_NS_PREFIX", p)
    return p


@pytest.mark.root
def test_benchmark_suite_smoke(tmp_path, prefix):
    require_root()
    out = tmp_path / "results"
    systems = "floor,ddp,ddp_bf16,ddp_powersgd,slipstream:bf16"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--topologies", "2x1", "--links", "5gbit", "--bucket-sweep", "25",
         "--systems", systems, "--repeats", "2", "--steps", "4", "--collectives", "2x1@1gbit:16K",
         "--codec-cost-repeats", "2", "--no-markdown", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert list_namespaces(prefix) == []
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["repeats"] == 2 and results["meta"]["steps"] == 4
    assert "error" not in results["codec_cost"]["mlp"], results["codec_cost"]  # the machine limit's figures

    (coll,) = results["collectives"]
    assert "error" not in coll, coll
    assert coll["world_size"] == 2 and coll["topology"] == "2x1"
    ops = {(row["op"], row["mode"]) for row in coll["rows"]}
    assert ops == {("all_reduce", "flat"), ("reduce_scatter", "flat"), ("all_gather", "flat")}
    for row in coll["rows"]:
        assert row["time_s"] > 0 and row["busbw_Bps"] > 0
        factor = 1.0 if row["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n for n = 2
        assert row["busbw_Bps"] == pytest.approx(row["algbw_Bps"] * factor)
        assert row["node_tx_bytes_per_call"] is not None

    (train,) = results["train"]
    assert train["errors"] == {}
    assert (train["workload"], train["topology"], train["link"], train["world_size"]) == ("mlp", "2x1", "5gbit", 2)
    runs = train["runs"]
    assert sorted((x["system"], x["repeat"]) for x in runs) == sorted(
        (s, rep) for s in systems.split(",") for rep in range(2))
    grad = train["grad_bytes"]
    for run in runs:
        assert len(run["losses"]) == 4 and len(run["step_times_s"]) == 4
        assert all(v == v and v > 0 for v in run["losses"])  # finite, positive
        wire = run["wire_bytes_per_step_per_node"]
        assert set(wire) == {"0", "1"}
        if run["system"] == "floor":
            assert all(v < 0.01 * grad for v in wire.values())  # no gradient traffic at all
        if run["system"] == "ddp":
            # two ranks: each sends 2(n-1)/n * S = S per all-reduce, plus headers
            assert all(0.95 * grad <= v <= 1.3 * grad for v in wire.values()), (wire, grad)
        if run["system"] in ("ddp_bf16", "slipstream:bf16"):
            assert all(0.45 * grad <= v <= 0.7 * grad for v in wire.values()), (run["system"], wire, grad)
        if run["system"] == "ddp_powersgd":
            assert all(v < 0.2 * grad for v in wire.values())
    # equal data and weights: the first step's loss is the same for every system
    assert len({round(x["losses"][0], 4) for x in runs}) == 1

    summary = json.loads((out / "summary.json").read_text())
    rows = {row["system"]: row for row in summary["train"][0]["rows"]}
    assert set(rows) == set(systems.split(","))
    assert rows["ddp"]["x_ddp"] == pytest.approx(1.0) and rows["floor"]["x_floor"] == pytest.approx(1.0)
    md = (out / "summary.md").read_text()
    assert "| ddp_powersgd |" in md and "Collectives: 2x1 @ 1gbit" in md
    for png in ("step_time_mlp_2x1.png", "loss_time_mlp_2x1.png", "collectives_2x1_1gbit.png"):
        assert (out / png).stat().st_size > 1000


@pytest.mark.distributed
def test_slipstream_bench_side_by_side(tmp_path, prefix):
    # Local (-n 2): `--emulate` only passes through to `slipstream run`, tested in test_emulate.py.
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "slipstream", "bench", str(Path(__file__).with_name("scripts_tiny_train.py")),
         "--sync", "allreduce,bf16", "-n", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(l.startswith("allreduce ") and "ok" in l for l in lines), r.stdout
    assert any(l.startswith("bf16 ") and "ok" in l for l in lines), r.stdout
    doc = json.loads(out.read_text())
    assert doc["shape"] == "1 node x 2 process(es)"
    for res in doc["results"]:
        assert res["ok"] and len(res["wall_s"]) == 1 and res["wall_s"][0] > 0
        assert res["samples_per_s"] and res["samples_per_s"][0] > 0, res  # parsed from the JSONL metrics
        assert res["final_loss"] and res["final_loss"][0] > 0
    assert list_namespaces(prefix) == []


def test_an_unknown_system_is_refused_before_anything_runs(tmp_path):
    # A typo must not cost a job start (and a retry per system) on an emulated cluster.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--topologies", "1x2", "--systems",
                           "ddp,ddp_hook_allreduce,slipstream:nope", "--out", str(tmp_path / "r"), "--no-markdown"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unknown system(s) slipstream:nope" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()
