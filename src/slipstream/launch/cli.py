"""``slipstream run``: argument parsing for the launcher (the flags become a :class:`LaunchOptions`).

Three kinds of options:

* torchrun's, every one of ``torch.distributed.run``'s parser in both spellings
  (``--nproc-per-node`` and ``--nproc_per_node``), with its default (``PET_<NAME>``
  variables included) and meaning; :data:`TORCHRUN_DIFFERENCES` lists where ours differ;
* the launcher's own (``--backend``, ``--device``, ``--collective-timeout-s``, ``--emulate``);
* training options: one flag per TrainConfig flat name, generated from config.py's
  fields (type, ``choices``/``metavar`` metadata, docstring as help), plus
  ``--config FILE`` (launch/run_config.py), which may hold the launcher's options too
  (``nproc_per_node: 4``). Flags override the file, which overrides the ``SLIPSTREAM_*``
  environment.

Example::

    slipstream run --standalone --nproc_per_node 2 --config run.yaml --precision bf16 train.py --steps 10
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Mapping

from .. import config as config_module
from ..config import ENV_PREFIX, FLAT_NAMES, SECTIONS, TrainConfig, env_text
from ..errors import ConfigError, UsageError, did_you_mean
from ..settings import field_docs, first_sentence
from . import run_config
from .api import LaunchOptions, launch

TORCHRUN_DIFFERENCES = """\
differences from torchrun (everything else means what it means to torchrun):
  rendezvous      every attempt bootstraps from a fresh c10d store (a new port per round), so a restarted
                  rank never reads its peer's address from an earlier attempt; --rdzv-backend static and
                  c10d both run this rendezvous, with --rdzv-endpoint, else --master-addr:--master-port
                  (static's endpoint), as the store; other backends (etcd, etcd-v2) go to torch unchanged
  one node        without --rdzv-endpoint or --master-port (or with --standalone): a free local port and
                  a fresh --rdzv-id, as torchrun --standalone; the workers' MASTER_PORT is new per attempt
  several nodes   need --rdzv-endpoint or --master-addr (torchrun waits at 127.0.0.1:29500 without them)
  --node-rank     names the node that hosts the store (0) for every backend; torchrun reads it for static only
  --rdzv-id       default: a fresh id on one node, torchrun's "none" across nodes
  workers         run `python -u -m slipstream.launch.worker SCRIPT` (SCRIPT as __main__, as python runs it,
                  plus a safe exit under gloo); --run-path is accepted and changes nothing (the worker runs
                  SCRIPT with runpy.run_path already); --no-python runs SCRIPT itself, as torchrun does
  OMP_NUM_THREADS default: cores / local workers (torchrun: 1)
  the end         a one-line summary and the run directory, whatever the script prints (--no-summary: neither);
                  --log-level / -q set how much Slipstream itself says, in the launcher and every worker
  exit codes      0 done, 1 training failed, 2 usage or configuration error (a worker exiting 2 is not
                  restarted: it would recur), 130 interrupted, 143 preempted
  --emulate       the emulated nodes' agents get -n, --nnodes, --max-restarts, --rdzv-id, --rdzv-conf, -m,
                  --log-level, --heal/--no-heal, --spares and the training options; torchrun's other
                  options are not passed to them"""


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# -- torchrun's options ------------------------------------------------------------------

NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")


def _nproc_value(text: str) -> int | str:
    """``-n``'s value: a whole number, or a keyword kept as text (resolved at launch by
    :func:`resolve_nproc`, so parsing needs no torch; a bad word is a one-line error there)."""
    try:
        return int(text)
    except ValueError:
        return text


def resolve_nproc(value: int | str) -> int:
    """``-n``'s value as a worker count, as torchrun's ``determine_local_world_size`` decides it:
    ``gpu`` one per CUDA device, ``cpu`` one per usable core, ``auto`` one per accelerator if
    there is one, else per core; ``xpu`` and a PrivateUse1 backend's name likewise.

    Example::

        resolve_nproc(4)       # 4
        resolve_nproc("cpu")   # len(os.sched_getaffinity(0))
    """
    if isinstance(value, int):
        return value
    if value == "cpu":  # torch's rule, without importing torch
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as exc:
        if str(exc).startswith("Unsupported nproc_per_node"):
            raise UsageError(f"--nproc-per-node must be a number or one of {', '.join(NPROC_KEYWORDS)}, "
                             f"got {value!r}") from None
        raise UsageError(f"--nproc-per-node {value}: {exc}") from None


def _comma_list(text: str) -> tuple[str, ...]:
    """torchrun's comma-separated list (``,,`` is a literal comma)."""
    return tuple(item.replace("\0", ",") for item in text.replace(",,", "\0").split(","))


