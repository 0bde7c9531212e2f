"""Read a mapping (as loaded from YAML) against the rules declared on the spec's dataclasses.

Every problem is recorded with its path, the rule broken and the value
(``replicas: must be >= 1, got 0``; ``gpu_cont: unknown key (did you mean
'gpu_count'?)``); reading goes on after a problem, with the key's default, so
one pass reports them all. The messages are worded here from the
:class:`~slipstream.job.fields.Rule`, so a key's rule and its message cannot
drift apart.

Example::

    errors = Errors()
    values = read_section({"port": 0}, Serve, "serve", errors, {})
    errors.items     # ["serve.port: must be >= 1, got 0"]
    values["port"]   # 8000 (the default, after the error)
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

from .fields import Rule, rules
from .quantity import parse_quantity, quantity_text


class Errors:
    """Problems found so far, each ``path: message``."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")


def show(value: Any) -> str:
    """A value as errors show it: repr for strings, YAML-ish for the rest, kept short."""
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    if value is None:
        text = "null"
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


def bound_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def read_section(data: Mapping[Any, Any], cls: type, path: str, errors: Errors,
                 scope: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the keys of ``cls`` in ``data``, checked; missing ones get their default.

    ``scope``: values already read at the top level, for defaults taken from
    another key (``elastic.min_replicas`` defaults to ``replicas``). Nested
    sections come back as instances of their dataclass (or None).
    """
    known = rules(cls)
    names = tuple(known)
    for key in data:
        if not isinstance(key, str):
            errors.add(_join(path, str(key)), f"keys must be strings, got {show(key)}")
        elif key not in known:
            hint = difflib.get_close_matches(key, names, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else f"; known keys: {', '.join(names)}"
            errors.add(_join(path, key), f"unknown key{extra}")
    values: dict[str, Any] = {}
    for name, rule in known.items():
        where = _join(path, name)
        raw = data.get(name, None)
        if raw is None:
            if rule.required:
                errors.add(where, f"is required {rule.required}")
            values[name] = _default(rule, name, values, scope)
            continue
        value = _read(rule, raw, where, errors, scope if path else values)
        values[name] = _default(rule, name, values, scope) if value is _INVALID else value
    return values


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _default(rule: Rule, name: str, values: Mapping[str, Any], scope: Mapping[str, Any]) -> Any:
    if rule.kind == "section":
        return None if rule.optional_section else rule.section()
    if rule.default_from is not None:
        source = values if rule.default_from in values else scope
        return source.get(rule.default_from, rule.default)
    return rule.default


_INVALID = object()


def _read(rule: Rule, v: Any, where: str, errors: Errors, scope: Mapping[str, Any]) -> Any:  # noqa: C901 - one branch per kind
    """One given (non-null) value, checked against ``rule``; ``_INVALID`` after recording why not."""
    kind = rule.kind
    if kind == "integer":
        if isinstance(v, bool) or not isinstance(v, int):
            return _fail(errors, where, f"must be a whole number, got {type_name(v)} {show(v)}")
        if rule.minimum is not None and v < rule.minimum:
            return _fail(errors, where, f"must be >= {bound_text(rule.minimum)}, got {v}")
        if rule.maximum is not None and v > rule.maximum:
            return _fail(errors, where, f"must be <= {bound_text(rule.maximum)}, got {v}")
        return v
    if kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            return _fail(errors, where, f"must be a finite number, got {type_name(v)} {show(v)}")
        if rule.minimum is not None and (v <= rule.minimum if rule.exclusive_minimum else v < rule.minimum):
            op = ">" if rule.exclusive_minimum else ">="
            return _fail(errors, where, f"must be {op} {bound_text(rule.minimum)}, got {show(v)}")
        if rule.maximum is not None and v > rule.maximum:
            return _fail(errors, where, f"must be <= {bound_text(rule.maximum)}, got {show(v)}")
        return float(v)
    if kind == "boolean":
        if not isinstance(v, bool):
            return _fail(errors, where, f"must be true or false, got {type_name(v)} {show(v)}")
        return v
    if kind == "string":
        return _read_string(rule, v, where, errors)
    if kind == "choice":
        if rule.default is not None and v == rule.default and type(v) is type(rule.default):
            return v  # the default is always allowed; a computed enum is not asked for it
        allowed = rule.choices()
        if not any(v == a and type(v) is type(a) for a in allowed):
            return _fail(errors, where, f"must be one of {', '.join(map(str, allowed))}, got {show(v)}")
        return v
    if kind == "quantity":
        try:
            amount = parse_quantity(v)
        except ValueError:
            return _fail(errors, where, f"must be a Kubernetes quantity (e.g. 4, 500m, 16Gi), got {type_name(v)} {show(v)}")
        if amount <= 0:
            return _fail(errors, where, f"must be > 0, got {show(v)}")
        return quantity_text(v)
    if kind == "strings":
        if not isinstance(v, list):
            return _fail(errors, where, f"must be a list of strings, got {type_name(v)} {show(v)}")
        bad = [(i, item) for i, item in enumerate(v) if not isinstance(item, str)]
        for i, item in bad:
            errors.add(f"{where}[{i}]", f"must be a string, got {type_name(item)} {show(item)}")
        if bad:
            return _INVALID
        if len(v) < rule.min_items:
            return _fail(errors, where, f"must not be empty, got {show(v)}")
        return tuple(v)
    if kind == "env":
        return _read_env(rule, v, where, errors)
    if kind == "section":
        if not isinstance(v, dict):
            return _fail(errors, where, f"must be a mapping, got {type_name(v)} {show(v)}")
        return rule.section(**read_section(v, rule.section, where, errors, scope))
    raise AssertionError(f"unknown rule kind {kind!r}")


def _read_string(rule: Rule, v: Any, where: str, errors: Errors) -> Any:
    if not isinstance(v, str):
        return _fail(errors, where, f"must be a string, got {type_name(v)} {show(v)}")
    if v == "" or v.strip() != v:
        return _fail(errors, where, f"must be a non-empty string without surrounding spaces, got {show(v)}")
    if rule.max_len is not None and len(v) > rule.max_len:
        return _fail(errors, where, f"must be at most {rule.max_len} characters, got {len(v)} ({show(v)})")
    if rule.pattern is not None and not re.match(rule.pattern, v):
        return _fail(errors, where, f"must be {rule.rule}, got {show(v)}")
    return rule.normalize(v) if rule.normalize else v


def _read_env(rule: Rule, raw: Any, where: str, errors: Errors) -> Any:
    if not isinstance(raw, dict):
        return _fail(errors, where, f"must be a mapping of NAME: value, got {type_name(raw)} {show(raw)}")
    out = []
    for key, value in raw.items():
        path = f"{where}.{key}"
        if not isinstance(key, str) or not re.match(rule.pattern or "", key):
            errors.add(path, f"name must match {(rule.pattern or '').strip('^$')}, got {show(key)}")
            continue
        if any(key == p or (p.endswith("_") and key.startswith(p)) for p in rule.reserved):
            errors.add(path, "is set by the spec itself (sync, checkpoint, data, gpu_slice sections); "
                             "set it there, got an env entry")
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (int, float)) and value == value:
            value = str(value)
        elif not isinstance(value, str):
            errors.add(path, f"must be a string, number or boolean, got {type_name(value)} {show(value)}")
            continue
        out.append((key, value))
    return tuple(out)


def _fail(errors: Errors, where: str, message: str) -> Any:
    errors.add(where, message)
    return _INVALID


__all__ = ["Errors", "read_section", "show", "type_name", "bound_text"]
