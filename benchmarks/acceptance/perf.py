"""Acceptance step "perf": bf16 against fp32 step time, Slipstream's step profiler
on against off, and peak memory, at world size 1 (NCCL on a GPU, gloo on the CPU).

    python -m benchmarks.acceptance.perf --device cuda --result r.json --out DIR

The GPT of examples/train_gpt.py, trained through ``slipstream.accelerate`` under
each configuration: precision fp32, bf16, and fp32 with TF32 matmuls (the
baseline vendors usually quote their 1.5-2x against; no effect on a CPU), each with the
profiler (TrainConfig.profile) on and off. Every configuration is built afresh
in each of --rounds rounds, the order rotating between rounds so a noisy
neighbour hurts all alike (docs/measuring.md, "The rules"); a round runs
--warmup steps, then times --steps steps. Step times are medians over every
timed step of every round; each round's median is reported too, to judge the noise.

Timing: on a GPU, CUDA events recorded around each step and read once after a
synchronize at the end of the round, so no host sync enters the timed loop
(host clocks around asynchronous launches would measure the launch queue). On
the CPU, where every op completes before it returns, perf_counter.

Memory: on a GPU, torch.cuda.max_memory_allocated after each configuration's
steps, the peak reset before it was built (the largest of its rounds); on the
CPU, the process's peak resident set (ru_maxrss), one figure for the whole run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback
from pathlib import Path

import torch

import slipstream
from benchmarks.acceptance.common import load_example, peak_memory_bytes, write_result


_DEFAULT_FP32_PRECISION = getattr(torch.backends.cuda.matmul, "fp32_precision", None)


def set_tf32(on: bool) -> None:
    """TF32 for fp32 matmuls, or back to the default. torch 2.13's new switch
    (fp32_precision): mixing it with the legacy allow_tf32 makes reading either raise,
    and Slipstream's profiler reads the new one (metrics.profiler.tf32_matmul_allowed)."""
    matmul = torch.backends.cuda.matmul
    if _DEFAULT_FP32_PRECISION is None:  # a torch without the new API
        matmul.allow_tf32 = on
    else:
        matmul.fp32_precision = "tf32" if on else _DEFAULT_FP32_PRECISION


