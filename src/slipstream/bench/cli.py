"""``slipstream bench SCRIPT [ARGS] --sync allreduce,auto [--emulate NxP --link RATE]``.

Runs the user's training script once per strategy and repeat (interleaved:
A B, B A, A B so a noisy neighbour hurts both), each time through
``slipstream run --sync NAME`` (which sets ``SLIPSTREAM_SYNC`` for the
workers), and prints a side-by-side table:

* **end-to-end s**: wall time of the whole run, measured here around the
  ``slipstream run`` process: start-up, rendezvous, training and shut-down.
  Every script has it.
* **samples/s** and **final loss**: read from the run's JSONL metrics
  (``RUN_DIR/metrics/rank0.jsonl``, written by scripts that use
  :func:`slipstream.accelerate`, and for the DDP model of any other script): the median of the per-window
  ``samples_per_s`` records after the first (warm-up) window, and the last
  logged loss. A script that builds its own DDP model gets these metrics too
  (docs/zero-change.md; the loss only when its model returns one, as Hugging
  Face models do). A script without JSONL metrics shows ``-`` there; its
  end-to-end time is still compared.

Medians over ``--repeats`` runs; ratios to the first strategy listed.

Example::

    slipstream bench examples/train_gpt.py --steps 100 --sync allreduce,bf16,auto -n 2
    slipstream bench train.py --sync allreduce,powersgd --emulate 2x1 --link 200mbit --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_TRAINING_FAILED, UsageError, did_you_mean
from ..names import warn_deprecated
from ..process import safe_signals

# Options of `slipstream bench` that may also be written after the script's own
# arguments: (flags, dest, takes a value).
_OWN = {
    "--sync": ("sync", True),
    "--emulate": ("emulate", True),
    "--link": ("link", True),
    "-n": ("nproc_per_node", True),
    "--nproc-per-node": ("nproc_per_node", True),
    "--repeats": ("repeats", True),
    "--timeout-s": ("timeout_s", True),
    "--json": ("json", False),
    "--json-out": ("json_out", True),
    "-m": ("module", False),
    "--module": ("module", False),
}


@dataclass
class BenchResult:
    """One strategy's runs."""

    strategy: str
    wall_s: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    final_loss: list[float] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.exit_codes) and all(c == 0 for c in self.exit_codes)

    def median(self, name: str) -> float | None:
        values = getattr(self, name)
        return statistics.median(values) if values else None

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy, "ok": self.ok, "exit_codes": self.exit_codes,
            "wall_s": self.wall_s, "samples_per_s": self.samples_per_s, "final_loss": self.final_loss,
            "median_wall_s": self.median("wall_s"), "median_samples_per_s": self.median("samples_per_s"),
            "median_final_loss": self.median("final_loss"),
        }


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run your script under several sync strategies and compare throughput side by side",
        description="Run SCRIPT once per strategy (and repeat) through `slipstream run --sync NAME`, "
        "then print samples/s (from the run's JSONL metrics) and end-to-end time side by side. "
        "Bench options may also follow the script's arguments; put `--` before script options that clash.",
    )
    p.add_argument("--sync", default="allreduce,auto", help="comma-separated strategies (first is the baseline)")
    p.add_argument("-n", "--nproc-per-node", type=int, default=2, metavar="N", help="workers (per node), default 2")
    p.add_argument("--emulate", default=None, metavar="NODESxPROCS", help="run each trial on an emulated cluster (root)")
    p.add_argument("--link", default=None, metavar="RATE[,RTT][,LOSS]",
                   help="with --emulate: link rate per node (default unshaped), optionally the round trip "
                   "between nodes and the loss per packet, e.g. 100mbit,40ms,0.1%%")
    p.add_argument("--repeats", type=int, default=1, help="runs per strategy (median reported)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on one run after this long")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--json-out", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=main)


def split_own_options(script_args: list[str], args: argparse.Namespace) -> list[str]:
    """Take bench options written after the script's arguments; stop at ``--``.

    Example::

        split_own_options(["--steps", "5", "--sync", "a,b"], ns)   # ["--steps", "5"], ns.sync == "a,b"
    """
    out: list[str] = []
    i = 0
    while i < len(script_args):
        tok = script_args[i]
        if tok == "--":
            out.extend(script_args[i + 1:])
            break
        flag, eq, value = tok.partition("=")
        if flag == "--json" and (eq or script_args[i + 1:i + 2] and script_args[i + 1].endswith(".json")):
            # the old spelling, --json PATH (slipstream.names.DEPRECATED): --json-out PATH
            warn_deprecated("--json PATH", "--json-out PATH", "slipstream bench")
            args.json_out = value if eq else script_args[i + 1]
            i += 1 if eq else 2
            continue
        if flag in _OWN:
            dest, takes = _OWN[flag]
            if not takes:
                setattr(args, dest, True)
                i += 1
                continue
            if not eq:
                if i + 1 >= len(script_args):
                    raise UsageError(f"{flag} needs a value")
                value = script_args[i + 1]
                i += 1
            setattr(args, dest, value)
            i += 1
            continue
        out.append(tok)
        i += 1
    return out


