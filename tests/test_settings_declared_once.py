"""Each setting is declared once (issue #44): a job spec key that feeds a TrainConfig setting agrees
with the config field on its type, default, bounds and choices, and the config checks what it declares."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.config import FLAT_NAMES, SECTIONS
from slipstream.errors import ConfigError
from slipstream.job.fields import Rule, config_field, rules
from slipstream.job.model import JobSpec
from slipstream.settings import Bounds, bounds_of, check_bounds

KINDS = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def _config_keys() -> list[tuple[str, str, Rule, str]]:
    """(spec key, its annotation, its rule, the flat name) for every key declared with ``config=``."""
    out = []
    for name, rule in rules(JobSpec).items():
        if rule.kind != "section":
            continue
        annotations = {f.name: str(f.type) for f in dataclasses.fields(rule.section)}
        out += [(f"{name}.{key}", annotations[key], inner, inner.config)
                for key, inner in rules(rule.section).items() if inner.config is not None]
    return out


def test_the_spec_feeds_the_settings_it_should():
    names = {flat for *_, flat in _config_keys()}
    assert {"checkpoint_keep_last", "checkpoint_every_steps", "bucket_cap_mb", "precision", "tp"} <= names
    assert names <= set(FLAT_NAMES)


@pytest.mark.parametrize("key, annotation, rule, flat", _config_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_spec_key_and_its_config_field_agree(key, annotation, rule, flat):
    f = config_field(flat)
    base = str(f.type).split(" ")[0]
    assert annotation.split(" ")[0] == base, f"{key} is a {annotation}, {flat} a {f.type}"
    config_default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    assert rule.default in (None, config_default), f"{key} defaults to {rule.default!r}, {flat} to {config_default!r}"
    bounds = bounds_of(f) or Bounds()
    assert (rule.minimum, rule.maximum, rule.exclusive_minimum) == (
        bounds.minimum, bounds.maximum, bounds.exclusive_minimum), f"{key} and {flat} disagree on bounds"
    if "choices" in f.metadata:
        assert rule.kind == "choice" and rule.choices() == tuple(f.metadata["choices"]), key
    else:
        assert rule.kind in ("choice", KINDS[base]), f"{key} is read as {rule.kind}, {flat} is a {base}"


def _bounded() -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in SECTIONS.values() for f in dataclasses.fields(cls) if bounds_of(f)]


@pytest.mark.parametrize("cls, f", _bounded(), ids=lambda v: v.name if isinstance(v, dataclasses.Field) else "")
def test_the_config_refuses_a_value_past_each_declared_bound(cls, f):
    b = bounds_of(f)
    outside = b.minimum - 1 if b.minimum is not None else b.maximum + 1
    flat = cls.FLAT[f.name]
    with pytest.raises(ConfigError, match=f"^{flat} must be "):
        cls(**{f.name: outside})
    with pytest.raises(ConfigError, match=f"^{flat} must be "):
        cls(**{f.name: True})  # a bool is not a number here, as YAML's true is not 1 in a job spec


def test_bounds_read_as_the_messages_always_said():
    @dataclasses.dataclass(frozen=True)
    class Section:
        port: int | None = dataclasses.field(default=None, metadata={"bounds": Bounds(0, 65535)})
        rate: float = dataclasses.field(default=1.0, metadata={"bounds": Bounds(0, exclusive_minimum=True)})

    with pytest.raises(ConfigError, match=r"^prometheus_port must be in 0..65535 or None, got 70000$"):
        check_bounds(Section(port=70000), {"port": "prometheus_port"})
    with pytest.raises(ConfigError, match=r"^rate must be > 0, got 0$"):
        check_bounds(Section(rate=0), {})
