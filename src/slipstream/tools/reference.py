"""docs/reference.md, generated from the code: ``accelerate()``, the run object and every option.

Every ``TrainConfig`` field comes from the dataclasses in ``slipstream/config.py``
(flat name, nested name, ``slipstream run`` flag, ``SLIPSTREAM_*`` variable, type
and bounds, default, unit, and the docstring under the field); ``accelerate()``, ``init()``,
``shutdown()``, the run object (:class:`slipstream.train.Accelerated`) and
:class:`slipstream.StepResult` from their signatures and docstrings. A field
without a docstring, or a number without a unit, stops the generator, so the
page cannot leave one out; ``tests/docs/test_reference.py`` regenerates it and
compares.

Example::

    python3 -m slipstream.tools.reference            # rewrite docs/reference.md
    python3 -m slipstream.tools.reference --check    # exit 1 when docs/reference.md is stale
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

from .. import config as config_module
from .. import settings
from ..config import ENV_PREFIX, SECTIONS, TrainConfig
from ..launch.cli import train_flags

OUT = Path("docs") / "reference.md"

# The unit of every number, by flat name; names that carry their unit (_s, _mb, _steps, _port)
# are read from the suffix. A new numeric field without either stops the generator.
UNITS: dict[str, str] = {
    "accumulate_steps": "micro-steps",
    "grad_clip_norm": "global gradient 2-norm",
    "dp_replicate": "ranks",
    "dp_shard": "ranks",
    "tp": "ranks",
    "pp": "pipeline stages (ranks)",
    "pp_microbatches": "micro-batches",
    "zero_stage": "ZeRO stage (2 or 3)",
    "checkpoint_keep_last": "checkpoints",
    "checkpoint_max_failures": "failed saves in a row",
    "flops_per_sample": "FLOPs",
    "peak_flops": "FLOP/s",
    "straggler_threshold": "fraction of the median rank's compute time",
}
SUFFIX_UNITS = (("_s", "seconds"), ("_mb", "MiB (2**20 bytes)"), ("_steps", "optimizer steps"), ("_port", "TCP port"))


class ReferenceError(Exception):
    """The code lacks what the reference needs (a field's docstring, a number's unit)."""


def field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring written under the field in config.py.

    Example::

        field_docs()[("NumericsConfig", "precision")]   # "fp32, bf16 (autocast) or ..."
    """
    return settings.field_docs(config_module)


def unit_of(flat: str, kind: str) -> str:
    """The unit of a field, or "" for a non-number (text, switch, list, mapping)."""
    if flat in UNITS:
        return UNITS[flat]
    for suffix, unit in SUFFIX_UNITS:
        if flat.endswith(suffix):
            return unit
    if kind.split(" ")[0] in ("int", "float") and "|" not in kind.replace(" | None", ""):
        raise ReferenceError(f"TrainConfig field {flat} ({kind}) has no unit: add it to UNITS in {__name__}")
    return ""


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_section() -> list[str]:
    docs = field_docs()
    flags = {f.flat: f.flag for f in train_flags()}
    lines = [
        "## `TrainConfig`: every option",
        "",
        inspect.cleandoc(TrainConfig.__doc__ or ""),
        "",
        "Each option has one flat name, used by `accelerate(**options)`, `TrainConfig(**flat)`, the "
        "`SLIPSTREAM_<FLAT NAME>` variable and the `slipstream run` flag, and a nested name, used by "
        "`run.config.<section>.<field>` and the sections of a run config file (`--config RUN.yaml`). "
        "The environment, which `slipstream run` fills from its flags, its run config or a job spec, wins over "
        "values given in code, and rank 0 names each value it replaced (launcher.md, \"Which value wins\").",
        "",
    ]
    for section, cls in SECTIONS.items():
        lines += [f"### `{section}`: {cls.__name__}", "", _cell(inspect.cleandoc(cls.__doc__ or "")), "",
                  "| option (flat name) | nested name | flag | type | default | unit | meaning |",
                  "|---|---|---|---|---|---|---|"]
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for leaf, flat in cls.FLAT.items():
            f = by_name[leaf]
            doc = docs.get((cls.__name__, leaf))
            if not doc:
                raise ReferenceError(f"TrainConfig field {section}.{leaf} (flat name {flat}) has no docstring in "
                                     "config.py: write one line under the field")
            kind = str(f.type)
            unit = unit_of(flat, kind)
            default = _default(f)
            shown = "none" if default is None else repr(default)
            bounds = settings.bounds_of(f)  # the declared range, as TrainConfig checks it
            kind_cell = f"`{_cell(kind)}`" + (f", {bounds.text()}" if bounds else "")
            lines.append(f"| `{flat}` | `{section}.{leaf}` | `{flags.get(flat, '')}` | {kind_cell} | `{_cell(shown)}` | "
                         f"{unit or '-'} | {_cell(doc)} |")
        lines.append("")
    lines += [f"Environment: `{ENV_PREFIX}` + the flat name in capitals (`SLIPSTREAM_PRECISION=bf16`); "
              "lists comma-separated, `sync_options` as JSON, `none` for no value.", ""]
    return lines


def _signature(name: str, obj: Callable[..., Any]) -> str:
    sig = str(inspect.signature(obj)).replace("'", "")
    return f"{name}{sig}"


def _doc(obj: Any) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "").replace("::\n", ":\n")


