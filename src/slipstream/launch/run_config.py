"""The run config file of ``slipstream run --config FILE``: TrainConfig's fields as YAML.

A run config holds training options only (what ``--precision``, ``--tp``,
``--checkpoint-dir`` ... set), never launcher options or the script. Keys are
TrainConfig's, in either spelling, mixed freely:

* flat names, as the flags and ``SLIPSTREAM_*`` variables spell them::

      precision: bf16
      checkpoint_dir: /ckpt
      activation_checkpointing: [Block]

* nested sections (``sync``, ``numerics``, ``parallel``, ``checkpoint``,
  ``metrics``, ``run``) with their field names::

      numerics: {precision: bf16, accumulate_steps: 4}
      checkpoint:
        dir: /ckpt
        every_steps: 500

``sync`` is both a section and a flat name: ``sync: powersgd`` names the
strategy, ``sync: {strategy: powersgd, options: {rank: 4}}`` is the section.
Tuple fields take a YAML list or a comma-separated string. An unknown key, a
key given twice or a value TrainConfig refuses is a :class:`ConfigError` (exit
2) whose one line starts with the file's name and suggests the closest key.

Precedence in ``slipstream run``: flags override the file, which overrides the
``SLIPSTREAM_*`` environment, which overrides the built-in defaults.

:func:`dump` writes the same format (nested sections, non-default values only),
so a file another tool writes (``slipstream plan --write-config``) is one
``slipstream run --config`` reads.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

import yaml

from ..config import FLAT_NAMES, SECTIONS, TrainConfig
from ..errors import ConfigError


def load(path: str) -> dict[str, Any]:
    """The training options of run config ``path``, by flat name, checked.

    Example::

        # run.yaml:  numerics: {precision: bf16}
        #            checkpoint_dir: /ckpt
        load("run.yaml")   # {"precision": "bf16", "checkpoint_dir": "/ckpt"}
        TrainConfig(**load("run.yaml")).numerics.precision   # "bf16"
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the run config: {exc.strerror or exc}") from None
    return parse(text, path)


def parse(text: str, source: str = "<run config>") -> dict[str, Any]:
    """:func:`load` for text already read; ``source`` names it in errors.

    Example::

        parse("precision: bf16\\nparallel: {tp: 2}")   # {"precision": "bf16", "tp": 2}
        parse("precison: bf16", "run.yaml")
        # ConfigError: run.yaml: unknown key 'precison' (did you mean precision?); ...
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a run config is a mapping of training options, got a {type(doc).__name__}")
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    kinds = {cls.FLAT[f.name]: str(f.type) for cls in SECTIONS.values() for f in fields(cls)}

    def put(flat: str, value: Any, key: str) -> None:
        if flat in values:
            raise ConfigError(f"{source}: {flat} is given twice ({where[flat]} and {key}); keep one")
        values[flat] = _number(kinds[flat], list_to_tuple(value), key, source)
        where[flat] = key

    for key, value in doc.items():
        key = str(key)
        if key in SECTIONS and isinstance(value, dict):
            cls = SECTIONS[key]
            for leaf, leaf_value in value.items():
                leaf = str(leaf)
                if leaf not in cls.FLAT:
                    raise ConfigError(f"{source}: unknown key {key}.{leaf}{_hint(leaf, list(cls.FLAT))}; "
                                      f"{key} has {', '.join(cls.FLAT)}")
                put(cls.FLAT[leaf], leaf_value, f"{key}.{leaf}")
        elif key in FLAT_NAMES:
            put(key, value, key)
        elif key in SECTIONS:
            raise ConfigError(f"{source}: {key} is a section and needs a mapping of its fields "
                              f"({', '.join(SECTIONS[key].FLAT)}), got {value!r}")
        else:
            raise ConfigError(f"{source}: unknown key {key!r}{_hint(key, [*FLAT_NAMES, *SECTIONS])}; "
                              f"keys are TrainConfig's flat names or its sections ({', '.join(SECTIONS)})")
    try:
        TrainConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong kind, e.g. a list where a number goes
        raise ConfigError(f"{source}: {exc}") from None
    return values


def dump(cfg: TrainConfig) -> str:
    """``cfg`` as run config YAML: nested sections, only the fields that differ from the defaults.

    ``load`` of the text gives back ``cfg`` (``TrainConfig(**parse(dump(cfg))) == cfg``);
    a config with nothing set gives ``"{}\\n"``. ``slipstream plan --write-config`` writes
    this (a comment header may go before it).

    Example::

        dump(TrainConfig(precision="bf16", tp=2, activation_checkpointing=("Block",)))
        # numerics:
        #   precision: bf16
        # parallel:
        #   tp: 2
        #   activation_checkpointing:
        #   - Block
    """
    default = TrainConfig()
    doc: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section, base = getattr(cfg, name), getattr(default, name)
        for f in fields(section):
            value = getattr(section, f.name)
            if value != getattr(base, f.name):
                doc.setdefault(name, {})[f.name] = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False) if doc else "{}\n"


def list_to_tuple(value: Any) -> Any:
    """YAML lists become tuples (TrainConfig's tuple fields); anything else is unchanged."""
    return tuple(value) if isinstance(value, list) else value


def _number(kind: str, value: Any, key: str, source: str) -> Any:
    """A number field's value, checked: YAML reads ``1e3`` and ``none`` as text, so text that
    is a number (or none, where the field may be None) is taken as one."""
    base = kind.split(" | ")[0]
    if base not in ("int", "float"):
        return value
    optional = "None" in kind
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    if not isinstance(value, bool):
        if isinstance(value, int) or (base == "float" and isinstance(value, float)):
            return value
        if isinstance(value, str):
            try:
                return float(value) if base == "float" else int(value)
            except ValueError:
                pass
    what = "a whole number" if base == "int" else "a number"
    raise ConfigError(f"{source}: {key} must be {what}{' or none' if optional else ''}, got {value!r}")


def _hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


__all__ = ["load", "parse", "dump"]