def parse_metrics(run_dir: str | os.PathLike) -> tuple[float | None, float | None]:
    """(median samples/s after the first window, last loss) from ``run_dir/metrics/rank0.jsonl``."""
    path = Path(run_dir) / "metrics" / "rank0.jsonl"
    if not path.exists():
        return None, None
    rates, loss = [], None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("samples_per_s") is not None and rec.get("step") is not None:
            rates.append(float(rec["samples_per_s"]))
        if rec.get("loss") is not None:
            loss = float(rec["loss"])
    if len(rates) > 1:
        rates = rates[1:]  # the first window carries start-up (first-step allocation, DDP bucket rebuild)
    return (statistics.median(rates) if rates else None), loss


def run_command(args: argparse.Namespace, strategy: str, run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "slipstream", "run", "--sync", strategy, "--run-dir", run_dir]
    if args.emulate:
        cmd += ["--emulate", args.emulate, "--link", args.link or "unshaped"]
    else:
        cmd += ["-n", str(args.nproc_per_node)]
    if args.module:
        cmd.append("-m")
    cmd.append(args.script)
    if args.script_args:
        cmd.append("--")
        cmd.extend(args.script_args)
    return cmd


def run_one(cmd: list[str], timeout_s: float, grace_s: float = 30.0, stdout: int | None = None) -> int:
    """Run one trial; its exit code, 124 past ``timeout_s``. ``stdout``: a file descriptor for the
    trial's output (2 under ``--json``, so stdout holds the JSON alone); None: ours.

    The trial is stopped with SIGTERM first (SIGINT on Ctrl-C), and SIGKILL only
    after ``grace_s``: an emulated run needs the chance to delete its namespaces.
    """
    from ..launch.proc import stop_processes

    proc = subprocess.Popen(cmd, start_new_session=True, stdout=stdout)
    # SIGTERM raises outside stdlib code only, and the wait is a loop of our own (a
    # signal inside Popen.wait could leave the Popen's lock held, its exit unseen).
    with safe_signals.installed(signal.SIGTERM, lambda signum: KeyboardInterrupt()):
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    print(f"[bench] run exceeded {timeout_s:.0f} s; stopping it", file=sys.stderr)
                    stop_processes([proc], sig=signal.SIGTERM, grace_s=grace_s)
                    return 124
                time.sleep(0.05)
            return proc.returncode
        except KeyboardInterrupt:
            stop_processes([proc], sig=signal.SIGINT, grace_s=grace_s)
            return EXIT_INTERRUPTED


