"""Acceptance steps "sync/*", "layout/*" and "nccl/*": one launch of N ranks trains
the GPT of examples/train_gpt.py under a list of configurations in turn; every
rank writes, per configuration, a digest of the whole model it ends with.

    slipstream run -n 2 -m benchmarks.acceptance.ranks --plan plan.json --out DIR

plan.json::

    {"steps": 4, "model": {"dim": 64, "layers": 2, "heads": 4, "context": 32, "batch": 8},
     "configs": [{"name": "sync/powersgd", "options": {"sync": "powersgd"}}, ...]}

A configuration may also have a ``case`` (see :func:`train_one`): bf16 parameters, an
asynchronous save on the final step followed by a resume and compressed steps, or a
forced loss-scale change under fp16 error feedback.

``options`` go to ``slipstream.accelerate`` as keyword options (sync, precision,
dp_shard, tp, pp, ...). Per configuration and rank, in DIR/<name with / as __>/:
``rank<R>.started`` when it begins, then ``rank<R>.json``: status, the effective
config, backend and device, per-name digests of ``run.unwrapped_state_dict()``
(every rank gets the whole model, gathered over its shards, tensor-parallel
slices and pipeline stages), the losses, seconds.

Equal digests on every rank is the claim: data-parallel replicas, tensor-parallel
replicas of unsharded weights and the tied embedding/head copies of pipeline
stages all ended with the same bits. The tied pair is also compared directly.

A configuration that raises writes its error and ends the process with exit
code 3: after a failure the ranks' collectives may no longer line up, so the
orchestrator relaunches the configurations that have not started yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import slipstream
from benchmarks.acceptance.common import load_example, tensor_digest, write_result
from benchmarks.acceptance.workload import CORPUS_BYTES, build_model, make_optimizer, rank_batch


def config_dir(out: Path, name: str) -> Path:
    return out / name.replace("/", "__")


def effective_mismatches(config, options: dict) -> list[str]:
    """Options asked for that the run's TrainConfig does not show (a lost flag or env)."""
    wrong = []
    flat = config.flat()  # options are given by their flat names
    for key, wanted in options.items():
        have = flat.get(key)
        if isinstance(have, tuple):
            wanted = tuple(wanted)
        if have != wanted:
            wrong.append(f"{key}: asked {wanted!r}, got {have!r}")
    return wrong


SCALE_GAP_BOUND = 0.02
"""Largest |loss difference| allowed between an fp16 run whose loss scale is forced down
mid-run and the same run without: a scale change is exact in binary (a power of two),
so only rounding may differ; error feedback kept in loss-scaled units is off by the
factor after the change and moves the loss far more."""


def _accelerate(ex, model_cfg: dict, steps: int, options: dict, run_dir: Path, param_dtype: str):
    model = build_model(ex, model_cfg, param_dtype)  # the same initial weights on every rank
    run = slipstream.accelerate(
        model,
        make_optimizer,
        tp_plan=ex.TP_PLAN,
        run_dir=str(run_dir),
        total_steps=steps,
        log_every_steps=2,  # log steps exchange per-rank timings over the control group: exercise it
        progress=False,
        **options,
    )
    wrong = effective_mismatches(run.config, options)
    if wrong:
        raise RuntimeError("the run's config does not show the options given: " + "; ".join(wrong))
    return run, model


def _train_to(ex, rt, run, model_cfg: dict, until: int, corpus, force_scale: dict | None = None,
              norms: dict | None = None) -> list:
    """Train to step ``until``; the losses (device tensors), and into ``norms`` the global gradient
    norm Slipstream measured at each log step (``run.last_grad_norm``, the synchronised gradient's,
    in true units), by step."""
    losses = []
    seen = run.last_grad_norm
    while run.step_count < until:
        # Ranks of one tensor-parallel group or pipeline read the same rows: index by dp_rank.
        x, y = rank_batch(ex, run.micro_step_count, run.dp_rank, corpus, model_cfg)
        losses.append(run.train_step(x.to(rt.device), y.to(rt.device), ex.loss_fn))
        if norms is not None and run.last_grad_norm is not None and run.last_grad_norm is not seen:
            seen = run.last_grad_norm  # this object until the next log step replaces it
            norms[run.step_count] = seen.detach()
        if force_scale and run.step_count == force_scale["at"]:
            # Every rank the same new scale (a power of two), between two steps, as a skipped step would.
            run.scaler.update(new_scale=float(run.scaler.get_scale() * force_scale["factor"]))
    return losses


