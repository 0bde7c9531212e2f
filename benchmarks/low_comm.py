"""Low-communication training side by side (issue #35 item 5): DDP, ``auto``, DiLoCo and torchft's DiLoCo.

Question it answers: on slow inter-node links, how many bytes per token does each system
move, how much of the machine does it keep busy, how fast does it reach a target loss,
and what does it cost in held-out loss at equal tokens? The issue's targets for
``--sync diloco`` at ``100mbit,40ms`` on 2x1: at least 100x fewer bytes per token than
fp32 DDP, at least 90% compute utilisation, held-out loss within 2% of DDP's.

The workload is the GPT example (``examples/train_gpt.py --dim 128 --layers 2``: 0.44M
parameters, 1.75 MB of fp32 gradients), trained by every row for the same ``--steps`` at the
same global batch (``--global-batch`` sequences of ``--context`` tokens, split over the
ranks), so every row sees the same tokens. For each cluster shape in ``--clusters`` one
emulated cluster (docs/cluster.md) is built and kept; for each link in ``--links`` it is
reshaped in place, and every system in ``--systems`` runs on it in turn (reversed order on
odd ``--repeats``):

* ``ddp``: ``--sync allreduce`` (DDP's reducer, fp32); any other Slipstream strategy by its
  name (``auto``, ``bf16``, ``powersgd``, ...);
* ``diloco:H[:CODEC][:tauN]``: ``--sync diloco --sync-options '{"inner_steps": H[, "outer_codec": CODEC][,
  "overlap_steps": N]}'``;
* ``torchft:H[:perparam]``: torchft's ``DiLoCo`` (``benchmarks/torchft_diloco_gpt.py``: one
  replica group per node, a lighthouse on node 0), same model, optimizer and data order, its
  pseudo-gradient in one bucketized all-reduce (``perparam``: torchft's default, one all-reduce
  per parameter tensor). Where torchft does not install or run, the row holds the exact error
  instead of numbers.

Per row:

* bytes/token: bytes every node sent on its link (``tx_bytes`` of its interface, in its
  namespace, before and after the job: payload, headers, ACKs, rendezvous and control traffic
  included), summed over the nodes, over the tokens trained (steps x global batch x context);
* utilisation: the floor's step time over the row's. The floor is the same cluster shape,
  ranks, per-rank batch and training script with no communication: the links unshaped and
  ``--sync diloco`` with H past the last step, so no outer step ever runs and each rank does
  exactly a DiLoCo inner step (forward, backward, AdamW, DDP with a hook that sends nothing).
  It runs on the same emulated nodes because the ranks share this machine's cores: one rank
  alone would get a core to itself (two at 4x1 on 2 cores) and its step would be a floor no
  multi-rank row can reach. It is measured in every cell, first in the cell's order (last on
  odd repeats), because a shared machine's load drifts over minutes. A step time is the
  loop's mean after the first log window. The floor is also a row of the table: its held-out
  loss is one replica's after training alone on its share of the data, the quality with no
  communication at all, which a DiLoCo row should beat;
* wall: the whole job (start, rendezvous, training, saving); loop: the training loop alone;
* time to target: loop seconds until the row's training loss (rank 0's, mean over
  ``--smooth-steps`` steps) first reaches the target: DDP's smoothed loss at
  ``--target-fraction`` of its steps, on the same cluster and link;
* held-out loss: ``benchmarks/heldout_gpt.py`` on the saved model (samples past the training
  pack). DiLoCo rows end on an outer step (H must divide ``--steps``), where the replicas agree.

Needs root (namespaces, tc). Examples::

    sudo PYTHONPATH=src:. python3 -m benchmarks.low_comm --quick                  # smoke test, ~1 min
    sudo PYTHONPATH=src:. python3 -m benchmarks.low_comm --clusters 2x1 --links 100mbit,40ms --systems ddp,diloco:50
    sudo PYTHONPATH=src:. python3 -m benchmarks.low_comm                          # the full grid
    python3 -m benchmarks.low_comm --report benchmarks/results/low-comm-<UTC>.json   # the table again

Writes ``benchmarks/results/low-comm-<UTC>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT_SCRIPT = REPO / "examples" / "train_gpt.py"
TORCHFT_SCRIPT = REPO / "benchmarks" / "torchft_diloco_gpt.py"

DEFAULT_CLUSTERS = ("2x1", "4x1")
DEFAULT_LINKS = ("100mbit,40ms", "1gbit,5ms")
DEFAULT_SYSTEMS = ("ddp", "auto", "diloco:10", "diloco:50", "diloco:100", "diloco:50:bf16", "torchft:50")
QUICK = {"steps": 10, "clusters": ("2x1",), "links": ("100mbit,40ms",), "systems": ("ddp", "diloco:5", "torchft:5"),
         "log_every": 5, "smooth_steps": 5, "heldout_samples": 64}
TARGETS = {"bytes_fewer_x": 100.0, "utilisation": 0.90, "heldout_within": 0.02}
"""The issue's targets for a DiLoCo row against DDP on the same cluster and link."""
LOW_COMM_KINDS = ("diloco", "torchft")
LIGHTHOUSE_PORT, STORE_PORT = 29510, 29520
QUIET_ENV = {"LOGLEVEL": "WARNING", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@dataclass(frozen=True)
class System:
    """One row's training system, parsed from ``NAME[:H[:CODEC]]``."""

    label: str
    kind: str  # "slipstream", "diloco" or "torchft"
    sync: str | None = None
    options: dict = field(default_factory=dict)
    inner_steps: int | None = None


def parse_system(text: str) -> System:
    """``ddp`` / ``auto`` / ``bf16`` / ``diloco:50`` / ``diloco:50:bf16`` / ``torchft:50`` -> :class:`System`.

    Example::

        parse_system("diloco:50:bf16").options     # {"inner_steps": 50, "outer_codec": "bf16"}
    """
    parts = text.strip().split(":")
    name = parts[0]
    if name in LOW_COMM_KINDS:
        if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) < 1:
            raise ValueError(f"system {text!r}: {name} needs its inner steps, {name}:H with H >= 1 (e.g. {name}:50)")
        h = int(parts[1])
        if name == "torchft":
            if len(parts) > 3 or parts[2:] not in ([], ["perparam"]):
                raise ValueError(f"system {text!r}: torchft:H (one bucketized all-reduce per outer step) or "
                                 "torchft:H:perparam (torchft's default: one all-reduce per parameter tensor)")
            return System(text, "torchft", options={"per_param": parts[2:] == ["perparam"]}, inner_steps=h)
        options: dict = {"inner_steps": h}
        for part in parts[2:]:
            if part in ("bf16", "fp16") and "outer_codec" not in options:
                options["outer_codec"] = part
            elif re.fullmatch(r"tau[1-9][0-9]*", part) and "overlap_steps" not in options:
                options["overlap_steps"] = int(part[3:])
            else:
                raise ValueError(f"system {text!r}: diloco:H[:CODEC][:tauN], e.g. diloco:50:bf16 or "
                                 "diloco:50:bf16:tau5 (the outer all-reduce overlapped with 5 steps)")
        return System(text, "diloco", "diloco", options, h)
    if len(parts) > 1 or not re.fullmatch(r"[a-z0-9_+]+", name):
        raise ValueError(f"system {text!r}: ddp, a --sync strategy name (auto, bf16, ...), diloco:H[:CODEC][:tauN] "
                         "or torchft:H")
    return System(text, "slipstream", "allreduce" if name == "ddp" else name)