def time_steps(run, batches, device: torch.device, warmup: int, steps: int, loss_fn) -> tuple[list[float], float]:
    """Per-step milliseconds of ``steps`` timed steps after ``warmup``, and the last loss."""
    for i in range(warmup):
        x, y = batches[i % len(batches)]
        run.train_step(x, y, loss_fn)
    times: list[float] = []
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for i, (start, end) in enumerate(pairs):
            x, y = batches[i % len(batches)]
            start.record()
            loss = run.train_step(x, y, loss_fn)
            end.record()
        torch.cuda.synchronize(device)  # once, after the timed loop
        times = [start.elapsed_time(end) for start, end in pairs]
    else:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            loss = run.train_step(x, y, loss_fn)
            times.append((time.perf_counter() - t0) * 1e3)
    return times, float(loss.float().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=None, help="GPT width (default: 1024 on cuda, 128 on cpu)")
    p.add_argument("--layers", type=int, default=None, help="default: 8 on cuda, 2 on cpu")
    p.add_argument("--heads", type=int, default=None, help="default: 16 on cuda, 4 on cpu")
    p.add_argument("--context", type=int, default=None, help="default: 512 on cuda, 64 on cpu")
    p.add_argument("--batch", type=int, default=None, help="default: 16 on cuda, 8 on cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    gpu = args.device == "cuda"
    size = {
        "dim": args.dim or (1024 if gpu else 128), "layers": args.layers or (8 if gpu else 2),
        "heads": args.heads or (16 if gpu else 4), "context": args.context or (512 if gpu else 64),
        "batch": args.batch or (16 if gpu else 8),
    }
    started = time.perf_counter()
    result: dict = {"status": "fail", "checks": [], "figures": {}}
    try:
        rt = slipstream.init()  # world size 1: NCCL on a GPU, gloo on the CPU
        ex = load_example("train_gpt")
        corpus = ex.load_corpus(int(0.5 * 2**20))
        batches = [tuple(t.to(rt.device) for t in ex.batch_for(i, 0, corpus, size["batch"], size["context"], 0))
                   for i in range(4)]
        # (name, precision, TF32 matmuls). TF32 changes nothing on a CPU; it runs there
        # too so that CI exercises the switch before a GPU depends on it.
        variants = [("fp32", "fp32", False), ("bf16", "bf16", False), ("fp32_tf32", "fp32", True)]
        configs = [(name, precision, tf32, profile) for name, precision, tf32 in variants for profile in (True, False)]
        times: dict[str, list[float]] = {}
        round_medians: dict[str, list[float]] = {}  # per round, to judge the noise
        peaks: dict[str, int] = {}
        last_loss: dict[str, float] = {}
        for r in range(args.rounds):
            shift = r % len(configs)
            for name, precision, tf32, profile in configs[shift:] + configs[:shift]:
                key = f"{name}/profile_{'on' if profile else 'off'}"
                set_tf32(tf32)
                if gpu:
                    torch.cuda.reset_peak_memory_stats(rt.device)
                torch.manual_seed(0)
                model = ex.GPT(dim=size["dim"], layers=size["layers"], heads=size["heads"], context=size["context"])
                run = slipstream.accelerate(
                    model, lambda params: torch.optim.AdamW(params, lr=3e-4),
                    precision=precision, profile=profile, progress=False,
                    # No log step inside the timed steps: a log step reads the loss back (a host sync).
                    log_every_steps=args.warmup + args.steps + 1,
                    run_dir=str(Path(args.out) / f"{key.replace('/', '_')}_round{r}"),
                )
                step_ms, loss = time_steps(run, batches, rt.device, args.warmup, args.steps, ex.loss_fn)
                run.finish()
                times.setdefault(key, []).extend(step_ms)
                round_medians.setdefault(key, []).append(round(statistics.median(step_ms), 3))
                last_loss[key] = loss
                if gpu:
                    peaks[key] = max(peaks.get(key, 0), int(torch.cuda.max_memory_allocated(rt.device)))
                del run, model
                if gpu:
                    torch.cuda.empty_cache()
        set_tf32(False)
        median = {key: statistics.median(values) for key, values in times.items()}
        figures: dict = {"model": size, "step_ms_median": {k: round(v, 3) for k, v in median.items()},
                         "step_ms_round_medians": round_medians}
        figures["bf16_speedup_vs_fp32"] = round(median["fp32/profile_off"] / median["bf16/profile_off"], 3)
        figures["bf16_speedup_vs_tf32"] = round(median["fp32_tf32/profile_off"] / median["bf16/profile_off"], 3)
        figures["profiler_overhead_pct"] = {
            name: round(100 * (median[f"{name}/profile_on"] / median[f"{name}/profile_off"] - 1), 2)
            for name, _, _ in variants
        }
        if gpu:
            figures["peak_memory_mib"] = {k: round(v / 2**20, 1) for k, v in peaks.items()}
            figures["peak_memory_source"] = "torch.cuda.max_memory_allocated"
        else:
            rss, source = peak_memory_bytes(rt.device)
            figures["peak_memory_mib"] = round(rss / 2**20, 1)
            figures["peak_memory_source"] = source
        figures["timing"] = "CUDA events" if gpu else "perf_counter (CPU ops are synchronous)"
        figures["last_loss"] = {k: round(v, 4) for k, v in last_loss.items()}
        result["figures"] = figures
        finite = all(math.isfinite(v) for v in last_loss.values())
        result["checks"].append({"name": "every configuration trains to a finite loss", "ok": finite,
                                 "detail": str(figures["last_loss"])})
        positive = all(v > 0 for v in median.values())
        result["checks"].append({"name": "every step time is positive", "ok": positive, "detail": ""})
        result["status"] = "pass" if finite and positive else "fail"
    except Exception as exc:  # noqa: BLE001 - reported in the result
        result["message"] = f"{type(exc).__name__}: {exc}"
        result["output_tail"] = traceback.format_exc()[-3000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    write_result(args.result, result)
    slipstream.shutdown(exit_code=0 if result["status"] == "pass" else 1)


if __name__ == "__main__":
    main()