def _pet(dest: str, default: object) -> object:
    """torchrun's default rule: ``PET_<DEST>`` from the environment, else the default."""
    return os.environ.get(f"PET_{dest.upper()}", default)


def _pet_flag(dest: str) -> bool:
    return bool(int(os.environ.get(f"PET_{dest.upper()}", "0") or 0))


def _spellings(*names: str) -> list[str]:
    """``--nproc-per-node`` -> [--nproc-per-node, --nproc_per_node], as torchrun spells its options."""
    out = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return out


def _add_torchrun_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "torchrun options",
        "torch.distributed.run's options in both spellings (--nproc-per-node, --nproc_per_node); a PET_<NAME> "
        "variable gives the default, as with torchrun. Differences: at the end of this help.",
    )

    def opt(*names: str, default: object = None, **kw: object) -> None:
        dest = names[-1].lstrip("-").replace("-", "_")
        if kw.get("action") == "store_true":
            g.add_argument(*_spellings(*names), dest=dest, default=_pet_flag(dest), **kw)
        else:
            g.add_argument(*_spellings(*names), dest=dest, default=_pet(dest, default), **kw)

    opt("-n", "--nproc-per-node", type=_nproc_value, default=1, metavar="N|auto|gpu|cpu",
        help="workers on this node: a number, gpu (one per GPU), cpu (one per core) or auto (gpu if there are "
        "GPUs, else cpu); default 1")
    opt("--nnodes", default="1", metavar="MIN[:MAX]", help="number of nodes, or an elastic range (default 1)")
    opt("--node-rank", type=int, metavar="R", help="rank of this node; 0 hosts the rendezvous store")
    opt("--standalone", action="store_true",
        help="one node, a local store on a free port, a fresh rendezvous id (--rdzv-* options are ignored)")
    opt("--rdzv-backend", default="static", metavar="NAME",
        help="static (the default) or c10d: our c10d rendezvous, a fresh store per attempt; etcd, etcd-v2: torch's")
    opt("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous store every node joins")
    opt("--rdzv-id", metavar="ID", help="job id shared by all nodes of one run")
    opt("--rdzv-conf", default="", metavar="K=V[,K=V]",
        help="rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2")
    opt("--master-addr", metavar="HOST",
        help="with --rdzv-backend static and no --rdzv-endpoint: the store's host (default 127.0.0.1)")
    opt("--master-port", type=int, metavar="PORT",
        help="with --rdzv-backend static and no --rdzv-endpoint: the store's port (default 29500; "
        "one node without it: a free port)")
    opt("--local-addr", metavar="ADDR", help="address this node publishes to the others")
    opt("--max-restarts", type=int, default=0, metavar="K", help="restart the workers up to K times (default 0)")
    opt("--monitor-interval", type=float, default=LaunchOptions.monitor_interval_s, metavar="S",
        help=f"seconds between checks on the workers (default {LaunchOptions.monitor_interval_s})")
    opt("--start-method", default=LaunchOptions.start_method, metavar="{spawn,fork,forkserver}",
        help=f"how workers are started (default {LaunchOptions.start_method})")
    opt("--role", default=LaunchOptions.role, metavar="NAME", help="the workers' role name (ROLE_NAME)")
    opt("-m", "--module", action="store_true", help="SCRIPT is a Python module name (python -m)")
    opt("--no-python", action="store_true", help="run SCRIPT as a program, not with python")
    opt("--run-path", action="store_true", help="accepted for torchrun parity; workers run SCRIPT with runpy.run_path")
    opt("--log-dir", metavar="DIR", help="base directory of the workers' log files")
    opt("-r", "--redirects", default="0", metavar="0-3|R:0-3,...",
        help="write 1 stdout, 2 stderr, 3 both to log files only, for all or some local ranks (0:1,1:2)")
    opt("-t", "--tee", default="0", metavar="0-3|R:0-3,...", help="as --redirects, but also to the console")
    opt("--local-ranks-filter", default="", metavar="R[,R]", help="show only these local ranks' output on the console")
    opt("--duplicate-stdout-filters", type=_comma_list, default=(), metavar="F[,F]",
        help="copy console stdout lines matching these filters to a file in the log directory")
    opt("--duplicate-stderr-filters", type=_comma_list, default=(), metavar="F[,F]",
        help="as --duplicate-stdout-filters, for stderr")
    opt("--logs-specs", metavar="NAME", help="a torchrun.logs_specs entry point: the LogsSpecs class to use")
    opt("--event-log-handler", default=LaunchOptions.event_log_handler, metavar="NAME",
        help="registered event logging handler of torch.distributed.elastic.events")
    opt("--numa-binding", metavar="{node,socket,exclusive,core-complex}",
        help="bind workers to CPUs near their GPU")
    opt("--signals-to-handle", metavar="SIG[,SIG]",
        help="signals the agent forwards to the workers (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    opt("--shutdown-timeout", type=int, metavar="S", help="seconds workers get after SIGTERM before SIGKILL")
    opt("--virtual-local-rank", action="store_true",
        help="every worker sees LOCAL_RANK 0 and only its own device")


def torchrun_option_defaults() -> dict[str, tuple[str, object]]:
    """Each torchrun option's dest -> (its long flag, its default, PET_* variables included).

    Example::

        torchrun_option_defaults()["log_dir"]   # ("--log-dir", None)
    """
    p = argparse.ArgumentParser(add_help=False)
    _add_torchrun_options(p)
    return {
        a.dest: (next((s for s in a.option_strings if s.startswith("--") and "_" not in s), a.option_strings[-1]), a.default)
        for a in p._actions
        if a.option_strings
    }


# -- training options, one flag per TrainConfig field ------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainFlag:
    """The flag of one TrainConfig field: ``--`` + its flat name with dashes."""

    flat: str
    flag: str
    kind: str
    """The field's type as written in config.py ("int | None", "tuple[str, ...]", ...)."""
    help: str
    metavar: str | None
    choices: tuple | None


def train_flags() -> list[TrainFlag]:
    """One :class:`TrainFlag` per flat name, from config.py's fields (in section order).

    Example::

        {f.flat: f.flag for f in train_flags()}["checkpoint_async"]   # "--checkpoint-async"
    """
    docs = field_docs(config_module)
    out = []
    for section, cls in SECTIONS.items():
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for leaf, flat in cls.FLAT.items():
            f = by_name[leaf]
            meta = f.metadata
            text = meta.get("help") or first_sentence(docs.get((cls.__name__, leaf), "")) or f"{section}.{leaf}"
            out.append(TrainFlag(flat, "--" + flat.replace("_", "-"), str(f.type), text,
                                 meta.get("metavar"), tuple(meta["choices"]) if "choices" in meta else None))
    return out


def _optional(kind: type):  # noqa: ANN202 - an argparse type
    def convert(text: str):  # noqa: ANN202
        return None if text.strip().lower() == "none" else kind(text)

    convert.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return convert


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None,
                   help="run config: TrainConfig's fields as YAML, flat (precision: bf16) or nested "
                   "(numerics: {precision: bf16}), and launcher settings by the flag's name (nproc_per_node: 4); "
                   "flags override it, it overrides SLIPSTREAM_* variables")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in train_flags():
        section = FLAT_NAMES[flag.flat][0]
        if section not in groups:
            groups[section] = p.add_argument_group(
                f"training options: {section}", (SECTIONS[section].__doc__ or "").strip().splitlines()[0])
        g = groups[section]
        text = flag.help.replace("%", "%%")
        dest = f"train_{flag.flat}"
        kind, optional = flag.kind.split(" | ")[0], "None" in flag.kind
        if kind == "bool":
            g.add_argument(flag.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        metavar = flag.metavar
        if flag.choices is not None:
            metavar = "{" + ",".join(map(str, flag.choices)) + "}" + ("[,...]" if kind.startswith("tuple") else "")
        if kind in ("int", "float"):
            convert = {"int": int, "float": float}[kind]
            g.add_argument(flag.flag, dest=dest, type=_optional(convert) if optional else convert, default=None,
                           metavar=metavar or ("N" if kind == "int" else "X"), help=text)
        elif kind == "dict":
            g.add_argument(flag.flag, dest=dest, type=_json_object, default=None, metavar=metavar or "JSON", help=text)
        else:  # str, and tuples as comma-separated names (TrainConfig splits them); values checked by TrainConfig
            g.add_argument(flag.flag, dest=dest, default=None,
                           metavar=metavar or ("NAME[,NAME]" if kind.startswith("tuple") else "TEXT"), help=text)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a training script on this node (torchrun-compatible)",
        description="Launch SCRIPT in N worker processes through torch's elastic agent. "
        "Every torchrun option is accepted and an unmodified torchrun script runs unchanged. "
        "With JOB.yaml instead of SCRIPT: run a job spec locally (slipstream validate JOB.yaml).",
        epilog=TORCHRUN_DIFFERENCES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # No prefix matching: the script's own flags (--checkpoint-every, say)
        # must reach the script, not be taken as abbreviations of ours.
        allow_abbrev=False,
    )
    _add_torchrun_options(p)
    g = p.add_argument_group("slipstream options")
    g.add_argument(
        "--collective-timeout-s", type=float, default=None, metavar="S",
        help="a collective waiting longer fails, is diagnosed (which rank stalled, where) and the group restarts",
    )
    # Checked in worker_env_from_args rather than with argparse choices, so a bad
    # value is one line and exit 2 like every other flag error.
    g.add_argument("--backend", default=None, metavar="{nccl,gloo}",
                   help="process-group backend of the workers (default: nccl with GPUs, else gloo)")
    g.add_argument("--device", default=None, metavar="{cuda,cpu}",
                   help="workers' device (default: cuda for nccl, cpu for gloo); "
                   "--backend gloo --device cuda lets ranks share a GPU on purpose")
    g.add_argument("--emulate", default=None, metavar="NODESxPROCS",
                   help="run on an emulated cluster on this machine: one network namespace per node (needs root)")
    g.add_argument("--link", default=None, metavar="RATE[,RTT][,LOSS]",
                   help="with --emulate: each node's link rate, both directions (1gbit, 200mbit, unshaped; "
                   "default unshaped), then optionally the round trip added between two nodes and the "
                   "packet loss each way, e.g. 100mbit,40ms,0.1%%")
    g.add_argument("--heal", action=argparse.BooleanOptionalAction, default=None,
                   help="heal in place (default: on with more than one rank on one node; off across nodes, "
                   "emulated ones included, and under --no-python): a rank whose process dies is replaced while the others keep their "
                   "processes, re-form the group and go back to the last in-memory snapshot; --no-heal: a "
                   "failed rank restarts every worker (--max-restarts) instead")
    g.add_argument("--spares", type=int, default=None, metavar="{0,1}",
                   help="warm spare processes each rank keeps for healing, torch imported (default 1; 0: a "
                   "replacement starts cold, seconds later, and costs no memory until then)")
    # Checked in check_launcher_flags (one line, exit 2, "did you mean"), not by argparse choices.
    g.add_argument("--log-level", default=None, metavar="{debug,info,warning,error}",
                   help="how much Slipstream says, in the launcher and in every worker: info (default) its "
                   "one-line notes and every warning, debug everything it logs, warning only warnings and "
                   "errors, error only errors; the script's own output is its own")
    g.add_argument("-q", "--quiet", action="store_true", default=None,
                   help="--log-level warning: no notes, no final summary; warnings and errors still shown")
    g.add_argument("--no-summary", action="store_true", default=None,
                   help="print no run directory and final summary line at the end (for a program that wraps "
                   "slipstream run and prints its own)")
    _add_training_flags(p)
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m), or JOB.yaml")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    p.set_defaults(func=main)
    _track_given(p)