def _function(title: str, obj: Callable[..., Any]) -> list[str]:
    doc = _doc(obj)
    if not doc:
        raise ReferenceError(f"{title} has no docstring")
    return [f"### `{title}`", "", "```python", _signature(title, obj), "```", "", doc, ""]


def run_object_section() -> list[str]:
    from ..train import Accelerated, StepResult

    lines = ["## The run object: `Accelerated`", "", _doc(Accelerated), "",
             "| attribute | what it is |", "|---|---|"]
    methods = []
    for name, member in inspect.getmembers(Accelerated):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            doc = _doc(member.fget) or ATTRIBUTES.get(name, "")
            if not doc:
                raise ReferenceError(f"run.{name} has no docstring: write one, or describe it in ATTRIBUTES")
            lines.append(f"| `run.{name}` (property) | {_cell(doc)} |")
        elif inspect.isfunction(member):
            methods.append((name, member))
    for name in _instance_attributes(Accelerated):
        if name not in ATTRIBUTES:
            raise ReferenceError(f"run.{name} (set in Accelerated.__init__) is not described: add it to ATTRIBUTES")
        lines.append(f"| `run.{name}` | {ATTRIBUTES[name]} |")
    lines.append("")
    for name, member in methods:
        if not _doc(member):
            continue  # state_dict plumbing without a docstring is not part of the loop's API
        lines += [f"### `run.{name}`", "", "```python",
                  _signature(f"run.{name}", member).replace("(self, ", "(").replace("(self)", "()"), "```", "",
                  _doc(member), ""]
    lines += ["## `StepResult`: what `run.step()` returns", "", _doc(StepResult), "",
              "| field | type | meaning |", "|---|---|---|"]
    docs = _class_field_docs(StepResult)
    for f in dataclasses.fields(StepResult):
        lines.append(f"| `{f.name}` | `{f.type}` | {_cell(docs.get(f.name, '-'))} |")
    lines.append("")
    return lines


ATTRIBUTES = {
    "device": "the device this rank computes on (`run.runtime.device`)",
    "layout": "the parallel layout in force (DDP with a sync strategy, or a device mesh); "
              "`run.describe_layout()` says which",
    "scaler": "the fp16 gradient scaler (None in fp32 and bf16)",
    "progress": "the heartbeat reporter that hang diagnosis reads (None on one rank)",
    "optimizer": "the optimizer (built over the layout's parameters when given as a factory)",
    "config": "the `TrainConfig` in force (`run.config.numerics.precision`, ...)",
    "runtime": "the `Runtime` of `slipstream.init()`: rank, world size, device, backend",
    "recorder": "the metrics recorder; `run.recorder.run_dir` is the run directory, `run.recorder.sources` "
                "takes callables whose dict joins every metrics record",
    "scheduler": "the learning-rate scheduler, stepped after every optimizer step (or None)",
    "step_count": "optimizer steps done so far (restored on resume: loop `while run.step_count < total`)",
    "resumed_from_step": "the checkpoint step this run resumed from, or None",
    "last_grad_norm": "the global gradient norm of the last measured step (a tensor), or None",
    "checkpoints": "the checkpoint manager when `checkpoint_dir` is set, else None",
    "healer": "under `slipstream run` with healing in place on (its default; `--no-heal` turns it off), when "
              "this run heals in place: the rank's "
              "`slipstream.resilience.heal.Healer` (`heals`, `last_heal_s`, `generation`); else None",
}


def _instance_attributes(cls: type) -> list[str]:
    """Public ``self.X = ...`` names of ``cls.__init__``, in order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names: list[str] = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    and not t.attr.startswith("_") and t.attr not in names):
                names.append(t.attr)
    return names


def _class_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    return {a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(node.body, node.body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def render() -> str:
    """The whole page, as text.

    Example::

        Path("docs/reference.md").write_text(render())
    """
    from ..process import runtime
    from ..train import accelerate

    lines = [
        "# Reference: `accelerate()`, the run object, every option",
        "",
        "<!-- Generated by `python3 -m slipstream.tools.reference` from the code (slipstream/config.py, "
        "train/facade.py, train/step_result.py, runtime.py); do not edit: tests/docs/test_reference.py "
        "fails when this page and the code differ. -->",
        "",
        "For the loop these make, see the README's script and [training.md](training.md); for the launcher's "
        "own options (torchrun's), [launcher.md](launcher.md).",
        "",
        "## Functions",
        "",
        *_function("slipstream.init", runtime.init),
        *_function("slipstream.accelerate", accelerate),
        *_function("slipstream.shutdown", runtime.shutdown),
        *run_object_section(),
        *config_section(),
    ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> tuple[int, str]:
    """(exit code, message) of ``python3 -m slipstream.tools.reference [--check] [OUT.md]``."""
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"]
    if any(a.startswith("-") for a in paths) or len(paths) > 1:
        return 2, "usage: python3 -m slipstream.tools.reference [--check] [OUT.md]"
    out = Path(paths[0]) if paths else OUT
    try:
        text = render()
    except ReferenceError as exc:
        return 2, f"slipstream.tools.reference: {exc}"
    if check:
        if not out.exists() or out.read_text() != text:
            return 1, f"{out} is stale: run python3 -m slipstream.tools.reference"
        return 0, f"{out} is up to date"
    out.write_text(text)
    return 0, f"wrote {out}"


if __name__ == "__main__":
    code, message = main(sys.argv[1:])
    print(message, file=sys.stderr if code else sys.stdout)
    sys.exit(code)
