"""`slipstream run --config FILE` and the training flags generated from TrainConfig's fields."""

from __future__ import annotations

import contextlib
import io

import pytest

from slipstream.cli import build_parser, main
from slipstream.config import FLAT_NAMES, TrainConfig
from slipstream.errors import ConfigError
from slipstream.launch import run_config
from slipstream.launch.cli import train_flags, worker_env_from_args


def env_for(argv: list[str]) -> dict[str, str]:
    return worker_env_from_args(build_parser().parse_args(["run", *argv, "train.py"]))


def test_flat_and_nested_keys_reach_the_same_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("precision: bf16\ncheckpoint:\n  dir: /ckpt\n  every_steps: 50\n"
                    "parallel: {activation_checkpointing: [Block, Attn]}\nsync: powersgd\nsync_options: {rank: 4}\n")
    values = run_config.load(str(path))
    assert values == {"precision": "bf16", "checkpoint_dir": "/ckpt", "checkpoint_every_steps": 50,
                      "activation_checkpointing": ("Block", "Attn"), "sync": "powersgd", "sync_options": {"rank": 4}}
    assert run_config.parse("numerics: {precision: bf16}") == run_config.parse("precision: bf16")
    assert run_config.parse("sync: {strategy: topk, options: {density: 0.1}}") == {
        "sync": "topk", "sync_options": {"density": 0.1}}
    assert run_config.parse("") == {}
    # YAML reads 1e3 and none as text; number fields take them as a number and None.
    assert run_config.parse("checkpoint_every_s: 1e3\ngrad_clip_norm: none") == {
        "checkpoint_every_s": 1000.0, "grad_clip_norm": None}


def test_dump_writes_nested_non_default_fields_that_load_back():
    cfg = TrainConfig(precision="bf16", tp=2, activation_checkpointing=("Block",), checkpoint_dir="/c",
                      log_to=("wandb",), profile=False, grad_clip_norm=1.0)
    text = run_config.dump(cfg)
    assert text.startswith("numerics:\n  precision: bf16\n") and "sync" not in text and "  tp: 2\n" in text
    assert TrainConfig(**run_config.parse(text)) == cfg
    assert run_config.dump(TrainConfig()) == "{}\n" and run_config.parse("{}\n") == {}


@pytest.mark.parametrize("text,message", [
    ("precison: bf16", "run.yaml: unknown key 'precison' (did you mean precision?)"),
    ("numerics: {precison: bf16}", "run.yaml: unknown key numerics.precison (did you mean precision?)"),
    ("numeric: {precision: bf16}", "run.yaml: unknown key 'numeric' (did you mean numerics?)"),
    ("precision: fp8", "run.yaml: precision must be one of fp32, bf16, fp16, got 'fp8'"),
    ("precision: bf16\nnumerics: {precision: fp16}", "run.yaml: precision is given twice"),
    ("[1, 2]", "run.yaml: a run config is a mapping"),
    ("a: [", "run.yaml: not valid YAML at line"),
    ("numerics: bf16", "run.yaml: numerics is a section and needs a mapping"),
    ("tp: two", "run.yaml: tp must be a whole number, got 'two'"),
    ("checkpoint: {every_s: soon}", "run.yaml: checkpoint.every_s must be a number or none, got 'soon'"),
])
def test_a_bad_file_is_one_line_naming_it(text, message):
    with pytest.raises(ConfigError) as info:
        run_config.parse(text, "run.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unknown_key_exits_2_with_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint_dri: /x\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--config", str(path), "train.py"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, err.getvalue()
    assert f"{path}: unknown key 'checkpoint_dri' (did you mean checkpoint_dir?)" in lines[0]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--config", str(tmp_path / "none.yaml"), "train.py"]) == 2
    assert "none.yaml: cannot read the run config" in err.getvalue()


def test_flags_override_the_file_which_overrides_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("numerics: {precision: fp32, accumulate_steps: 4}\ntp: 1\nlog_every_steps: 5\n")
    monkeypatch.setenv("SLIPSTREAM_PRECISION", "bf16")  # the launcher's environment, inherited by workers
    env = env_for(["--config", str(path), "--log-every-steps", "7"])
    # Given in the file at its default value: still set, so it overrides the inherited variable.
    assert env["SLIPSTREAM_PRECISION"] == "fp32" and env["SLIPSTREAM_TP"] == "1"
    assert env["SLIPSTREAM_ACCUMULATE_STEPS"] == "4" and env["SLIPSTREAM_LOG_EVERY_STEPS"] == "7"
    path.write_text("sync: powersgd\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "-n", "2", "--config", str(path), "--tp", "2", "train.py"])
    assert code == 2 and f"invalid training flag (flags over {path}): sync 'powersgd'" in err.getvalue()


def test_every_trainconfig_field_has_a_flag():
    flags = {f.flat: f.flag for f in train_flags()}
    assert set(flags) == set(FLAT_NAMES)
    assert flags["checkpoint_async"] == "--checkpoint-async" and flags["log_to"] == "--log-to"
    env = env_for(["--timeline", "--tensorboard", "--prometheus-port", "9100", "--checkpoint-async",
                   "--activation-checkpointing", "Block,Attn", "--log-to", "wandb,mlflow", "--no-profile",
                   "--grad-clip-norm", "none", "--sync", "powersgd", "--sync-options", '{"rank": 2}', "--precision", "bf16"])
    assert {k: env[k] for k in env if k != "SLIPSTREAM_GRAD_CLIP_NORM"} == {
        "SLIPSTREAM_TIMELINE": "True", "SLIPSTREAM_TENSORBOARD": "True", "SLIPSTREAM_PROMETHEUS_PORT": "9100",
        "SLIPSTREAM_CHECKPOINT_ASYNC": "True", "SLIPSTREAM_ACTIVATION_CHECKPOINTING": "Block,Attn",
        "SLIPSTREAM_LOG_TO": "wandb,mlflow", "SLIPSTREAM_PROFILE": "False", "SLIPSTREAM_SYNC_OPTIONS": '{"rank": 2}', "SLIPSTREAM_SYNC": "powersgd",
        "SLIPSTREAM_PRECISION": "bf16"}
    assert TrainConfig.from_env(env).numerics.grad_clip_norm is None
    assert TrainConfig.from_env(env).metrics.log_to == ("wandb", "mlflow")


def test_help_shows_choices_and_metavars(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    for piece in ("--log-to {tensorboard,wandb,mlflow}[,...]", "--precision {fp32,bf16,fp16}",
                  "--checkpoint-verify {full,size,off}", "--zero-stage {2,3}", "--prometheus-port PORT",
                  "--timeline, --no-timeline", "--config FILE", "training options: metrics"):
        assert piece in text, piece


def test_a_bad_flag_value_is_still_one_line():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--log-to", "neptune", "train.py"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "log_to must name trackers among tensorboard, wandb, mlflow" in lines[0]