# --- figures from a finished run (pure) ---------------------------------------------------------------


def loop_step_s(records: list[dict]) -> float | None:
    """Mean seconds per step of the loop after its first log window (start-up transients out)."""
    if not records:
        return None
    first, last = records[0], records[-1]
    if len(records) == 1 or last["step"] == first["step"]:
        return last["time_s"] / max(1, last["step"])
    return (last["time_s"] - first["time_s"]) / (last["step"] - first["step"])


def smoothed(records: list[dict], window_records: int) -> list[tuple[int, float, float]]:
    """(step, loop seconds, trailing mean of the last ``window_records`` logged losses) per record."""
    out, losses = [], []
    for r in records:
        if r.get("loss") is None:
            continue
        losses.append(float(r["loss"]))
        tail = losses[-window_records:]
        out.append((int(r["step"]), float(r["time_s"]), sum(tail) / len(tail)))
    return out


def target_loss(curve: list[tuple[int, float, float]], steps: int, fraction: float) -> float | None:
    """The smoothed loss of the first record at or past ``fraction`` of ``steps``."""
    at = fraction * steps
    return next((loss for step, _, loss in curve if step >= at), None)


def time_to(curve: list[tuple[int, float, float]], target: float | None) -> float | None:
    """Loop seconds of the first record whose smoothed loss is at or below ``target`` (None: never)."""
    if target is None:
        return None
    return next((t for _, t, loss in curve if loss <= target), None)


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --- running ------------------------------------------------------------------------------------------