# -- launcher settings in the run config ---------------------------------------------------

_GIVEN_CLASSES: dict[type, type] = {}


def _track_given(p: argparse.ArgumentParser) -> None:
    """Each launcher option, when given on the command line, adds its dest to ``args.given_flags``:
    a flag overrides the run config's value even when it repeats the default (``--max-restarts 0``)."""
    for action in p._actions:
        if action.option_strings and action.dest not in ("help", "config") and not action.dest.startswith("train_"):
            cls = type(action)
            if cls not in _GIVEN_CLASSES:
                def call(self, parser, namespace, values, option_string=None, _base=cls):  # noqa: ANN001
                    _base.__call__(self, parser, namespace, values, option_string)
                    namespace.given_flags = {*getattr(namespace, "given_flags", ()), self.dest}

                _GIVEN_CLASSES[cls] = type(f"Given{cls.__name__}", (cls,), {"__call__": call})
            action.__class__ = _GIVEN_CLASSES[cls]


@functools.lru_cache(maxsize=1)
def launcher_settings() -> dict[str, argparse.Action]:
    """The launcher's options a run config may hold, by dest (the flag's name with underscores):
    every ``slipstream run`` option but the training ones, ``--config`` and ``--help``.

    Example::

        sorted(launcher_settings())[:3]   # ["backend", "collective_timeout_s", "device"]
    """
    subparsers = argparse.ArgumentParser(add_help=False).add_subparsers()
    register(subparsers)
    run = subparsers.choices["run"]
    return {a.dest: a for a in run._actions
            if a.option_strings and a.dest not in ("help", "config") and not a.dest.startswith("train_")}


