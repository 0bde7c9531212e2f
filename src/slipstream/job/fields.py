"""The job spec's schema as data: one :class:`Rule` per key, attached to the spec's dataclasses.

Each key of the YAML file is a field of a frozen dataclass in
:mod:`slipstream.job.model`, declared with one of the helpers below
(:func:`integer`, :func:`number`, :func:`string`, :func:`choice`, ...). The
helper stores a :class:`Rule` in the field's metadata; from that one
definition come

* the reader (:mod:`slipstream.job.reader`): types, bounds, patterns, enums,
  defaults, unknown keys with "did you mean";
* the error messages (``field: rule, got value``), worded from the rule;
* the published JSON Schema (:mod:`slipstream.job.json_schema`), which editors
  use for completion and checking.

Rules that relate two keys (``processes_per_replica <= gpu_count``) are
checks in :mod:`slipstream.job.spec`; the JSON Schema leaves them out.

Example::

    @dataclass(frozen=True, kw_only=True)
    class Serve:
        port: int = integer(8000, minimum=1, maximum=65535, doc="Container port of the service.")

    rules(Serve)   # {"port": Rule(kind="integer", default=8000, minimum=1, maximum=65535, ...)}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

KINDS = ("integer", "number", "boolean", "string", "choice", "quantity", "strings", "env", "section")
"""What a key holds. ``quantity``: a Kubernetes quantity; ``strings``: a list of strings;
``env``: a mapping NAME: scalar; ``section``: a nested mapping of its own keys."""


@dataclass(frozen=True)
class Rule:
    """What one key of the spec may hold, and what it means."""

    kind: str
    doc: str
    default: Any = None
    """The value when the key is absent or null (None: stays None, "not set")."""
    default_from: str | None = None
    """When absent, take the value of this key (the same section first, then the top level)."""
    default_doc: str | None = None
    """The default in words, when it is not a constant (published as text only)."""
    required: str | None = None
    """Set: the key must be given; the message's hint, e.g. "(the container image the replicas run)"."""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    max_len: int | None = None
    pattern: str | None = None
    """A regular expression the whole string must match (Python and ECMA-262 alike)."""
    rule: str = ""
    """The pattern in words, for messages: "must be {rule}, got ..."."""
    enum: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None
    """Allowed values, or a function returning them (asked only when a value is given)."""
    min_items: int = 0
    reserved: tuple[str, ...] = ()
    """For ``env``: names refused (one ending in ``_`` refuses every name it begins)."""
    config: str | None = None
    """The flat :class:`~slipstream.config.TrainConfig` name this key feeds (``checkpoint.every_steps``:
    ``checkpoint_every_steps``); the workers get it as ``SLIPSTREAM_<NAME>``. A key with no default of
    its own (None) takes the engine's."""
    section: type | None = None
    """For ``section``: the dataclass whose fields are the section's keys."""
    optional_section: bool = False
    """For ``section``: absent means None ("not used"), rather than every default."""
    only_for: str | None = None
    """``training`` or ``inference``: the only ``kind`` of job that may give this key."""
    normalize: Callable[[Any], Any] | None = None
    """Applied to a valid value (e.g. ``3g.40gb`` -> ``mig-3g.40gb``)."""

    def choices(self) -> tuple[Any, ...]:
        return tuple(self.enum()) if callable(self.enum) else tuple(self.enum or ())


