"""accelerate() refuses bad input with a readable message (single process, no launcher)."""

import pytest
import torch
from torch import nn

import slipstream
from slipstream.errors import ConfigError


def test_bad_inputs(single_process):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module, got str"):
        slipstream.accelerate("model", opt)
    with pytest.raises(ConfigError, match="optimizer must be a torch.optim.Optimizer"):
        slipstream.accelerate(model, "sgd")
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="2 parameter\\(s\\) that are not in the model"):
        slipstream.accelerate(model, other)
    with pytest.raises(ConfigError, match="accumulate_steps must be >= 1, got 0"):
        slipstream.accelerate(model, opt, accumulate_steps=0)
    with pytest.raises(ConfigError, match="no module of type Block in the model"):
        slipstream.accelerate(model, opt, activation_checkpointing=("Block",), progress=False)
    with pytest.raises(ConfigError, match="sync_options for 'auto': verify_steps must be >= 0"):
        slipstream.accelerate(model, opt, sync="auto", sync_options={"verify_steps": -1}, progress=False)


def test_single_process_trains_without_a_launcher(single_process, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = slipstream.accelerate(model, opt, run_dir=str(tmp_path), progress=False, log_every_steps=5)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    for _ in range(50):
        run.backward(nn.functional.mse_loss(run.model(x), y))
        run.step()
    summary = run.finish()
    assert summary["steps"] == 50 and summary["final_loss"] < 0.5
    lines = (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert len(lines) == 10
