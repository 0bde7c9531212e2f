"""Worker functions for the multi-process sync tests (spawned, so importable at top level).

Each worker initialises gloo, runs a list of checks, and rank 0 writes a JSON
result file the test process asserts on (one spawn runs many checks: starting
torch in a process costs seconds on the shared 2-core machine).
"""

from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from slipstream.network.link import Link
from slipstream.process import gloo_exit
from slipstream.process.timing import duration_s


def init(rank: int, world: int, port: int, local_world: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo_exit.install()  # mp.spawn counts a rank that aborts in teardown as failed


def mlp(widths: list[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int, n: int, width_in: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs, and labels from a fixed random linear teacher (a task that can be learnt)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, width_in, generator=g)
    teacher = torch.randn(width_in, classes, generator=torch.Generator().manual_seed(12345))
    return x, (x @ teacher).argmax(dim=1)


def run(strategy: str | None, widths: list[int], steps: int, bucket_cap_mb: float = 25.0, lr: float = 0.05,
        batch_size: int = 16, sync_state: dict | None = None, start_step: int = 0, model_state: dict | None = None,
        opt_state: dict | None = None, bucket_view: bool = False, **options):
    """Train ``steps`` steps; returns (model, last grads, losses, state, optimizer)."""
    from slipstream import sync

    model = mlp(widths)
    if model_state is not None:
        model.load_state_dict(model_state)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=bucket_view)
    state = sync.apply(strategy, ddp, **options) if strategy is not None else None
    if sync_state is not None:
        state.load_state_dict(sync_state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    losses, grads = [], []
    for step in range(start_step, start_step + steps):
        x, y = batch(step, dist.get_rank(), batch_size, widths[0], widths[-1])
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if state is not None and hasattr(state, "observe_loss"):
            state.observe_loss(loss.detach())
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return model, grads, losses, state, opt


def same_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.reshape(-1) for t in tensors]).double()
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).detach().abs().max() / (y.detach().abs().max() + 1e-12)) for x, y in zip(a, b))


