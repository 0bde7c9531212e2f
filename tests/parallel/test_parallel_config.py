"""Layout configuration is checked when built, with the numbers in the message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.harness import run_ranks
from tests.parallel.parallel_workers import REPO, errors_worker

from slipstream import ConfigError, TrainConfig


def test_default_layout_is_data_parallel_over_every_rank():
    cfg = TrainConfig()
    assert cfg.degrees(8) == {"pp": 1, "dp_replicate": 8, "dp_shard": 1, "tp": 1}
    assert cfg.is_plain_data_parallel(8)
    assert TrainConfig(tp=2).degrees(8) == {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "tp": 2}
    assert TrainConfig(dp_shard=-1, pp=2).degrees(8) == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert not TrainConfig(dp_shard=2).is_plain_data_parallel(2)


@pytest.mark.parametrize(
    "options, world, message",
    [
        ({"dp_replicate": 2, "tp": 3}, 4, r"dp_replicate\(2\) \* dp_shard\(1\) \* tp\(3\) \* pp\(1\) != world_size\(4\)"),
        ({"tp": 3}, 4, r"world_size\(4\) is not divisible by dp_shard\(1\) \* tp\(3\) \* pp\(1\) = 3"),
        ({"dp_shard": 2, "tp": 2, "pp": 2}, 4, r"world_size\(4\) is not divisible by .* = 8"),
    ],
)
def test_degrees_that_do_not_multiply_to_the_world_say_so(options, world, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options).degrees(world)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tp": 0}, r"tp must be >= 1 \(or -1: the rest of the world\), got 0"),
        ({"tp": -1}, r"only dp_replicate or dp_shard may be -1"),
        ({"pp_schedule": "zb"}, r"pp_schedule must be one of gpipe, 1f1b, got 'zb'"),
        ({"pp": 4, "pp_microbatches": 2}, r"pp_microbatches\(2\) must be >= pp\(4\) for the 1f1b schedule"),
        ({"zero_stage": 1}, r"zero_stage 1 .* FSDP2 shards parameters, gradients and optimizer state together"),
        ({"zero_stage": 4}, r"zero_stage must be 2 or 3, got 4"),
        ({"tp": 2, "sync": "powersgd"}, r"sync 'powersgd' is a DDP gradient hook; with dp_shard, tp or pp"),
        ({"dp_shard": -1, "sync": "allreduce", "sync_options": {"x": 1}}, r"sync 'allreduce' is a DDP gradient hook"),
        ({"pp": 2, "precision": "fp16"}, r"precision fp16 is not supported with dp_shard, tp or pp; use bf16"),
    ],
)
def test_bad_layout_values_are_refused_on_construction(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options)


def test_layout_comes_from_the_environment():
    cfg = TrainConfig.from_env({"SLIPSTREAM_TP": "2", "SLIPSTREAM_PP_SCHEDULE": "gpipe", "SLIPSTREAM_PP_MICROBATCHES": "4"})
    assert (cfg.parallel.tp, cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches) == (2, "gpipe", 4)
    assert TrainConfig(dp_shard=2, zero_stage=2).to_env() == {"SLIPSTREAM_DP_SHARD": "2", "SLIPSTREAM_ZERO_STAGE": "2"}


def test_cli_refuses_a_layout_that_does_not_fit_in_one_line():
    proc = subprocess.run(  # the real command: one line on stderr, exit 2
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "--tp", "3", "examples/train_gpt.py"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        (
            "slipstream run: error: invalid training flag: world_size(2) is not divisible by "
            "dp_shard(1) * tp(3) * pp(1) = 3, so dp_replicate=-1 has no value"
        )
    ], proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp-schedule", "zb"], "pp_schedule must be one of gpipe, 1f1b, got 'zb'"),
        (["-n", "4", "--dp-replicate", "2", "--tp", "3"], "dp_replicate(2) * dp_shard(1) * tp(3) * pp(1) != world_size(4)"),
        (["--zero-stage", "1"], "zero_stage 1 (sharded optimizer state only) is not available"),
        (["--pp-microbatches", "0"], "pp_microbatches must be >= 1 or None, got 0"),
        (["--pp", "2", "--sync", "bf16"], "sync 'bf16' is a DDP gradient hook"),
    ],
)
def test_cli_layout_flags_are_checked_before_workers_start(flags, message, capsys):
    from slipstream.cli import main

    assert main(["run", *flags, "examples/train_gpt.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_layout_flags_reach_the_workers_environment():
    import argparse

    from slipstream.launch.cli import worker_env_from_args

    args = argparse.Namespace(nproc_per_node=4, nnodes="1", emulate=None, collective_timeout_s=None, **{
        f"train_{k}": None for k in ("sync", "sync_options", "precision", "accumulate_steps", "bucket_cap_mb",
                                     "grad_clip_norm", "run_dir", "log_every_steps", "checkpoint_dir",
                                     "checkpoint_every_steps", "checkpoint_every_s", "checkpoint_keep_last",
                                     "checkpoint_verify", "checkpoint_max_failures", "dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "pp_microbatches",
                                     "zero_stage")
    })
    args.train_dp_shard, args.train_tp, args.train_pp_schedule, args.train_zero_stage = 2, 2, "gpipe", 2
    args.train_checkpoint_verify, args.train_checkpoint_max_failures = "size", 5
    assert worker_env_from_args(args) == {
        "SLIPSTREAM_DP_SHARD": "2", "SLIPSTREAM_TP": "2", "SLIPSTREAM_PP_SCHEDULE": "gpipe", "SLIPSTREAM_ZERO_STAGE": "2",
        "SLIPSTREAM_CHECKPOINT_VERIFY": "size", "SLIPSTREAM_CHECKPOINT_MAX_FAILURES": "5",
    }


@pytest.mark.distributed
def test_model_and_batch_misfits_are_reported_with_numbers(tmp_path):
    messages = run_ranks(errors_worker, 2, str(tmp_path), timeout_s=120)[0]
    assert messages[0] == "tp(2) does not divide the attention heads(3) of blocks.0.attn", messages
    assert messages[1] == "pp_microbatches(3) does not divide the batch(8) of this rank", messages
    assert "the optimizer has state already" in messages[2] and "factory" in messages[2], messages
