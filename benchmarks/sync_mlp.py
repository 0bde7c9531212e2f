"""Gradient-sync strategies side by side on the benchmark MLP workload (docs/measuring.md), over shaped links.

Two ranks in two network namespaces joined by a veth pair, each end shaped
with tbf (docs/measuring.md), one core each. Every strategy, and the compute
floor (the same model with no communication), runs in the same pair of worker
processes, interleaved step by step in a rotating order, so the load of a
shared machine falls on all of them alike and their ratios are comparable.

    sudo python benchmarks/sync_mlp.py --rates unshaped,1gbit,200mbit \
        --strategies ddp,allreduce,torch_fp16,torch_powersgd,fp16,bf16,powersgd,auto --steps 10

Per rate and strategy it reports: median step time and its ratio to the floor,
loss after the same number of steps, steps to reach DDP's final loss, and bytes
per step as reported by the strategy and as counted by the interface
(/sys/class/net/IF/statistics/tx_bytes inside the namespace).

The machine is shared: run it when it is quiet, and read ratios, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("ddp", "torch_fp16", "torch_powersgd")  # torch's bf16 hook refuses CPU/gloo


def build_model():
    from torch import nn

    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def _batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)


def tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def floor_worker(steps: int, warmup: int) -> dict:
    """One worker, no communication: forward + backward + SGD step."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch(0)
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"step_s": times, "losses": losses}


def _build(name: str, bucket_cap_mb: float):
    """(model, ddp or None, state) for one strategy; ``floor`` has no DDP at all."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slipstream import sync

    torch.manual_seed(0)
    model = build_model()
    if name == "floor":
        return model, None, None
    state = None
    if name == "torch_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # One bucket: with several, torch's hook aborts under gloo (docs/measuring.md).
        ddp = DDP(model, bucket_cap_mb=64, gradient_as_bucket_view=True)
        ddp.register_comm_hook(
            psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2),
            psgd.powerSGD_hook,
        )
    else:
        # Gradients as views of the buckets: no copy in and out of them (DDP configured well).
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        if name == "torch_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name != "ddp":
            state = sync.apply(name, ddp)
    return model, ddp, state


def dist_worker(rank: int, master: str, port: int, strategies: list[str], steps: int, warmup: int,
                ifname: str | None, out: str, bucket_cap_mb: float = 25.0, rounds: int = 1) -> None:
    """All strategies (and the floor) side by side, interleaved step by step: step t of
    every strategy runs before step t+1 of any, in a rotating order, so the load of the
    shared machine falls on all of them alike."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # one rank per emulated node
    x, y = _batch(rank)
    names = ["floor", *strategies]
    runs = {}
    for name in names:
        model, ddp, state = _build(name, bucket_cap_mb)
        runs[name] = {"model": model, "ddp": ddp, "state": state,
                      "opt": torch.optim.SGD(model.parameters(), lr=0.01),
                      "step_s": [], "losses": [], "tx": 0, "reported0": None}
    extra = 5 if "auto" in names else 0  # auto observes 3 steps after DDP's first
    total = warmup + extra + steps
    for i in range(total):
        timed = i >= warmup + extra
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            r = runs[name]
            net = r["ddp"] if r["ddp"] is not None else r["model"]
            if timed and r["reported0"] is None:
                st = r["state"]
                r["reported0"] = st.stats().get("sync_bytes_sent_total", 0.0) if st is not None else 0.0
            dist.barrier()  # both ranks start this strategy's step together
            tx0 = tx_bytes(ifname) if r["ddp"] is not None else 0
            t0 = time.perf_counter()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if timed:
                r["step_s"].append(dt)
                if r["ddp"] is not None:
                    r["tx"] += tx_bytes(ifname) - tx0
            r["losses"].append(float(loss.detach()))
    results = {}
    for name, r in runs.items():
        rec = {"step_s": r["step_s"], "losses": r["losses"],
               "tx_bytes_per_step": r["tx"] / steps if ifname and r["ddp"] is not None else None}
        st = r["state"]
        if st is not None:
            stats = st.stats()
            rec["stats"] = stats
            rec["reported_bytes_per_step"] = (stats.get("sync_bytes_sent_total", 0.0) - r["reported0"]) / steps
            if getattr(st, "decision", None) is not None:
                rec["decision"] = st.decision.explain()
        results[name] = rec
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


