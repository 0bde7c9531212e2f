import pytest

from slipstream.config import TrainConfig
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
    assert cfg.precision == "bf16"
    assert cfg.accumulate_steps == 2
    assert cfg.grad_clip_norm is None


def test_bad_environment_value_is_a_clear_error():
    with pytest.raises(ConfigError, match="SLIPSTREAM_ACCUMULATE_STEPS must be a int, got 'two'"):
        TrainConfig.from_env({"SLIPSTREAM_ACCUMULATE_STEPS": "two"})


def test_unknown_option_is_refused():
    with pytest.raises(ConfigError, match="unknown training option"):
        TrainConfig.from_env({}, acumulate_steps=2)


def test_to_env_round_trips():
    cfg = TrainConfig(precision="fp16", accumulate_steps=3, activation_checkpointing=("Block", "Attn"), static_graph=True)
    assert TrainConfig.from_env(cfg.to_env()) == cfg


def test_activation_checkpointing_accepts_comma_separated_names():
    assert TrainConfig(activation_checkpointing="Block, Attn").activation_checkpointing == ("Block", "Attn")
