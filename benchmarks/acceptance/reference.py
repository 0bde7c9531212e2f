"""The loss references of the ranks steps: each distinct (model, precision, parameter dtype,
steps, data-parallel size) trained once by ONE process, a plain PyTorch loop on the device the
ranks use, over the whole global batch (benchmarks/acceptance/workload.py).

    python -m benchmarks.acceptance.reference --device cuda --plan plan.json --result r.json

plan.json::

    {"model": {"dim": 64, "layers": 2, "heads": 4, "context": 32, "batch": 8}, "steps": 3,
     "references": [{"key": "fp32/fp32/dp2/3", "precision": "fp32", "param_dtype": "fp32", "dp": 2}, ...]}

Why: the ranks steps check that every rank ends with the same bits, which an error every
rank makes alike (a gradient averaged over the wrong group, a shard summed twice) passes.
The mean of the ranks' losses must instead follow this one-process run of the same
mathematical step; the orchestrator compares them (benchmarks/acceptance/losses.py).

Plain on purpose: no Slipstream, only torch, as a user's single-GPU loop would be: the model
built with seed 0 and moved to the device, autocast around the forward for bf16/fp16 (the
logits back in fp32 before the loss, as Slipstream's front module does), a GradScaler for
fp16, AdamW. Losses and each step's global gradient norm (true units, before the optimizer
step) are read back once, after the last step.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path

import torch

from benchmarks.acceptance.common import load_example, write_result
from benchmarks.acceptance.workload import AUTOCAST_DTYPES, CORPUS_BYTES, build_model, global_batch, make_optimizer


def train_reference(ex, model_cfg: dict, steps: int, precision: str, param_dtype: str, dp: int,
                    corpus: torch.Tensor, device: torch.device) -> tuple[list[float], list[float]]:
    """Losses and gradient norms (true units, before the optimizer step) of ``steps`` steps at
    world size 1 over ``dp`` ranks' rows at once."""
    model = build_model(ex, model_cfg, param_dtype).to(device)
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    losses, norms = [], []
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(ex, step, dp, corpus, model_cfg))
        if precision in AUTOCAST_DTYPES:
            with torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision]):
                logits = model(x)
        else:
            logits = model(x)
        # The loss of fp32 logits whatever the model computed in (bf16 parameters too): Slipstream's
        # front module casts 16-bit outputs back to fp32 before the user's loss.
        loss = ex.loss_fn(logits.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # the norm in true units; step() does not unscale twice
        else:
            loss.backward()
        # As Slipstream measures it: every parameter once (the tied embedding and head are one).
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    # One host sync each, after training.
    return torch.stack(losses).float().cpu().tolist(), torch.stack(norms).float().cpu().tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    started = time.perf_counter()
    result: dict = {"status": "fail", "checks": [], "figures": {}}
    try:
        plan = json.loads(Path(args.plan).read_text())
        # The ranks' device: every rank of a shared-GPU launch is on the first visible GPU.
        device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        ex = load_example("train_gpt")
        corpus = ex.load_corpus(CORPUS_BYTES)
        references = {}
        for ref in plan["references"]:
            t0 = time.perf_counter()
            losses, norms = train_reference(ex, plan["model"], plan["steps"], ref["precision"], ref["param_dtype"],
                                            ref["dp"], corpus, device)
            references[ref["key"]] = {"losses": [round(v, 6) for v in losses],
                                      "grad_norms": [round(v, 6) for v in norms],
                                      "seconds": round(time.perf_counter() - t0, 2)}
            finite = all(math.isfinite(v) for v in losses)
            result["checks"].append({"name": f"reference {ref['key']} trains to finite losses", "ok": finite,
                                     "detail": str(references[ref["key"]]["losses"])})
        result["figures"] = {"device": str(device), "references": references}
        result["status"] = "pass" if all(c["ok"] for c in result["checks"]) else "fail"
    except Exception as exc:  # noqa: BLE001 - reported in the result, the orchestrator decides
        result["message"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    write_result(args.result, result)
    raise SystemExit(0 if result["status"] == "pass" else 1)


if __name__ == "__main__":
    main()
