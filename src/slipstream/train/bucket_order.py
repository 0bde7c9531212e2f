"""One gradient-bucket layout from the first step on, so a resumed run sums in the same order.

DDP reduces gradients in buckets. It builds them twice: at construction every
parameter goes into one bucket (``bucket_size_limits = [sys.maxsize]`` when
neither ``static_graph`` nor ``find_unused_parameters`` is set), and before the
second forward it rebuilds them (``bucket_cap_mb`` each) in the order the
gradients became ready in the first backward. A run resumed from a checkpoint
therefore reduces its first step in the one big bucket while the uninterrupted
run, at that step, used the rebuilt ones. A ring all-reduce (gloo's, NCCL's)
adds each element's contributions starting at the rank that owns the element's
chunk of the *bucket*, so a different layout changes the order of the sum. With
two ranks ``a + b == b + a`` and nothing shows; from three ranks on the results
differ in the last bits (measured: 62 of 69 tensors of the GPT example, up to
2.6e-5, after a restart at 4 ranks), and bitwise resume is lost. On NCCL the
layout also picks the algorithm (ring, tree) per bucket size.

:func:`fix_bucket_order` makes the rebuild happen before the first real step,
in every run, fresh or resumed: it runs one backward of zeros through DDP's own
reducer, with the gradients becoming ready in reverse declaration order (the
order DDP itself assumes for its initial buckets), so the first forward
rebuilds the buckets from that order; rank 0's order is the one all ranks use
(DDP broadcasts it). Every run then uses the same layout at every step, so a
resume at any step continues the same sums.

The cost is one all-reduce of the parameters' size at construction (DDP's
construction already broadcasts as much) and, where a model's gradients become
ready in an order far from the reverse of declaration, some overlap of
communication with the backward: DDP's own rebuild would have learned that
order from the first step. ``find_unused_parameters=True`` never rebuilds and
``static_graph=True`` keeps its own first-iteration bookkeeping: both are left
as they are.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("slipstream.train")

_FIXED = "_slipstream_bucket_order_fixed"


def is_fixed(ddp: DistributedDataParallel) -> bool:
    """Whether :func:`fix_bucket_order` fixed this DDP model's bucket layout."""
    return bool(getattr(ddp, _FIXED, False))


def fix_bucket_order(ddp: DistributedDataParallel) -> bool:
    """Make DDP rebuild its buckets at the first forward from reverse declaration order.

    Collective (one all-reduce through the reducer, on every rank). Call it right
    after constructing DDP, before a comm hook is registered (the zeros go through
    DDP's default all-reduce) and before any backward. Returns whether the order
    was fixed; idempotent (a second call would make DDP count every parameter twice).
    """
    if getattr(ddp, _FIXED, False):
        return False
    if ddp.find_unused_parameters or ddp.static_graph:
        return False
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params:
        return False
    # Arm the reducer for one backward, as DDP's forward does with find_unused_parameters=False.
    ddp.reducer.prepare_for_backward([])
    total: torch.Tensor | None = None
    for p in params:
        # The autograd engine runs the most recently created branch first, so the
        # last declared parameter becomes ready first: reverse declaration order.
        term = (p.reshape(-1)[:1] * 0).sum()
        total = term if total is None else total + term
    assert total is not None
    total.backward()
    for p in params:
        p.grad = None  # the zeros were reduced; nothing of them stays
    setattr(ddp, _FIXED, True)
    log.debug("DDP buckets will be rebuilt from reverse declaration order at the first forward")
    return True


def fix_bucket_order_again(ddp: DistributedDataParallel) -> bool:
    """:func:`fix_bucket_order` once more, for a model whose reducer was reset (its process group
    replaced after healing in place): every rank rebuilds the same layout as at the start.
    Collective."""
    setattr(ddp, _FIXED, False)
    return fix_bucket_order(ddp)
