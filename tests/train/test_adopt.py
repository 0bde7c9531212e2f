"""Zero-change acceleration (slipstream.train.adopt), in-process on a one-rank gloo group.

Each launcher option is either applied to a DDP model the script builds or named in
a start-up line; these tests check that option by option. The 2-rank runs under
``slipstream run`` are in tests/integration/test_zero_change.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from slipstream import config
from slipstream.errors import ConfigError
from slipstream.train import adopt


@pytest.fixture()
def adopting(one_rank_group, tmp_path, monkeypatch):
    """install() with the given SLIPSTREAM_* options; the DDP patch is undone after."""
    monkeypatch.delenv("SLIPSTREAM_RUN_DIR", raising=False)
    made = []

    def start(**options: str) -> adopt.Adopter:
        env = {f"SLIPSTREAM_{k.upper()}": v for k, v in options.items()}
        env.setdefault("SLIPSTREAM_RUN_DIR", str(tmp_path / "run"))
        adopter = adopt.install(env)
        assert adopter is not None
        made.append(adopter)
        return adopter

    yield start
    for adopter in made:
        adopter.finish()
    adopt.uninstall()
    assert DDP.__init__ is adopt._ORIGINAL_INIT


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def train(model: nn.Module, steps: int = 3) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def test_every_option_is_applied_or_named():
    flat = set(config.FLAT_NAMES)
    applied, named = set(adopt.APPLIED), set(adopt.NOT_APPLIED)
    assert not applied & named
    # precision: applied for bf16, named for fp16 (FP16_NOT_APPLIED)
    assert flat - applied - named == {"precision"}, "an option neither applied nor named"
    assert (applied | named) - flat == set(), "a name that is not an option"


def test_no_option_installs_nothing(one_rank_group):
    assert adopt.install({"SLIPSTREAM_RUN_DIR": "/tmp/x"}) is None
    assert DDP.__init__ is adopt._ORIGINAL_INIT
    assert config.options_in_env({"SLIPSTREAM_SYNC": "bf16", "SLIPSTREAM_PRECISION": "",
                                  "SLIPSTREAM_RUN_DIR": "/tmp/x"}) == ["sync"]


def test_a_bad_value_is_refused_before_the_script_runs(one_rank_group):
    with pytest.raises(ConfigError, match="precision"):
        adopt.install({"SLIPSTREAM_PRECISION": "fp8"})
    assert DDP.__init__ is adopt._ORIGINAL_INIT


def test_the_strategy_is_installed_on_the_scripts_ddp(adopting, capsys):
    adopter = adopting(sync="bf16")
    model = DDP(net())
    assert adopter.models == [model]
    assert adopter.handles[0].name == "bf16"
    train(model)
    assert adopter.handles[0].stats()["sync_steps"] == 3  # one rank: the reducer is kept (2 ranks: test_zero_change)
    err = capsys.readouterr().err
    assert "adopted the script's DistributedDataParallel (Sequential, 162 parameters)" in err and "sync bf16" in err


def test_a_parameter_count_is_shown_in_a_unit_that_shows_it():
    assert [adopt.parameter_count(n) for n in (162, 85_002, 2_180_000, 1_300_000_000)] == ["162", "85.0k", "2.18M", "1.30B"]


def test_a_model_built_by_accelerate_is_not_adopted_twice(adopting):
    from slipstream.train.layout_dp import SlipstreamDDP
    from slipstream.train.microsteps import ForwardContext, MicroSteps
    from slipstream.metrics import StepRecorder

    adopter = adopting(sync="bf16")
    context = ForwardContext(micro=MicroSteps(1), recorder=StepRecorder(0, 1, None), progress=None,
                             device=torch.device("cpu"))
    SlipstreamDDP(net(), context=context, precision="fp32")
    assert adopter.models == []


def test_ddp_options_override_the_scripts(adopting, capsys):
    adopting(bucket_cap_mb="1", find_unused_parameters="true", sync="allreduce")
    model = DDP(net(), find_unused_parameters=False)
    assert model.bucket_bytes_cap == 2**20
    assert model.find_unused_parameters is True
    assert "--find-unused-parameters True overrides the script's find_unused_parameters=False" in capsys.readouterr().err


def test_grad_clip_norm_clips_before_each_step(adopting):
    adopting(grad_clip_norm="0.001")
    model = DDP(net())
    seen = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()))
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    opt.step()
    assert seen and seen[0] <= 0.001 * 1.0001  # clipped by adoption's hook, registered first


def test_an_optimizer_of_another_model_is_left_alone(adopting):
    adopting(grad_clip_norm="0.001")
    DDP(net())
    other = nn.Linear(8, 1)
    other(torch.randn(2, 8)).sum().backward()
    before = torch.nn.utils.get_total_norm([p.grad for p in other.parameters()]).item()
    torch.optim.SGD(other.parameters(), lr=0.0).step()
    assert torch.nn.utils.get_total_norm([p.grad for p in other.parameters()]).item() == before > 0.001


def test_activation_checkpointing_wraps_before_ddp(adopting):
    adopting(activation_checkpointing="Block")
    model = DDP(net())
    wrapped = [type(m).__name__ for m in model.module]
    assert wrapped[:2] == ["CheckpointWrapper", "CheckpointWrapper"]
    train(model, steps=1)


def test_precision_bf16_runs_the_forward_in_bf16(adopting):
    adopting(precision="bf16")
    model = DDP(net())
    inner = []
    model.module[0].lin.register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    out = model(torch.randn(4, 8))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32


def test_not_applied_options_are_named_one_line_each(adopting, capsys):
    adopting(accumulate_steps="4", checkpoint_dir="/tmp/ckpt", precision="fp16", sync="bf16")
    DDP(net())
    err = [line for line in capsys.readouterr().err.splitlines() if " not applied: " in line]
    assert [line.split(" not applied")[0] for line in err] == [
        "[slipstream] --precision fp16", "[slipstream] --accumulate-steps 4", "[slipstream] --checkpoint-dir /tmp/ckpt"]
    assert "gradient_accumulation_steps" in err[1] and "fp16=True" in err[0]


def test_every_named_option_gets_its_line(adopting, capsys):
    values = {"accumulate_steps": "2", "dp_replicate": "1", "dp_shard": "1", "tp": "1", "pp": "1",
              "pp_schedule": "gpipe", "pp_microbatches": "2", "zero_stage": "2", "checkpoint_dir": "/tmp/c",
              "checkpoint_every_steps": "5", "checkpoint_every_s": "60", "checkpoint_keep_last": "2",
              "checkpoint_async": "true", "checkpoint_verify": "size", "checkpoint_max_failures": "2",
              "preemption_deadline_s": "10", "snapshot_every_steps": "1",
              "snapshot_peer_copy": "false"}
    assert set(values) == set(adopt.NOT_APPLIED)
    adopting(**values)
    DDP(net())
    err = capsys.readouterr().err
    for name in values:
        assert f"--{name.replace('_', '-')} " in err, name


def test_a_second_comm_hook_is_refused_in_one_line(adopting):
    adopting(sync="bf16")
    model = DDP(net())
    with pytest.raises(ConfigError, match="registers its own DDP communication hook"):
        model.register_comm_hook(None, lambda state, bucket: None)


def test_metrics_are_recorded_at_optimizer_steps(adopting, tmp_path):
    import json

    adopter = adopting(sync="powersgd", log_every_steps="2")
    train(DDP(net()), steps=4)
    adopter.finish()
    lines = (tmp_path / "run" / "metrics" / "rank0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4]
    assert records[-1]["sync_strategy"] == "powersgd" and records[-1]["samples"] == 8
    assert records[-1]["forward_s"] > 0 and records[-1]["backward_s"] > 0 and records[-1]["grad_norm"] > 0


def test_a_script_without_ddp_gets_the_line_at_exit(adopting, capsys):
    adopter = adopting(sync="powersgd")
    adopter.finish()
    assert "--sync not applied: the script built no DistributedDataParallel" in capsys.readouterr().err


def test_the_docs_table_names_every_option():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "zero-change.md").read_text()
    table = text[text.index("## Every option"):text.index("## What differs")]
    missing = [name for name in config.FLAT_NAMES if f"`--{name.replace('_', '-')}" not in table]
    assert not missing, f"docs/zero-change.md's table lacks {missing}"


def test_a_script_that_calls_accelerate_gets_no_line_at_exit(adopting, capsys):
    adopter = adopting(sync="powersgd")
    adopt.mark_accelerate_called()  # what slipstream.accelerate() does first
    adopter.finish()
    assert "not applied" not in capsys.readouterr().err