def run_file(args: argparse.Namespace) -> run_config.RunFile | None:
    """``--config FILE``, read once per parse (None without ``--config``)."""
    path = getattr(args, "config", None)
    if not path:
        return None
    cached = getattr(args, "run_file", None)
    if cached is None:
        try:
            cached = run_config.read(path, launcher_settings())
        except (ConfigError, UsageError) as exc:  # one line that names the flag, as every flag's error does
            text = str(exc)
            raise type(exc)(text if text.startswith("--config") else f"--config {text}") from None
        args.run_file = cached
    return cached


def _launch_value(action: argparse.Action, key: str, value: object, source: str) -> object:
    """A run config's launcher value as the flag would give it (the flag's own conversion)."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(value, dict):
        text = ",".join(f"{k}={v}" for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        text = ",".join(map(str, value))
    elif value is None or isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be {action.metavar or 'a value'}, got {value!r}")
    else:
        text = str(value)
    if action.type is None:
        return text
    try:
        return action.type(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {key} must be {action.metavar or 'a value'}, got {value!r} ({exc})") from None


@functools.lru_cache(maxsize=1)
def launcher_flags_type() -> type:
    """A frozen dataclass with one field per launcher option (:func:`launcher_settings`), generated from
    the parser, the one declaration of each flag: a flag added there is a field here.

    Example::

        [f.name for f in dataclasses.fields(launcher_flags_type())][:2]   # ["nproc_per_node", "nnodes"]
    """
    return dataclasses.make_dataclass("LauncherFlags", [(dest, object) for dest in launcher_settings()],
                                      frozen=True, namespace={"__module__": __name__})


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """``slipstream run``'s command line as typed values, read from the parse once (:func:`run_flags`): the
    run config's launcher settings applied where no flag gave them, every launcher flag checked. What
    reads the flags outside this module (the job runner's job/cli.py) takes this, never the Namespace."""

    script: str
    """SCRIPT (a module with ``-m``), or JOB.yaml."""
    script_args: tuple[str, ...]
    """What follows it, a leading ``--`` removed."""
    launcher: Any
    """Every launcher option by its dest (``flags.launcher.max_restarts``): a :func:`launcher_flags_type`."""
    config_path: str | None = None
    """``--config FILE``."""
    config_launcher: tuple[str, ...] = ()
    """The launcher settings the run config gives, by dest."""
    file_training: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """The run config's training options, by flat name."""
    flag_training: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """The training options given as flags, by flat name."""

    @property
    def training(self) -> dict[str, object]:
        """The training options given: the run config's, then the flags over them (flat names)."""
        return {**self.file_training, **self.flag_training}


def run_flags(args: argparse.Namespace) -> RunFlags:
    """The parse of ``slipstream run`` as a :class:`RunFlags`, its launcher flags checked (one line, exit 2).

    Example::

        flags = run_flags(build_parser().parse_args(["run", "--config", "run.yaml", "-n", "2", "train.py"]))
        flags.launcher.nproc_per_node, flags.training   # (2, {"precision": "bf16"}) with run.yaml: {precision: bf16}
    """
    found = run_file(args)
    actions = launcher_settings()
    values = {dest: getattr(args, dest, action.default) for dest, action in actions.items()}
    given = getattr(args, "given_flags", set())
    for key, value in (found.launch.items() if found else ()):
        if key not in given:  # a flag wins over the file, even one that repeats the default (--max-restarts 0)
            values[key] = _launch_value(actions[key], key, value, args.config)
    script_args = tuple(getattr(args, "script_args", None) or ())  # a Namespace built by hand may lack them
    flags = RunFlags(
        script=getattr(args, "script", ""), script_args=script_args[1:] if script_args[:1] == ("--",) else script_args,
        launcher=launcher_flags_type()(**values), config_path=getattr(args, "config", None),
        config_launcher=tuple(found.launch) if found else (), file_training=dict(found.train) if found else {},
        flag_training={name: getattr(args, f"train_{name}") for name in FLAT_NAMES
                       if getattr(args, f"train_{name}", None) is not None},
    )
    check_launcher_flags(flags)
    return flags


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    parts = text.split(":")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise UsageError(f"--nnodes must be N or MIN:MAX with whole numbers, got {text!r}") from None
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise UsageError(f"--nnodes must be N or MIN:MAX, got {text!r}")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> {"a": "1", "b": "2"}."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf must be KEY=VALUE pairs separated by commas, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def training_options(args: argparse.Namespace) -> dict[str, object]:
    """The training options given: ``--config FILE``'s, then the flags over them (flat names).

    Example::

        # run.yaml: {precision: bf16, tp: 2}
        training_options(parse(["run", "--config", "run.yaml", "--tp", "1", "train.py"]))
        # {"precision": "bf16", "tp": 1}
    """
    return run_flags(args).training


def worker_env_from_args(args: argparse.Namespace, nproc_per_node: int | None = None) -> dict[str, str]:
    """:func:`worker_env` of the parse (``slipstream run``'s flags as given)."""
    return worker_env(run_flags(args), nproc_per_node)


def worker_env(flags: RunFlags, nproc_per_node: int | None = None) -> dict[str, str]:
    """The SLIPSTREAM_* variables for the training options given (file and flags), checked now.

    Every option given is set, its default value too, so it overrides a variable the
    launcher's own environment passes to the workers. ``nproc_per_node``: the resolved
    worker count when ``-n`` named a keyword (``gpu``), for the layout check.

    Example::

        worker_env(run_flags(parse(["run", "--precision", "bf16", "train.py"])))["SLIPSTREAM_PRECISION"]   # "bf16"
    """
    given, f = flags.training, flags.launcher
    _say_flags_over_file(flags)
    try:
        cfg = TrainConfig.from_env(environ={}, **given)
        nproc = nproc_per_node if nproc_per_node is not None else f.nproc_per_node
        if isinstance(nproc, int) and isinstance(f.nnodes, str) and f.nnodes.isdigit() and not f.emulate:
            cfg.degrees(nproc * int(f.nnodes))  # a layout that cannot fit the world fails now, not in every worker
    except ConfigError as exc:
        where = f" (flags over {flags.config_path})" if flags.config_path else ""
        raise UsageError(f"invalid training flag{where}: {exc}") from None
    _check_local_dirs(cfg.flat(), given)
    env = cfg.to_env()
    flat = cfg.flat()
    for name in given:
        env.setdefault(ENV_PREFIX + name.upper(), env_text(flat[name]))
    run_dir = cfg.run.dir
    if run_dir is not None:
        env["SLIPSTREAM_RUN_DIR"] = run_dir
    timeout_s = f.collective_timeout_s
    if timeout_s is not None:
        if timeout_s <= 0:
            raise UsageError(f"--collective-timeout-s must be > 0, got {timeout_s}")
        env["SLIPSTREAM_COLLECTIVE_TIMEOUT_S"] = str(timeout_s)
    env.update(_placement_env(f.backend, f.device))
    level = log_level(flags)
    if level is not None:  # the workers' level, and that of the agents a job spec's runner starts
        from ..log import ENV_LOG_LEVEL

        env[ENV_LOG_LEVEL] = level
    return env


def _say_flags_over_file(flags: RunFlags) -> None:
    """One line per run config value a flag replaces (the precedence rule, said when it bites:
    docs/launcher.md, "Which value wins")."""
    if flags.config_path is None:
        return
    for name in config_module.replaced(flags.file_training, flags.flag_training):
        print(f"slipstream run: --{name.replace('_', '-')} {env_text(flags.flag_training[name])} overrides "
              f"{flags.config_path}'s {name}: {env_text(flags.file_training[name])}", file=sys.stderr, flush=True)


def _check_local_dirs(flat: dict[str, object], given: dict[str, object]) -> None:
    """A local checkpoint_dir / run_dir given that is a file: refused now, not in every worker.
    (A URL, ``s3://...``, is the storage's to check.) The addresses too: a space is never in one."""
    for name in ("checkpoint_dir", "run_dir"):
        path = flat.get(name)
        if name in given and isinstance(path, str) and "://" not in path and os.path.isfile(path):
            raise UsageError(f"--{name.replace('_', '-')} must be a directory, got a file: {path}")
    addr = flat.get("prometheus_addr")
    if "prometheus_addr" in given and isinstance(addr, str) and (not addr.strip() or any(c.isspace() for c in addr)):
        raise UsageError(f"--prometheus-addr must be a host name or address, got {addr!r}")


def _placement_env(backend: str | None, device: str | None) -> dict[str, str]:
    """SLIPSTREAM_BACKEND / SLIPSTREAM_DEVICE for --backend / --device, which runtime.init() reads
    as its defaults."""
    from ..process.runtime import BACKENDS, DEVICES

    env: dict[str, str] = {}
    if backend is not None:
        if backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        env["SLIPSTREAM_BACKEND"] = backend
    if device is not None:
        if device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
        env["SLIPSTREAM_DEVICE"] = device
    if backend == "nccl" and device == "cpu":
        raise UsageError("--backend nccl cannot run on --device cpu (NCCL carries CUDA tensors only); "
                         "use --backend gloo for the CPU")
    return env


def _rendezvous(args: Any, max_nodes: int) -> tuple[str, str | None, str | None]:
    """(backend, endpoint, id) as torchrun's ``run`` settles them before launching.

    --standalone, or the static backend on one node with no endpoint and no
    --master-port: a local store on a free port and a fresh id. The static backend
    otherwise: --rdzv-endpoint, else --master-addr:--master-port. Both static and c10d
    run our c10d rendezvous (a fresh store per attempt). ``args``: the launcher flags (RunFlags.launcher).
    """
    backend = args.rdzv_backend
    endpoint, rdzv_id = args.rdzv_endpoint or None, args.rdzv_id
    if args.standalone:
        return "c10d", None, None
    if backend == "static" and endpoint is None:
        if args.master_port is None and (max_nodes == 1 or args.master_addr is None):
            # One node: a free local port. Several with neither given: no endpoint, which
            # LaunchOptions.validate refuses at once (torchrun would wait at 127.0.0.1:29500).
            return "c10d", None, rdzv_id
        endpoint = f"{args.master_addr or '127.0.0.1'}:{29500 if args.master_port is None else args.master_port}"
    return ("c10d" if backend == "static" else backend), endpoint, rdzv_id


def _local_ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(part) for part in text.split(",")})) if text.strip() else ()
    except ValueError:
        raise UsageError(f"--local-ranks-filter must be local ranks separated by commas (e.g. 0,1), got {text!r}") from None


