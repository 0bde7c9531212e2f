"""Validate the cost model (slipstream.plan) against measured step times on the emulated cluster.

    sudo python benchmarks/plan_validation.py --rates unshaped,1gbit,200mbit \
        --strategies allreduce,bf16,powersgd --steps 20 --repeats 3

What it does, in order:

1. calibrates on this machine, one core, no communication: fp32 matmul FLOP/s at
   1 thread; forward / backward / optimizer time of the benchmark MLP workload
   (docs/measuring.md); each codec's compute time on each DDP bucket;
   each strategy's step on a one-rank gloo group (codec + sync engine cost);
   at the start and again after each link rate (medians are used);
2. per link rate, in two network namespaces joined by a tbf-shaped veth pair
   (benchmarks/sync_mlp.py's TwoNodes), ``--repeats`` times: probes the link
   (``slipstream.sync.probe.probe_link`` and a five-size all-reduce sweep), then
   measures the step time of every strategy side by side with the floor
   (benchmarks/sync_mlp.py's run_pair);
3. predicts each (rate, strategy) step from the calibration alone
   (slipstream.plan.costmodel.simulate_dp_step) and prints predicted vs measured
   (median over repeats of the per-run median step) with the error.

The machine is shared: load averages before and after are recorded. Results go
to benchmarks/results/plan-validation-<UTC>.json (``--json`` to choose).
``--predict-only FILE`` recomputes predictions from a saved result file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import sync_mlp  # the benchmark MLP and the two-node emulation


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


# -- calibration (local, no communication) --------------------------------------------------------
def mlp_buckets():
    """DDP's bucket assignment for the MLP (first bucket 1 MiB, then 25 MiB), reversed parameter order,
    and each bucket's layout (for PowerSGD's matrices) and the layers it holds."""
    import torch.distributed as dist

    from slipstream.sync.compress import layout_from_shapes

    model = sync_mlp.build_model()
    params = list(model.parameters())[::-1]
    groups, _ = dist._compute_bucket_assignment_by_size(
        params, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024], [False] * len(params))
    out = []
    for g in groups:
        ps = [params[i] for i in g]
        out.append({"param_indices": g, "numel": sum(p.numel() for p in ps),
                    "layout": layout_from_shapes([p.shape for p in ps])})
    return out


def calibrate_local(strategies: list[str]) -> dict:
    import torch

    from slipstream.plan import calibrate

    torch.manual_seed(0)
    flops = calibrate.matmul_flops_per_s(threads=1)
    model = sync_mlp.build_model()
    x, y = sync_mlp._batch(0)
    phases = calibrate.step_phases(model, x, y, threads=1, steps=30)
    buckets = mlp_buckets()
    codec_s = {name: [calibrate.codec_compute_s(name, b["numel"], b["layout"], threads=1) for b in buckets]
               for name in strategies}
    engine = run_engine(strategies)
    return {"matmul_flops_per_s": flops, "phases": phases.to_dict(), "one_rank_step_s": engine,
            "buckets": [{"numel": b["numel"], "param_indices": b["param_indices"]} for b in buckets],
            "codec_s": codec_s}


def engine_worker(strategies: list[str], out: str, steps: int = 30, warmup: int = 3) -> None:
    """Each strategy's local step on a ONE-rank gloo group, interleaved with the floor: what the
    strategy costs the rank's core (codec compute + the sync engine's own work: thread handoff,
    copies, error feedback) with no network at all. sync.apply() leaves one rank alone, so the
    hook engine is installed directly, as sync.apply() does for several ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slipstream.sync.compress import make_codec
    from slipstream.sync.hierarchical import FlatReducer
    from slipstream.sync.hooks import HookSync
    from slipstream.sync.topology import groups

    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{22000 + os.getpid() % 20000}", rank=0,
                            world_size=1)
    x, y = sync_mlp._batch(0)
    runs = {}
    for name in ["floor", *strategies]:
        torch.manual_seed(0)
        model = sync_mlp.build_model()
        net = model
        if name != "floor":
            net = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
            if name != "allreduce":
                g = groups()
                HookSync(name, FlatReducer(g.flat), {name: make_codec(name)}, name, control_group=g.control,
                         guard=None).install(net)
        runs[name] = (net, torch.optim.SGD(model.parameters(), lr=0.01), [])
    for i in range(warmup + steps):
        for name, (net, opt, ts) in runs.items():
            t0 = time.perf_counter()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps({name: statistics.median(ts) for name, (_, _, ts) in runs.items()}))
    dist.destroy_process_group()