def _error_line(log_text: str) -> str:
    lines = [l.strip() for l in log_text.splitlines() if l.strip() and "hostname of the client socket" not in l]
    errs = [l for l in lines if re.search(r"Error|error:|Exception|Traceback|failed", l)]
    return (errs[-1] if errs else (lines[-1] if lines else "no output"))[:500]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Bench:
    """Runs the rows of one benchmark; one emulated cluster per shape at a time."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.log_path = work / "jobs.log"
        self.seq = 0

    def model_args(self, per_rank_batch: int) -> list[str]:
        a = self.args
        return ["--steps", str(a.steps), "--batch-size", str(per_rank_batch), "--context", str(a.context),
                "--dim", str(a.dim), "--layers", str(a.layers), "--seed", str(a.seed), "--corpus-mb", f"{a.corpus_mb:g}"]

    def _log(self, text: str) -> int:
        with open(self.log_path, "a") as fh:
            fh.write(f"\n=== {time.strftime('%H:%M:%S')} {text}\n")
        return self.log_path.stat().st_size

    def _tail(self, start: int) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(start)
            return fh.read().decode(errors="replace")

    def run_slipstream(self, cluster, procs: int, sync: str, options: dict, tag: str) -> dict:
        from slipstream.cli import build_parser
        from slipstream.launch.cli import launch_options_from_args

        self.seq += 1
        job = self.work / f"{self.seq:03d}-{tag}"
        run_dir, out = job / "run", job / "out"
        world = cluster.nodes * procs
        flags = ["run", "--sync", sync, "--run-dir", str(run_dir), "--log-every-steps", str(self.args.log_every)]
        if options:
            flags += ["--sync-options", json.dumps(options)]
        argv = [*flags, str(self.args.script), *self.model_args(self.args.global_batch // world), "--out", str(out)]
        opts = launch_options_from_args(build_parser(argv).parse_args(argv))
        opts.worker_env.update(QUIET_ENV)
        start = self._log(f"{tag}: slipstream {' '.join(argv[1:])}")
        row = self._measure(cluster, lambda: cluster.run(opts, procs, timeout_s=self.args.timeout_s, failure_grace_s=20,
                                                          log_path=str(self.log_path), cwd=str(REPO)))
        records = _read_jsonl(run_dir / "metrics" / "rank0.jsonl")
        if row["exit_code"] != 0 or not (out / "model.pt").exists():
            row["error"] = f"exit {row['exit_code']}: {_error_line(self._tail(start))}"
        last = records[-1] if records else {}
        row.update(records=[{k: r.get(k) for k in ("step", "time_s", "loss", "step_time_s")} for r in records],
                   model=str(out / "model.pt"), sync_decision=last.get("sync_decision"),
                   sync_outer_steps=last.get("sync_outer_steps"),
                   sync_bytes_sent_total_rank0=last.get("sync_bytes_sent_total"))
        return row

    def run_torchft(self, cluster, procs: int, h: int, per_param: bool, tag: str) -> dict:
        self.seq += 1
        out = self.work / f"{self.seq:03d}-{tag}" / "out"
        why = torchft_unavailable(procs)
        if why:
            return {"error": why}
        nodes = cluster.nodes
        lh_addr = cluster.node_list[0].addr
        start = self._log(f"{tag}: torchft DiLoCo H={h} on {nodes} replica groups")
        log = open(self.log_path, "ab")
        cores = len(os.sched_getaffinity(0))
        common = [sys.executable, str(TORCHFT_SCRIPT), "--replicas", str(nodes), "--timeout-s", "300"]
        lighthouse = subprocess.Popen(cluster.exec_argv(0, [*common, "--lighthouse", "--port", str(LIGHTHOUSE_PORT)]),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                      env=cluster.node_env(0), text=True)
        try:
            ready = select.select([lighthouse.stdout], [], [], 120)[0]
            first = lighthouse.stdout.readline().strip() if ready else ""
            if not first.startswith("up "):
                lighthouse.kill()
                lighthouse.wait(timeout=10)
                return {"error": f"torchft's lighthouse did not start: {_error_line(self._tail(start))}"}

            def replicas() -> int:
                procs_ = []
                for i, node in enumerate(cluster.node_list):
                    env = {**cluster.node_env(i), **QUIET_ENV, "OMP_NUM_THREADS": str(max(1, cores // nodes))}
                    argv = [*common, "--replica", str(i), "--addr", node.addr, "--store-port", str(STORE_PORT),
                            "--lighthouse-addr", f"http://{lh_addr}:{LIGHTHOUSE_PORT}", "--inner-steps", str(h),
                            "--log-every", str(self.args.log_every), *(["--per-param"] if per_param else []),
                            *self.model_args(self.args.global_batch // nodes),
                            "--out", str(out)]
                    procs_.append(subprocess.Popen(cluster.exec_argv(i, argv), env=env, stdout=log, stderr=log,
                                                   cwd=str(REPO)))
                deadline = time.monotonic() + self.args.timeout_s
                codes = []
                for p in procs_:
                    try:
                        codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        codes.append(p.wait())
                return next((c for c in codes if c != 0), 0)

            row = self._measure(cluster, replicas)
        finally:
            lighthouse.stdin.close()
            try:
                lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lighthouse.kill()
                lighthouse.wait()
            log.close()
        records = _read_jsonl(out / "rank0.jsonl")
        if row["exit_code"] != 0 or not (out / "model.pt").exists():
            row["error"] = f"exit {row['exit_code']}: {_error_line(self._tail(start))}"
        results = [json.loads(p.read_text()) for p in sorted(out.glob("result-*.json"))]
        row.update(records=records, model=str(out / "model.pt"), torchft_version=importlib.metadata.version("torchft"),
                   sync_outer_steps=results[0]["outer_steps_committed"] if results else None,
                   torchft_errored=[r.get("errored") for r in results])
        return row

    def _measure(self, cluster, job) -> dict:
        """Run ``job()`` (returns an exit code) with the link counters, forwarder CPU and wall clock around it."""
        nodes = range(cluster.nodes)
        tx0 = [cluster.tx_bytes(i) for i in nodes]
        cpu0, load0, t0 = cluster.forwarder_cpu_s(), os.getloadavg()[0], time.perf_counter()
        code = job()
        wall = time.perf_counter() - t0
        tx1 = [cluster.tx_bytes(i) for i in nodes]
        return {"exit_code": code, "wall_s": wall, "node_tx_bytes": [b - a for a, b in zip(tx0, tx1)],
                "forwarder_cpu_s": cluster.forwarder_cpu_s() - cpu0, "load_1min": [load0, os.getloadavg()[0]]}

    def heldout(self, model: str, samples: int) -> float | None:
        a = self.args
        cmd = [sys.executable, "-m", "benchmarks.heldout_gpt", model, "--dim", str(a.dim), "--layers", str(a.layers),
               "--context", str(a.context), "--corpus-mb", f"{a.corpus_mb:g}", "--samples", str(samples)]
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        found = re.search(r"held-out loss ([0-9.]+)", proc.stdout)
        if not found:
            raise RuntimeError(f"heldout_gpt failed ({proc.returncode}): {_error_line(proc.stdout + proc.stderr)}")
        return float(found.group(1))


def torchft_unavailable(procs_per_node: int) -> str | None:
    """Why the torchft rows cannot run here, or None."""
    if procs_per_node != 1:
        return (f"torchft rows run one replica group of one rank per node; this cluster has {procs_per_node} "
                "ranks per node (a group of several would need torchrun inside each node)")
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install torchft==0.2.0)"
    try:
        importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError as exc:
        return f"torchft has no package metadata: {exc}"
    return None


def finish_row(bench: Bench, row: dict, args: argparse.Namespace, tokens: int, score: bool = True) -> dict:
    """Bytes per token, loop step time and (``score``) held-out loss of a finished run."""
    records = row.get("records") or []
    row["tokens"] = tokens
    row["bytes_per_token"] = sum(row["node_tx_bytes"]) / tokens if "node_tx_bytes" in row else None
    row["step_s"] = loop_step_s(records)
    row["loop_s"] = records[-1]["time_s"] if records else None
    row["heldout_loss"] = None
    if score and "error" not in row:
        try:
            row["heldout_loss"] = bench.heldout(row["model"], args.heldout_samples)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            row["error"] = str(exc)
    return row


def summarise(runs: list[dict], floor_step_s: float | None, args: argparse.Namespace) -> dict:
    """One table row from a system's runs on one cluster and link: medians, and each run's figures."""
    ok = [r for r in runs if "error" not in r]
    out = {"runs": len(runs), "failed": len(runs) - len(ok), "error": runs[0].get("error") if not ok else None}
    for key in ("bytes_per_token", "step_s", "loop_s", "wall_s", "heldout_loss", "time_to_target_s", "final_loss"):
        out[key] = median_or_none([r.get(key) for r in ok])
    out["utilisation"] = (floor_step_s / out["step_s"]) if floor_step_s and out["step_s"] else None
    return out


FLOOR = "floor"
"""The label of each cell's floor row: the same jobs with no communication (see the module docstring)."""


