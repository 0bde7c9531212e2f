"""The run config of ``slipstream run --config FILE``: TrainConfig's fields and launcher settings as YAML.

Training options are TrainConfig's keys, in either spelling, mixed freely:

* flat names, as the flags and ``SLIPSTREAM_*`` variables spell them::

      precision: bf16
      checkpoint_dir: /ckpt
      activation_checkpointing: [Block]

* nested sections (``sync``, ``numerics``, ``parallel``, ``checkpoint``,
  ``metrics``, ``run``) with their field names, the job spec's names too::

      numerics: {precision: bf16, accumulate_steps: 4}
      checkpoint:
        dir: /ckpt
        every_steps: 500

``sync`` is both a section and a flat name: ``sync: powersgd`` names the
strategy, ``sync: {strategy: powersgd, options: {rank: 4}}`` is the section.
Tuple fields take a YAML list or a comma-separated string.

Launcher settings (what ``slipstream run`` takes besides the script and the training
options: ``nproc_per_node``, ``nnodes``, ``max_restarts``, ``rdzv_endpoint``, ``rdzv_conf``,
``backend``, ...) are the flags' names with underscores, flat or in a ``launch`` section::

      nproc_per_node: 4
      launch: {nnodes: 2, max_restarts: 3, rdzv_endpoint: "node0:29400"}

An unknown key, a key given twice or a value TrainConfig refuses is a :class:`ConfigError`
(exit 2) whose one line starts with the file's name and suggests the closest key. An old
spelling (``sync.precision``, ``checkpoint.interval_steps``: slipstream.names) is read with one
warning line naming the new one.

Precedence in ``slipstream run``: flags override the file, which overrides the
``SLIPSTREAM_*`` (and torchrun's ``PET_*``) environment, which overrides the built-in defaults.

:func:`dump` writes the same format (nested sections, non-default values only),
so a file another tool writes (``slipstream plan --write-config``) is one
``slipstream run --config`` reads.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Collection

import yaml

from ..config import FLAT_NAMES, SECTIONS, TrainConfig
from ..errors import ConfigError
from ..names import RUN_CONFIG, rename_nested

LAUNCH_SECTION = "launch"
"""The section of launcher settings (they may also be written flat)."""


@dataclass(frozen=True)
class RunFile:
    """A run config, read and checked: training options by flat name, launcher settings by flag name."""

    train: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    """By the flag's name with underscores (``nproc_per_node``), values as written (the launcher converts them)."""


def read(path: str, launch_keys: Collection[str] = ()) -> RunFile:
    """Run config ``path``, checked; ``launch_keys``: the launcher settings it may hold.

    Example::

        # run.yaml:  {nproc_per_node: 2, precision: bf16}
        read("run.yaml", {"nproc_per_node", "nnodes"})   # RunFile(train={"precision": "bf16"}, launch={"nproc_per_node": 2})
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the run config: {exc.strerror or exc}") from None
    return parse_file(text, path, launch_keys)


def load(path: str) -> dict[str, Any]:
    """The training options of run config ``path``, by flat name, checked.

    Example::

        # run.yaml:  numerics: {precision: bf16}
        #            checkpoint_dir: /ckpt
        load("run.yaml")   # {"precision": "bf16", "checkpoint_dir": "/ckpt"}
        TrainConfig(**load("run.yaml")).numerics.precision   # "bf16"
    """
    return read(path).train


def parse(text: str, source: str = "<run config>") -> dict[str, Any]:
    """:func:`load` for text already read; ``source`` names it in errors.

    Example::

        parse("precision: bf16\\nparallel: {tp: 2}")   # {"precision": "bf16", "tp": 2}
        parse("precison: bf16", "run.yaml")
        # ConfigError: run.yaml: unknown key 'precison' (did you mean precision?); ...
    """
    return parse_file(text, source).train


def parse_file(text: str, source: str = "<run config>", launch_keys: Collection[str] = ()) -> RunFile:
    """:func:`read` for text already read; ``source`` names it in errors."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if doc is None:
        return RunFile()
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a run config is a mapping of training options, got a {type(doc).__name__}")
    try:
        doc = rename_nested(doc, RUN_CONFIG, source)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    launch: dict[str, Any] = {}

    def put_launch(key: str, value: Any) -> None:
        if key in launch:
            raise ConfigError(f"{source}: {key} is given twice ({key} and {LAUNCH_SECTION}.{key}); keep one")
        launch[key] = value

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
        if key == LAUNCH_SECTION and launch_keys and isinstance(value, dict):
            for leaf, leaf_value in value.items():
                if str(leaf) not in launch_keys:
                    raise ConfigError(f"{source}: unknown key {key}.{leaf}{_hint(str(leaf), list(launch_keys))}; "
                                      f"{key} has {', '.join(launch_keys)}")
                put_launch(str(leaf), leaf_value)
        elif key in launch_keys:
            put_launch(key, value)
        elif key in SECTIONS and isinstance(value, dict):
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
            launcher = f", or launcher settings ({', '.join(launch_keys)})" if launch_keys else ""
            raise ConfigError(f"{source}: unknown key {key!r}{_hint(key, [*FLAT_NAMES, *SECTIONS, *launch_keys])}; "
                              f"keys are TrainConfig's flat names or its sections ({', '.join(SECTIONS)}){launcher}")
    try:
        TrainConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong kind, e.g. a list where a number goes
        raise ConfigError(f"{source}: {exc}") from None
    return RunFile(values, launch)


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


__all__ = ["RunFile", "LAUNCH_SECTION", "read", "parse_file", "load", "parse", "dump"]