def run_engine(strategies: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "engine.json")
        subprocess.run(["taskset", "-c", "0", sys.executable, os.path.abspath(__file__), "--engine-worker",
                        "--strategies", ",".join(strategies), "--out", out], check=True, timeout=600)
        return json.loads(Path(out).read_text())


def merge_calibrations(cals: list[dict]) -> dict:
    """Median of each calibrated figure over several calibrations spread over the run, so that the
    calibration sees the same mix of machine load as the measurements do."""
    med = statistics.median
    out = dict(cals[0])
    out["matmul_flops_per_s"] = med(c["matmul_flops_per_s"] for c in cals)
    out["phases"] = {k: med(c["phases"][k] for c in cals) for k in cals[0]["phases"]}
    out["codec_s"] = {name: [med(c["codec_s"][name][i] for c in cals) for i in range(len(v))]
                      for name, v in cals[0]["codec_s"].items()}
    if all(c.get("one_rank_step_s") for c in cals):
        out["one_rank_step_s"] = {k: med(c["one_rank_step_s"][k] for c in cals) for k in cals[0]["one_rank_step_s"]}
    return out


def merge_probes(probes: list[dict]) -> dict:
    """Per-size median of several probes of one link (taken before each repeat)."""
    med = statistics.median
    out = dict(probes[0])
    out["alpha_s"] = med(p["alpha_s"] for p in probes)
    out["bytes_per_s"] = med(p["bytes_per_s"] for p in probes)
    if all(p.get("sweep") for p in probes):
        out["sweep"] = [[size, med(p["sweep"][i][1] for p in probes)] for i, (size, _) in enumerate(probes[0]["sweep"])]
    return out


# -- link probe in the namespaces --------------------------------------------------------------------
def probe_worker(rank: int, master: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from slipstream.sync.probe import probe_link

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    figs = probe_link(None, sizes_bytes=(8 << 10, 16 << 20), repeats=5)
    # The same all-reduce at five sizes, for a least-squares alpha-beta fit (calibrate.fit_alpha_beta):
    # a two-point fit takes the small size's time as the latency, however disturbed it is.
    sizes = (8 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20)
    medians = []
    for size in sizes:
        t = torch.zeros(size // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    agreed = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": figs.ranks, "alpha_s": figs.alpha_s,
                                         "bytes_per_s": figs.bytes_per_s, "samples": figs.samples,
                                         "sweep": list(zip(sizes, agreed.tolist()))}))
    dist.barrier()
    dist.destroy_process_group()


def run_probe(nodes, timeout_s: float = 300) -> dict:
    port = 21000 + os.getpid() % 20000
    return sync_mlp.spawn_pair(
        nodes, __file__,
        lambda rank, out: ["--probe-worker", str(rank), "--master", nodes.addrs[0], "--port", str(port), "--out", out],
        timeout_s, what="probe",
    )


# -- prediction --------------------------------------------------------------------------------------
def link_of(probe: dict, source: str = "sweep"):
    """The link the model uses: the five-size least-squares fit, or probe_link's two-point fit."""
    from slipstream.network.link import Link
    from slipstream.plan.calibrate import fit_alpha_beta, link_from_probe

    if source == "sweep" and probe.get("sweep"):
        return fit_alpha_beta([tuple(x) for x in probe["sweep"]], probe["ranks"])
    return link_from_probe(Link.measured(probe["ranks"], probe["alpha_s"], probe["bytes_per_s"]))


def phases_of(cal: dict, floor_s: float | None = None) -> dict:
    """Calibrated forward/backward/optimizer times; scaled to ``floor_s`` (the floor measured in the
    same run) when given, keeping the standalone calibration's split between the phases."""
    ph = dict(cal["phases"])
    if floor_s is not None:
        k = floor_s / (ph["forward_s"] + ph["backward_s"] + ph["optimizer_s"])
        ph = {key: v * k for key, v in ph.items()}
    return ph


