"""The conformance matrix: its axes, the pure check that refuses a row, and the worker that trains rows.

Every configuration that ``TrainConfig`` and ``slipstream run`` accept either
trains or is refused before any worker starts, with one line naming the
combination. A row is one point of the axes below:

* ``param_dtype``: the dtype the model's parameters are in (fp32, bf16, fp16);
* ``precision``: the numerics' precision (autocast; fp16 with a loss scaler);
* ``sync``: every ``slipstream.sync.available()`` name;
* ``layout``: plain DDP, dp_shard (FSDP2, ZeRO-3 and ZeRO-2), tp, pp (2 ranks: no mixes fit);
* ``accum_clip``: accumulation 1 or 2 micro-steps, clipping off or at 1.0;
* ``checkpoint``: off, blocking, async. With checkpoints on, the row trains in two
  launches of ``accelerate()`` over one directory: the first ends on a save at its
  final step, the second resumes there (the middle of the run) and takes the rest
  of the steps under the row's sync (compressed steps after a resume);
* ``config_via``: keyword arguments to ``accelerate()``, or the ``slipstream run``
  flags turned into the workers' ``SLIPSTREAM_*`` environment (``worker_env_from_args``);
* ``optimizer``: AdamW's implementation: torch's default as a GPU resolves it (foreach:
  the harness makes the CPU resolve it so, tests/gpu_defaults.py), the per-tensor loop
  (the CPU's default, asked for) or fused. Layouts whose parameters are DTensors took
  another branch on the GPU than on the CPU until this axis existed;
* ``launch`` (pure, see :mod:`tests.conformance.launch_rows`): how the ranks were started.

"Trains" means every step's loss is finite and the last one ends within a stated
tolerance of the row's reference: the same row with fp32 parameters, ``allreduce``,
no checkpoints and keyword options (:func:`tolerance` states the bounds).

Used by tests/conformance/test_matrix.py (a pairwise covering array) and
benchmarks/conformance_matrix.py (``--pairwise`` or ``--full``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

PARAM_DTYPES = ("fp32", "bf16", "fp16")
PRECISIONS = ("fp32", "bf16", "fp16")
LAYOUTS: dict[str, dict[str, int]] = {
    "ddp": {},
    "dp_shard": {"dp_shard": 2},
    "dp_shard_zero2": {"dp_shard": 2, "zero_stage": 2},
    "tp": {"tp": 2},
    "pp": {"pp": 2},
}
ACCUM_CLIP: dict[str, tuple[int, float | None]] = {
    "accum1": (1, None),
    "accum2": (2, None),
    "accum1+clip": (1, 1.0),
    "accum2+clip": (2, 1.0),
}
CHECKPOINTS = ("off", "blocking", "async")
CONFIG_VIA = ("keywords", "slipstream run")
OPTIMIZERS: dict[str, dict[str, bool]] = {
    "gpu-default": {},             # foreach=None: foreach on a GPU (and in the harness's ranks)
    "for-loop": {"foreach": False},
    "fused": {"fused": True},
}
WORLD = 2
STEPS = 6  # optimizer steps per row; with checkpoints: 3 in the first launch, 3 after the resume
RESUME_AT = 3
GLOBAL_BATCH, CONTEXT, DIM, LAYERS, HEADS, VOCAB, LR = 8, 8, 16, 2, 2, 64, 3e-2

# Codecs whose gradients differ from allreduce's by more than a rounding: error feedback
# keeps them converging, but at 4 steps their loss is its own. Bounds measured on this
# matrix (benchmarks/conformance_matrix.py --full, see benchmarks/results/conformance.md) with margin.
LOSSY = ("powersgd", "topk", "sign", "auto")
DILOCO_INNER_STEPS = 2


def axes() -> dict[str, tuple[str, ...]]:
    """The axes of the trained rows, in the order the covering array takes them."""
    from slipstream import sync

    return {
        "sync": tuple(sync.available()),
        "layout": tuple(LAYOUTS),
        "accum_clip": tuple(ACCUM_CLIP),
        "param_dtype": PARAM_DTYPES,
        "precision": PRECISIONS,
        "checkpoint": CHECKPOINTS,
        "config_via": CONFIG_VIA,
        "optimizer": tuple(OPTIMIZERS),
    }


@dataclass(frozen=True)
class Row:
    sync: str = "allreduce"
    layout: str = "ddp"
    accum_clip: str = "accum1"
    param_dtype: str = "fp32"
    precision: str = "fp32"
    checkpoint: str = "off"
    config_via: str = "keywords"
    optimizer: str = "gpu-default"

    @property
    def name(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())

    def reference(self) -> "Row":
        """The row this one is judged against: fp32 parameters, allreduce, no checkpoints, keywords,
        and the per-tensor optimizer loop (so foreach and fused are each held to the plain update)."""
        return replace(self, param_dtype="fp32", sync="allreduce", checkpoint="off", config_via="keywords",
                       optimizer="for-loop")


# --- configuration of a row ------------------------------------------------------------------

def options(row: Row, checkpoint_dir: str | None = None) -> dict[str, Any]:
    """The flat training options of a row (what accelerate() takes as keywords)."""
    accumulate, clip = ACCUM_CLIP[row.accum_clip]
    out: dict[str, Any] = {"sync": row.sync, "precision": row.precision, "accumulate_steps": accumulate,
                           **LAYOUTS[row.layout]}
    if clip is not None:
        out["grad_clip_norm"] = clip
    if row.sync == "diloco":
        # Outer steps at 2, 4 and 6; with checkpoints the resume at step 3 lands between two,
        # where the replicas differ (their own parameters and AdamW state come from the
        # strategy's per-rank checkpoint entry).
        out["sync_options"] = {"inner_steps": DILOCO_INNER_STEPS}
    if row.checkpoint != "off":
        out.update(checkpoint_dir=checkpoint_dir or "/nonexistent/ckpt", checkpoint_every_steps=RESUME_AT,
                   checkpoint_async=row.checkpoint == "async")
    return out


def run_flags(opts: dict[str, Any]) -> list[str]:
    """``slipstream run`` flags for the options (``--nproc-per-node 2 --nnodes 1 ... train.py``)."""
    argv = ["run", "--nproc-per-node", str(WORLD), "--nnodes", "1"]
    for name, value in opts.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv + ["train.py"]


@functools.lru_cache(maxsize=1)
def _parser():
    from slipstream.cli import build_parser

    return build_parser()


def run_env(opts: dict[str, Any]) -> dict[str, str]:
    """The SLIPSTREAM_* environment ``slipstream run`` gives its workers for these options
    (raises the launcher's UsageError where it refuses them, before any worker starts)."""
    from slipstream.launch.cli import worker_env_from_args

    return worker_env_from_args(_parser().parse_args(run_flags(opts)))


def refusal(row: Row) -> str | None:
    """Why the product refuses this row before any worker starts, or None when it accepts it.

    Pure: the checks ``slipstream run`` makes (flags -> TrainConfig -> degrees against the
    world) or, for keyword rows, TrainConfig and its degrees; and the parameter-dtype check
    accelerate() makes before it builds anything. The product's own checks, not a copy of
    their rules, so the two cannot disagree: ``diloco`` with dp_shard is accepted (one replica
    at 2 ranks), with tp or pp refused, as TrainConfig decides.
    """
    from slipstream.config import TrainConfig, check_parameter_dtype
    from slipstream.errors import SlipstreamError

    opts = options(row)
    try:
        if row.config_via == "slipstream run":
            cfg = TrainConfig.from_env(run_env(opts))
        else:
            cfg = TrainConfig.from_env(environ={}, **opts)
        cfg.degrees(WORLD)
        check_parameter_dtype(cfg, row.param_dtype)
    except SlipstreamError as exc:
        return str(exc)
    return None


def accepted_partial(values: list[str]) -> bool:
    """allpairspy's filter: a prefix of a row (in axes() order) the product accepts."""
    names = list(axes())
    return refusal(Row(**dict(zip(names, values)))) is None


def pairwise_rows() -> list[Row]:
    """A covering array of the accepted rows: every pair of axis values that some accepted
    row holds appears in at least one row (allpairspy, filtered by :func:`refusal`)."""
    from allpairspy import AllPairs

    ax = axes()
    names = list(ax)
    rows = [Row(**dict(zip(names, values))) for values in AllPairs([list(v) for v in ax.values()],
                                                                   filter_func=accepted_partial)]
    # allpairspy's filter may leave a pair uncovered (it settles a row's first values before the
    # later ones are known): complete the array with a row per missing pair, the rest at defaults.
    covered = {pair for row in rows for pair in itertools.combinations(asdict(row).items(), 2)}
    for (a, values_a), (b, values_b) in itertools.combinations(ax.items(), 2):
        for va, vb in itertools.product(values_a, values_b):
            if ((a, va), (b, vb)) not in covered:
                row = Row(**{a: va, b: vb})
                if refusal(row) is None:
                    rows.append(row)
                    covered.update(itertools.combinations(asdict(row).items(), 2))
    return rows


def all_rows() -> Iterable[Row]:
    """The full cross product of the axes (accepted and refused)."""
    ax = axes()
    for values in itertools.product(*ax.values()):
        yield Row(**dict(zip(ax, values)))


def tolerance(row: Row) -> tuple[float, str]:
    """(bound on |final loss - reference final loss|, why): the documented bound for the row.

    The reference (fp32, allreduce) goes from ln(64) = 4.16 to about 3.73 in 6 steps.

    * fp32 parameters and allreduce (only the checkpoint, config_via and optimizer axes
      differ): 1e-4: a resume is bitwise, the flags path builds the same config, and foreach
      and fused AdamW compute the per-tensor update up to rounding;
    * 16-bit casts (``bf16``/``fp16`` sync, plain ``hierarchical``) and 16-bit parameters:
      0.08 (a 16-bit rounding of the weights or the gradient moved the 6th step's loss
      by at most 0.04 in the full matrix run);
    * lossy codecs (powersgd, topk, sign, auto, and hierarchical+those): 0.5, and the
      final loss below the first step's: their gradient is not the mean gradient (error
      feedback repays the rest later), so at 6 steps they trail allreduce (topk at its
      default density barely moves: 4.17 -> 4.17) but must not diverge; a residual kept
      in loss-scaled units, say, sends the loss far past either bound;
    * ``diloco`` (H=2): the same bound and rule: local steps and an outer step are another
      optimisation, not a rounding of the reference's. With dp_shard over both ranks it is
      one replica, which runs as plain FSDP2 (docs/sync.md): the reference's numerics, so
      the bound of the same row under ``allreduce``.
    """
    if row.sync == "diloco" and LAYOUTS[row.layout].get("dp_shard", 1) == WORLD:
        row = replace(row, sync="allreduce")  # one replica: nothing to join
    codec = row.sync.split("+")[-1]
    if codec in LOSSY:
        return 0.5, "lossy codec (error feedback): within 0.5 of allreduce's loss at step 6, below step 1's"
    if row.sync == "diloco":
        return 0.5, "diloco (local steps, an outer step every 2): its own optimisation; within 0.5, below step 1's"
    if row.sync != "allreduce" or row.param_dtype != "fp32":
        return 0.08, "16-bit casts (sync, parameters, or reduction levels): within 0.08"
    return 1e-4, "same numerics as the reference (checkpoint resume, flags): within 1e-4"


# --- training one row (in each of the 2 ranks) ------------------------------------------------

def _example():
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("train_gpt_example", repo / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(step: int):
    import torch

    # Learnable rows (each counts up by one from a random start), so 4 steps move the loss
    # well off ln(VOCAB) and a wrong gradient shows in it.
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(CONTEXT + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _train(ex, row: Row, until: int, checkpoint_dir: str | None) -> tuple[list[float], int]:
    """Train ``row`` up to optimizer step ``until`` (resuming from checkpoint_dir if it holds one);
    returns (the losses of the steps run here, the step it started from)."""
    import torch

    import slipstream
    from slipstream.config import TrainConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[row.param_dtype]
    torch.manual_seed(0)
    model = ex.GPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, context=CONTEXT).to(dtype)
    opts = options(row, checkpoint_dir)
    if row.config_via == "slipstream run":
        config = TrainConfig.from_env(run_env(opts), progress=False, profile=False, log_every_steps=1)
        kwargs: dict[str, Any] = {"config": config}
    else:
        kwargs = dict(opts, progress=False, profile=False, log_every_steps=1)
    impl = OPTIMIZERS[row.optimizer]
    run = slipstream.accelerate(model, lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **impl),
                                tp_plan=ex.TP_PLAN, **kwargs)
    start = run.step_count
    accumulate, _ = ACCUM_CLIP[row.accum_clip]
    per_rank = GLOBAL_BATCH // run.dp_size
    per_micro = per_rank // accumulate
    losses = []
    while run.step_count < until:
        x, y = _batch(run.step_count)
        rows = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
        x, y = x[rows], y[rows]
        total = 0.0
        for m in range(accumulate):
            part = slice(m * per_micro, (m + 1) * per_micro)
            total += float(run.train_step(x[part], y[part], ex.loss_fn))
        losses.append(total / accumulate)
    run.finish()
    return losses, start


def train_row(ex, row: Row, scratch: str) -> dict[str, Any]:
    """Train a row: STEPS optimizer steps, in two launches around a resume when checkpointing."""
    if row.checkpoint == "off":
        losses, _ = _train(ex, row, STEPS, None)
        return {"losses": losses}
    ckpt = os.path.join(scratch, "ckpt")
    first, start1 = _train(ex, row, RESUME_AT, ckpt)     # ends on a save at its final step
    second, start2 = _train(ex, row, STEPS, ckpt)        # resumes in the middle, compressed steps after
    if start1 != 0 or start2 != RESUME_AT:
        raise AssertionError(f"resume started at step {start2} (first launch at {start1}), expected {RESUME_AT}")
    return {"losses": first + second}


def judge(row: Row, losses: list[float], reference: list[float]) -> tuple[bool, str]:
    """(trained, why): finite losses, and the last within :func:`tolerance` of the reference's last."""
    if len(losses) != STEPS:
        return False, f"{len(losses)} steps ran, expected {STEPS}"
    if not all(math.isfinite(v) for v in losses):
        return False, f"non-finite loss: {losses}"
    bound, why = tolerance(row)
    diff = abs(losses[-1] - reference[-1])
    if (row.sync.split("+")[-1] in LOSSY or row.sync == "diloco") and losses[-1] > losses[0] + 0.05:
        return False, f"final loss {losses[-1]:.5f} above the first step's {losses[0]:.5f} (diverging; {why})"
    if diff > bound:
        return False, f"final loss {losses[-1]:.5f} vs reference {reference[-1]:.5f}: |diff| {diff:.4f} > {bound} ({why})"
    return True, f"final loss {losses[-1]:.5f}, reference {reference[-1]:.5f}, |diff| {diff:.2e} <= {bound}"


# --- the worker: many rows in one process group -----------------------------------------------

ROW_DEADLINE_S = 60.0


def matrix_worker(rank: int, world: int, rows: list[dict], progress_dir: str, scratch: str) -> list[dict]:
    """Train ``rows`` (as dicts, references first where a row needs one) one after another.

    Each rank appends one JSON line per row to PROGRESS_DIR/rank<R>.jsonl as it goes, so
    the parent learns which row failed even when a rank crashed or hung there. A row
    that raises ends the worker (a failed row may leave the group's collectives out of
    step): the parent starts a new process group for the rows after it. A row past
    ROW_DEADLINE_S is a hang: faulthandler (a C thread, so also while a call holds the
    GIL) writes every thread's stack to PROGRESS_DIR/hang-rank<R>.txt and ends the process.
    """
    import faulthandler

    import torch

    import slipstream

    torch.set_num_threads(1)
    slipstream.init()
    ex = _example()
    log = open(os.path.join(progress_dir, f"rank{rank}.jsonl"), "a")
    out = []
    for item in rows:
        row, index = Row(**item["row"]), item["index"]
        where = os.path.join(scratch, f"row{index}")
        os.makedirs(where, exist_ok=True)
        os.environ["SLIPSTREAM_RUN_DIR"] = os.path.join(where, "run")
        with open(os.path.join(progress_dir, f"hang-rank{rank}.txt"), "w") as hang:
            hang.write(f"row {index}: no end after {ROW_DEADLINE_S:.0f} s (hang); the stacks:\n")
            hang.flush()
            faulthandler.dump_traceback_later(ROW_DEADLINE_S, exit=True, file=hang)
            t0 = time.perf_counter()
            try:
                result = train_row(ex, row, where)
                status, error = "ok", ""
            except Exception as exc:  # noqa: BLE001 - recorded per row
                text = str(exc).strip()
                status, error = "error", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                result = {"traceback": traceback.format_exc()[-3000:]}
            finally:
                faulthandler.cancel_dump_traceback_later()
        record = {"index": index, "status": status, "error": error, "seconds": round(time.perf_counter() - t0, 2),
                  **result}
        log.write(json.dumps(record) + "\n")
        log.flush()
        out.append(record)
        if status != "ok":
            break  # the group may be out of step: the parent relaunches for the rest
        if rank == 0:
            shutil.rmtree(os.path.join(where, "ckpt"), ignore_errors=True)
    log.close()
    slipstream.shutdown()
    return out


def read_progress(progress_dir: str) -> dict[int, list[dict]]:
    """Per row index, the records of the ranks that reached its end."""
    got: dict[int, list[dict]] = {}
    for r in range(WORLD):
        f = Path(progress_dir) / f"rank{r}.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    got.setdefault(rec["index"], []).append(rec)
    return got


def run_rows(rows: list[Row], workdir: str, timeout_s: float = 900, max_launches: int = 12) -> dict[Row, dict]:
    """Train ``rows`` and their references at 2 ranks on gloo in as few launches as possible.

    Returns per row: status "trained" / "failed", a reason, the losses and seconds.
    A row that crashes a rank or hangs is failed with what the ranks recorded, and a
    new launch takes the rows after it.
    """
    from tests.harness import run_ranks

    refs = sorted({r.reference() for r in rows} - set(rows), key=lambda r: r.name)
    order = refs + [r for r in rows]
    order = list(dict.fromkeys(order))
    items = [{"index": i, "row": asdict(r)} for i, r in enumerate(order)]
    progress_dir = os.path.join(workdir, "progress")
    os.makedirs(progress_dir, exist_ok=True)
    pending = items
    launches = 0
    launch_errors: dict[int, str] = {}
    while pending and launches < max_launches:
        launches += 1
        try:
            run_ranks(matrix_worker, WORLD, pending, progress_dir, os.path.join(workdir, "scratch"),
                      env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "60", "SLIPSTREAM_PROFILE": "0"},
                      timeout_s=timeout_s, local_world_size=1)  # 2 "nodes": hierarchical has an inter-node step
            error = ""
        except AssertionError as exc:
            error = str(exc)
        got = read_progress(progress_dir)
        rest = [it for it in pending if len(got.get(it["index"], [])) < WORLD
                or any(r["status"] != "ok" for r in got[it["index"]])]
        if not rest:
            break
        if len(rest) == len(pending) and not got.get(rest[0]["index"]):
            # Nothing ran at all (the launch itself failed): the same error for every row left.
            for it in rest:
                launch_errors[it["index"]] = error[-3000:] or "the launch failed"
            break
        # The first row not finished by both ranks is where this launch broke off: fail it.
        broke = rest[0]
        hung = [Path(progress_dir, f"hang-rank{r}.txt") for r in range(WORLD)]
        hung_text = "\n".join(f.read_text() for f in hung if f.exists() and f.read_text().startswith(f"row {broke['index']}:")
                              and "Thread" in f.read_text())
        launch_errors[broke["index"]] = hung_text or error[-3000:] or "the launch ended before this row finished"
        pending = rest[1:]
    got = read_progress(progress_dir)
    by_index: dict[int, dict] = {}
    for it in items:
        recs = got.get(it["index"], [])
        if len(recs) == WORLD and all(r["status"] == "ok" for r in recs):
            by_index[it["index"]] = {"ok": True, "losses": recs[0]["losses"],
                                     "seconds": max(r["seconds"] for r in recs)}
        else:
            errors = [f"rank {i}: {r['status']} {r.get('error', '')}" for i, r in enumerate(recs) if r["status"] != "ok"]
            reason = "; ".join(errors) or _summary(launch_errors.get(it["index"], "not run"))
            tb = next((r.get("traceback", "") for r in recs if r.get("traceback")), launch_errors.get(it["index"], ""))
            by_index[it["index"]] = {"ok": False, "reason": reason, "traceback": tb,
                                     "seconds": max((r.get("seconds", 0) for r in recs), default=0)}
    index_of = {Row(**it["row"]): it["index"] for it in items}
    out: dict[Row, dict] = {}
    for row in rows:
        mine = by_index[index_of[row]]
        if not mine["ok"]:
            out[row] = {"status": "failed", "reason": mine["reason"], "traceback": mine["traceback"],
                        "seconds": mine["seconds"]}
            continue
        ref = by_index[index_of[row.reference()]]
        if not ref["ok"]:
            out[row] = {"status": "failed", "reason": f"its reference failed: {ref['reason']}",
                        "losses": mine["losses"], "seconds": mine["seconds"]}
            continue
        ok, why = judge(row, mine["losses"], ref["losses"])
        out[row] = {"status": "trained" if ok else "failed", "reason": why, "losses": mine["losses"],
                    "reference": ref["losses"], "seconds": mine["seconds"]}
    out_meta = {"launches": launches}
    out[None] = out_meta  # type: ignore[index]
    return out


def _summary(text: str) -> str:
    """One line for a launch's failure: a hang's first line and where in slipstream it stood, or the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines and "(hang)" in lines[0]:
        frames = list(dict.fromkeys(line for line in lines if "slipstream/" in line))[:3]
        return lines[0].split(";")[0] + (": " + " <- ".join(frames) if frames else "")
    return _last_line(text)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else text