def train_one(ex, rt, model_cfg: dict, steps: int, options: dict, run_dir: Path, case: dict | None = None) -> dict:
    """One configuration. ``case`` (optional) adds what the plain run lacks:

    * ``param_dtype``: the model's parameters in bf16/fp16 (default fp32);
    * ``resume_at``: train to that step with checkpoints saved asynchronously every
      ``resume_at`` steps (so the last step's save is async and still in flight when
      ``finish()`` runs), then a second accelerate() over the same directory must resume
      there and take the remaining steps under the configuration's sync (compressed steps);
    * ``force_scale``: {"at": k, "factor": f} with precision fp16: after step k the loss
      scale is set to f times itself; the same run without it is trained first, and the
      losses after k must stay within SCALE_GAP_BOUND of it.
    """
    case = case or {}
    dtype = case.get("param_dtype", "fp32")
    corpus = ex.load_corpus(CORPUS_BYTES)
    extra: dict = {}
    norms: dict[int, torch.Tensor] = {}  # step -> the global gradient norm of that step (log steps)
    if case.get("force_scale"):
        ref, _ = _accelerate(ex, model_cfg, steps, options, run_dir / "unforced", dtype)
        ref_losses = torch.stack(_train_to(ex, rt, ref, model_cfg, steps, corpus)).float().cpu().tolist()
        ref.finish()
        del ref
    if case.get("resume_at"):
        at = case["resume_at"]
        ckpt = {"checkpoint_dir": str(run_dir / "ckpt"), "checkpoint_every_steps": at, "checkpoint_async": True}
        first, _ = _accelerate(ex, model_cfg, at, {**options, **ckpt}, run_dir / "first", dtype)
        losses = _train_to(ex, rt, first, model_cfg, at, corpus, norms=norms)
        first.finish()  # the save of step `at` was started asynchronously by the step itself
        del first
        run, model = _accelerate(ex, model_cfg, steps, {**options, **ckpt}, run_dir, dtype)
        extra["resumed_from"] = run.resumed_from_step
        if run.resumed_from_step != at:
            raise RuntimeError(f"the second launch resumed from step {run.resumed_from_step}, expected {at} "
                               "(the asynchronous save of the first launch's final step)")
        losses += _train_to(ex, rt, run, model_cfg, steps, corpus, norms=norms)
    else:
        run, model = _accelerate(ex, model_cfg, steps, options, run_dir, dtype)
        losses = _train_to(ex, rt, run, model_cfg, steps, corpus, case.get("force_scale"), norms=norms)
        if case.get("force_scale"):
            extra["scale_after"] = float(run.scaler.get_scale())
    # What the loss check against the one-rank reference needs: which slice of the global batch
    # this rank's losses are of, and what a sync that decides for itself (auto) ended up doing.
    extra.update(dp_rank=run.dp_rank, dp_size=run.dp_size,
                 sync_decision=run.sync_state.decision_summary() if run.sync_state is not None else None)
    run.finish()
    state = run.unwrapped_state_dict()  # a collective on sharded layouts: every rank calls it
    digests = {name: tensor_digest(t) for name, t in state.items() if isinstance(t, torch.Tensor)}
    tied = None
    if "tok.weight" in state and "head.weight" in state:
        tied = bool(torch.equal(state["tok.weight"].cpu(), state["head.weight"].cpu()))
    loss_values = torch.stack(losses).float().cpu().tolist()  # one host sync, after training
    norm_values = dict(zip(norms, torch.stack(list(norms.values())).float().cpu().tolist())) if norms else {}
    layout = run.describe_layout()
    del run, model, state
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    if case.get("force_scale"):
        after = case["force_scale"]["at"]
        gaps = [abs(a - b) for a, b in zip(loss_values[after:], ref_losses[after:])]
        extra.update(loss_gap=round(max(gaps), 6) if gaps else float("nan"), loss_gap_bound=SCALE_GAP_BOUND)
    return {
        "digests": digests,
        "tied_equal": tied,
        "losses": [round(v, 6) for v in loss_values],
        "losses_finite": all(math.isfinite(v) for v in loss_values),
        "grad_norms": {str(k): round(v, 6) for k, v in norm_values.items()},  # JSON keys: the step, as text
        "layout": layout,
        **extra,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="JSON file: steps, model sizes, configurations")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    out = Path(args.out)

    rt = slipstream.init()
    ex = load_example("train_gpt")
    asked_backend = os.environ.get("SLIPSTREAM_BACKEND")
    asked_device = os.environ.get("SLIPSTREAM_DEVICE")
    placement = {"backend": rt.backend, "device": str(rt.device), "world_size": rt.world_size}
    for cfg in plan["configs"]:
        folder = config_dir(out, cfg["name"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rt.rank}.started").write_text(str(time.time()))
        started = time.perf_counter()
        try:
            if (asked_backend and rt.backend != asked_backend) or (asked_device and rt.device.type != asked_device):
                raise RuntimeError(f"asked for backend {asked_backend} on {asked_device}, "
                                   f"slipstream.init() gave {rt.backend} on {rt.device}")
            record = train_one(ex, rt, plan["model"], plan["steps"], cfg["options"], folder / "run", cfg.get("case"))
            record.update(status="ok", placement=placement, seconds=round(time.perf_counter() - started, 2))
            write_result(folder / f"rank{rt.rank}.json", record)
        except Exception as exc:  # noqa: BLE001 - recorded, then this launch ends (see the module docstring)
            write_result(folder / f"rank{rt.rank}.json", {
                "status": "error", "placement": placement, "seconds": round(time.perf_counter() - started, 2),
                "message": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:],
            })
            print(f"[acceptance] rank {rt.rank}: {cfg['name']} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Not slipstream.shutdown(): its exit barrier would wait for a peer that may be stuck in a collective.
            os._exit(3)
    slipstream.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
