"""``slipstream plan``: rank layouts of a model on a cluster by predicted time to train and cost.

    slipstream plan --model gpt-7b --gpus 64 --gpu-type H100 --network 8x400gbit-ib --tokens 300B
    slipstream plan --model resnet50 --gpus 16 --gpu-type V100 --network 25gbit-roce \
        --write-config plan.yaml --write-job job.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from .. import __version__, sync
from ..errors import ConfigError, UsageError, did_you_mean
from .costmodel import FRAMEWORKS, Layout
from .lowcomm import LowCommPlan, low_comm, per_step_name
from .planner import PlanResult, fmt_s, plan
from .specs import GIB, GPUS, MODELS

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str, flag: str) -> float:
    """``300B`` -> 3e11, ``1.2M`` -> 1.2e6, ``5e9`` -> 5e9."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbgt]?)\s*$", str(text).lower())
    if not m:
        raise ConfigError(f"{flag}: expected a number such as 300B, 1.2M or 5e9, got {text!r}")
    value = float(m.group(1)) * _SUFFIX[m.group(2)]
    if value <= 0:
        raise ConfigError(f"{flag}: must be > 0, got {text!r}")
    return value


def parse_shape(text: str) -> tuple[int, ...]:
    """``3,32,32`` -> (3, 32, 32): one sample's input shape."""
    try:
        dims = tuple(int(x) for x in str(text).replace("x", ",").split(",") if x.strip())
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"--input-shape: expected positive integers such as 3,32,32, got {text!r}")
    return dims


KNOWN_NETWORKS = ("1gbit", "10gbit", "25gbit-roce", "100gbit-roce", "100gbit-ib", "200gbit-ib", "400gbit-ib",
                  "8x400gbit-ib", "200mbit@2ms", "100mbit,40ms")
"""Example --network SPECs, listed when one is refused."""


def check_network(text: str) -> None:
    """Refuse a --network SPEC the planner would misread, with the examples and the closest.

    ``400GB-ib`` (capital B: gigabytes) was read as 400 Gbit/s, eight times too slow:
    rates are in bits, so a byte unit is an error that says both readings.

    Example::

        check_network("400GB-ib")
        # ConfigError: --network: rates are in bits (gbit), got 'GB' (bytes) in '400GB-ib': 400gbit-ib means ...
    """
    from .network import FABRICS, parse_network

    known = f"known forms: {', '.join(KNOWN_NETWORKS)} (fabrics: {', '.join(FABRICS)})"
    m = re.match(r"^\s*(?:\d+\s*x\s*)?(\d+(?:\.\d+)?)\s*([kKmMgGtT])B(?:ps|/s)?\b", text)
    if m:
        bits = text.replace(m.group(2) + "B", m.group(2).lower() + "bit", 1).lower()
        raise ConfigError(f"--network: rates are in bits, got {m.group(2)}B (bytes) in {text!r}: "
                          f"did you mean {bits!r}? ({known})")
    try:
        parse_network(text)
    except ConfigError as exc:
        fabric = re.split("[@,]", text.rsplit("-", 1)[-1])[0].lower() if "-" in text else ""
        hint = did_you_mean(fabric, tuple(FABRICS), quote=True) if fabric and fabric not in FABRICS else ""
        raise ConfigError(f"{exc}{hint}; {known}") from None