def check_launcher_flags(flags: RunFlags) -> None:
    """The launcher's flags that no later check names (ports, --link, --emulate's shape),
    each with its flag, rule and value; raises :class:`UsageError`. Starts nothing."""
    f = flags.launcher
    if f.master_port is not None and not 0 <= f.master_port < 65536:
        raise UsageError(f"--master-port must be in [0, 65535], got {f.master_port}")
    for flag, host in (("--master-addr", f.master_addr), ("--local-addr", f.local_addr)):
        if host is not None and (not host.strip() or any(c.isspace() for c in host)):
            raise UsageError(f"{flag} must be a host name or address, got {host!r}")
    if f.link is not None and not f.emulate:
        raise UsageError(f"--link {f.link} shapes the links of an emulated cluster: it needs --emulate NODESxPROCS")
    if f.emulate:
        from .emulate import parse_link, parse_shape

        parse_shape(f.emulate)
        parse_link(f.link)
    log_level(flags)
    heal_settings(flags)


def heal_settings(flags: RunFlags) -> tuple[bool | None, int | None]:
    """``--heal``/``--no-heal`` and ``--spares`` (flags over the run config) as
    :class:`LaunchOptions`' ``heal`` and ``spares``, checked by its own rules (one line, exit 2).

    Example::

        heal_settings(run_flags(parse(["run", "--no-heal", "train.py"])))   # (False, None)
    """
    f = flags.launcher
    LaunchOptions("-", heal=f.heal, spares=f.spares, no_python=bool(f.no_python)).validate_heal()
    return f.heal, f.spares


