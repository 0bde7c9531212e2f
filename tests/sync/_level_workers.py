"""Worker of tests/sync/test_auto_levels.py: ``auto`` on 4 ranks as 2 nodes of 2 (spawned; rank 0 writes JSON).

One spawn runs every check (starting torch in 4 processes on 2 cores costs seconds):

* ``natural``: ``auto`` decides both levels from its own measurements and takes one;
* ``forced``: the level choice forced to hierarchical (a stand-in for a slow flat link):
  training goes on through the two-level reducer, equal to DDP's flat all-reduce
  (uncompressed plan), and ``request_probe()`` observes again on flat;
* ``reverted``: hierarchical forced and made slow: verification reverts to flat all-reduce;
* ``retreat``: hierarchical + PowerSGD forced, the guard tripping: to the flat plan once, then
  the fallback; bitwise resume from before the first trip;
* ``resume/CODEC``: hierarchical + CODEC forced, state saved after the decision, bitwise resume.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.sync._workers import _check, batch, init, max_rel_diff, mlp, run, same_on_all_ranks

WIDTHS = [32, 64, 64, 8]
RESUME_CODECS = ("bf16", "fp16", "powersgd", "topk", "sign")  # every codec auto can choose but allreduce


def _agree(value) -> bool:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return all(e == everyone[0] for e in everyone)


class _Forced:
    """Replace ``slipstream.sync.auto``'s level choice (and, with ``codec``, its plan) while in use."""

    def __init__(self, level: str | None = None, codec: str | None = None):
        self.level, self.codec = level, codec

    def __enter__(self):
        from slipstream.sync import auto as engine_auto

        self.real_choose, self.real_decide = engine_auto.choose_level, engine_auto.decide
        if self.level is not None:
            engine_auto.choose_level = lambda predicted: self.level
        if self.codec is not None:
            real = self.real_decide

            def forced(buckets, *a, **k):
                d = real(buckets, *a, **k)
                d.choices = {b.index: self.codec for b in buckets}
                return d

            engine_auto.decide = forced
        return self

    def __exit__(self, *exc):
        from slipstream.sync import auto as engine_auto

        engine_auto.choose_level, engine_auto.decide = self.real_choose, self.real_decide


def _through_a_file(state: dict) -> dict:
    """``state`` as a checkpoint would give it back: saved with torch.save, loaded again."""
    path = f"/tmp/_sync_levels_{os.getpid()}.pt"
    torch.save(state, path)
    try:
        return torch.load(path, weights_only=False)
    finally:
        os.unlink(path)


def _steps(ddp, st, opt, start: int, steps: int) -> list[list[str]]:
    """Train ``steps`` steps; after each, [mode, level, decision summary]."""
    seen = []
    for i in range(start, start + steps):
        x, y = batch(i, dist.get_rank(), 16, WIDTHS[0], WIDTHS[-1])
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append([st.mode.value, st.level, st.decision_summary()])
    return seen


def _auto(**options):
    from slipstream import sync

    model = mlp(WIDTHS)
    ddp = DDP(model, bucket_cap_mb=0.005)
    st = sync.apply("auto", ddp, **options)
    return model, ddp, st, torch.optim.SGD(model.parameters(), lr=0.05)


def natural() -> dict:
    """auto's own choice from its own figures."""
    model, ddp, st, opt = _auto(observe_steps=2, verify_steps=2)
    seen = _steps(ddp, st, opt, 0, 7)
    stats = st.stats()
    st.close()
    mine = [seen, sorted(st.decisions.items()), stats.get("sync_predicted_flat_s"),
            stats.get("sync_predicted_hierarchical_s"), stats.get("sync_verification")]
    return {"agree": _agree(mine), "same_on_ranks": same_on_all_ranks(list(model.parameters())),
            "seen": seen, "stats": stats, "levels_built": sorted(st.levels or {})}


def forced() -> dict:
    """Hierarchical taken: the run reduces in two levels, equal to flat all-reduce (fp32); a re-probe
    observes again on flat."""
    with _Forced(level="hierarchical"):
        model, ddp, st, opt = _auto(observe_steps=2, verify_steps=0, candidates=("allreduce",))
        seen = _steps(ddp, st, opt, 0, 4)
        stats = st.stats()
        # Plain DDP after the same 4 steps: the same fp32 sums, in another order.
        ref, _, _, _, _ = run(None, WIDTHS, 4, bucket_cap_mb=0.005)
        rel_diff = max_rel_diff(list(model.parameters()), list(ref.parameters()))
        st.request_probe()
        after = _steps(ddp, st, opt, 4, 4)
    out = {"seen": seen, "stats": stats, "rel_diff": rel_diff, "after_probe": after,
           "same_on_ranks": same_on_all_ranks(list(model.parameters())), "agree": _agree([seen, after])}
    st.close()
    return out


def reverted() -> dict:
    """Hierarchical taken but slow (40 ms per bucket): verification goes back to flat all-reduce."""
    from slipstream.sync.hierarchical import Hierarchical

    real = Hierarchical.reduce

    def slow(self, *a, **k):
        time.sleep(0.04)
        return real(self, *a, **k)

    with _Forced(level="hierarchical"):
        model, ddp, st, opt = _auto(observe_steps=2, verify_steps=2, candidates=("allreduce",))
        Hierarchical.reduce = slow
        try:
            seen = _steps(ddp, st, opt, 0, 8)
        finally:
            Hierarchical.reduce = real
    out = {"seen": seen, "verification": st.verification, "stats": st.stats(),
           "same_on_ranks": same_on_all_ranks(list(model.parameters())), "agree": _agree(seen)}
    st.close()
    return out