def check_plan_args(args: argparse.Namespace) -> None:
    """Every ``plan`` argument's rule, before any model is built: flag, rule and value."""
    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--global-batch", args.global_batch),
                        ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {value}")
    check_network(args.network)
    if args.framework not in FRAMEWORKS:
        raise ConfigError(f"--framework: must be one of {', '.join(FRAMEWORKS)}, got {args.framework!r}"
                          f"{did_you_mean(args.framework, tuple(FRAMEWORKS), quote=True)}")
    if args.input_shape is not None:
        parse_shape(args.input_shape)
    for flag, path in (("--write-config", args.write_config), ("--write-job", args.write_job)):
        if path is not None and (Path(path).is_dir() or not Path(path).resolve().parent.is_dir()):
            raise ConfigError(f"{flag}: must be a file path in an existing directory, got {path!r}")
    if args.link_calibration is not None and not Path(args.link_calibration).is_file():
        raise ConfigError(f"--link-calibration: no such file: {args.link_calibration!r}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="rank parallel layouts by predicted time to train and cost",
        description="Predict step time, memory per GPU, scaling efficiency, time to train and cost of every "
                    "layout (DDP with each sync strategy, FSDP/HSDP, tensor and pipeline parallel, micro-batch, "
                    "accumulation, activation checkpointing) of a model on a cluster; print the best as a table "
                    "and write the chosen config. Equations and validation: docs/plan.md.",
    )
    p.add_argument("--model", required=True, metavar="SPEC",
                   help=f"built-in model ({', '.join(MODELS)}), your own as PATH.py:FUNCTION (a function that "
                        "builds the nn.Module; measured on the meta device) or a Hugging Face config.json "
                        "(needs transformers)")
    p.add_argument("--input-shape", metavar="DIMS",
                   help="one sample's input shape for PATH.py:FUNCTION models, e.g. 3,32,32 (default: "
                        "sample_input(model) in the file, else inferred from the first layer)")
    p.add_argument("--explain", action="store_true",
                   help="break the chosen layout's step and memory down term by term, each with its source")
    p.add_argument("--gpus", required=True, type=int, metavar="N", help="GPUs in all")
    p.add_argument("--gpu-type", required=True, metavar="T", help=f"GPU: {', '.join(GPUS)}")
    p.add_argument("--network", required=True, metavar="SPEC",
                   help="inter-node link per node: [Kx]RATE[-FABRIC][@LATENCY|,RTT], e.g. 25gbit-roce, "
                        "100gbit-ib, 1gbit, 100mbit,40ms (RTT: the round trip between nodes, as --link writes it)")
    p.add_argument("--link-calibration", metavar="FILE",
                   help="measured inter-node link (probe_link figures as JSON, or a benchmarks/plan_validation.py "
                        "result: the link named by --network) instead of the SPEC's nominal rate")
    p.add_argument("--framework", default="ddp", metavar="NAME",
                   help=f"how gradients are fused and launched: {', '.join(FRAMEWORKS)} (default ddp, what slipstream "
                        "runs; the others are the frameworks of the published record, python -m "
                        "slipstream.plan.published, to compare a prediction with a published measurement)")
    p.add_argument("--gpus-per-node", type=int, metavar="K", help="GPUs per node (default: the GPU type's usual, 8)")
    p.add_argument("--price", type=float, metavar="PER_GPU_HOUR", help="price per GPU-hour (default: a rough list price)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", metavar="TOTAL", help="tokens to train on (transformers), e.g. 300B")
    g.add_argument("--samples", metavar="TOTAL", help="samples to train on, e.g. 115M (default: 90 ImageNet epochs)")
    p.add_argument("--global-batch", type=int, metavar="B", help="samples per optimizer step (default: the model's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: bf16 where the GPU has it, else fp16")
    p.add_argument("--top", type=int, default=10, help="rows in the table (default 10)")
    p.add_argument("--script", default="train.py", help="training script named in the written run command and job")
    p.add_argument("--image", default=f"slipstream:{__version__}",
                   help="container image for --write-job (default: the one scripts/build_image.sh builds)")
    p.add_argument("--write-config", metavar="PATH",
                   help="write the chosen layout as a run config for `slipstream run --config PATH` "
                        "(the run command and the prediction as comments)")
    p.add_argument("--write-job", metavar="PATH", help="write a job spec YAML for the chosen layout (slipstream validate)")
    p.add_argument("--probe-memory", action="store_true",
                   help="on a CUDA GPU: find the largest micro-batch that fits by trying forward+backward")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON instead of a table")
    p.set_defaults(func=main)


