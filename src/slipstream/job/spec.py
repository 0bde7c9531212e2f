"""The job spec: one YAML file that runs on a laptop, an emulated cluster and Kubernetes.

``load_spec(path)`` reads and checks a file and returns a frozen :class:`JobSpec`.
Every problem is reported at once, each as ``field: rule, got value``; the
whole lot is raised as one :class:`~slipstream.errors.ConfigError` (exit code 2).

The schema is data: every key is a field of a dataclass in
:mod:`slipstream.job.model` carrying its rule (:mod:`slipstream.job.fields`);
:mod:`slipstream.job.reader` reads a mapping against those rules, and
:mod:`slipstream.job.json_schema` publishes them as a JSON Schema for editors.
This module adds the checks that relate two keys, and reads files. Every key,
with its default, is documented in docs/job.md.

Example::

    spec = load_spec("examples/jobs/mlp.yaml")
    spec.replicas, spec.procs_per_replica   # (2, 1)
    parse_spec({"name": "x", "image": "i", "command": ["python", "t.py"], "replicas": 0})
    # ConfigError: replicas: must be >= 1, got 0
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

import yaml

from ..errors import ConfigError, UsageError
from ..names import JOB_SPEC, rename_nested
from .fields import rules
from .model import (
    GENERATED_ENV_PREFIXES, KINDS, NAME_MAX_CHARS, RDZV_PORT, TIME_SLICED_RESOURCE, Checkpoint, Data, Elastic,
    Entrypoint, GpuSlice, JobSpec, Network, Numerics, Parallel, Restarts, Serve, Slurm, Sync, parse_entrypoint, train_config,
)
from .quantity import parse_quantity
from .reader import Errors, read_section, type_name
from .variables import reference_problems

_URL_SCHEME_RE = re.compile(r"^([a-z][a-z0-9+.\-]*)://")


# ---------------------------------------------------------------------------- checks across keys
# Each takes the values read (top-level keys; sections as their dataclasses, or None)
# and the data as given, and records problems the per-key rules cannot see.


def _command_runs(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    if v["command"] is not None and v["kind"] == "training":
        try:
            parse_entrypoint(list(v["command"]) + list(v["args"]))
        except ValueError as exc:
            errors.add("command", str(exc))


def _processes_fit_gpus(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    procs, gpus = v["processes_per_replica"], v["gpu_count"]
    if procs is not None and gpus and procs > gpus:
        errors.add("processes_per_replica", f"must be <= gpu_count ({gpus}) when GPUs are requested, got {procs}")


def _shm_fits_memory(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    shm, memory = v["shm_size"], v["memory"]
    if shm and memory and parse_quantity(shm) > parse_quantity(memory):
        errors.add("shm_size", f"must be <= memory ({memory}): /dev/shm counts against the memory limit, got {shm!r}")


def _gpu_slice(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    sl: GpuSlice = v["gpu_slice"]
    if sl.mig and sl.time_sliced:
        errors.add("gpu_slice", f"mig and time_sliced are exclusive, got mig {sl.mig!r} and time_sliced true")
    if (sl.mig or sl.time_sliced or sl.memory_fraction is not None) and v["gpu_count"] == 0:
        errors.add("gpu_slice", "needs gpu_count >= 1 (a slice of what?), got gpu_count 0")


def _elastic_range(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    el: Elastic | None = v["elastic"]
    replicas = v["replicas"]
    if el is None:
        return
    if el.min_replicas > replicas:
        errors.add("elastic.min_replicas", f"must be <= replicas ({replicas}), got {el.min_replicas}")
    elif el.max_replicas < replicas:
        errors.add("elastic.max_replicas", f"must be >= replicas ({replicas}), got {el.max_replicas}")


def _checkpoint_mount(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    ck: Checkpoint | None = v["checkpoint"]
    if ck and ck.volume_claim and ck.dir and (_URL_SCHEME_RE.match(ck.dir) or not ck.dir.startswith("/")):
        errors.add("checkpoint.dir", f"must be an absolute path (the volume claim is mounted there), got {ck.dir!r}")


def _data_cache(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    d: Data | None = v["data"]
    if d is None:
        return
    if d.cache_dir is not None and not d.cache_dir.startswith("/") and not d.cache_dir.startswith("."):
        errors.add("data.cache_dir", f"must be a local path (absolute, or relative starting with .), got {d.cache_dir!r}")
    if d.cache_size and not d.cache_dir:
        errors.add("data.cache_size", f"needs data.cache_dir (the size of what?), got {d.cache_size!r}")


def _serve_port(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    if v["serve"] is not None and v["serve"].port == RDZV_PORT:
        errors.add("serve.port", f"must not be {RDZV_PORT} (reserved for the training rendezvous), got {RDZV_PORT}")


def _keys_of_the_kind(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    for key, rule in rules(JobSpec).items():
        if rule.only_for and rule.only_for != v["kind"] and data.get(key) is not None:
            errors.add(key, f"is only for kind {rule.only_for}, got kind {v['kind']}")


def _env_vs_sections(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    """An env entry for a variable a section also sets (``parallel.tp`` and ``SLIPSTREAM_TP``) would fight it."""
    env = dict(v["env"])
    for name, rule in rules(JobSpec).items():
        part = v[name]
        if rule.kind != "section" or part is None:
            continue
        for key, inner in rules(rule.section).items():
            var = f"SLIPSTREAM_{inner.config.upper()}" if inner.config else None
            if var in env and getattr(part, key) is not None:
                errors.add(f"env.{var}", f"is set by {name}.{key} too; set it in one place, got both")


def _engine_accepts(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    """The engine's own checks across its options (``pp_microbatches >= pp`` for 1f1b, a layout that
    fits replicas x processes, ...), run once every key is valid on its own; the message is the
    engine's, under the key it names first."""
    if errors.items or v["kind"] != "training":
        return
    spec = JobSpec(**v)
    try:
        cfg = train_config(spec)
        if spec.min_replicas == spec.max_replicas:  # a fixed world: the layout must fit it
            cfg.degrees(spec.replicas * spec.procs_per_replica)
    except ConfigError as exc:
        errors.add(_key_named(str(exc), data), str(exc))