def resume(codec: str) -> dict:
    """Hierarchical + ``codec``, state saved after the decision: a resumed run reduces the same way, bitwise.

    On two levels of k > 1 ranks a codec's state is kept per bucket (its 1/k shard cuts
    parameters), and DDP's first iteration of the resumed process orders the bucket's
    parameters differently from the rebuilt buckets the saving run used: the reducer cuts
    its shards in one canonical parameter order, so the resumed step finds that state.
    """
    opts = {"candidates": (codec,), "observe_steps": 2, "verify_steps": 0}
    with _Forced(level="hierarchical", codec=codec):
        m_full, _, _, st_full, _ = run("auto", WIDTHS, 8, **opts)
        m_a, _, _, st_a, opt_a = run("auto", WIDTHS, 5, **opts)
        saved = _through_a_file(st_a.state_dict())
        m_b, _, _, st_b, _ = run("auto", WIDTHS, 3, sync_state=saved, start_step=5, model_state=m_a.state_dict(),
                                 opt_state=opt_a.state_dict(), **opts)
        # The same state without its level: the run reduces flat and must differ (the check can fail).
        no_level = {k: v for k, v in saved.items() if k != "level"}
        m_c, _, _, st_c, _ = run("auto", WIDTHS, 3, sync_state=no_level, start_step=5,
                                 model_state=m_a.state_dict(), opt_state=opt_a.state_dict(), **opts)
    full = list(m_full.parameters())
    out = {"saved_level": saved.get("level"), "full_level": st_full.level, "resumed_level": st_b.level,
           "resumed_mode": st_b.mode.value, "resumed_decision": st_b.decision_summary(), "resumed_steps": st_b.steps,
           "bitwise": all(torch.equal(a, b) for a, b in zip(m_b.parameters(), full)),
           "resumed_diff": max_rel_diff(list(m_b.parameters()), full),
           "no_level_level": st_c.level, "no_level_diff": max_rel_diff(list(m_c.parameters()), full),
           "inter_node_bytes": st_b.stats().get("sync_inter_node_bytes_sent"),
           "same_on_ranks": same_on_all_ranks(list(m_b.parameters()))}
    for st in (st_full, st_a, st_b, st_c):
        st.close()
    return out


def retreat() -> dict:
    """Hierarchical + PowerSGD forced, the guard made to trip at every check: the first trip moves
    ``auto`` to its flat plan (PowerSGD, as forced), the second falls back; a state saved on the
    hierarchical level, before the first trip, resumes to the same weights, bitwise."""
    opts = {"candidates": ("powersgd",), "observe_steps": 2, "verify_steps": 0, "check_every_steps": 2,
            "max_error_ratio": 1e-9}
    with _Forced(level="hierarchical", codec="powersgd"):
        model, ddp, st, opt = _auto(**opts)
        seen = _steps(ddp, st, opt, 0, 9)
        out = {"seen": seen, "verification": st.verification, "fallback": st.fallback_reason,
               "same_on_ranks": same_on_all_ranks(list(model.parameters())), "agree": _agree(seen)}
        st.close()
        m_full, _, _, st_full, _ = run("auto", WIDTHS, 9, **opts)
        m_a, _, _, st_a, opt_a = run("auto", WIDTHS, 3, **opts)
        saved = _through_a_file(st_a.state_dict())
        common = dict(start_step=3, model_state=m_a.state_dict(), opt_state=opt_a.state_dict(), **opts)
        m_b, _, _, st_b, _ = run("auto", WIDTHS, 6, sync_state=saved, **common)
        # Without the flat plan in the state, the resumed run cannot move to it (the check can fail).
        no_flat = {k: v for k, v in saved.items() if k != "flat_choices"}
        m_c, _, _, st_c, _ = run("auto", WIDTHS, 6, sync_state=no_flat, **common)
    full = list(m_full.parameters())
    out.update({"saved_level": saved.get("level"), "saved_flat_choices": saved.get("flat_choices"),
                "full_verification": st_full.verification, "resumed_verification": st_b.verification,
                "bitwise": all(torch.equal(a, b) for a, b in zip(m_b.parameters(), full)),
                "no_flat_verification": st_c.verification, "no_flat_diff": max_rel_diff(list(m_c.parameters()), full)})
    for s in (st_full, st_a, st_b, st_c):
        s.close()
    return out


def levels(rank: int, world: int, port: int, out_path: str, local_world: int) -> None:
    init(rank, world, port, local_world)
    res: dict = {}
    t0 = time.perf_counter()
    checks = [("natural", natural), ("forced", forced), ("reverted", reverted), ("retreat", retreat)]
    checks += [(f"resume/{c}", lambda c=c: resume(c)) for c in RESUME_CODECS]
    for name, fn in checks:
        t = time.perf_counter()
        _check(res, name, fn)
        if isinstance(res[name], dict):
            res[name]["seconds"] = time.perf_counter() - t
    res["seconds"] = time.perf_counter() - t0
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, default=str)
    dist.destroy_process_group()