def run_flags(layout: Layout, nodes: int, gpus_per_node: int) -> list[str]:
    """``slipstream run`` flags that reproduce ``layout``."""
    flags = ["--nnodes", str(nodes), "-n", str(gpus_per_node)]
    for name, value in (("--dp-replicate", layout.dp_replicate), ("--dp-shard", layout.dp_shard),
                        ("--tp", layout.tp), ("--pp", layout.pp)):
        if value > 1:
            flags += [name, str(value)]
    if layout.pp > 1:
        flags += ["--pp-schedule", layout.pp_schedule, "--pp-microbatches", str(layout.pp_microbatches)]
    if layout.dp_shard > 1:
        flags += ["--zero-stage", str(layout.zero_stage)]
    plain = sync.describe(layout.sync).kind is sync.SyncKind.REDUCER  # DDP's reducer: the default, no flag
    if layout.dp_shard == 1 and layout.dp_replicate > 1 and not plain:
        flags += ["--sync", layout.sync]
    flags += ["--precision", layout.precision]
    if layout.accumulate_steps > 1:
        flags += ["--accumulate-steps", str(layout.accumulate_steps)]
    return flags


def _ckpt_classes(model) -> list[str]:
    # TrainConfig.activation_checkpointing takes module class names: the user's model's own repeated
    # block when it was measured, else the usual block names.
    if model.block_class:
        return [model.block_class]
    return {"transformer": ["Block"], "cnn": ["Bottleneck"], "mlp": ["Linear"]}.get(model.kind, ["Block"])


def layout_env(result: PlanResult, layout: Layout) -> dict[str, str]:
    """TrainConfig fields of the layout as SLIPSTREAM_* variables (config.py reads SLIPSTREAM_<FIELD>)."""
    env = {"SLIPSTREAM_DP_REPLICATE": str(layout.dp_replicate), "SLIPSTREAM_DP_SHARD": str(layout.dp_shard),
           "SLIPSTREAM_TP": str(layout.tp), "SLIPSTREAM_PP": str(layout.pp)}
    if layout.pp > 1:
        env["SLIPSTREAM_PP_SCHEDULE"] = layout.pp_schedule
        env["SLIPSTREAM_PP_MICROBATCHES"] = str(layout.pp_microbatches)
    if layout.dp_shard > 1:
        env["SLIPSTREAM_ZERO_STAGE"] = str(layout.zero_stage)
    if layout.activation_checkpointing:
        env["SLIPSTREAM_ACTIVATION_CHECKPOINTING"] = ",".join(_ckpt_classes(result.model))
    return env


NODE0_HOST = "NODE0_HOST"  # the placeholder the user replaces in a several-node command
RDZV_PORT = 29500  # torchrun's usual store port


def rendezvous_flags(nodes: int) -> list[str]:
    """Across nodes, the rendezvous store every node joins (``slipstream run`` refuses --nnodes
    above 1 without one): the first node's address, a placeholder to fill in, and a port."""
    return ["--rdzv-endpoint", f"{NODE0_HOST}:{RDZV_PORT}"] if nodes > 1 else []


def rendezvous_note(nodes: int) -> str | None:
    if nodes <= 1:
        return None
    return (f"Run it on each of the {nodes} nodes, with {NODE0_HOST} replaced by an address of the first node "
            f"that every node reaches (that node hosts the rendezvous store on port {RDZV_PORT}; any free port "
            f"does). Your own script replaces train.py.")


def diloco_command(result: PlanResult, low: LowCommPlan | None, script: str) -> str | None:
    """The ``slipstream run`` line of the low-communication recommendation (None without one):
    the plain data-parallel layout's flags, then ``--sync diloco --sync-options '{...}'``."""
    rec = low.advice.recommendation if low is not None else None
    if rec is None:
        return None
    assert low is not None
    layout = dataclasses.replace(low.base.layout, sync="allreduce")
    flags = run_flags(layout, result.nodes, min(result.gpus, result.gpus_per_node))
    flags[4:4] = rendezvous_flags(result.nodes)
    return "slipstream run " + " ".join(shlex.quote(f) for f in [*flags, *rec.setting.run_flags(), script])