def _field(rule: Rule, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying ``rule`` in its metadata."""
    if rule.kind not in KINDS:
        raise ValueError(f"unknown rule kind {rule.kind!r}")
    if rule.required:
        return dataclasses.field(metadata={"spec": rule})  # no default: the reader reports it missing
    if default is dataclasses.MISSING:
        default = rule.default
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"spec": rule})
    return dataclasses.field(default=default, metadata={"spec": rule})


def integer(default: int | None = None, *, minimum: int | None = None, maximum: int | None = None, doc: str,
            **more: Any) -> Any:
    """An int key (booleans are refused, as YAML's ``true`` is not 1)."""
    return _field(Rule("integer", doc, default, minimum=minimum, maximum=maximum, **more))


def number(default: float | None = None, *, minimum: float | None = None, maximum: float | None = None,
           exclusive_minimum: bool = False, doc: str, **more: Any) -> Any:
    """A finite int or float key, read as float."""
    return _field(Rule("number", doc, default, minimum=minimum, maximum=maximum,
                       exclusive_minimum=exclusive_minimum, **more))


def boolean(default: bool = False, *, doc: str, **more: Any) -> Any:
    return _field(Rule("boolean", doc, default, **more))


def string(default: str | None = None, *, doc: str, pattern: str | None = None, rule: str = "",
           max_len: int | None = None, **more: Any) -> Any:
    """A non-empty string without surrounding spaces, optionally matching ``pattern``."""
    return _field(Rule("string", doc, default, pattern=pattern, rule=rule, max_len=max_len, **more))


def choice(default: Any, enum: tuple[Any, ...] | Callable[[], tuple[Any, ...]], *, doc: str, **more: Any) -> Any:
    """One of ``enum``, of the same type (the default is always allowed, so a callable enum is asked
    only when another value is given)."""
    return _field(Rule("choice", doc, default, enum=enum, **more))


def quantity(*, doc: str, **more: Any) -> Any:
    """A Kubernetes quantity > 0 (``4``, ``500m``, ``16Gi``), kept as its canonical text."""
    return _field(Rule("quantity", doc, None, **more))


def strings(default: tuple[str, ...] | None = None, *, doc: str, min_items: int = 0, **more: Any) -> Any:
    """A list of strings, read as a tuple."""
    return _field(Rule("strings", doc, default, min_items=min_items, **more))


def env_mapping(*, doc: str, pattern: str, reserved: tuple[str, ...] = (), **more: Any) -> Any:
    """A mapping NAME: string, number or boolean, read as a tuple of (name, text) pairs;
    names must match ``pattern`` and not be ``reserved``."""
    return _field(Rule("env", doc, (), pattern=pattern, reserved=reserved, **more))


def section(cls: type, *, doc: str, optional: bool = False, **more: Any) -> Any:
    """A nested mapping whose keys are ``cls``'s fields. ``optional``: absent means None."""
    rule = Rule("section", doc, None, section=cls, optional_section=optional, **more)
    if optional:
        return dataclasses.field(default=None, metadata={"spec": rule})
    return dataclasses.field(default_factory=cls, metadata={"spec": rule})


def config_field(flat: str) -> dataclasses.Field:
    """The :mod:`slipstream.config` field behind a flat TrainConfig name (``checkpoint_keep_last``:
    ``CheckpointConfig.keep_last``): the one declaration of that setting."""
    from ..config import FLAT_NAMES, SECTIONS

    section, leaf = FLAT_NAMES[flat]
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == leaf)


def _config_doc(flat: str) -> str:
    from .. import config
    from ..config import FLAT_NAMES, SECTIONS
    from ..settings import field_docs

    section, leaf = FLAT_NAMES[flat]
    return " ".join(field_docs(config).get((SECTIONS[section].__name__, leaf), "").replace("``", "").split())


def from_config(flat: str, *, engine_default: bool = False, enum: Any = None, note: str = "", **more: Any) -> Any:
    """A key that feeds the TrainConfig setting ``flat``, declared by that setting: its kind (from the
    field's type, or ``choice`` for a field with ``choices``), default, bounds and documentation
    (the docstring under the field, then ``note``: what only the spec says). ``engine_default``: the
    key's own default is None, so a spec that leaves it out leaves the engine's default in force (the
    JSON Schema still shows it). ``enum``: the allowed values, for a setting whose list the core
    computes (the sync strategies). Nothing here restates a bound, so the spec cannot disagree with
    the config (tests/test_settings_declared_once.py checks every ``config=`` key).

    Example::

        keep_last: int = from_config("checkpoint_keep_last")   # default 3, >= 1, as CheckpointConfig says
    """
    from ..settings import bounds_of

    f = config_field(flat)
    choices = enum if enum is not None else f.metadata.get("choices")
    kind = "choice" if choices is not None else str(f.type).split(" ")[0]
    kind = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(kind, kind)
    default = None if engine_default else (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
    bounds = bounds_of(f)
    if bounds is not None:
        more.update(minimum=bounds.minimum, maximum=bounds.maximum, exclusive_minimum=bounds.exclusive_minimum)
    if choices is not None:
        more["enum"] = choices
    doc = " ".join(part for part in (_config_doc(flat), note) if part)
    return _field(Rule(kind, doc, default, config=flat, **more))


def rules(cls: type) -> dict[str, Rule]:
    """The keys of a spec dataclass, in declaration order (fields without a rule are not keys)."""
    return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls) if "spec" in f.metadata}


__all__ = ["Rule", "KINDS", "integer", "number", "boolean", "string", "choice", "quantity", "strings",
           "env_mapping", "section", "rules", "from_config", "config_field"]