def run_grid(args: argparse.Namespace, systems: list[System], work: Path) -> dict:
    from slipstream.launch.emulate import EmulatedCluster, parse_shape

    bench = Bench(args, work)
    window = max(1, args.smooth_steps // args.log_every)
    floor = System(FLOOR, FLOOR, "diloco", {"inner_steps": args.steps + 1})  # H past the last step: no outer step
    doc: dict = {"floor_definition": "the same cluster shape, ranks, per-rank batch and script, links unshaped, "
                                     f"--sync diloco with inner_steps {args.steps + 1} (no outer step ever runs); "
                                     "measured in every cell, interleaved with its rows", "cells": []}
    for shape in args.clusters:
        nodes, procs = parse_shape(shape)
        tokens = args.steps * args.global_batch * args.context
        with EmulatedCluster(nodes, link="unshaped") as cluster:
            for link in args.links:
                runs: dict[str, list[dict]] = {x.label: [] for x in (floor, *systems)}
                for repeat in range(args.repeats):
                    # The floor first, then the rows; reversed on odd repeats, so a neighbour's load drifting
                    # over the cell's minutes weighs on the floor and the rows alike.
                    order = [floor, *systems] if repeat % 2 == 0 else [*reversed(systems), floor]
                    for s in order:
                        tag = f"{shape}-{link.replace(',', '_')}-{s.label.replace(':', '_')}"
                        cluster.set_link("unshaped" if s is floor else link)
                        if s.kind == "torchft":
                            row = bench.run_torchft(cluster, procs, s.inner_steps or 1, bool(s.options["per_param"]), tag)
                        else:
                            row = bench.run_slipstream(cluster, procs, s.sync or "allreduce", s.options, tag)
                        if "node_tx_bytes" in row:
                            row = finish_row(bench, row, args, tokens)
                        runs[s.label].append(row)
                        print(f"{shape} {link} {s.label} #{repeat + 1}: " + _brief(row), flush=True)
                floor_step = median_or_none([r.get("step_s") for r in runs[FLOOR] if "error" not in r])
                # The target: DDP's smoothed training loss at target_fraction of its steps (per DDP run, median).
                ddp_curves = [smoothed(r["records"], window) for r in runs.get("ddp", []) if "error" not in r]
                target = median_or_none([target_loss(c, args.steps, args.target_fraction) for c in ddp_curves])
                for rs in runs.values():
                    for r in rs:
                        curve = smoothed(r.get("records") or [], window)
                        r["final_loss"] = curve[-1][2] if curve else None
                        r["time_to_target_s"] = time_to(curve, target) if "error" not in r else None
                cell = {"cluster": shape, "world_size": nodes * procs, "link": link, "tokens": tokens,
                        "target_loss": target, "floor_step_s": floor_step, "systems": {}}
                for s in (*systems, floor):
                    cell["systems"][s.label] = {"kind": s.kind, "sync": s.sync, "options": s.options,
                                                **summarise(runs[s.label], floor_step, args), "each": runs[s.label]}
                check_targets(cell)
                doc["cells"].append(cell)
    return doc


def check_targets(cell: dict) -> None:
    """The issue's three targets for every DiLoCo-like row, against DDP's row of the same cell."""
    ddp = cell["systems"].get("ddp")
    for label, s in cell["systems"].items():
        if s["kind"] not in LOW_COMM_KINDS or s["error"] or not ddp or ddp["error"]:
            continue
        fewer = ddp["bytes_per_token"] / s["bytes_per_token"] if s["bytes_per_token"] else None
        loss_ratio = s["heldout_loss"] / ddp["heldout_loss"] if s["heldout_loss"] and ddp["heldout_loss"] else None
        s["targets"] = {
            "bytes_fewer_x": fewer, "bytes_ok": fewer is not None and fewer >= TARGETS["bytes_fewer_x"],
            "utilisation_ok": s["utilisation"] is not None and s["utilisation"] >= TARGETS["utilisation"],
            "heldout_ratio": loss_ratio,
            "heldout_ok": loss_ratio is not None and loss_ratio <= 1 + TARGETS["heldout_within"],
        }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _brief(row: dict) -> str:
    if "error" in row and "node_tx_bytes" not in row:
        return f"ERROR {row['error']}"
    text = (f"wall {row['wall_s']:.1f} s, step {_ms(row.get('step_s'))}, "
            f"{(row.get('bytes_per_token') or 0):.1f} B/token, held-out {row.get('heldout_loss')}")
    return text + (f"; ERROR {row['error']}" if "error" in row else "")


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(doc: dict) -> str:
    """The markdown table of a finished run (medians over repeats)."""
    lines = ["| cluster | link | system | bytes/token | DDP's bytes / row's | utilisation | wall s | loop s | "
             "time to target s | held-out loss | / DDP's | targets (bytes, util, loss) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cell in doc["cells"]:
        ddp = cell["systems"].get("ddp") or {}
        for label, s in cell["systems"].items():
            head = f"| {cell['cluster']} | {cell['link']} | {label} |"
            if s["error"]:
                lines.append(f"{head} error: {s['error'].replace('|', '/')} |" + " |" * 9)
                continue
            fewer = ddp.get("bytes_per_token") / s["bytes_per_token"] if ddp.get("bytes_per_token") and s["bytes_per_token"] else None
            ratio = s["heldout_loss"] / ddp["heldout_loss"] if ddp.get("heldout_loss") and s["heldout_loss"] else None
            t = s.get("targets")
            marks = "-" if not t else ", ".join("yes" if t[k] else "NO" for k in ("bytes_ok", "utilisation_ok", "heldout_ok"))
            lines.append(f"{head} {_f(s['bytes_per_token'], ',.1f')} | {_f(fewer, '.1f')}x | {_f(s['utilisation'], '.2f')} | "
                         f"{_f(s['wall_s'], '.1f')} | {_f(s['loop_s'], '.1f')} | {_f(s['time_to_target_s'], '.1f')} | "
                         f"{_f(s['heldout_loss'], '.4f')} | {_f(ratio, '.4f')} | {marks} |")
    notes = [f"target loss per cell (DDP's training loss at {doc['meta']['target_fraction']:.0%} of its steps): "
             + "; ".join(f"{c['cluster']} {c['link']}: {_f(c['target_loss'], '.4f')}" for c in doc["cells"]),
             f"floor: {doc['floor_definition']}; its held-out loss is one replica's model after training alone. "
             "Floor step per cell: " + "; ".join(f"{c['cluster']} {c['link']}: {_ms(c['floor_step_s'])}" for c in doc["cells"])]
    return "\n".join(lines + [""] + notes)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except OSError:
        return None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[System]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.low_comm", description=__doc__.splitlines()[0])
    p.add_argument("--clusters", default=",".join(DEFAULT_CLUSTERS), help="comma-separated NODESxPROCS shapes")
    p.add_argument("--links", nargs="+", default=list(DEFAULT_LINKS),
                   help="links RATE[,RTT][,LOSS], space-separated (a link has commas of its own)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated: ddp, a --sync strategy name (auto, bf16, ...), diloco:H[:CODEC], torchft:H")
    p.add_argument("--script", default=str(GPT_SCRIPT),
                   help="the GPT training script the Slipstream rows run (default examples/train_gpt.py; a copy or "
                        "link of it under another name keeps it apart from tools that pick processes by script name)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of every row (H must divide it)")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps per logged loss (the jobs' --log-every-steps)")
    p.add_argument("--smooth-steps", type=int, default=50, help="steps the training loss is averaged over for the target")
    p.add_argument("--target-fraction", type=float, default=0.8, help="the target: DDP's loss at this fraction of its steps")
    p.add_argument("--heldout-samples", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="runs of each row (order reversed on odd repeats); medians")
    p.add_argument("--timeout-s", type=float, default=3600, help="per job")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK['steps']} steps, {QUICK['clusters'][0]}, {QUICK['links'][0]}, "
                        f"{','.join(QUICK['systems'])} (flags given override it)")
    p.add_argument("--work", default=None, help="keep the jobs' run directories, models and log here (default: a temporary one)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory of low-comm-<UTC>.json")
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run again, and exit")
    given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value if not isinstance(value, tuple) else list(value))
    if isinstance(args.clusters, str):
        args.clusters = [c for c in args.clusters.split(",") if c]
    if isinstance(args.systems, str):
        args.systems = [s for s in args.systems.split(",") if s]
    if args.report:
        return args, []
    try:
        systems = [parse_system(s) for s in args.systems]
    except ValueError as exc:
        p.error(str(exc))
    from slipstream.errors import SlipstreamError
    from slipstream.launch.emulate import parse_link, parse_shape

    try:
        shapes = [parse_shape(c) for c in args.clusters]
        for link in args.links:
            parse_link(link)
    except SlipstreamError as exc:
        p.error(str(exc))
    if len({s.label for s in systems}) != len(systems):
        p.error(f"--systems names a system twice: {','.join(args.systems)}")
    for name, v in (("--steps", args.steps), ("--global-batch", args.global_batch), ("--log-every", args.log_every),
                    ("--repeats", args.repeats), ("--heldout-samples", args.heldout_samples)):
        if v < 1:
            p.error(f"{name} must be >= 1, got {v}")
    if not Path(args.script).is_file():
        p.error(f"--script {args.script}: no such file")
    if not 0 < args.target_fraction <= 1:
        p.error(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    for s in systems:
        if s.inner_steps and args.steps % s.inner_steps:
            p.error(f"system {s.label}: --steps({args.steps}) must be a multiple of H({s.inner_steps}), so the run "
                    "ends on an outer step and the saved model is the replicas' common one")
    for (nodes, procs), shape in zip(shapes, args.clusters):
        if args.global_batch % (nodes * procs):
            p.error(f"--global-batch({args.global_batch}) must divide over the {nodes * procs} ranks of {shape}")
    if "ddp" not in {s.label for s in systems}:
        print("note: no ddp row: no ratios, no target loss, no target check", file=sys.stderr)
    return args, systems


def main(argv: list[str] | None = None) -> int:
    args, systems = parse_args(argv)
    if args.report:
        print(table(json.loads(Path(args.report).read_text())))
        return 0
    from slipstream.launch.emulate import missing_privileges

    why = missing_privileges()
    if why:
        print(f"python -m benchmarks.low_comm: error: the emulated cluster cannot be built here: {why}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    started = time.time()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="low-comm-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        grid = run_grid(args, systems, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    try:
        torchft_version = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        torchft_version = None
    meta = {"command": "python -m benchmarks.low_comm " + " ".join(argv if argv is not None else sys.argv[1:]),
            "args": {k: v for k, v in vars(args).items() if k != "report"}, "systems": [asdict(s) for s in systems],
            "git_commit": _git_commit(), "torch_version": importlib.metadata.version("torch"),
            "torchft_version": torchft_version, "started_utc": stamp, "elapsed_s": time.time() - started,
            "target_fraction": args.target_fraction, "targets": TARGETS, "cores": len(os.sched_getaffinity(0)),
            "tokens_per_row": args.steps * args.global_batch * args.context}
    doc = {"meta": meta, **grid}
    doc["table"] = table(doc)
    print(doc["table"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"low-comm-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"written: {path} ({meta['elapsed_s']:.0f} s)")
    # A Slipstream row that failed is a failed benchmark; torchft's row records its error instead.
    failed = [f"{c['cluster']} {c['link']} {label}" for c in doc["cells"] for label, s in c["systems"].items()
              if s["kind"] != "torchft" and s["error"]]
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