def config_doc(result: PlanResult, script: str) -> dict[str, Any]:
    c = result.best
    L, p = c.layout, c.prediction
    flags = run_flags(L, result.nodes, min(result.gpus, result.gpus_per_node))
    flags[4:4] = rendezvous_flags(result.nodes)  # after --nnodes N -n K
    return {
        "run": "slipstream run " + " ".join(shlex.quote(f) for f in [*flags, script]),
        "train": L.train_fields(tuple(_ckpt_classes(result.model))),
        "micro_batch": L.micro_batch, "global_batch": L.global_batch,
        "cluster": {"gpus": result.gpus, "gpu_type": result.gpu.name, "gpus_per_node": result.gpus_per_node,
                    "nodes": result.nodes, "network": result.network.spec},
        "prediction": {"step_s": round(p.step_s, 6), "exposed_comm_s": round(p.exposed_comm_s, 6),
                       "bubble_s": round(p.bubble_s, 6), "memory_gib": round(p.memory_bytes / GIB, 2),
                       "scaling_efficiency": round(p.scaling_efficiency, 4),
                       "time_to_train_s": round(c.time_to_train_s, 1), "cost": round(c.cost, 2)},
    }


def check_train_config(train: dict[str, Any]) -> None:
    """The written layout must be one TrainConfig accepts (names, degrees, schedule rules)."""
    from .planner import train_config_error

    err = train_config_error(train)
    if err:
        raise ConfigError(f"internal: the chosen layout is not a valid TrainConfig: {err}")


def job_doc(result: PlanResult, script: str, image: str) -> dict[str, Any]:
    L = result.best.layout
    name = re.sub(r"[^a-z0-9-]", "-", f"plan-{result.model.name}".lower())[:40].strip("-")
    return {
        "name": name, "image": image, "command": ["python", script],
        "replicas": result.nodes, "gpu_count": min(result.gpus, result.gpus_per_node),
        "env": layout_env(result, L),
        "sync": {"strategy": L.sync if L.dp_shard == 1 else "allreduce"},
        "numerics": {"precision": L.precision, "accumulate_steps": L.accumulate_steps},
    }


def run_config_text(doc: dict[str, Any], header: str) -> str:
    """The chosen layout as a run config (``slipstream run --config``): the format of
    :func:`slipstream.launch.run_config.dump`, with the run command, batch sizes,
    cluster and prediction as comments above it (the launcher settings stay in the run command).
    """
    from ..config import TrainConfig
    from ..launch.run_config import dump

    facts = {key: doc[key] for key in ("micro_batch", "global_batch", "cluster", "prediction")}
    notes = [f"run: {doc['run']}", *yaml.safe_dump(facts, sort_keys=False).splitlines()]
    return header + "".join(f"# {line}\n" for line in notes) + dump(TrainConfig(**doc["train"]))