def _check(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
    dist.barrier()


def suite(rank: int, world: int, port: int, out_path: str, local_world: int) -> None:
    """The 2-rank suite: equality with DDP, ordering stress, state round trip, guard, convergence."""
    init(rank, world, port, local_world)
    res: dict = {}
    widths = [32, 64, 64, 8]

    def equality():
        _, ref, _, _, _ = run(None, widths, 3)
        out = {}
        for strat in ("allreduce", "hierarchical", "bf16", "fp16"):
            _, g, _, st, _ = run(strat, widths, 3, bucket_cap_mb=0.005)
            out[strat] = {"rel_diff": max_rel_diff(g, ref), "same_on_ranks": same_on_all_ranks(g),
                          "stats": st.stats()}
        # Gradients as views of DDP's buckets (no copies): the same results as with copies.
        for strat in ("hierarchical", "bf16", "powersgd", "sign"):
            m1, _, _, _, _ = run(strat, widths, 3, bucket_cap_mb=0.005)
            m2, _, _, _, _ = run(strat, widths, 3, bucket_cap_mb=0.005, bucket_view=True)
            out[f"view_{strat}"] = max_rel_diff(list(m2.parameters()), list(m1.parameters()))
        return out

    def stress():
        # 60 layers of 512x512 (1 MiB of weights each) in 1 MiB buckets: 60+ buckets per step.
        wide = [512] * 61 + [8]
        out = {}
        for strat in ("allreduce", "bf16", "fp16", "powersgd", "topk", "sign", "hierarchical",
                      "hierarchical+powersgd", "auto"):
            model, g, losses, st, _ = run(strat, wide, 3, bucket_cap_mb=1.0, batch_size=4, lr=0.01)
            buckets = len(st.last.numel) if getattr(st, "last", None) is not None else None
            out[strat] = {"same_on_ranks": same_on_all_ranks(list(model.parameters())), "buckets": buckets,
                          "finite": all(bool(torch.isfinite(t).all()) for t in g), "steps": st.stats()["sync_steps"]}
        return out

    def roundtrip():
        out = {}
        # PowerSGD in several buckets (its state is per parameter, so DDP's different
        # first-iteration bucketing does not matter); top-k and sign select over a whole
        # bucket, so they get one bucket, the same in every iteration.
        for strat, cap, opts in (("powersgd", 0.005, {"rank": 2}), ("topk", 25.0, {"density": 0.05}),
                                 ("sign", 25.0, {})):
            m_full, _, _, st_full, _ = run(strat, widths, 6, bucket_cap_mb=cap, **opts)
            m_a, _, _, st_a, opt_a = run(strat, widths, 3, bucket_cap_mb=cap, **opts)
            saved = {k: v for k, v in st_a.state_dict().items()}
            torch.save(saved, f"/tmp/_sync_rt_{os.getpid()}.pt")
            loaded = torch.load(f"/tmp/_sync_rt_{os.getpid()}.pt", weights_only=False)
            os.unlink(f"/tmp/_sync_rt_{os.getpid()}.pt")
            m_b, _, _, st_b, _ = run(strat, widths, 3, bucket_cap_mb=cap, sync_state=loaded, start_step=3,
                                     model_state=m_a.state_dict(), opt_state=opt_a.state_dict(), **opts)
            # Without the sync state, the resumed run must differ (the check can fail).
            m_c, _, _, _, _ = run(strat, widths, 3, bucket_cap_mb=cap, start_step=3,
                                  model_state=m_a.state_dict(), opt_state=opt_a.state_dict(), **opts)
            full = list(m_full.parameters())
            out[strat] = {
                "resumed_diff": max_rel_diff(list(m_b.parameters()), full),
                "fresh_state_diff": max_rel_diff(list(m_c.parameters()), full),
                "steps": st_b.stats()["sync_steps"],
            }
        return out

    def guard():
        _, _, _, st, _ = run("topk", widths, 12, bucket_cap_mb=0.005, density=0.001, max_error_ratio=0.5,
                             check_every_steps=5)
        # Loss rule: 3 uncompressed warm-up steps give the baseline; a loss tolerance of -50 %
        # (the compressed loss must halve) cannot hold over 3 steps, so the guard must fall back.
        _, _, _, st2, _ = run("powersgd", widths, 12, bucket_cap_mb=0.005, rank=1, warmup_steps=3,
                              loss_window=3, loss_tolerance=-0.5, check_every_steps=5)
        return {"mode": st.mode, "reason": st.fallback_reason, "stats": st.stats(),
                "loss_mode": st2.mode, "loss_reason": st2.fallback_reason,
                "baseline_count": st2.guard.baseline_count}

    def auto():
        from slipstream import sync

        model = mlp(widths)
        ddp = DDP(model, bucket_cap_mb=0.005)
        st = sync.apply("auto", ddp, observe_steps=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        modes = []

        def step(i):
            x, y = batch(i, dist.get_rank(), 16, widths[0], widths[-1])
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            modes.append(st.mode)

        for i in range(5):
            step(i)
        first = st.decision
        st.request_probe()  # re-measure: the next step probes, then 2 steps are observed again
        for i in range(5, 10):
            step(i)
        mine = [st.mode, st.decision_summary(), sorted(st.decisions.items())]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out = {"mode": st.mode, "agree": all(e == everyone[0] for e in everyone), "decision": st.decision.explain(),
               "same_on_ranks": same_on_all_ranks(list(model.parameters())), "n_decisions": len(st.decisions),
               "modes": modes, "redecided": st.decision is not first}
        out["verify"] = verify_reverts_a_slow_plan()
        # The probe's link replaced by a fixed one (the tiny model's communication is hidden
        # or exposed depending on loopback's mood): a slow link, where the codecs are timed
        # and the convergence gate measured, and a fast one, where no codec could help.
        out["default_window"] = default_window(Link.measured(dist.get_world_size(), 2e-4, 2e6))
        out["fast_link_window"] = default_window(Link.measured(dist.get_world_size(), 1e-7, 1e12))
        return out

    def default_window(link):
        # auto with no options: the default observation window, and the decision in stats().
        from slipstream import sync
        from slipstream.sync import probe

        model = mlp(widths)
        ddp = DDP(model, bucket_cap_mb=0.005)
        real_probe = probe.probe_link
        probed_sizes = []

        def stand_in(*a, **k):
            probed_sizes.append(list(k.get("sizes_bytes", ())))
            return link

        probe.probe_link = stand_in
        try:
            st = sync.apply("auto", ddp)
        finally:
            probe.probe_link = real_probe
        # What auto's pricing of DiLoCo was handed: whether the step before the observed one
        # reached it (the wiring), and the figure the measured branch compares with the backward.
        priced = {}
        real_price = st.auto.price_lowcomm

        def price_recorded(last, before, clock):
            priced["before_given"] = before is not None and before.t_backward_start is not None
            out = real_price(last, before, clock)
            if priced["before_given"] and last.t_backward_start is not None:
                priced["period_less_exposed_s"] = (
                    duration_s(before.t_backward_start, last.t_backward_start) - before.exposed_s)
            return out

        st.auto.price_lowcomm = price_recorded
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        modes = []
        for i in range(4):
            x, y = batch(i, dist.get_rank(), 16, widths[0], widths[-1])
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            modes.append(st.mode.value)
        stats = st.stats()
        st.close()
        d = st.decision
        return {"modes": modes, "stats": stats, "choices": {str(k): v for k, v in st.decisions.items()},
                "decided": {str(k): v for k, v in d.choices.items()} if d is not None else {},
                "cast_choices": {str(k): v for k, v in (d.cast_choices or {}).items()} if d is not None else {},
                "probed_sizes": probed_sizes, "priced": priced,
                "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    def verify_reverts_a_slow_plan():
        # A plan the model got wrong: every bucket on a codec made 40 ms slower per bucket
        # than it measured when costed (a stand-in for a cost mismeasured under load).
        import time as _time

        from slipstream import sync
        from slipstream.sync import auto as engine_auto
        from slipstream.sync import policy

        model = mlp(widths)
        ddp = DDP(model, bucket_cap_mb=0.005)
        st = sync.apply("auto", ddp, candidates=("allreduce", "sign"), observe_steps=2, verify_steps=3)
        real_decide = engine_auto.decide

        def forced(buckets, *a, **k):
            d = real_decide(buckets, *a, **k)
            d.choices = {b.index: "sign" for b in buckets}
            return d

        engine_auto.decide = forced
        codec = st.codecs["sign"]
        real_reduce = codec.reduce

        def slow_reduce(*a, **k):
            _time.sleep(0.04)
            return real_reduce(*a, **k)

        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        seen = []
        try:
            for i in range(10):
                if st.mode == "run":
                    codec.reduce = slow_reduce  # only once the costs were measured
                x, y = batch(i, dist.get_rank(), 16, widths[0], widths[-1])
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                seen.append(st.decision_summary())
        finally:
            engine_auto.decide = real_decide
        assert policy.verify_plan  # the pure rule the engine applies
        return {"seen": seen, "final": st.decision_summary(), "verification": st.verification,
                "stats": st.stats(), "same_on_ranks": same_on_all_ranks(list(model.parameters()))}

    def convergence():
        # A learnable task: a fixed random teacher labels the inputs.
        out = {}
        for strat, opts in (("allreduce", {}), ("bf16", {}), ("fp16", {}), ("powersgd", {"rank": 2}),
                            ("topk", {"density": 0.05}), ("sign", {})):
            _, _, losses, st, _ = run(strat, [32, 128, 128, 4], 150, bucket_cap_mb=0.02, lr=0.1, batch_size=32,
                                      **opts)
            s = st.stats()
            out[strat] = {"first": sum(losses[:10]) / 10, "last": sum(losses[-20:]) / 20,
                          "ratio": s.get("sync_compression_ratio"), "mode": s.get("sync_mode"),
                          "error_ratio": s.get("sync_error_ratio")}
        return out

    def direct():
        # The casts with default options: every bucket on the direct path (no ordering thread),
        # and every step's gradient bitwise the codec's formula on each rank's own gradient.
        import threading

        from slipstream import sync
        from slipstream.sync.ordering import THREAD_NAME

        def sync_threads() -> int:
            return sum(t.name == THREAD_NAME for t in threading.enumerate())

        n = dist.get_world_size()
        formulas = {  # Cast.encode -> a sum in 16 bits (what gloo computes) -> Cast.decode
            "bf16": lambda gs: sum(g.to(torch.bfloat16) for g in gs).float().div_(n),
            "fp16": lambda gs: sum(g.div(n).to(torch.float16) for g in gs).float(),
        }
        out = {}
        for strat, formula in formulas.items():
            threads_before = sync_threads()
            model = mlp(widths)
            local = mlp(widths)
            ddp = DDP(model, bucket_cap_mb=0.005)
            st = sync.apply(strat, ddp)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            bitwise = []
            for i in range(4):
                local.load_state_dict(model.state_dict())
                local.zero_grad(set_to_none=True)
                x, y = batch(i, dist.get_rank(), 16, widths[0], widths[-1])
                nn.functional.cross_entropy(ddp(x), y).backward()
                nn.functional.cross_entropy(local(x), y).backward()
                for p, q in zip(model.parameters(), local.parameters()):
                    everyone = [torch.empty_like(q.grad) for _ in range(n)]
                    dist.all_gather(everyone, q.grad)
                    bitwise.append(bool(torch.equal(p.grad, formula(everyone))))
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[strat] = {"bitwise": all(bitwise), "checked": len(bitwise), "queued_jobs": st.queued_jobs_total,
                          "threads_added": sync_threads() - threads_before, "steps": st.stats()["sync_steps"]}
            st.close()
        out["auto_casts"] = auto_plan_of_casts()
        return out

    def auto_plan_of_casts():
        # auto's default candidates (powersgd among them, so it has a guard) with a plan of
        # bf16 everywhere, kept (no verification): after the decision, no bucket is queued.
        from slipstream import sync
        from slipstream.sync import auto as engine_auto

        model = mlp(widths)
        ddp = DDP(model, bucket_cap_mb=0.005)
        st = sync.apply("auto", ddp, observe_steps=2, verify_steps=0)
        real_decide = engine_auto.decide

        def forced(buckets, *a, **k):
            d = real_decide(buckets, *a, **k)
            d.choices = {b.index: "bf16" for b in buckets}
            return d

        engine_auto.decide = forced
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        modes, jobs = [], []
        try:
            for i in range(8):
                x, y = batch(i, dist.get_rank(), 16, widths[0], widths[-1])
                loss = nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                st.observe_loss(loss.detach())
                opt.step()
                opt.zero_grad(set_to_none=True)
                modes.append(st.mode.value)
                jobs.append(st.queued_jobs_total)
        finally:
            engine_auto.decide = real_decide
        stats = st.stats()
        st.close()
        return {"modes": modes, "jobs": jobs, "decision": st.decision_summary(), "verification": st.verification,
                "guard": st.guard is not None, "same_on_ranks": same_on_all_ranks(list(model.parameters())),
                "stats": stats}

    def roundtrip_auto():
        # Every codec auto can choose (compress.CODECS), flat and hierarchical (2 nodes of 1 rank:
        # the codec on the inter-node step), in a plan forced onto it: 8 steps straight against
        # 5 steps, state saved through torch.save, and 3 resumed steps. One bucket, the same in
        # every iteration (top-k and sign select over a whole bucket).
        from slipstream.sync import auto as engine_auto
        from slipstream.sync.compress import CODECS

        real_decide = engine_auto.decide
        plan = {}

        def forced(buckets, *a, **k):
            d = real_decide(buckets, *a, **k)
            d.choices = {b.index: plan["codec"] for b in buckets}
            return d

        def resumed(strat, codec, **opts):
            plan["codec"] = codec
            m_full, _, _, _, _ = run(strat, widths, 8, **opts)
            m_a, _, _, st_a, opt_a = run(strat, widths, 5, **opts)
            path = f"/tmp/_sync_rt_auto_{os.getpid()}.pt"
            torch.save(st_a.state_dict(), path)
            loaded = torch.load(path, weights_only=False)
            os.unlink(path)
            m_b, _, _, st_b, _ = run(strat, widths, 3, sync_state=loaded, start_step=5, model_state=m_a.state_dict(),
                                     opt_state=opt_a.state_dict(), **opts)
            full = list(m_full.parameters())
            r = {"resumed_diff": max_rel_diff(list(m_b.parameters()), full),
                 "bitwise": all(torch.equal(a, b) for a, b in zip(m_b.parameters(), full)),
                 "decision": st_b.decision_summary(), "mode": st_b.mode.value, "steps": st_b.steps}
            if st_b.codecs[codec].error_feedback:  # without the state the run must differ
                m_c, _, _, _, _ = run(strat, widths, 3, start_step=5, model_state=m_a.state_dict(),
                                      opt_state=opt_a.state_dict(), **opts)
                r["fresh_state_diff"] = max_rel_diff(list(m_c.parameters()), full)
            for st in (st_a, st_b):
                st.close()
            return r

        out = {"codecs": list(CODECS)}
        engine_auto.decide = forced
        try:
            for codec in CODECS:
                opts = {"candidates": (codec,), "observe_steps": 2, "verify_steps": 0}
                out[f"auto/{codec}"] = resumed("auto", codec, **opts)
            saved = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
            os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # 2 nodes of 1 rank
            try:
                for codec in CODECS:
                    opts = {"candidates": (codec,), "observe_steps": 2, "verify_steps": 0}
                    out[f"hierarchical+auto/{codec}"] = resumed("hierarchical+auto", codec, **opts)
            finally:
                os.environ.update(saved)
        finally:
            engine_auto.decide = real_decide
        return out

    which = os.environ.get("SYNC_TEST_CHECKS",
                           "equality,stress,roundtrip,guard,auto,convergence,direct,roundtrip_auto").split(",")
    for name, fn in (("equality", equality), ("stress", stress), ("roundtrip", roundtrip), ("guard", guard),
                     ("auto", auto), ("convergence", convergence), ("direct", direct),
                     ("roundtrip_auto", roundtrip_auto)):
        if name in which:
            _check(res, name, fn)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, default=str)
    dist.destroy_process_group()


def hierarchy(rank: int, world: int, port: int, out_path: str, local_world: int) -> None:
    """4 ranks as 2 nodes of 2: hierarchical == flat all-reduce; hierarchical+codec consistent."""
    init(rank, world, port, local_world)
    from slipstream.sync import topology

    res: dict = {}
    widths = [32, 64, 64, 8]

    def equal():
        topo = topology.detect()
        _, ref, _, _, _ = run(None, widths, 3)
        out = {"node_rank": topo.node_rank, "num_nodes": topo.num_nodes}
        for strat in ("hierarchical", "hierarchical+bf16"):
            _, g, _, st, _ = run(strat, widths, 3, bucket_cap_mb=0.005)
            out[strat] = {"rel_diff": max_rel_diff(g, ref), "same_on_ranks": same_on_all_ranks(g),
                          "stats": st.stats()}
        for strat in ("hierarchical+powersgd", "hierarchical+topk", "hierarchical+sign"):
            m, g, _, st, _ = run(strat, [512] * 12 + [8], 3, bucket_cap_mb=1.0, batch_size=4)
            out[strat] = {"same_on_ranks": same_on_all_ranks(list(m.parameters())),
                          "buckets": len(st.last.numel), "stats": st.stats()}
        # hierarchical+auto: both levels probed, one agreed plan; the run goes on under it.
        m, g, _, st, _ = run("hierarchical+auto", [512] * 12 + [8], 6, bucket_cap_mb=1.0, batch_size=4,
                             observe_steps=2)
        mine = [st.mode, sorted(st.decisions.items())]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out["hierarchical+auto"] = {"same_on_ranks": same_on_all_ranks(list(m.parameters())),
                                    "agree": all(e == everyone[0] for e in everyone), "mode": st.mode,
                                    "n_decisions": len(st.decisions), "explain": st.decision.explain(),
                                    "stats": st.stats()}
        return out

    _check(res, "hierarchy", equal)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, default=str)
    dist.destroy_process_group()
