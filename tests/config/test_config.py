import pytest

import dataclasses

from slipstream.config import (
    FLAT_NAMES,
    SECTIONS,
    CheckpointConfig,
    NumericsConfig,
    ParallelConfig,
    SyncConfig,
    TrainConfig,
)
from slipstream.errors import ConfigError


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"accumulate_steps": 0}, "accumulate_steps must be >= 1, got 0"),
        ({"precision": "fp8"}, "precision must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0, got 0"),
        ({"grad_clip_norm": -1.0}, "grad_clip_norm must be > 0 or None, got -1.0"),
        ({"sync": "carrier-pigeon"}, "sync must be one of"),
        ({"log_every_steps": 0}, "log_every_steps must be >= 1, got 0"),
    ],
)
def test_invalid_values_name_field_rule_and_value(kwargs, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    assert message in str(info.value)


def test_environment_feeds_defaults_and_code_overrides_it():
    env = {"SLIPSTREAM_PRECISION": "bf16", "SLIPSTREAM_ACCUMULATE_STEPS": "4", "SLIPSTREAM_GRAD_CLIP_NORM": "none"}
    cfg = TrainConfig.from_env(env, accumulate_steps=2)
    assert cfg.numerics == NumericsConfig(precision="bf16", accumulate_steps=2, grad_clip_norm=None)


def test_bad_environment_value_is_a_clear_error():
    with pytest.raises(ConfigError, match="SLIPSTREAM_ACCUMULATE_STEPS must be a int, got 'two'"):
        TrainConfig.from_env({"SLIPSTREAM_ACCUMULATE_STEPS": "two"})


def test_unknown_option_is_refused():
    with pytest.raises(ConfigError, match=r"unknown training option\(s\): acumulate_steps \(did you mean accumulate_steps\?\)"):
        TrainConfig.from_env({}, acumulate_steps=2)
    with pytest.raises(ConfigError, match="unknown training option"):
        TrainConfig(checkpoint_every=3)


def test_to_env_round_trips():
    cfg = TrainConfig(precision="fp16", accumulate_steps=3, activation_checkpointing=("Block", "Attn"), static_graph=True)
    assert TrainConfig.from_env(cfg.to_env()) == cfg


def test_activation_checkpointing_accepts_comma_separated_names():
    assert TrainConfig(activation_checkpointing="Block, Attn").parallel.activation_checkpointing == ("Block", "Attn")


def test_every_section_field_has_exactly_one_flat_name():
    leaves = {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert sorted(FLAT_NAMES.values()) == sorted(leaves)
    assert len(set(FLAT_NAMES)) == len(FLAT_NAMES)


def test_flat_keywords_and_sections_build_the_same_config():
    flat = TrainConfig(sync="powersgd", sync_options={"rank": 2}, precision="bf16", tp=1, checkpoint_dir="/ck", checkpoint_async=True)
    nested = TrainConfig(
        sync=SyncConfig(strategy="powersgd", options={"rank": 2}),
        numerics=NumericsConfig(precision="bf16"),
        checkpoint=CheckpointConfig(dir="/ck", async_save=True),
    )
    assert flat == nested
    assert flat.sync.strategy == "powersgd" and flat.checkpoint.dir == "/ck"


def test_a_flat_keyword_overrides_the_field_of_a_given_section():
    cfg = TrainConfig(numerics=NumericsConfig(precision="bf16", accumulate_steps=4), accumulate_steps=2)
    assert (cfg.numerics.precision, cfg.numerics.accumulate_steps) == ("bf16", 2)


def test_a_section_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="parallel must be a ParallelConfig, got NumericsConfig"):
        TrainConfig(parallel=NumericsConfig())


def test_rules_across_sections_are_checked_whichever_way_it_was_built():
    with pytest.raises(ConfigError, match="DDP gradient hook"):
        TrainConfig(sync=SyncConfig(strategy="powersgd"), parallel=ParallelConfig(dp_shard=2))
    with pytest.raises(ConfigError, match="fp16 is not supported"):
        TrainConfig(precision="fp16", tp=2)


def test_replace_takes_flat_names_and_sections_and_validates_again():
    cfg = TrainConfig().replace(precision="bf16", checkpoint=CheckpointConfig(keep_last=5))
    assert (cfg.numerics.precision, cfg.checkpoint.keep_last) == ("bf16", 5)
    with pytest.raises(ConfigError, match="checkpoint_keep_last must be >= 1"):
        cfg.replace(checkpoint_keep_last=0)


def test_every_flat_name_round_trips_through_the_environment():
    changed = dict(
        sync="topk", sync_options={"density": 0.1}, bucket_cap_mb=4.0, gradient_as_bucket_view=False,
        find_unused_parameters=True, static_graph=True, precision="bf16", accumulate_steps=3,
        grad_clip_norm=1.5, dp_replicate=2, activation_checkpointing=("Block",), checkpoint_dir="/ck",
        checkpoint_every_steps=7, checkpoint_every_s=30.0, checkpoint_keep_last=2, checkpoint_async=True,
        checkpoint_verify="size", checkpoint_max_failures=5, preemption_deadline_s=9.0, profile=False,
        timeline=True, tensorboard=True, prometheus_port=9400, prometheus_addr="0.0.0.0",
        flops_per_sample=1e9, peak_flops=1e15, straggler_threshold=0.2, run_dir="/runs",
        log_every_steps=5, progress=False, total_steps=100, log_to=("wandb", "mlflow"),
    )
    cfg = TrainConfig(**changed)
    env = cfg.to_env()
    assert set(env) == {"SLIPSTREAM_" + name.upper() for name in changed}
    assert TrainConfig.from_env(env) == cfg
    assert {name: cfg.flat()[name] for name in changed} == changed