def _key_named(message: str, data: Mapping[str, Any]) -> str:
    """``parallel.pp_microbatches`` for "pp_microbatches(3) must be >= pp(4) ...": the spec key whose
    engine name comes first in the message (keys the spec gives before the others, the longest name
    at one place); "sync" if none is named."""
    found: list[tuple[bool, int, int, str]] = []
    for name, rule in rules(JobSpec).items():
        if rule.kind == "section":
            given = data.get(name) if isinstance(data.get(name), dict) else {}
            for key, inner in rules(rule.section).items():
                hit = re.search(rf"\b{re.escape(inner.config)}\b", message) if inner.config else None
                if hit:
                    found.append((key not in given, hit.start(), -len(inner.config), f"{name}.{key}"))
    return min(found)[3] if found else "sync"


def _variable_references(v: dict[str, Any], data: Mapping[str, Any], errors: Errors) -> None:
    """``$(VAR)`` references and bytes that would not reach the program with one meaning on every
    target (:func:`slipstream.job.variables.reference_problems`); run once every key is valid."""
    if errors.items:
        return
    spec = JobSpec(**v)
    own = dict(spec.env)
    env = [(f"env.{name}" if name in own else _env_field(name), name, value)
           for name, value in spec.worker_env().items()]
    argv = [(f"command[{i}]", w) for i, w in enumerate(spec.command)]
    argv += [(f"args[{i}]", w) for i, w in enumerate(spec.args)]
    mounts = set()
    if spec.checkpoint and spec.checkpoint.volume_claim:
        mounts.add("checkpoint.dir")
    if spec.data and spec.data.cache_dir and spec.data.cache_dir.startswith("/"):
        mounts.add("data.cache_dir")
    for field, message in reference_problems(env, argv, mounts):
        errors.add(field, message)


