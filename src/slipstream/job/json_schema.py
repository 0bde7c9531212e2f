"""The job spec's JSON Schema (draft 2020-12), generated from the rules on the spec's dataclasses.

Editors use it for completion, hover documentation and checking while a spec
is written; ``slipstream validate`` remains the authority. The schema carries
every per-key rule (type, bounds, pattern, enum, default, required keys,
unknown keys refused, keys of the other ``kind`` refused); checks that relate
two keys (``processes_per_replica <= gpu_count``, ``shm_size <= memory``) are
the reader's only.

A copy is committed at ``slipstream/job/schema/jobspec.schema.json`` and
shipped with the package; a test keeps it equal to :func:`schema_text`.
Regenerate it with ``slipstream job schema --out src/slipstream/job/schema/jobspec.schema.json``.

Example::

    import jsonschema, yaml
    jsonschema.validate(yaml.safe_load(open("examples/jobs/full.yaml")), job_schema())
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .fields import Rule, rules
from .model import JobSpec
from .quantity import QUANTITY_RE

SCHEMA_FILE = Path(__file__).resolve().parent / "schema" / "jobspec.schema.json"
"""The committed copy (package data)."""
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def job_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec file, as a dict. Strategy names come from ``slipstream.sync``;
    the defaults of keys the spec leaves to the engine from ``TrainConfig()``."""
    schema: dict[str, Any] = {
        "$schema": DRAFT,
        "title": "Slipstream job spec",
        "description": "One YAML file that runs on a laptop (slipstream run), an emulated cluster and Kubernetes "
                       "(slipstream render/submit). Generated from slipstream.job.model; see docs/job.md.",
    }
    from ..config import TrainConfig

    schema.update(_object(JobSpec, TrainConfig().flat()))
    _deprecated_keys(schema["properties"])
    kinds = {rule.only_for for rule in rules(JobSpec).values() if rule.only_for}
    # Keys of the other kind are refused: "kind: inference" (given) against the training-only keys, and the
    # inference-only keys otherwise (kind defaults to training).
    forbid = {k: {key: False for key, rule in rules(JobSpec).items() if rule.only_for not in (None, k)} for k in kinds}
    schema["if"] = {"properties": {"kind": {"const": "inference"}}, "required": ["kind"]}
    schema["then"] = {"properties": forbid.get("inference", {})}
    schema["else"] = {"properties": forbid.get("training", {})}
    return schema


def _deprecated_keys(props: dict[str, Any]) -> None:
    """The old spellings the reader still takes (slipstream.names.DEPRECATED), as their new key with
    ``deprecated: true``, so an editor marks them rather than refusing a spec the reader accepts."""
    from ..names import JOB_SPEC, REMOVED_IN, nested_aliases

    for old, new in nested_aliases(JOB_SPEC).items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        entry = dict(props[new_section]["properties"][new_key])
        entry["description"] = f"Deprecated (refused from {REMOVED_IN}): write {new}. " + entry.get("description", "")
        entry["deprecated"] = True
        props[old_section]["properties"][old_key] = entry


def schema_text() -> str:
    """:func:`job_schema` as the committed file holds it (2-space indent, trailing newline)."""
    return json.dumps(job_schema(), indent=2, ensure_ascii=False) + "\n"


def _object(cls: type, engine_defaults: dict[str, Any]) -> dict[str, Any]:
    keys = rules(cls)
    out: dict[str, Any] = {
        "type": "object",
        "properties": {name: _property(rule, engine_defaults) for name, rule in keys.items()},
        "additionalProperties": False,
    }
    required = [name for name, rule in keys.items() if rule.required]
    if required:
        out["required"] = required
    return out


def _property(rule: Rule, engine_defaults: dict[str, Any]) -> dict[str, Any]:  # noqa: C901 - one branch per kind
    doc = rule.doc
    if rule.default_doc:
        doc += f" Default: {rule.default_doc}."
    if rule.only_for:
        doc += f" Only for kind {rule.only_for}."
    out: dict[str, Any] = {"description": doc}
    kind = rule.kind
    if kind == "integer":
        out["type"] = "integer"
    elif kind == "number":
        out["type"] = "number"
    elif kind == "boolean":
        out["type"] = "boolean"
    elif kind == "string":
        out.update(type="string", minLength=1)
        if rule.max_len is not None:
            out["maxLength"] = rule.max_len
        if rule.pattern is not None:
            out["pattern"] = rule.pattern
    elif kind == "choice":
        choices = list(rule.choices())
        out.update(type="integer" if isinstance(choices[0], int) else "string", enum=choices)
    elif kind == "quantity":
        out.update(type=["string", "number"], pattern=_ecma(QUANTITY_RE.pattern), exclusiveMinimum=0)
    elif kind == "strings":
        out.update(type="array", items={"type": "string"})
        if rule.min_items:
            out["minItems"] = rule.min_items
    elif kind == "env":
        names: dict[str, Any] = {"pattern": rule.pattern}
        if rule.reserved:
            names["not"] = {"anyOf": [{"pattern": f"^{re.escape(p)}"} if p.endswith("_") else {"const": p}
                                      for p in rule.reserved]}
        out.update(type="object", propertyNames=names,
                   additionalProperties={"type": ["string", "number", "boolean"]})
    elif kind == "section":
        out.update(_object(rule.section, engine_defaults))
    if kind in ("integer", "number") and rule.minimum is not None:
        out["exclusiveMinimum" if rule.exclusive_minimum else "minimum"] = _num(rule.minimum)
    if kind in ("integer", "number") and rule.maximum is not None:
        out["maximum"] = _num(rule.maximum)
    default = rule.default
    if default is None and rule.config is not None:
        default = engine_defaults.get(rule.config)  # "not set" in the spec: the engine's default applies
    if kind == "env":
        out["default"] = {}
    elif default is not None and kind != "section" and rule.default_from is None:
        out["default"] = list(default) if isinstance(default, tuple) else default
    return out


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _ecma(pattern: str) -> str:
    """A Python pattern with named groups as plain groups (ECMA-262 spells them differently)."""
    return re.sub(r"\(\?P<[A-Za-z_]+>", "(", pattern)


__all__ = ["job_schema", "schema_text", "SCHEMA_FILE"]