def predict(cal: dict, probe: dict, strategy: str, world: int = 2, floor_s: float | None = None,
            link_source: str = "sweep", cpu_s_per_byte: float = 0.0) -> dict:
    """Predicted step of ``strategy`` from the calibration and the probed link alone.

    ``cpu_s_per_byte``: CPU time the communication itself takes per byte sent (on the rank's one
    core it cannot overlap backward); calibrated as 1 / bandwidth of the unshaped link, where the
    transfer is CPU-bound (veth, no shaping)."""
    from slipstream.plan.costmodel import BucketTask, simulate_dp_step
    from slipstream.sync.compress import make_codec

    link = link_of(probe, link_source)
    ph = phases_of(cal, floor_s)
    scale = 1.0 if floor_s is None else floor_s / sum(cal["phases"].values())
    # Backward time of each Linear, in the order backward reaches them (last layer first), in
    # proportion to its FLOPs; the first layer computes no input gradient (half the work).
    model = sync_mlp.build_model()
    params = list(model.parameters())
    weights = []  # per parameter, reversed order: backward FLOPs share
    for idx, p in enumerate(params):
        if p.dim() == 2:
            weights.append(p.numel() * (1 if idx == 0 else 2))
        else:
            weights.append(0)
    weights = weights[::-1]
    total_w = sum(weights)
    done_at = []  # backward time at which each reversed parameter's gradient is ready
    acc = 0.0
    for w in weights:
        acc += ph["backward_s"] * w / total_w
        done_at.append(acc)
    codec = make_codec(strategy)
    # What the strategy costs the core locally, per bucket: from the one-rank engine run when there
    # is one (codec + engine work: step - floor on one rank, split over the buckets like the codec's
    # own compute time, or like their sizes for DDP's reducer), else the codec's compute time alone.
    codec_s = cal["codec_s"].get(strategy) or [0.0] * len(cal["buckets"])
    one = cal.get("one_rank_step_s")
    if one and strategy in one:
        total = max(0.0, one[strategy] - one["floor"]) * scale
        weights = codec_s if sum(codec_s) > 0 else [b["numel"] for b in cal["buckets"]]
        local_cost = [total * w / sum(weights) for w in weights]
    else:
        local_cost = [scale * c for c in codec_s]
    tasks = []
    layouts = {i: b for i, b in enumerate(mlp_buckets())}
    for i, b in enumerate(cal["buckets"]):
        ready = max(done_at[j] for j in b["param_indices"])
        wb = codec.wire_bytes(b["numel"], world, layouts[i]["layout"])
        comm = link.wire_s(wb, steps=2 * (world - 1) * codec.collectives_per_call)
        tasks.append(BucketTask(ready_s=ready, compute_s=local_cost[i], comm_s=comm, cpu_s=wb * cpu_s_per_byte))
    sim = simulate_dp_step(forward_s=ph["forward_s"], backward_s=ph["backward_s"], optimizer_s=ph["optimizer_s"],
                           buckets=tasks)
    return {"step_s": sim.step_s, "exposed_comm_s": sim.exposed_comm_s, "comm_s": sim.comm_s,
            "codec_compute_s": sim.codec_compute_s}