_GENERATED_FROM = {"SLIPSTREAM_JOB_NAME": "name", "SLIPSTREAM_DATA_SOURCE": "data.source",
                   "SLIPSTREAM_DATA_CACHE_DIR": "data.cache_dir", "SLIPSTREAM_DATA_PREWARM": "data.prewarm",
                   "SLIPSTREAM_GPU_MEMORY_FRACTION": "gpu_slice.memory_fraction"}


def _env_field(var: str) -> str:
    """The spec key a generated ``SLIPSTREAM_*`` variable is made from (``SLIPSTREAM_CHECKPOINT_DIR``:
    ``checkpoint.dir``); ``env.X`` if none."""
    if var in _GENERATED_FROM:
        return _GENERATED_FROM[var]
    for name, rule in rules(JobSpec).items():
        if rule.kind == "section":
            for key, inner in rules(rule.section).items():
                if inner.config and f"SLIPSTREAM_{inner.config.upper()}" == var:
                    return f"{name}.{key}"
    return f"env.{var}"


CHECKS: tuple[Callable[[dict[str, Any], Mapping[str, Any], Errors], None], ...] = (
    _command_runs, _processes_fit_gpus, _shm_fits_memory, _gpu_slice, _elastic_range, _checkpoint_mount,
    _data_cache, _serve_port, _keys_of_the_kind, _env_vs_sections, _engine_accepts, _variable_references,
)


# ---------------------------------------------------------------------------- reading


def parse_spec(data: Any, source_path: str | None = None) -> JobSpec:
    """Check a mapping (as loaded from YAML) and build a :class:`JobSpec`.

    Raises :class:`ConfigError` listing every problem found.
    """
    where = f"{source_path}: " if source_path else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}the job spec must be a mapping of keys (name, image, command, ...), got {type_name(data)}")
    renamed: dict[str, str] = {}
    try:  # old key names (checkpoint.interval_steps, sync.precision, ...): one warning line each
        data = rename_nested(data, JOB_SPEC, source_path or "job spec", renamed)
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None
    errors = Errors()
    values = read_section(data, JobSpec, "", errors, {})
    for check in CHECKS:
        check(values, data, errors)
    for new, old in renamed.items():  # name the key as the file writes it
        errors.items = [f"{old}{e[len(new):]}" if e.startswith(f"{new}:") else e for e in errors.items]
    if errors.items:
        if len(errors.items) == 1:
            raise ConfigError(f"{where}{errors.items[0]}")
        lines = "\n".join(f"  {e}" for e in errors.items)
        raise ConfigError(f"{where}{len(errors.items)} problems in the job spec:\n{lines}")
    if values["kind"] == "inference":
        values["serve"] = values["serve"] or Serve()
    return JobSpec(**values, source_path=source_path)


# ---------------------------------------------------------------------------- files


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_spec_text(text: str, source_path: str | None = None) -> JobSpec:
    """Parse YAML text into a checked :class:`JobSpec`."""
    where = source_path or "<spec>"
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader)]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML{pos}: {problem}") from None
    docs = [d for d in docs if d is not None]
    if len(docs) != 1:
        raise ConfigError(f"{where}: must hold exactly one YAML document (the job spec), got {len(docs)}")
    return parse_spec(docs[0], source_path=source_path)


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and check a job spec file; see :func:`parse_spec`."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise UsageError(f"job spec not found: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"job spec is a directory, not a file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"cannot read job spec {path}: {exc.strerror}") from None
    return load_spec_text(text, source_path=path)


def is_job_file(path: str) -> bool:
    """True for paths ``slipstream run`` treats as a job spec (``.yaml`` / ``.yml``)."""
    return path.lower().endswith((".yaml", ".yml"))


__all__ = [
    "JobSpec", "GpuSlice", "Restarts", "Elastic", "Checkpoint", "Data", "Sync", "Numerics", "Parallel", "Network", "Slurm", "Serve",
    "Entrypoint", "parse_spec", "load_spec", "load_spec_text", "parse_entrypoint", "is_job_file",
    "RDZV_PORT", "KINDS", "NAME_MAX_CHARS", "TIME_SLICED_RESOURCE", "GENERATED_ENV_PREFIXES", "CHECKS",
]
