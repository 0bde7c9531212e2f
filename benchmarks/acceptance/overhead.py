"""Acceptance step "overhead": Slipstream's own cost at world size 1, against a plain PyTorch
loop training the same model on the same device.

    python -m benchmarks.acceptance.overhead --device cuda --result r.json --out DIR

The model is a decoder-only transformer built from torch.nn alone (token and position
embeddings, pre-norm ``nn.TransformerEncoderLayer`` blocks under a causal mask, a final
LayerNorm and an untied head); the GPU defaults are d 1024, 8 layers, 16 heads, sequence
1024, batch 16, vocabulary 32000 (167M parameters), bf16 autocast, AdamW(fused=True).

Four runs alternate, plain, slipstream, plain, slipstream, each from the same seed (the same
initial weights) over the same batches: the plain one is the loop a user writes
(autocast around the forward, the loss on fp32 logits, backward, step, zero_grad); the
other is ``slipstream.init()`` (once, before the first Slipstream run) and
``accelerate(model, optimizer, precision="bf16")`` + ``run.train_step``. Each run times
--steps steps after --warmup: on a GPU with CUDA events around every step, read once after
the timed steps (no host sync inside them); on the CPU with perf_counter. Losses are read
back once per run too.

Figures: median step ms per kind (every timed step of both runs of a kind) and per run, the
overhead (slipstream / plain - 1, %), tokens per second, the largest relative gap between
each run's losses and the first plain run's, and ``torch.cuda.max_memory_allocated()`` read
in this (the user's) process after each run. The peak is reset before each run, as a user
measuring one would; a Slipstream run that then reads far lower than the plain one has had
its peak reset by Slipstream, which a user reading it would not expect.

The step passes when every run trains and each Slipstream run's losses stay as close to the
first plain run's as the second plain run's do (3x that spread, at least rel 1e-3):
Slipstream adds no arithmetic at world size 1, but bf16 kernels on a GPU are not bitwise
reproducible, so two plain runs already differ. The overhead is a figure, not a criterion: it depends on the GPU,
the model and the load of the machine.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.acceptance.common import write_result

LOSS_REL_FLOOR = 1e-3
SPREAD_FACTOR = 3.0
"""A Slipstream run's largest relative loss gap to the first plain run may be SPREAD_FACTOR
times the second plain run's own gap, and at least LOSS_REL_FLOOR. Slipstream at world size 1
runs the same kernels on the same data, but bf16 kernels are not all bitwise reproducible from
run to run on a GPU (atomics in some backward reductions, SDPA's flash backward): on the H200
(2026-12-04, 50 steps of the 167M decoder) two plain runs ended 1.7e-3 apart and the Slipstream
runs 0.8e-3 and 1.9e-3 from the first plain one, so a fixed 1e-3 failed plain against plain.
A run that differs in what it computes (a lost update, another learning rate, a cast in
another place) drifts by far more than the plain runs' own spread."""


class Decoder(nn.Module):
    """A GPT-style decoder from torch.nn parts only."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.size(1)
        h = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        # is_causal with the mask: attention takes its causal kernel (flash on a GPU).
        h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def timed_run(step, batches, device: torch.device, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(per-step ms of the timed steps, every step's loss), host syncs only at the end."""
    losses = []
    for i in range(warmup):
        losses.append(step(*batches[i % len(batches)]))
    times: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for i, (start, end) in enumerate(events):
            start.record()
            losses.append(step(*batches[(warmup + i) % len(batches)]))
            end.record()
        torch.cuda.synchronize(device)  # once, after the timed steps
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(steps):
            t0 = time.perf_counter()
            losses.append(step(*batches[(warmup + i) % len(batches)]))
            times.append((time.perf_counter() - t0) * 1e3)
    return times, torch.stack(losses).float().cpu().tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--out", required=True, help="Slipstream's run directories")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    started = time.perf_counter()
    result: dict = {"status": "fail", "checks": [], "figures": {}}
    try:
        result.update(measure(args))
    except Exception as exc:  # noqa: BLE001 - reported in the result
        result["message"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    write_result(args.result, result)
    try:
        import slipstream

        slipstream.shutdown(exit_code=0 if result["status"] == "pass" else 1)
    except ImportError:
        pass
    raise SystemExit(0 if result["status"] == "pass" else 1)


def measure(args: argparse.Namespace) -> dict:
    gpu = args.device == "cuda"
    device = torch.device("cuda:0" if gpu else "cpu")
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(4)]
    batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
    rt = None
    runs = []
    for index, kind in enumerate(("plain", "slipstream", "plain", "slipstream")):
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)  # what a user measuring this run would do
        torch.manual_seed(0)
        with device:  # built on the device: the same weights every run, without a host-side init
            model = Decoder(args.vocab, args.dim, args.layers, args.heads, args.seq)
        # fused=True as on the GPU; CPU fused AdamW exists too, so both devices take that path.
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        run = None
        if kind == "plain":
            def step(x, y, model=model, optimizer=optimizer):
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    logits = model(x)
                loss = loss_fn(logits.float(), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()
        else:
            import slipstream

            if rt is None:
                rt = slipstream.init()  # world size 1: NCCL on a GPU, gloo on the CPU
            run = slipstream.accelerate(model, optimizer, precision="bf16", run_dir=str(Path(args.out) / f"run{index}"))

            def step(x, y, run=run):
                return run.train_step(x, y, loss_fn)
        times, losses = timed_run(step, batches, device, args.warmup, args.steps)
        if run is not None:
            run.finish()
        peak = int(torch.cuda.max_memory_allocated(device)) if gpu else None  # read after the run, as a user would
        runs.append({"kind": kind, "step_ms": times, "losses": losses, "peak": peak,
                     "parameters": sum(p.numel() for p in model.parameters())})
        del model, optimizer, run, step
    return judge(args, runs, gpu, device)


def judge(args: argparse.Namespace, runs: list[dict], gpu: bool, device: torch.device) -> dict:
    medians = {kind: statistics.median([t for r in runs if r["kind"] == kind for t in r["step_ms"]])
               for kind in ("plain", "slipstream")}
    base = runs[0]["losses"]
    gaps = [max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base)) for r in runs]
    spread = max([g for r, g in zip(runs[1:], gaps[1:]) if r["kind"] == "plain"], default=0.0)
    bound = max(LOSS_REL_FLOOR, SPREAD_FACTOR * spread)
    slipstream_gap = max(g for r, g in zip(runs, gaps) if r["kind"] == "slipstream")
    finite = all(math.isfinite(v) for r in runs for v in r["losses"])
    params = runs[0]["parameters"]
    tokens = args.batch * args.seq
    figures = {
        "model": {"parameters_m": round(params / 1e6, 1), "dim": args.dim, "layers": args.layers, "heads": args.heads,
                  "seq": args.seq, "batch": args.batch, "vocab": args.vocab, "precision": "bf16 autocast",
                  "optimizer": "AdamW(fused=True)", "warmup": args.warmup, "steps": args.steps},
        "timing": "CUDA events" if gpu else "perf_counter (CPU ops are synchronous)",
        "step_ms_median": {k: round(v, 3) for k, v in medians.items()},
        "overhead_pct": round(100 * (medians["slipstream"] / medians["plain"] - 1), 2),
        "tokens_per_s": {k: round(tokens / (v / 1e3)) for k, v in medians.items()},
        "runs": [{"kind": r["kind"], "step_ms_median": round(statistics.median(r["step_ms"]), 3),
                  "final_loss": round(r["losses"][-1], 6), "loss_max_rel_gap_vs_first_plain": float(f"{gap:.3g}"),
                  "max_memory_allocated_mib": round(r["peak"] / 2**20, 1) if r["peak"] is not None else None}
                 for r, gap in zip(runs, gaps)],
        "loss_max_rel_gap": float(f"{max(gaps):.3g}"),
        "plain_runs_rel_spread": float(f"{spread:.3g}"),
        "loss_rel_bound": float(f"{bound:.3g}"),
    }
    if gpu:
        peaks = {kind: min(r["peak"] for r in runs if r["kind"] == kind) for kind in ("plain", "slipstream")}
        figures["max_memory_allocated_mib"] = {k: round(v / 2**20, 1) for k, v in peaks.items()}
        # A finding, not a criterion: the same model and optimizer peak alike unless something
        # reset the process's peak statistics during the Slipstream run.
        figures["peak_memory_reset_suspected"] = peaks["slipstream"] < 0.8 * peaks["plain"]
    else:
        figures["max_memory_allocated_mib"] = "n/a on the CPU"
    checks = [
        {"name": "every run trains to finite losses", "ok": finite, "detail": str([r["final_loss"] for r in figures["runs"]])},
        {"name": f"Slipstream's losses as close to the first plain run's as the plain runs' own spread allows "
                 f"(rel {bound:.3g}: {SPREAD_FACTOR:g}x {spread:.3g}, at least {LOSS_REL_FLOOR:g})",
         "ok": slipstream_gap <= bound, "detail": f"largest rel gap per run {[float(f'{g:.3g}') for g in gaps]}"},
        {"name": "every step time is positive", "ok": all(t > 0 for r in runs for t in r["step_ms"]), "detail": ""},
    ]
    ok = all(c["ok"] for c in checks)
    failed = next((c for c in checks if not c["ok"]), None)
    return {"status": "pass" if ok else "fail", "checks": checks, "figures": figures,
            **({"message": f"{failed['name']}: {failed['detail']}"} if failed else {})}


if __name__ == "__main__":
    main()
