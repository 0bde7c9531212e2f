"""Codec properties that matter on GPUs, checked on CPU in one process.

Several ranks are simulated with threads over :class:`SimWire`, which sums and
concatenates in rank order, so every run is deterministic. The device-side path
that CUDA takes (no host read of the finite flag) is forced on CPU by emptying
``base.HOST_FLAG_DEVICES`` (:func:`_force_device_select`: the name must exist and the
patch must take effect, or the device-select cases would silently run the host path).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch

from slipstream.sync.compress import PowerSGD, ScaledSign, TopK, Wire, base, layout_from_shapes, sign


class _Hub:
    def __init__(self, n: int):
        self.n = n
        self.slots: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts


class SimWire(Wire):
    """One simulated rank of an n-rank group: all-reduce sums in rank order, all-gather stacks."""

    def __init__(self, hub: _Hub, rank: int):
        super().__init__(None, size=hub.n)
        self.hub, self.rank = hub, rank

    def allreduce(self, t, op=None):
        parts = self.hub.exchange(self.rank, t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return t.copy_(total)

    def allgather(self, t):
        return torch.stack(self.hub.exchange(self.rank, t.contiguous()))


def on_ranks(n: int, fn: Callable[[int, Wire], object]) -> list:
    """fn(rank, wire) on n threads; their results in rank order."""
    hub, out, errors = _Hub(n), [None] * n, []

    def run(r: int) -> None:
        try:
            out[r] = fn(r, SimWire(hub, r))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# -- 1. top-k: each rank's contribution added on its own, in rank order ---------------


def test_topk_adds_each_rank_in_rank_order_without_duplicate_indices(monkeypatch):
    # Ranks share their largest coordinates: their top-k index sets overlap. On CUDA one
    # index_add_ over all ranks' indices sums the duplicates with atomics, in an order
    # that differs from rank to rank; no call may carry a duplicate index.
    n, numel = 3, 4096
    torch.manual_seed(0)
    shared = torch.randn(numel)
    grads = [shared + 0.1 * torch.randn(numel) for _ in range(n)]
    calls: list[torch.Tensor] = []
    real = torch.Tensor.index_add_

    def recording(self, dim, index, source, **kw):
        calls.append(index.clone())
        return real(self, dim, index, source, **kw)

    monkeypatch.setattr(torch.Tensor, "index_add_", recording)
    codec_of = [TopK(density=0.05) for _ in range(n)]
    outs = on_ranks(n, lambda r, w: codec_of[r].reduce(grads[r].clone(), w, key=0))
    monkeypatch.undo()

    assert calls, "top-k no longer uses index_add_: update this test"
    for idx in calls:
        assert idx.unique().numel() == idx.numel(), "an index_add_ call adds twice to one coordinate"
    # The overlap this test relies on exists.
    k = codec_of[0].k_of(numel)
    picked = [set(TopK(0.05).select(g, k).tolist()) for g in grads]
    assert picked[0] & picked[1] & picked[2]
    # Result: float32 sums in rank order, identical on every rank.
    want = torch.zeros(numel)
    for g in grads:
        idx = TopK(0.05).select(g, k)
        want.index_put_((idx,), g[idx], accumulate=True)
    want /= n
    for out in outs:
        assert torch.equal(out, want)


# -- 2. overflow steps (fp16 + GradScaler) -------------------------------------------------

SHAPES = [torch.Size([256, 288]), torch.Size([256]), torch.Size([16, 8])]
LAYOUT = layout_from_shapes(SHAPES)
NUMEL = sum(p.numel for p in LAYOUT)  # 74112: top-k takes its sampled CPU path

CODECS = {
    "powersgd": lambda: PowerSGD(rank=2),
    "topk": lambda: TopK(density=0.01),
    "sign": lambda: ScaledSign(chunk_numel=40),  # parameters end mid-chunk: the padded path
}


def _force_device_select(monkeypatch) -> None:
    """Make CPU take the path CUDA takes: no host read of the finite flag.

    ``monkeypatch.setattr`` raises if ``base`` has no ``HOST_FLAG_DEVICES`` (a rename must
    fail here, not leave the device-select cases running the host path), and the codecs'
    own test of the device must then say "device-side".
    """
    monkeypatch.setattr(base, "HOST_FLAG_DEVICES", frozenset())
    assert not base.host_reads_flags(torch.device("cpu")), "the patch did not reach host_reads_flags"


def _state(codec) -> dict[str, torch.Tensor]:
    out = {f"residual {k}": v.detach().clone().reshape(-1) for k, v in codec.residuals.items()}
    out.update({f"q {k}": v.detach().clone() for k, v in getattr(codec, "q", {}).items()})
    return out


@pytest.mark.parametrize("path", ["host_flag", "device_select"])
@pytest.mark.parametrize("where", [7, 256 * 288 + 3])  # inside the big matrix / in the bias
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("keyed", ["params", "bucket"])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_overflow_step_keeps_state_and_reaches_every_rank(monkeypatch, name, keyed, bad, where, path):
    if path == "device_select":  # what CUDA runs: the flag never leaves the device
        _force_device_select(monkeypatch)
    else:
        assert base.host_reads_flags(torch.device("cpu"))
    n = 2
    key = (0, 1, 2) if keyed == "params" else "bucket0"
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(NUMEL, generator=gen) for _ in range(3)] for _ in range(n)]
    overflow = grads[1][1].clone()
    overflow[where] = bad  # only rank 1 overflows

    def run(steps: list[int]) -> Callable[[int, Wire], dict]:
        def fn(r: int, wire: Wire) -> dict:
            codec = CODECS[name]()
            rec = {"out": [], "state": []}
            for s in steps:
                g = overflow if (s == 1 and r == 1) else grads[r][s]
                rec["out"].append(codec.reduce(g.clone(), wire, key, LAYOUT).clone())
                rec["state"].append(_state(codec))
            rec["signal"] = (torch.as_tensor(codec.residual_sq), torch.as_tensor(codec.grad_sq))
            return rec

        return fn

    with_overflow = on_ranks(n, run([0, 1, 2]))
    without = on_ranks(n, run([0, 2]))
    for r in range(n):
        got, ref = with_overflow[r], without[r]
        # Every rank's output of the overflow step is non-finite: all scalers skip it.
        assert not torch.isfinite(got["out"][1]).all(), f"rank {r} does not see the overflow"
        # State after the overflow step is exactly the state before it, and finite.
        before, after = got["state"][0], got["state"][1]
        assert before.keys() == after.keys() and before
        for k in before:
            assert torch.isfinite(after[k]).all(), f"rank {r}: {k} poisoned"
            assert torch.equal(after[k], before[k]), f"rank {r}: {k} changed on an overflow step"
        # The next step is the one that would have come had the overflow never happened.
        assert torch.equal(got["out"][2], ref["out"][1]), f"rank {r}: step after the overflow differs"
        for k, v in ref["state"][1].items():
            assert torch.equal(got["state"][2][k], v)
        # The guard's norms skip the overflow step.
        for a, b in zip(got["signal"], ref["signal"], strict=True):
            assert torch.isfinite(a) and torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_device_select_path_matches_the_cpu_path_bitwise(monkeypatch, name):
    # What CUDA runs (device-side selects) and what CPU runs (flag read on the host)
    # give the same bits on normal steps, on 2 ranks.
    def run(r: int, wire: Wire) -> list[torch.Tensor]:
        codec = CODECS[name]()
        gen = torch.Generator().manual_seed(r)
        outs = [codec.reduce(torch.randn(NUMEL, generator=gen), wire, (0, 1, 2), LAYOUT).clone() for _ in range(3)]
        return outs + list(_state(codec).values()) + [torch.as_tensor(codec.residual_sq)]

    assert base.host_reads_flags(torch.device("cpu"))
    host = on_ranks(2, run)
    _force_device_select(monkeypatch)
    device = on_ranks(2, run)
    for a, b in zip(host, device, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_overflow_on_the_first_step_leaves_no_poisoned_state(monkeypatch, name):
    # No residual yet: an overflow must not create one out of uninitialised memory or inf.
    for device_select in (False, True):
        if device_select:
            _force_device_select(monkeypatch)
        codec = CODECS[name]()
        g = torch.randn(NUMEL)
        g[5] = math.nan
        out = on_ranks(1, lambda r, w, c=codec, g=g: c.reduce(g.clone(), w, (0, 1, 2), LAYOUT))[0]
        assert not torch.isfinite(out).all()
        for k, v in _state(codec).items():
            assert torch.isfinite(v).all(), k
            if k.startswith("residual"):
                assert not v.any(), k


def test_topk_selects_nan_on_the_sampled_path():
    codec = TopK(density=0.01)
    x = torch.randn(1 << 17)
    x[12345] = math.nan
    idx = codec.select(x, codec.k_of(x.numel()))
    assert 12345 in set(idx.tolist())


# -- 3. sign: constant tables copied once per device and dtype ------------------------


def test_sign_tables_are_not_copied_per_call(monkeypatch):
    x = torch.randn(4096)
    for dtype in (torch.float32, torch.float64):
        sign.unpack_signs(sign.pack_signs(x), dtype)  # first use may build the copies
    copied, tables_used = [], []
    real_to, real_select = torch.Tensor.to, torch.Tensor.index_select

    def to(self, *a, **kw):
        if self is sign._SHIFTS or self is sign._TABLE:
            copied.append(self)
        return real_to(self, *a, **kw)

    def index_select(self, *a, **kw):
        tables_used.append(self)
        return real_select(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    for _ in range(3):
        packed = sign.pack_signs(x)
        sign.unpack_signs(packed, torch.float64)
    monkeypatch.undo()
    assert copied == [], "pack/unpack copy their constant tables on every call"
    assert len(tables_used) == 3 and all(t is tables_used[0] for t in tables_used)
    assert torch.equal(sign.unpack_signs(sign.pack_signs(x)), torch.where(x >= 0, 1.0, -1.0))


# -- per-parameter residuals: one add when the bucket is unchanged --------------------


def test_residuals_survive_regrouping_and_match_a_per_parameter_run():
    # Bucket A holds params (0, 1, 2); then DDP regroups to (0, 1) + (2,); then back.
    torch.manual_seed(0)
    head = layout_from_shapes(SHAPES[:2])
    tail = layout_from_shapes(SHAPES[2:])
    cut = sum(p.numel for p in head)
    solo = Wire(None, size=1)
    for make in CODECS.values():
        fast, slow = make(), make()
        for step in range(5):
            g = torch.randn(NUMEL)
            outs = []
            for codec in (fast, slow):
                if codec is slow and hasattr(codec, "_whole"):
                    codec._whole.clear()  # forces the per-parameter path every step
                if step == 2:
                    a = codec.reduce(g[:cut].clone(), solo, (0, 1), head)
                    b = codec.reduce(g[cut:].clone(), solo, (2,), tail)
                    outs.append(torch.cat([a, b]))
                else:
                    outs.append(codec.reduce(g.clone(), solo, (0, 1, 2), LAYOUT))
            assert torch.equal(outs[0], outs[1])
            for k, v in slow.residuals.items():
                assert torch.equal(fast.residuals[k].reshape(-1), v.reshape(-1)), k
