"""One precedence rule: slipstream run's settings (SLIPSTREAM_* variables, from its flags, run
config or job spec) win over the script's, and each value they replace is named (issue #46, item 2)."""

from __future__ import annotations

import pytest

from slipstream.config import Override, TrainConfig, resolve
from slipstream.errors import ConfigError


def test_a_variable_wins_over_the_scripts_keyword_and_is_named():
    cfg, over = resolve({"checkpoint_dir": "ckpt", "precision": "bf16", "accumulate_steps": 2},
                        {"SLIPSTREAM_CHECKPOINT_DIR": "/shared/ckpt", "SLIPSTREAM_PRECISION": "bf16",
                         "SLIPSTREAM_GRAD_CLIP_NORM": "1.0"})
    assert cfg.checkpoint.dir == "/shared/ckpt"
    assert (cfg.numerics.precision, cfg.numerics.accumulate_steps, cfg.numerics.grad_clip_norm) == ("bf16", 2, 1.0)
    # Only a value the script gave and the variable changed: the same precision, or a clip the script never set, is no news.
    assert over == [Override("checkpoint_dir", "ckpt", "/shared/ckpt")]
    assert over[0].line().startswith("[slipstream] --checkpoint-dir /shared/ckpt (SLIPSTREAM_CHECKPOINT_DIR")
    assert over[0].line().endswith("overrides the script's checkpoint_dir='ckpt'")


def test_none_is_not_given_and_spellings_of_one_value_are_equal():
    cfg, over = resolve({"checkpoint_dir": None, "activation_checkpointing": "Block,MLP", "log_to": ["wandb"]},
                        {"SLIPSTREAM_CHECKPOINT_DIR": "/c", "SLIPSTREAM_ACTIVATION_CHECKPOINTING": "Block, MLP",
                         "SLIPSTREAM_LOG_TO": "wandb"})
    assert cfg.checkpoint.dir == "/c" and over == []


def test_a_whole_config_gets_the_same_rule():
    cfg, over = resolve(TrainConfig(precision="fp16", sync="powersgd"), {"SLIPSTREAM_PRECISION": "bf16",
                                                                           "SLIPSTREAM_SYNC": "bf16"})
    assert (cfg.numerics.precision, cfg.sync.strategy) == ("bf16", "bf16")
    assert [(o.name, o.script_value, o.used_value) for o in over] == [("sync", "powersgd", "bf16"),
                                                                       ("precision", "fp16", "bf16")]
    # A field the config left at its default is not the script's choice: replaced without a line.
    cfg, over = resolve(TrainConfig(), {"SLIPSTREAM_PRECISION": "bf16"})
    assert cfg.numerics.precision == "bf16" and over == []


def test_without_variables_the_script_decides_and_bad_names_are_refused():
    cfg, over = resolve({"precision": "bf16"}, {})
    assert cfg.numerics.precision == "bf16" and over == []
    with pytest.raises(ConfigError, match="precison \\(did you mean precision\\?\\)"):
        resolve({"precison": "bf16"}, {})
    with pytest.raises(ConfigError, match="SLIPSTREAM_ACCUMULATE_STEPS must be a int"):
        resolve({}, {"SLIPSTREAM_ACCUMULATE_STEPS": "two"})


def test_replace_takes_the_strategy_by_its_flat_name():
    assert TrainConfig(sync="powersgd").replace(sync="bf16").sync.strategy == "bf16"


def test_the_scripts_run_dir_is_kept_and_both_directories_are_named():
    # slipstream run sets SLIPSTREAM_RUN_DIR for every run (its own runs/<time> without --run-dir).
    cfg, over = resolve({"run_dir": "runs/sweep-a"}, {"SLIPSTREAM_RUN_DIR": "/abs/runs/20261207-001500"})
    assert cfg.run.dir == "runs/sweep-a"
    (line,) = [o.line() for o in over]
    assert line.startswith("[slipstream] the script's run_dir='runs/sweep-a' is used; SLIPSTREAM_RUN_DIR "
                           "/abs/runs/20261207-001500 (slipstream run's --run-dir, or the directory it chose)")
    cfg, over = resolve({}, {"SLIPSTREAM_RUN_DIR": "/abs/runs/x"})
    assert cfg.run.dir == "/abs/runs/x" and over == []


def test_a_flag_over_the_run_config_and_over_a_job_spec_is_named_at_launch(tmp_path, capsys):
    from pathlib import Path

    from slipstream.cli import build_parser
    from slipstream.config import replaced
    from slipstream.job.cli import job_run_from_args
    from slipstream.launch.cli import worker_env_from_args

    assert replaced({"precision": "fp16", "grad_clip_norm": 1, "tp": 2}, {"precision": "bf16", "grad_clip_norm": 1.0,
                                                                         "tp": 2}) == ["precision"]
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("precision: fp16\naccumulate_steps: 2\n")
    args = build_parser().parse_args(["run", "--config", str(run_yaml), "--precision", "bf16", "--accumulate-steps",
                                      "2", "train.py"])
    env = worker_env_from_args(args)
    assert env["SLIPSTREAM_PRECISION"] == "bf16"
    assert capsys.readouterr().err.splitlines() == [f"slipstream run: --precision bf16 overrides {run_yaml}'s "
                                                    "precision: fp16"]

    spec = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "local-2x1.yaml"  # numerics.precision: bf16
    job = job_run_from_args(build_parser().parse_args(["run", "--precision", "fp32", str(spec)]))
    assert job.worker_env["SLIPSTREAM_PRECISION"] == "fp32"
    assert f"slipstream run: precision fp32 (its flags or --config) overrides {spec}'s precision bf16" in \
        capsys.readouterr().err
    job_run_from_args(build_parser().parse_args(["run", "--precision", "bf16", str(spec)]))  # the same value: no line
    assert capsys.readouterr().err == ""