def bench(args: argparse.Namespace, out=sys.stdout) -> list[BenchResult]:
    """Run every strategy ``args.repeats`` times, interleaved; the results in the order given."""
    strategies = [s.strip() for s in args.sync.split(",") if s.strip()]
    results = {s: BenchResult(s) for s in strategies}
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-") as tmp:
        for rep in range(args.repeats):
            order = strategies if rep % 2 == 0 else list(reversed(strategies))
            for strategy in order:
                run_dir = os.path.join(tmp, f"{strategy}-{rep}")
                cmd = run_command(args, strategy, run_dir)
                print(f"[bench] {strategy} (run {rep + 1}/{args.repeats}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                code = run_one(cmd, args.timeout_s, stdout=2 if args.json else None)
                wall = time.perf_counter() - t0
                if code == EXIT_INTERRUPTED:
                    raise KeyboardInterrupt
                r = results[strategy]
                r.exit_codes.append(code)
                if code != 0:
                    print(f"[bench] {strategy}: exit code {code}; its figures are left out", file=sys.stderr)
                    continue
                r.wall_s.append(wall)
                rate, loss = parse_metrics(run_dir)
                if rate is not None:
                    r.samples_per_s.append(rate)
                if loss is not None:
                    r.final_loss.append(loss)
    return [results[s] for s in strategies]


def format_table(results: list[BenchResult], shape: str) -> str:
    base = results[0]
    b_wall, b_rate = base.median("wall_s"), base.median("samples_per_s")
    lines = [
        f"slipstream bench: {shape}; medians of {max(len(r.exit_codes) for r in results)} run(s); "
        f"ratios against {base.strategy}",
        f"{'strategy':<24} {'samples/s':>10} {'x':>6} {'end-to-end s':>13} {'x':>6} {'final loss':>11}  status",
    ]
    for r in results:
        wall, rate, loss = r.median("wall_s"), r.median("samples_per_s"), r.median("final_loss")
        lines.append(
            f"{r.strategy:<24} {_f(rate, '.1f'):>10} {_f(rate / b_rate if rate and b_rate else None, '.2f'):>6} "
            f"{_f(wall, '.1f'):>13} {_f(b_wall / wall if wall and b_wall else None, '.2f'):>6} {_f(loss, '.4f'):>11}  "
            + ("ok" if r.ok else f"failed (exit {', '.join(str(c) for c in r.exit_codes if c)})")
        )
    lines.append("samples/s: median of the JSONL windows after the first (scripts using slipstream.accelerate); "
                 "end-to-end: whole `slipstream run`, start-up included. x > 1 is faster.")
    return "\n".join(lines)


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def take_old_json_spelling(args: argparse.Namespace) -> None:
    """``bench --json out.json train.py``, the old spelling of ``--json-out out.json``: argparse reads
    ``--json`` as the switch and out.json as SCRIPT (never a .json file); one warning line, then the
    file is the output and the next word the script (slipstream.names.DEPRECATED)."""
    if args.json and args.script.endswith(".json") and args.script_args:
        warn_deprecated("--json PATH", "--json-out PATH", "slipstream bench")
        args.json, args.json_out = False, args.script
        args.script, args.script_args = args.script_args[0], list(args.script_args[1:])


def main(args: argparse.Namespace) -> int:
    take_old_json_spelling(args)
    args.script_args = split_own_options(list(args.script_args), args)
    # Options written after the script's arguments arrive as text (split_own_options).
    for dest, flag, kind in (("nproc_per_node", "-n", int), ("repeats", "--repeats", int),
                             ("timeout_s", "--timeout-s", float)):
        try:
            setattr(args, dest, kind(getattr(args, dest)))
        except ValueError:
            rule = "a whole number" if kind is int else "a number"
            raise UsageError(f"{flag} must be {rule}, got {getattr(args, dest)!r}") from None
    if args.timeout_s <= 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
    out = args.json_out
    if out is not None and (os.path.isdir(out) or not os.path.isdir(os.path.dirname(out) or ".")):
        raise UsageError(f"--json-out must be a file path in an existing directory, got {out!r}")
    if args.link is not None and not args.emulate:
        raise UsageError(f"--link {args.link} shapes the links of an emulated cluster: it needs --emulate NODESxPROCS")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.nproc_per_node < 1:
        raise UsageError(f"-n must be >= 1, got {args.nproc_per_node}")
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"training script not found: {args.script}")
    from .. import sync

    strategies = [s.strip() for s in args.sync.split(",") if s.strip()]
    if not strategies:
        raise UsageError("--sync needs at least one strategy")
    unknown = [s for s in strategies if not sync.is_valid(s)] if hasattr(sync, "is_valid") else \
        [s for s in strategies if s not in sync.available()]
    if unknown:
        named = [name + did_you_mean(name, sync.available(), quote=True) for name in unknown]
        raise UsageError(f"--sync: unknown strateg{'y' if len(unknown) == 1 else 'ies'}: {', '.join(named)}; "
                         f"known: {', '.join(sync.available())}")
    if len(set(strategies)) != len(strategies):
        raise UsageError(f"--sync lists a strategy twice: {args.sync}")
    if args.emulate:
        from ..launch.emulate import missing_privileges, parse_link, parse_shape

        parse_shape(args.emulate)
        parse_link(args.link)
        why = missing_privileges()
        if why:
            raise UsageError(f"--emulate cannot build a cluster here: {why}")
        shape = f"{args.emulate} emulated, link {args.link or 'unshaped'}"
    else:
        shape = f"1 node x {args.nproc_per_node} process(es)"
    results = bench(args)
    doc = {"shape": shape, "results": [r.as_dict() for r in results]}
    print(json.dumps(doc, indent=1) if args.json else format_table(results, shape))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    return EXIT_OK if all(r.ok for r in results) else EXIT_TRAINING_FAILED
