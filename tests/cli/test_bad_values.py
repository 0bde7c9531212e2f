"""Every option of every ``slipstream`` command, fed a bad value: one short error, exit 2.

The table below is checked against the parsers themselves (argparse's ``_actions`` and
sub-parsers, walked from ``slipstream.cli.build_parser()``): an option added without a
bad-value entry here, or without a line in ``NO_BAD_VALUE`` saying why it has none, fails
``test_every_option_has_a_bad_value``. Each case runs in this process (``main(argv)``),
with torch's ``elastic_launch`` replaced by a tripwire: a bad value must be refused
before any worker starts. The cases that need real processes are in test_worker_errors.py.

A case passes when the command exits 2, prints no traceback, at most ``MAX_LINES`` lines
on stderr, and the error names the option (or, for a training flag, its field) and the value.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import pytest

from slipstream.cli import build_parser, main

MAX_LINES = 4


@dataclass(frozen=True)
class Bad:
    """One bad value for an option: ``argv`` goes where the option goes (before the
    positionals), ``names``: words the error must hold (default: the option and the value)."""

    argv: tuple[str, ...]
    names: tuple[str, ...] = ()


def bad(option: str, value: str, *also: str, names: tuple[str, ...] | None = None) -> Bad:
    return Bad((option, value, *also), names if names is not None else (option, value))


# What each command needs after the option under test (its positionals), in the case's folder.
TAIL = {
    "run": ("ok.py",), "bench": ("ok.py",), "report": ("rundir",), "export": ("ckpt", "--out", "w.safetensors"),
    "validate": ("job.yaml",), "render": ("job.yaml",), "submit": ("job.yaml", "--dry-run"),
    "job schema": (), "status": ("myjob",), "logs": ("myjob",), "cancel": ("myjob",),
    "plan": (), "data pack": ("text.txt", "packed"), "data prewarm": ("dataset", "--cache", "cache"),
    "data verify": ("dataset",),
}
PLAN = ("--model", "gpt-125m", "--gpus", "8", "--gpu-type", "H100", "--network", "100gbit-ib")

# (command, the option's first long spelling, or the positional's dest) -> its bad values.
BAD: dict[tuple[str, str], list[Bad]] = {
    # -- run: torchrun's options ---------------------------------------------------------
    ("run", "--nproc-per-node"): [bad("--nproc-per-node", "lots"), bad("--nproc-per-node", "0")],
    ("run", "--nnodes"): [bad("--nnodes", "a:b"), bad("--nnodes", "0")],
    ("run", "--node-rank"): [bad("--node-rank", "x"), bad("--node-rank", "5")],
    ("run", "--rdzv-backend"): [bad("--rdzv-backend", "zookeeper")],
    ("run", "--rdzv-endpoint"): [bad("--rdzv-endpoint", "nohost"), bad("--rdzv-endpoint", "h:99999", names=("--rdzv-endpoint", "99999"))],
    ("run", "--rdzv-conf"): [bad("--rdzv-conf", "timeout")],
    ("run", "--master-addr"): [bad("--master-addr", "a host")],
    ("run", "--master-port"): [bad("--master-port", "99999"), bad("--master-port", "x")],
    ("run", "--local-addr"): [bad("--local-addr", "a host")],
    ("run", "--max-restarts"): [bad("--max-restarts", "-1"), bad("--max-restarts", "x")],
    ("run", "--monitor-interval"): [bad("--monitor-interval", "0"), bad("--monitor-interval", "x")],
    ("run", "--start-method"): [bad("--start-method", "thread")],
    ("run", "--log-dir"): [bad("--log-dir", "afile")],
    ("run", "--redirects"): [bad("--redirects", "4")],
    ("run", "--tee"): [bad("--tee", "x")],
    ("run", "--local-ranks-filter"): [bad("--local-ranks-filter", "a")],
    ("run", "--logs-specs"): [bad("--logs-specs", "nosuch")],
    ("run", "--event-log-handler"): [bad("--event-log-handler", "bogus")],
    ("run", "--numa-binding"): [bad("--numa-binding", "nodes")],
    ("run", "--signals-to-handle"): [bad("--signals-to-handle", "SIGFOO")],
    ("run", "--shutdown-timeout"): [bad("--shutdown-timeout", "-1"), bad("--shutdown-timeout", "x")],
    # -- run: the launcher's own ---------------------------------------------------------
    ("run", "--collective-timeout-s"): [bad("--collective-timeout-s", "0"), bad("--collective-timeout-s", "x")],
    ("run", "--backend"): [bad("--backend", "mpi")],
    ("run", "--device"): [bad("--device", "tpu")],
    ("run", "--log-level"): [bad("--log-level", "loud"), Bad(("-q", "--log-level", "debug"), ("-q", "--log-level debug"))],
    ("run", "--emulate"): [bad("--emulate", "2by2")],
    ("run", "--spares"): [Bad(("--heal", "--spares", "2"), ("--spares", "2")),
                          Bad(("--no-heal", "--spares", "1"), ("--spares", "--no-heal")), bad("--spares", "x"),
                          Bad(("--heal", "--no-python", "--spares", "1"), ("--heal", "--no-python"))],
    ("run", "--link"): [bad("--link", "1gbit"), Bad(("--emulate", "2x1", "--link", "1zbit"), ("--link", "1zbit"))]
    + [Bad(("--emulate", "2x1", "--link", v), ("--link", v, why)) for v, why in (
        ("100mbit,-5ms", "round trip"), ("100mbit,3s", "round trip"), ("100mbit,40", "unit"),
        ("100mbit,40ms,100%", "below 100%"), ("100mbit,-1%", "loss"), ("100mbit,40furlongs", "round trip"))],
    ("run", "--config"): [bad("--config", "nofile.yaml"), bad("--config", "badkey.yaml")],
    # A positional has no flag to name: its error names the value (TAIL replaced, see _argv).
    ("run", "script"): [Bad((), ("script", "nofile.py"))],
    # -- run: training options (the error names the field: --sync-options -> sync_options) --
    ("run", "--sync"): [bad("--sync", "powersdg", names=("sync", "powersdg", "did you mean 'powersgd'"))],
    ("run", "--sync-options"): [
        bad("--sync-options", "{rank: 4}"),
        bad("--sync-options", '{"rnk": 4}', "--sync", "powersgd", names=("rnk", "did you mean 'rank'")),
        bad("--sync-options", '{"inner_steps": 0}', "--sync", "diloco", names=("inner_steps", "0")),
        bad("--sync-options", '{"outer_codec": "int8"}', "--sync", "diloco", names=("outer_codec", "int8")),
        bad("--sync-options", '{"fragments": 9, "inner_steps": 4}', "--sync", "diloco", names=("fragments", "9")),
        bad("--sync-options", '{"outer_momentum": 1.5}', "--sync", "diloco", names=("outer_momentum", "1.5")),
        bad("--sync-options", '{"rank": 4}', "--sync", "diloco", names=("rank", "inner_steps")),
        bad("--sync", "diloco", "--tp", "2", "-n", "2", names=("diloco", "tp(2)")),
    ],
    ("run", "--bucket-cap-mb"): [bad("--bucket-cap-mb", "0"), bad("--bucket-cap-mb", "x")],
    ("run", "--precision"): [bad("--precision", "fp64")],
    ("run", "--accumulate-steps"): [bad("--accumulate-steps", "0"), bad("--accumulate-steps", "x")],
    ("run", "--grad-clip-norm"): [bad("--grad-clip-norm", "-1"), bad("--grad-clip-norm", "x")],
    ("run", "--dp-replicate"): [bad("--dp-replicate", "3"), bad("--dp-replicate", "x")],
    ("run", "--dp-shard"): [bad("--dp-shard", "0"), bad("--dp-shard", "x")],
    ("run", "--tp"): [bad("--tp", "3"), bad("--tp", "x")],
    ("run", "--pp"): [bad("--pp", "0"), bad("--pp", "x")],
    ("run", "--pp-schedule"): [bad("--pp-schedule", "zb")],
    ("run", "--pp-microbatches"): [bad("--pp-microbatches", "0"), bad("--pp-microbatches", "x")],
    ("run", "--zero-stage"): [bad("--zero-stage", "1"), bad("--zero-stage", "x")],
    ("run", "--activation-checkpointing"): [bad("--activation-checkpointing", "not-a-class")],
    ("run", "--checkpoint-dir"): [bad("--checkpoint-dir", "afile")],
    ("run", "--checkpoint-every-steps"): [bad("--checkpoint-every-steps", "0"), bad("--checkpoint-every-steps", "x")],
    ("run", "--checkpoint-every-s"): [bad("--checkpoint-every-s", "0"), bad("--checkpoint-every-s", "x")],
    ("run", "--checkpoint-keep-last"): [bad("--checkpoint-keep-last", "-1"), bad("--checkpoint-keep-last", "x")],
    ("run", "--checkpoint-verify"): [bad("--checkpoint-verify", "some")],
    ("run", "--checkpoint-max-failures"): [bad("--checkpoint-max-failures", "-1"),
                                          bad("--checkpoint-max-failures", "x")],
    ("run", "--preemption-deadline-s"): [bad("--preemption-deadline-s", "-1"), bad("--preemption-deadline-s", "x")],
    ("run", "--snapshot-every-steps"): [bad("--snapshot-every-steps", "0"), bad("--snapshot-every-steps", "x")],
    ("run", "--prometheus-port"): [bad("--prometheus-port", "abc"), bad("--prometheus-port", "70000")],
    ("run", "--prometheus-addr"): [bad("--prometheus-addr", "a host")],
    ("run", "--flops-per-sample"): [bad("--flops-per-sample", "-1"), bad("--flops-per-sample", "x")],
    ("run", "--peak-flops"): [bad("--peak-flops", "-1"), bad("--peak-flops", "x")],
    ("run", "--straggler-threshold"): [bad("--straggler-threshold", "0"), bad("--straggler-threshold", "x")],
    ("run", "--log-to"): [bad("--log-to", "neptune")],
    ("run", "--run-dir"): [bad("--run-dir", "afile")],
    ("run", "--log-every-steps"): [bad("--log-every-steps", "0"), bad("--log-every-steps", "x")],
    ("run", "--total-steps"): [bad("--total-steps", "-1"), bad("--total-steps", "x")],
    # -- bench -----------------------------------------------------------------------------
    ("bench", "--sync"): [bad("--sync", "powersdg", names=("--sync", "powersdg", "did you mean 'powersgd'"))],
    ("bench", "--nproc-per-node"): [bad("-n", "0"), bad("-n", "x")],
    ("bench", "--emulate"): [bad("--emulate", "2by2")],
    ("bench", "--link"): [bad("--link", "1gbit"), Bad(("--emulate", "2x1", "--link", "1gbit,9s"), ("--link", "9s")),
                          Bad(("--emulate", "2x1", "--link", "1gbit,250%"), ("--link", "250%"))],
    ("bench", "--repeats"): [bad("--repeats", "0"), bad("--repeats", "x")],
    ("bench", "--timeout-s"): [bad("--timeout-s", "0"), bad("--timeout-s", "x")],
    ("bench", "--json-out"): [bad("--json-out", "nodir/out.json")],
    ("bench", "script"): [Bad((), ("script", "nofile.py"))],
    # -- plan ------------------------------------------------------------------------------
    ("plan", "--model"): [bad("--model", "gpt-8b")],
    ("plan", "--input-shape"): [bad("--input-shape", "0")],
    ("plan", "--gpus"): [bad("--gpus", "0"), bad("--gpus", "x")],
    ("plan", "--gpu-type"): [bad("--gpu-type", "H10")],
    ("plan", "--network"): [bad("--network", "400GB-ib", names=("--network", "400GB-ib", "400gbit-ib", "25gbit-roce")),
                            bad("--network", "fast"),
                            bad("--network", "100mbit,40ms,0.1%", names=("--network", "100mbit,40ms,0.1%", "RTT")),
                            bad("--network", "100mbit,40", names=("--network", "100mbit,40", "100mbit,40ms"))],
    ("plan", "--link-calibration"): [bad("--link-calibration", "nofile.json")],
    ("plan", "--gpus-per-node"): [bad("--gpus-per-node", "0"), bad("--gpus-per-node", "x")],
    ("plan", "--price"): [bad("--price", "-1"), bad("--price", "x")],
    ("plan", "--tokens"): [bad("--tokens", "abc")],
    ("plan", "--samples"): [bad("--samples", "0")],
    ("plan", "--global-batch"): [bad("--global-batch", "0"), bad("--global-batch", "x")],
    ("plan", "--precision"): [bad("--precision", "fp64")],
    ("plan", "--top"): [bad("--top", "0"), bad("--top", "x")],
    ("plan", "--framework"): [bad("--framework", "horovd", names=("--framework", "horovd", "horovod"))],
    ("plan", "--write-config"): [bad("--write-config", "nodir/plan.yaml")],
    ("plan", "--write-job"): [bad("--write-job", "nodir/job.yaml")],
    # -- report, export --------------------------------------------------------------------
    ("report", "run_dir"): [Bad((), ("RUN_DIR", "norundir"))],
    ("report", "--out"): [bad("--out", "afile/r.html")],
    ("report", "--png-dir"): [bad("--png-dir", "afile")],
    # The value is names[1] (see _argv): a missing directory, an fsspec URL of no known protocol.
    ("export", "checkpoint"): [Bad((), ("checkpoint", "nockpt")),
                               Bad((), ("CHECKPOINT", "foo://x/run", "not a usable fsspec URL"))],
    ("export", "--out"): [bad("--out", "afile/w.safetensors"), bad("--out", "s3://bucket/w.safetensors")],
    ("export", "--format"): [bad("--format", "onnx")],
    ("export", "--verify"): [bad("--verify", "some")],
    # -- job specs -------------------------------------------------------------------------
    ("validate", "spec"): [Bad((), ("nojob.yaml",))],
    ("validate", "--target"): [bad("--target", "slrum", names=("--target", "slrum", "did you mean 'slurm'"))],
    ("render", "spec"): [Bad((), ("nojob.yaml",))],
    ("render", "--target"): [bad("--target", "k8s")],
    ("render", "--out"): [bad("--out", "afile")],
    ("submit", "spec"): [Bad((), ("nojob.yaml",))],
    ("submit", "--target"): [bad("--target", "k8s")],
    ("submit", "--kubectl"): [bad("--kubectl", "/no/such/kubectl", "--target", "jobset")],
    ("submit", "--sbatch"): [bad("--sbatch", "/no/such/sbatch", "--target", "slurm")],
    ("job schema", "--out"): [bad("--out", "afile/schema.json")],
    # -- status, logs, cancel --------------------------------------------------------------
    **{(cmd, "--target"): [bad("--target", "k8s")] for cmd in ("status", "logs", "cancel")},
    **{(cmd, "--kubectl"): [bad("--kubectl", "/no/such/kubectl", "--target", "kubernetes")]
       for cmd in ("status", "logs", "cancel")},
    **{(cmd, "--namespace"): [bad("--namespace", "Not_A_Namespace", "--target", "kubernetes")]
       for cmd in ("status", "logs", "cancel")},
    **{(cmd, "job"): [Bad(("--target", "slurm"), ("not-a-number",))] for cmd in ("status", "logs", "cancel")},
    # -n is processes per node (run, bench): here any value is refused, with the flag to write.
    **{(cmd, "-n"): [bad("-n", "ns", names=("-n", "--namespace ns"))] for cmd in ("status", "logs", "cancel")},
    ("status", "--run-dir"): [bad("--run-dir", "afile", "--target", "slurm")],
    ("logs", "--rank"): [bad("--rank", "-1"), bad("--rank", "x")],
    # -- data ------------------------------------------------------------------------------
    ("data pack", "input"): [Bad((), ("noinput",))],
    ("data pack", "out"): [Bad((), ("OUT", "afile"))],
    ("data pack", "--kind"): [bad("--kind", "txt")],
    ("data pack", "--shard-size-mb"): [bad("--shard-size-mb", "0"), bad("--shard-size-mb", "x")],
    ("data pack", "--tokens-per-sample"): [bad("--tokens-per-sample", "0")],
    ("data pack", "--field"): [bad("--field", "nosuch", "--kind", "jsonl")],
    ("data pack", "--tokenizer"): [bad("--tokenizer", "nosuchmodule:encode")],
    ("data pack", "--eot-token"): [bad("--eot-token", "x")],
    ("data pack", "--max-mb"): [bad("--max-mb", "0")],
    ("data pack", "--endpoint-url"): [bad("--endpoint-url", "not-a-url")],
    ("data prewarm", "url"): [Bad((), ("nodata",))],
    ("data prewarm", "--cache"): [bad("--cache", "afile")],
    ("data prewarm", "--workers"): [bad("--workers", "0")],
    ("data prewarm", "--max-cache-gb"): [bad("--max-cache-gb", "0")],
    ("data prewarm", "--endpoint-url"): [bad("--endpoint-url", "not-a-url")],
    ("data verify", "url"): [Bad((), ("nodata",))],
    ("data verify", "--cache"): [bad("--cache", "afile")],
    ("data verify", "--endpoint-url"): [bad("--endpoint-url", "not-a-url")],
}

# Options that take no value, or whose every value is valid; each with the reason.
NO_BAD_VALUE: dict[tuple[str, str], str] = {
    ("", "--version"): "a switch",
    ("run", "--rdzv-id"): "any text names a rendezvous",
    ("run", "--role"): "any text names the workers' role (ROLE_NAME)",
    ("run", "--duplicate-stdout-filters"): "any text is a filter",
    ("run", "--duplicate-stderr-filters"): "any text is a filter",
    ("run", "script_args"): "passed to the script unread",
    ("bench", "script_args"): "passed to the script unread",
    ("plan", "--script"): "a name written into the printed command, for another machine",
    ("plan", "--image"): "an image name written into the job spec, for another machine",
    ("data pack", "--exclude-dir"): "any name is a directory name to skip",
}

# Training flags of type bool take no value (--x / --no-x); they come from config.py's fields.
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction,
             argparse._VersionAction, argparse._HelpAction)


# `slipstream job validate|render|submit` are the top-level commands' parsers, built by the same
# function (job/cli.py): their cases are the top-level ones (test_job_aliases_take_the_same_options).
_ALIASES = {"job validate", "job render", "job submit"}


def _walk(parser: argparse.ArgumentParser, path: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if f"{path} {name}".strip() not in _ALIASES:
                    yield from _walk(sub, f"{path} {name}".strip())
        else:
            yield path, action


def _key(path: str, action: argparse.Action) -> tuple[str, str]:
    if not action.option_strings:
        return path, action.dest
    longs = [s for s in action.option_strings if s.startswith("--") and "_" not in s]
    return path, (longs or action.option_strings)[0]


def option_table() -> dict[tuple[str, str], argparse.Action]:
    """Every option and positional of every command: (command, option) -> its action."""
    return {_key(path, a): a for path, a in _walk(build_parser()) if not isinstance(a, _SWITCHES)
            or a.option_strings == ["--version"]}


def test_job_aliases_take_the_same_options():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    job = next(a for a in commands["job"]._actions if isinstance(a, argparse._SubParsersAction)).choices
    for alias in _ALIASES:
        name = alias.split()[1]
        assert [(a.option_strings, a.dest) for a in job[name]._actions] == \
            [(a.option_strings, a.dest) for a in commands[name]._actions], alias


def test_every_option_has_a_bad_value():
    """An option added to a parser without a case here (or a reason in NO_BAD_VALUE) fails."""
    options = set(option_table())
    missing = sorted(options - set(BAD) - set(NO_BAD_VALUE))
    stale = sorted((set(BAD) | set(NO_BAD_VALUE)) - options)
    assert not missing, f"options with no bad-value case in tests/cli/test_bad_values.py: {missing}"
    assert not stale, f"cases for options the parsers no longer have: {stale}"
    assert not set(BAD) & set(NO_BAD_VALUE)


CASES = [pytest.param(cmd, case, id=f"{cmd} {' '.join(case.argv) or opt}") for (cmd, opt), cases in BAD.items()
         for case in cases]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_values")
    (d / "ok.py").write_text("print('ran')\n")
    (d / "afile").write_text("not a directory\n")
    (d / "badkey.yaml").write_text("precison: bf16\n")
    (d / "rundir").mkdir()
    (d / "ckpt").mkdir()
    (d / "dataset").mkdir()  # exists, so an option's check is reached
    (d / "text.txt").write_text("some text to pack\n" * 50)
    (d / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (d / "job.yaml").write_text("name: sweep\nimage: img:1\ncommand: [python, train.py]\nreplicas: 1\ngpu_count: 0\n")
    return d


@pytest.fixture
def in_folder(folder, monkeypatch):
    monkeypatch.chdir(folder)
    import torch.distributed.launcher.api as launcher_api

    def tripwire(*args, **kwargs):
        raise AssertionError("a worker would start: the bad value was not refused before launch")

    monkeypatch.setattr(launcher_api, "elastic_launch", tripwire)
    for name in [k for k in os.environ if k.startswith(("SLIPSTREAM_", "PET_"))]:
        monkeypatch.delenv(name)
    return folder


def _argv(cmd: str, case: Bad) -> list[str]:
    tail = list(TAIL[cmd])
    if (cmd, "script") in BAD and case in BAD[(cmd, "script")]:
        tail = ["nofile.py"]
    elif cmd == "report" and case in BAD[("report", "run_dir")]:
        tail = ["norundir"]
    elif cmd == "export" and case in BAD[("export", "checkpoint")]:
        tail = [case.names[1], "--out", "w.safetensors"]
    elif cmd in ("validate", "render", "submit") and case in BAD[(cmd, "spec")]:
        tail = ["nojob.yaml", *tail[1:]]
    elif cmd == "submit" and ("--kubectl" in case.argv or "--sbatch" in case.argv):
        tail = ["job.yaml"]  # a real submission, which needs the tool
    elif cmd in ("status", "logs", "cancel") and case in BAD[(cmd, "job")]:
        tail = ["not-a-number"]
    elif cmd == "data pack" and case in BAD[("data pack", "input")]:
        tail = ["noinput", "packed"]
    elif cmd == "data pack" and case in BAD[("data pack", "out")]:
        tail = ["text.txt", "afile"]
    elif cmd == "data pack" and "--field" in case.argv:
        tail = ["data.jsonl", "packed"]
    elif cmd in ("data prewarm", "data verify") and case in BAD[(cmd, "url")]:
        tail = ["nodata", *tail[1:]]
    given = [w for w in case.argv if w.startswith("-")]
    tail = [w for i, w in enumerate(tail) if w not in given and not (i and tail[i - 1] in given)]
    head = cmd.split()
    if cmd == "plan":  # the required options, less the one under test
        head += [w for i in range(0, len(PLAN), 2) if PLAN[i] not in case.argv for w in PLAN[i:i + 2]]
    return [*head, *case.argv, *tail]


@pytest.mark.parametrize("cmd, case", CASES)
def test_a_bad_value_is_one_short_error_and_exit_2(cmd, case, in_folder, capsys):
    argv = _argv(cmd, case)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, f"slipstream {' '.join(argv)}: exit {code}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert 0 < len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{err}"
    words = case.names
    for word in words:
        flat = word.lstrip("-").replace("-", "_") if cmd == "run" and word.startswith("--") else None
        assert word in err or (flat is not None and flat in err), f"{word!r} not named in:\n{err}"