# -- the emulated two-node network (root) ------------------------------------------------------
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class TwoNodes:
    """Two namespaces and a veth pair, names unique to this process; removed on exit."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the two-node emulation needs root (ip netns, tc)")
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"ss4a{tag}", f"ss4b{tag}")
        self.ifs = (f"s4a{tag}", f"s4b{tag}")
        octet = 16 + os.getpid() % 200
        self.addrs = (f"10.213.{octet}.1", f"10.213.{octet}.2")

    def __enter__(self) -> TwoNodes:
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.ifs[0], "type", "veth", "peer", "name", self.ifs[1])
            for ns, ifn, addr in zip(self.ns, self.ifs, self.addrs):
                _sh("ip", "link", "set", ifn, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifn)
                _sh("ip", "-n", ns, "link", "set", ifn, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def shape(self, rate: str) -> None:
        for ns, ifn in zip(self.ns, self.ifs):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ifn, "root", check=False)
            if rate != "unshaped":
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifn, "root", "tbf", "rate", rate,
                    "burst", "512kb", "latency", "100ms")

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            _sh("ip", "netns", "del", ns, check=False)


def spawn_pair(nodes: TwoNodes, script: str, args_for_rank, timeout_s: float, what: str = "workers") -> dict:
    """Run ``script`` once in each node's namespace, pinned to core = rank, with
    GLOO_SOCKET_IFNAME set; ``args_for_rank(rank, out_path)`` gives its arguments.
    Returns the JSON the workers left at ``out_path``; a failure raises with both logs."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=nodes.ifs[rank], PYTHONUNBUFFERED="1")
            cmd = ["ip", "netns", "exec", nodes.ns[rank], "taskset", "-c", str(rank % (os.cpu_count() or 1)),
                   sys.executable, os.path.abspath(script), *args_for_rank(rank, out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{what} failed:\n" + "\n---\n".join(log[-3000:] for log in logs))
        return json.loads(Path(out).read_text())


def run_pair(nodes: TwoNodes, strategies: list[str], steps: int, warmup: int, timeout_s: float = 900,
             bucket_cap_mb: float = 25.0, rounds: int = 1) -> dict:
    port = 20000 + os.getpid() % 20000
    return spawn_pair(
        nodes, __file__,
        lambda rank, out: ["--worker", str(rank), "--master", nodes.addrs[0], "--port", str(port),
                           "--strategies", ",".join(strategies), "--steps", str(steps), "--warmup", str(warmup),
                           "--ifname", nodes.ifs[rank], "--out", out, "--bucket-cap-mb", str(bucket_cap_mb),
                           "--rounds", str(rounds)],
        timeout_s,
    )


def _steps_to(losses: list[float], target: float) -> int | None:
    for i, v in enumerate(losses):
        if v <= target:
            return i + 1
    return None


def report(by_rate: dict, target_frac: float = 0.8) -> str:
    lines = [f"target loss: DDP's loss after {target_frac:.0%} of the steps (the floor trains on one rank's data "
             "only: its loss is not comparable); floor: the same model in the same worker with no communication, "
             "interleaved step by step with the strategies; p25: lower quartile of step times, the steps least "
             "disturbed by other load", ""]
    lines.append("| link | strategy | step ms (median) | x floor | p25 x floor | final loss | steps to target "
                 "| est. time to it (s) | bytes/step reported | bytes/step on the wire | decision |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for rate, res in by_rate.items():
        f = statistics.median(res["floor"]["step_s"])
        f25 = statistics.quantiles(res["floor"]["step_s"], n=4)[0]
        ddp = res.get("ddp")
        target = ddp["losses"][int(target_frac * (len(ddp["losses"]) - 1))] if ddp else None
        for name, r in res.items():
            med = statistics.median(r["step_s"])
            p25 = statistics.quantiles(r["step_s"], n=4)[0]  # the steps least disturbed by other load
            k = _steps_to(r["losses"], target) if target is not None else None
            rep = r.get("reported_bytes_per_step")
            wire = r.get("tx_bytes_per_step")
            lines.append(
                f"| {rate} | {name} | {med * 1e3:.1f} | {med / f:.2f} | {p25 / f25:.2f} | {r['losses'][-1]:.4f} | {k} | "
                f"{'' if k is None else f'{k * med:.2f}'} | {'' if rep is None else f'{rep / 1e6:.3f} MB'} | "
                f"{'' if wire is None else f'{wire / 1e6:.3f} MB'} | {r.get('stats', {}).get('sync_decision', '')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="unshaped,1gbit,200mbit")
    ap.add_argument("--strategies", default="ddp,allreduce,torch_fp16,torch_powersgd,fp16,bf16,powersgd,auto")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per strategy (losses from step 0)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)  # kept for old command lines
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP bucket size for every strategy but torch_powersgd (one bucket: it aborts with more)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ifname", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    strategies = a.strategies.split(",")
    if a.worker is not None:
        dist_worker(a.worker, a.master, a.port, strategies, a.steps, a.warmup, a.ifname, a.out, a.bucket_cap_mb, a.rounds)
        return 0
    by_rate = {}
    with TwoNodes() as nodes:
        for rate in a.rates.split(","):
            nodes.shape(rate)
            by_rate[rate] = run_pair(nodes, strategies, a.steps, a.warmup, bucket_cap_mb=a.bucket_cap_mb, rounds=a.rounds)
            print(f"{rate}: done", file=sys.stderr, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rates": by_rate}))
    print(report(by_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
