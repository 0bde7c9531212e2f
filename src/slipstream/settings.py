"""One declaration per setting: its default, bounds, choices and help on the dataclass field that holds it.

A section of :mod:`slipstream.config` declares each setting with :func:`setting` and checks its bounds
from there (:func:`check_bounds`); ``slipstream run`` makes the setting's flag from the same field
(launch/cli.py), and a job spec key that feeds it (slipstream.job.model, ``config=...``) takes its
default, bounds and help from it. So no boundary restates a setting with bounds of its own, and a
bound changed here changes the library, the flag and the job spec (and its JSON Schema) together.

Torch-free and below the config, so anything may ask it.

Example::

    @dataclass(frozen=True)
    class Section:
        keep_last: int = setting(3, minimum=1)
        \"\"\"Complete checkpoints kept.\"\"\"

        def __post_init__(self) -> None:
            check_bounds(self, {"keep_last": "checkpoint_keep_last"})

    Section(keep_last=0)   # ConfigError: checkpoint_keep_last must be >= 1, got 0
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping

from .errors import ConfigError

BOUNDS_KEY = "bounds"
"""The field metadata key holding a setting's :class:`Bounds` (the others: "choices", "metavar", "help")."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class Bounds:
    """The range a number setting may take (None: unbounded on that side).

    Example::

        Bounds(minimum=0, exclusive_minimum=True).text()   # "> 0"
        Bounds(0, 65535).holds(70000)                       # False
    """

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    excluded: tuple[float, ...] = ()
    """Values inside the range that are refused (a degree's 0, between -1 "the rest" and 1)."""

    def holds(self, value: float) -> bool:
        if value in self.excluded:
            return False
        if self.minimum is not None and (value <= self.minimum if self.exclusive_minimum else value < self.minimum):
            return False
        return self.maximum is None or value <= self.maximum

    def text(self) -> str:
        """The rule in words, as the messages say it: ``>= 1``, ``> 0``, ``<= 1`` or ``in 0..65535``."""
        if self.minimum is not None and self.maximum is not None and not self.exclusive_minimum:
            return f"in {_num(self.minimum)}..{_num(self.maximum)}"
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {_num(self.minimum)}")
        if self.maximum is not None:
            parts.append(f"<= {_num(self.maximum)}")
        return " and ".join(parts) + "".join(f", not {_num(x)}" for x in self.excluded)


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            minimum: float | None = None, maximum: float | None = None, exclusive_minimum: bool = False,
            excluded: tuple[float, ...] = (), **metadata: Any) -> Any:
    """A dataclass field declaring one setting: its default, its bounds, and ``metadata`` such as
    ``choices``, ``metavar`` and ``help`` (the help defaults to the docstring under the field).

    Example::

        every_s: float | None = setting(None, minimum=0, exclusive_minimum=True)
    """
    if minimum is not None or maximum is not None:
        metadata[BOUNDS_KEY] = Bounds(minimum, maximum, exclusive_minimum, excluded)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    """The bounds a field declares (None: none)."""
    return f.metadata.get(BOUNDS_KEY)


def check_bounds(obj: Any, names: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` for the first field of ``obj`` outside its declared bounds, named by
    ``names`` (field -> the name users write, e.g. ``keep_last`` -> ``checkpoint_keep_last``).
    An ``X | None`` field may be None; an ``int`` field must hold a whole number (a bool is not one).

    Example::

        check_bounds(CheckpointConfig(), CheckpointConfig.FLAT)   # passes: the defaults are in bounds
    """
    for f in dataclasses.fields(obj):
        bounds = bounds_of(f)
        if bounds is None:
            continue
        value, kind = getattr(obj, f.name), str(f.type)
        optional = "None" in kind
        if value is None and optional:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind.startswith("int"):
            number = number and isinstance(value, int)
        if not (number and bounds.holds(value)):
            raise ConfigError(f"{names.get(f.name, f.name)} must be {bounds.text()}{' or None' if optional else ''}, "
                              f"got {value!r}")


def field_docs(module: ModuleType) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring written under the field in ``module``'s source
    (empty without the source, as in a frozen install).

    Example::

        field_docs(slipstream.config)[("NumericsConfig", "precision")]   # "fp32, bf16 (autocast) or ..."
    """
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return {}
    docs = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for a, b in zip(cls.body, cls.body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                docs[(cls.name, a.target.id)] = inspect.cleandoc(b.value.value)
    return docs


def first_sentence(text: str) -> str:
    """A docstring's first sentence, without its full stop, in lower case unless it starts with a
    name (the help line of a flag).

    Example::

        first_sentence("Complete checkpoints kept; older ones are deleted.")   # "complete checkpoints kept; ..."
    """
    text = " ".join(text.replace("``", "").split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    text = (match.group(1) if match else text).rstrip(".")
    return text[0].lower() + text[1:] if text[1:2].islower() else text


__all__ = ["BOUNDS_KEY", "Bounds", "bounds_of", "check_bounds", "field_docs", "first_sentence", "setting"]