def log_level(flags: RunFlags) -> str | None:
    """``--log-level`` / ``-q`` as one level (None: neither given); a bad or contradicting value
    is a :class:`UsageError`.

    Example::

        log_level(run_flags(parse(["run", "-q", "train.py"])))   # "warning"
    """
    from ..log import LOG_LEVELS

    level, quiet = flags.launcher.log_level, flags.launcher.quiet
    if level is not None:
        level = str(level).strip().lower()
        if level not in LOG_LEVELS:
            raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {flags.launcher.log_level!r}"
                             + did_you_mean(level, LOG_LEVELS, quote=True))
    if quiet:
        if level not in (None, "warning", "error"):
            raise UsageError(f"-q/--quiet means --log-level warning; it cannot go with --log-level {level}")
        return level or "warning"
    return level


def launch_options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The ``slipstream run SCRIPT`` flags as a :class:`LaunchOptions`, checked (no worker starts).

    Example::

        args = build_parser().parse_args(["run", "--standalone", "--nproc_per_node", "2", "train.py", "--steps", "5"])
        launch_options_from_args(args)   # LaunchOptions(entrypoint="train.py", args=["--steps", "5"], nproc_per_node=2, ...)
    """
    return launch_options(run_flags(args))


def launch_options(flags: RunFlags) -> LaunchOptions:
    """:class:`LaunchOptions` from the typed flags: a field named as a flag's dest (``max_restarts``,
    ``tee``, ``heal``, ...) takes its value as given; the others below are converted or renamed.

    Example::

        launch_options(run_flags(parse(["run", "-n", "2", "train.py"]))).nproc_per_node   # 2
    """
    f = flags.launcher
    min_nodes, max_nodes = parse_nnodes(f.nnodes)
    nproc = resolve_nproc(f.nproc_per_node)
    backend, endpoint, rdzv_id = _rendezvous(f, max_nodes)
    same = {field.name: getattr(f, field.name) for field in dataclasses.fields(LaunchOptions) if hasattr(f, field.name)}
    converted = dict(  # in the order their checks ran before (the first error is the one said)
        worker_env=worker_env(flags, nproc), rdzv_conf=parse_rdzv_conf(f.rdzv_conf),
        local_ranks_filter=_local_ranks(f.local_ranks_filter), log_level=log_level(flags),
    )
    return LaunchOptions(**{
        **same, **converted, "entrypoint": flags.script, "args": list(flags.script_args), "nproc_per_node": nproc,
        "min_nodes": min_nodes, "max_nodes": max_nodes, "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id,
        "rdzv_backend": backend, "monitor_interval_s": f.monitor_interval, "shutdown_timeout_s": f.shutdown_timeout,
        "duplicate_stdout_filters": tuple(f.duplicate_stdout_filters),
        "duplicate_stderr_filters": tuple(f.duplicate_stderr_filters), "summary": not f.no_summary,
    })


def main(args: argparse.Namespace) -> int:
    """``slipstream run SCRIPT``: the flags as a :class:`LaunchOptions`, then :func:`launch`.

    ``slipstream run JOB.yaml`` never reaches here: the top-level command sends it to
    ``slipstream.job.cli.run_main`` (the job package uses the launcher, not the reverse).
    """
    flags = run_flags(args)
    opts = launch_options(flags)
    if flags.launcher.emulate:
        from .emulate import parse_shape
        from .emulate_job import run_emulated

        nodes, procs = parse_shape(flags.launcher.emulate)
        return run_emulated(nodes, procs, flags.launcher.link or "unshaped", opts)
    return launch(opts)