def _write_text(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _write_yaml(path: str, doc: dict, header: str) -> None:
    _write_text(path, header + yaml.safe_dump(doc, sort_keys=False))


MEMORY_WARN_FRACTION = 0.90
"""Warn when the chosen layout's predicted memory is above this fraction of the device's memory:
the prediction is a model (fragmentation, library workspaces and the data loader vary by a few
GiB), so a pick above it may not fit when run."""

# One entry per part of a layout name (costmodel.Layout.label): (pattern, how it is written, meaning).
_LEGEND = (
    (r"(?:^|x)ddp\d", "ddpN", ("N data-parallel replicas (DDP: each holds the whole model; the sync column "
                              "is their gradient sync)")),
    (r"fsdp\d+\(z\d\)", "fsdpN(zS)", ("the model sharded over N data-parallel ranks (FSDP), ZeRO stage S: 3 "
                                     "re-gathers parameters in backward (least memory), 2 keeps them "
                                     "gathered through backward (one all-gather per step)")),
    (r"(?:^|x)tp\d", "tpN", "tensor parallel: each layer's weights split over N GPUs"),
    (r"pp\d+\(", "ppN(S,mM)", ("pipeline parallel: N stages, schedule S (gpipe or 1f1b), M micro-batches "
                           "per step")),
    (r"^single$", "single", "one GPU, no parallelism"),
)


def terminal_width() -> int:
    """The terminal's columns (``COLUMNS`` first, as :func:`shutil.get_terminal_size` reads it);
    120 when the output is not a terminal."""
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


def layout_legend(labels: list[str]) -> list[str]:
    """What the parts of ``labels`` (as the table shows them) and the table's short columns mean.

    Example::

        layout_legend(["ddp8xfsdp8(z3)"])
        # ['layouts: ddpN = N data-parallel replicas ...', '  fsdpN(zS) = ...', '  AxB = ...', ...]
    """
    parts = [f"{name} = {meaning}" for pattern, name, meaning in _LEGEND
             if any(re.search(pattern, label) for label in labels)]
    if any("x" in label for label in labels):
        parts.append("AxB = both at once (N ranks in all = the product; device mesh pp, ddp, fsdp, tp, "
                     "tp innermost)")
    parts.append("micro x acc = micro-batch per rank x micro-batches per optimizer step; ckpt = activation "
                 "checkpointing; mem/GPU = predicted / usable GiB")
    return [f"{'layouts: ' if i == 0 else '  '}{part}" for i, part in enumerate(parts)]


def memory_warning(result: PlanResult) -> str | None:
    """A warning when the chosen layout leaves under 10% of the device's memory free
    (:data:`MEMORY_WARN_FRACTION`), naming the best layout that leaves more."""
    device = result.gpu.memory_bytes
    limit = MEMORY_WARN_FRACTION * device
    need = result.best.prediction.memory_bytes
    if need <= limit:
        return None
    text = (f"warning: memory: the chosen layout needs {need / GIB:.1f} GiB of {device / GIB:.0f} GiB per "
            f"{result.gpu.name} ({need / device:.0%}), above {MEMORY_WARN_FRACTION:.0%} of the device's memory; "
            f"the prediction is a model, so it may not fit.")
    alt = next(((i, c) for i, c in enumerate(result.candidates, 1) if c.prediction.memory_bytes <= limit), None)
    if alt is not None:
        i, c = alt
        slower = c.time_to_train_s / result.best.time_to_train_s - 1
        text += (f" The best under {MEMORY_WARN_FRACTION:.0%}: #{i} {c.layout.label()}, "
                 f"{c.prediction.memory_bytes / GIB:.1f} GiB, time to train {fmt_s(c.time_to_train_s)} "
                 f"({slower:+.1%}).")
    return text


def print_low_comm(console, result: PlanResult, low: LowCommPlan | None, script: str) -> None:
    """DiLoCo's rows, and the recommendation with its command (printed whole, indented: the chosen
    layout's command stays the one line that starts with ``slipstream run``)."""
    if low is None:
        return
    console.print(low.table(width=console.width))
    line = low.advice.line(per_step_name(low.per_step))
    if line is None:
        return
    console.print(line + ":", markup=False, style="bold")
    console.file.flush()
    print("  " + str(diloco_command(result, low, script)), flush=True)


def print_ranking(result: PlanResult, doc: dict[str, Any], top: int, explain_it: bool,
                  low: LowCommPlan | None = None, script: str = "train.py") -> None:
    """The table, its legend, DiLoCo's rows, warnings, the chosen layout's run command and
    environment, at the terminal's width. Lines meant to be copied (the commands, the variables)
    are printed whole."""
    from rich.console import Console

    console = Console(width=terminal_width(), soft_wrap=False, highlight=False)
    console.print(result.table(top, width=console.width))
    for line in layout_legend([c.layout.label() for c in result.candidates[:top]]):
        console.print(line, markup=False)
    print_low_comm(console, result, low, script)
    b = result.best
    console.print(f"{len(result.candidates)} layouts fit in memory, {result.rejected_memory} do not. "
                  f"Chosen: {b.layout.label()}, predicted step {fmt_s(b.prediction.step_s)}, time to train "
                  f"{fmt_s(b.time_to_train_s)}, cost ${b.cost:,.0f} at ${result.price_per_gpu_hour:g}/GPU-hour.",
                  markup=False)
    warning = memory_warning(result)
    if warning:
        console.print(warning, markup=False, style="yellow")
    for note in result.notes:
        console.print(note, markup=False)
    if explain_it:
        from .explain import explain

        console.print(explain(result), markup=False)
    console.file.flush()
    print(doc["run"], flush=True)
    note = rendezvous_note(result.nodes)
    if note:
        console.print(note, markup=False)
    console.print("The layout as environment variables (config.py reads SLIPSTREAM_<FIELD>):", markup=False)
    console.file.flush()
    print(" ".join(f"{k}={v}" for k, v in layout_env(result, b.layout).items()), flush=True)


def main(args: argparse.Namespace) -> int:
    tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
    samples = parse_count(args.samples, "--samples") if args.samples is not None else None
    check_plan_args(args)
    network: Any = args.network
    if args.link_calibration:
        from .calibrate import load_link
        from .network import Network

        link = load_link(args.link_calibration, args.network)
        network = Network(spec=f"{args.network} (measured: {link.describe()})", link=link)
    model: Any = args.model
    from .usermodel import is_user_model

    if is_user_model(args.model):
        from .usermodel import load_user_model

        model = load_user_model(args.model, parse_shape(args.input_shape) if args.input_shape else None)
    elif args.input_shape:
        raise ConfigError("--input-shape: only for --model PATH.py:FUNCTION")
    result = plan(model, gpus=args.gpus, gpu_type=args.gpu_type, network=network, price=args.price,
                  samples=samples, tokens=tokens, global_batch=args.global_batch, precision=args.precision,
                  gpus_per_node=args.gpus_per_node, framework=args.framework)
    if args.probe_memory:
        from .probe import probe_max_micro_batch

        best = probe_max_micro_batch(result.model, result.best.layout)
        print(f"largest micro-batch that fits (probed): {best}")
    doc = config_doc(result, args.script)
    check_train_config(doc["train"])
    low = low_comm(result)
    if args.json:
        rows = [{"layout": c.layout.label(), "sync": c.layout.sync, "micro_batch": c.layout.micro_batch,
                 "microbatches_per_step": c.layout.microbatches_per_step,
                 "activation_checkpointing": c.layout.activation_checkpointing, "step_s": c.prediction.step_s,
                 "time_to_train_s": c.time_to_train_s, "cost": c.cost,
                 "memory_gib": c.prediction.memory_bytes / GIB, "scaling_efficiency": c.prediction.scaling_efficiency,
                 "step_range_s": result.uncertainty.step_range(c.prediction.step_s, c.prediction.scaling_efficiency),
                 "scaling_efficiency_range": result.uncertainty.efficiency_range(c.prediction.scaling_efficiency)}
                for c in result.candidates[: args.top]]
        out = {"chosen": doc, "ranking": rows, "uncertainty": result.uncertainty.source}
        out["memory_warning"] = memory_warning(result)  # None when the pick leaves 10% of the device free
        # None where no plain data-parallel layout of 2+ replicas fits (DiLoCo's only layout)
        out["low_communication"] = low.as_record(diloco_command(result, low, args.script)) if low else None
        if args.explain:
            from .explain import explain

            out["explain"] = explain(result)
        print(json.dumps(out, indent=1))
    else:
        print_ranking(result, doc, args.top, args.explain, low, args.script)
    header = f"# written by: slipstream plan {' '.join(shlex.quote(a) for a in sys.argv[2:])}\n"
    if args.write_config:
        _write_text(args.write_config, run_config_text(doc, header))
        print(f"config written to {args.write_config} (use: slipstream run --config {args.write_config} ...)",
              file=sys.stderr)
    if args.write_job:
        from ..job.spec import parse_spec

        jd = job_doc(result, args.script, args.image)
        parse_spec(jd)  # the spec checks itself: a bad job is an error here, not at submit time
        _write_yaml(args.write_job, jd, header)
        print(f"job spec written to {args.write_job} (check: slipstream validate {args.write_job})", file=sys.stderr)
    return 0