def table(result: dict) -> tuple[str, list[dict]]:
    """Predicted vs measured. Columns: (A) compute from the standalone calibration, link from the
    five-size fit; (B) compute scaled to the floor measured in the same run (same minutes, same
    load), link from the five-size fit; (C) as B with probe_link's two-point link fit; (D) as B
    without the communication's CPU cost (the GPU form of the model). All but D charge the
    communication's CPU time (1 / unshaped bandwidth per byte) to the rank's one core."""
    cal = result["calibration"]
    rows = []
    lines = [("| link | strategy | link fit (5 sizes) | measured ms (median of runs) | runs (ms) | "
              "predicted A ms | error A | predicted B ms | error B | error C | error D |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    unshaped = result["rates"].get("unshaped")
    cpu = 1.0 / link_of(unshaped["probe"]).bytes_per_s if unshaped else 0.0
    for rate, rec in result["rates"].items():
        probe = rec["probe"]
        lk = link_of(probe)
        link_txt = f"{lk.bytes_per_s * 8 / 1e9:.3f} Gbit/s, alpha {lk.hop_latency_s * 2e3:.2f} ms"
        floor_runs = [statistics.median(r["floor"]["step_s"]) for r in rec["runs"]]
        floor = statistics.median(floor_runs)
        for strategy in ["floor", *result["strategies"]]:
            runs = [statistics.median(r[strategy]["step_s"]) for r in rec["runs"]]
            meas = statistics.median(runs)
            if strategy == "floor":
                a = sum(phases_of(cal).values())
                b = c = d = floor
            else:
                a = predict(cal, probe, strategy, cpu_s_per_byte=cpu)["step_s"]
                b = predict(cal, probe, strategy, floor_s=floor, cpu_s_per_byte=cpu)["step_s"]
                c = predict(cal, probe, strategy, floor_s=floor, link_source="probe_link", cpu_s_per_byte=cpu)["step_s"]
                d = predict(cal, probe, strategy, floor_s=floor)["step_s"]
            row = {"rate": rate, "strategy": strategy, "measured_s": meas, "runs_s": runs,
                   "predicted_a_s": a, "predicted_b_s": b, "predicted_c_s": c, "predicted_d_s": d,
                   "error_a": (a - meas) / meas, "error_b": (b - meas) / meas, "error_c": (c - meas) / meas,
                   "error_d": (d - meas) / meas}
            rows.append(row)
            fb = "(calibration input)" if strategy == "floor" else f"{row['error_b']:+.1%}"
            fc = "" if strategy == "floor" else f"{row['error_c']:+.1%}"
            fd = "" if strategy == "floor" else f"{row['error_d']:+.1%}"
            lines.append(f"| {rate} | {strategy} | {link_txt} | {meas * 1e3:.1f} | "
                         f"{', '.join(f'{r * 1e3:.0f}' for r in runs)} | {a * 1e3:.1f} | {row['error_a']:+.1%} | "
                         f"{b * 1e3:.1f} | {fb} | {fc} | {fd} |")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="unshaped,1gbit,200mbit")
    ap.add_argument("--strategies", default="allreduce,bf16,powersgd")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="result file (default benchmarks/results/plan-validation-<UTC>.json)")
    ap.add_argument("--predict-only", metavar="FILE", help="recompute predictions from a saved result file")
    ap.add_argument("--probe-worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe_worker is not None:
        probe_worker(a.probe_worker, a.master, a.port, a.out)
        return 0
    if a.engine_worker:
        engine_worker(a.strategies.split(","), a.out)
        return 0
    if a.predict_only:
        result = json.loads(Path(a.predict_only).read_text())
        text, rows = table(result)
        print(text)
        return 0
    strategies = a.strategies.split(",")
    started = datetime.datetime.now(datetime.timezone.utc)
    result = {"command": "python benchmarks/plan_validation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": _git_commit(), "started_utc": started.isoformat(timespec="seconds"),
              "loadavg_before": os.getloadavg(), "strategies": strategies, "steps": a.steps, "repeats": a.repeats}
    # Calibrate at the start and after each rate, probe the link before each repeat: the medians
    # see the same load as the measurements (the machine is shared), and none uses a figure of a
    # predicted configuration.
    cals = [calibrate_local(strategies)]
    print(f"calibrated: {json.dumps(cals[0]['phases'])}, "
          f"matmul {cals[0]['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s", file=sys.stderr, flush=True)
    result["rates"] = {}
    with sync_mlp.TwoNodes() as nodes:
        for rate in a.rates.split(","):
            nodes.shape(rate)
            runs, probes = [], []
            for r in range(a.repeats):
                probes.append(run_probe(nodes))
                runs.append(sync_mlp.run_pair(nodes, strategies, a.steps, a.warmup))
                print(f"{rate}: run {r + 1}/{a.repeats} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr,
                      flush=True)
            cals.append(calibrate_local(strategies))
            probe = merge_probes(probes)
            result["rates"][rate] = {"probe": probe, "probes": probes, "loadavg": os.getloadavg(), "runs": [{k: {"step_s": v["step_s"]} for k, v in run.items()}
                                                              for run in runs]}
    result["calibrations"] = cals
    result["calibration"] = merge_calibrations(cals)
    result["loadavg_after"] = os.getloadavg()
    result["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(a.json) if a.json else HERE / "results" / f"plan-validation-{started:%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))  # measurements first: predictions can be redone
    text, rows = table(result)
    result["table"] = rows
    out.write_text(json.dumps(result, indent=1))
    print(text)
    print(f"\nload average before {result['loadavg_before']}, after {result['loadavg_after']}; written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
