"""``slipstream plan`` end to end: table, written config and job spec, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from slipstream.cli import main
from tests.conftest import cannot_run_here


def test_table_and_written_files(tmp_path, capsys):
    cfg, job = tmp_path / "plan.yaml", tmp_path / "job.yaml"
    rc = main(["plan", "--model", "gpt-1.3b", "--gpus", "16", "--gpu-type", "A100", "--network", "100gbit-ib",
               "--tokens", "10B", "--top", "5", "--write-config", str(cfg), "--write-job", str(job)])
    assert rc == 0
    out = capsys.readouterr().out
    for col in ("layout", "step", "time to train", "cost", "mem/GPU", "scaling eff"):
        assert col in out
    assert "slipstream run --nnodes 2 -n 8" in out
    # The written file is a run config: `slipstream run --config` reads it back.
    from slipstream.config import TrainConfig
    from slipstream.launch.run_config import load

    text = cfg.read_text()
    assert "# run: slipstream run --nnodes 2 -n 8" in text and "#   step_s: " in text
    train = TrainConfig(**load(str(cfg)))
    assert train.degrees(16)["dp_replicate"] * train.degrees(16)["dp_shard"] * train.parallel.tp * train.parallel.pp == 16
    assert yaml.safe_load(text)  # the layout is there, not only comments
    from slipstream.job.spec import load_spec

    spec = load_spec(str(job))
    assert spec.replicas == 2 and spec.gpu_count == 8


def test_written_job_passes_slipstream_validate(tmp_path):
    job = tmp_path / "job.yaml"
    assert main(["plan", "--model", "resnet50", "--gpus", "16", "--gpu-type", "V100", "--network", "25gbit-roce",
                 "--write-job", str(job), "--json"]) == 0
    r = subprocess.run([sys.executable, "-m", "slipstream", "validate", str(job)],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit"], "--model"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "Z80", "--network", "1gbit"], "--gpu-type"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "H100", "--network", "fast"], "--network"),
    (["--model", "gpt-7b", "--gpus", "0", "--gpu-type", "H100", "--network", "1gbit"], "--gpus"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit", "--tokens", "lots"], "--tokens"),
    (["--model", "resnet50", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit", "--tokens", "1B"], "--tokens"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and err.startswith("slipstream plan: error:")


def test_probe_memory_without_cuda_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        cannot_run_here("this machine has a GPU: the probe would run")
    assert main(["plan", "--model", "gpt-125m", "--gpus", "1", "--gpu-type", "H100", "--network", "1gbit",
                 "--probe-memory"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_link_calibration_from_probe_figures(tmp_path, capsys):
    import json

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"ranks": 2, "alpha_s": 0.0, "bytes_per_s": 117e6,
                                 "sweep": [[8192, 0.0004], [4 << 20, 0.0362], [16 << 20, 0.1438]]}))
    assert main(["plan", "--model", "mlp", "--gpus", "2", "--gpus-per-node", "1", "--gpu-type", "V100",
                 "--network", "1gbit", "--link-calibration", str(probe), "--global-batch", "128"]) == 0
    assert "measured" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", "--model", "mlp", "--gpus", "2", "--gpu-type", "V100", "--network", "1gbit",
                 "--link-calibration", str(bad)]) == 2
