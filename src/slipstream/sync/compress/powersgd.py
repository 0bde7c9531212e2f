"""PowerSGD (Vogels et al., 2019): rank-r gradient approximation with error feedback.

For each matrix M (a parameter gradient viewed as shape[0] x rest) one power
iteration gives M ~= P Q^T with P = orth(sum_i M_i Q) and Q = mean_i M_i^T P.
The Ps of all matrices travel in one all-reduce, together with the tensors
that are not worth compressing (1-D tensors, and matrices where rank r would
save less than ``min_compression``x); the Qs travel in a second one. So each
bucket costs exactly two collectives, launched from one thread, in bucket
order: the ordering bug of torch's hook (callbacks launching the second
collective in completion order) cannot happen.

Tune: ``rank`` (bytes vs. accuracy), ``min_compression``.
Leave on: ``error_feedback`` (without it the bias stalls training),
``warm_start`` (reusing last step's Q makes one power iteration per step
enough). Internal: ``residuals`` (per bucket), ``q`` (per bucket and matrix).

Example::

    PowerSGD(rank=4).reduce(flat, wire, key=0, layout=layout_from_shapes(shapes))
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any

import torch

from ...network.link import allreduce_bytes
from .base import ErrorFeedback, Layout, Piece, Wire, all_finite, host_reads_flags, key_parse, key_str, param_units


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """Columns of p made orthonormal (reduced QR, in fp32); zero columns stay finite.

    QR has no half-precision kernel (CPU: "geqrf_cpu" not implemented for 'BFloat16';
    CUDA neither), so a bf16/fp16 ``p`` is orthonormalised in fp32 and rounded back.
    """
    q, _ = torch.linalg.qr(p if p.dtype in _QR_DTYPES else p.float(), mode="reduced")
    p.copy_(q)
    return p


_QR_DTYPES = (torch.float32, torch.float64)


def orthonormalize_all_(ps: list[torch.Tensor]) -> None:
    """:func:`orthonormalize_` on every matrix of ``ps``, one batched QR per shape.

    ``torch.linalg.qr`` takes a batch (..., m, r) and factorises each matrix of it
    as a call on that matrix alone would: the results are bitwise those of one call
    per matrix (checked in tests/sync/test_half_params.py). What batching saves is
    a call (Python, dispatch; on GPUs the solver's launches) per matrix. Matrices
    that lie end to end in memory (PowerSGD's Ps in its send buffer) are viewed as
    the batch, no copy; others are stacked. Half-precision ones go through fp32.
    """
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for p in ps:
        groups.setdefault(tuple(p.shape), []).append(p)
    for same in groups.values():
        if len(same) == 1:
            orthonormalize_(same[0])
            continue
        batch = _end_to_end(same)
        if batch is None:
            batch = torch.stack(same)
        q, _ = torch.linalg.qr(batch if batch.dtype in _QR_DTYPES else batch.float(), mode="reduced")
        if batch.data_ptr() == same[0].data_ptr():
            batch.copy_(q)
        else:
            for p, qi in zip(same, q.unbind(0)):
                p.copy_(qi)


def _end_to_end(ms: list[torch.Tensor]) -> torch.Tensor | None:
    """``ms`` (contiguous, one shape) as one (len, rows, cols) view when each starts where
    the one before ends in the same storage; else None."""
    first = ms[0]
    n = first.numel()
    for i, m in enumerate(ms):
        if not m.is_contiguous() or m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if m.storage_offset() != first.storage_offset() + i * n:
            return None
    return first.as_strided((len(ms), *first.shape), (n, *first.stride()))


class PowerSGD(ErrorFeedback):
    name = "powersgd"
    collectives_per_call = 2

    def __init__(
        self,
        rank: int = 4,
        min_compression: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if min_compression < 1.0:
            raise ValueError(f"min_compression must be >= 1, got {min_compression}")
        self.rank = rank
        self.min_compression = min_compression
        self.use_error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.q: dict[Hashable, torch.Tensor] = {}  # per parameter (or bucket+matrix)
        # Initial Qs on the device: without warm start every step starts from them, and
        # making one is a host-to-device copy.
        self._q0: dict[tuple[Hashable, tuple[int, int], torch.device, torch.dtype], torch.Tensor] = {}

    # -- pure helpers -------------------------------------------------------------
    def split(self, numel: int, layout: Layout | None) -> tuple[list[Piece], list[Piece]]:
        """(matrices to compress, pieces to send as they are)."""
        if layout is None or sum(p.numel for p in layout) != numel:
            return [], [Piece(0, numel, 1, numel)]
        mats, rest = [], []
        for p in layout:
            r = min(self.rank, p.rows, p.cols)
            if p.is_matrix and p.numel >= self.min_compression * r * (p.rows + p.cols):
                mats.append(p)
            else:
                rest.append(p)
        return mats, rest

    def wire_bytes(self, numel: int, n: int, layout: Layout | None = None, itemsize: int = 4) -> float:
        mats, rest = self.split(numel, layout)
        values = sum(p.numel for p in rest) + sum(min(self.rank, p.rows, p.cols) * (p.rows + p.cols) for p in mats)
        return allreduce_bytes(values * itemsize, n)  # P, Q and the rest travel in the gradients' dtype

    def _initial_q(self, qkey: Hashable, p: Piece, like: torch.Tensor) -> torch.Tensor:
        # Same on every rank without a broadcast: seeded by (seed, parameter or bucket+matrix).
        shape = (p.cols, min(self.rank, p.rows, p.cols))
        cache_key = (qkey, shape, like.device, like.dtype)
        q = self._q0.get(cache_key)
        if q is None:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, qkey)).encode()))
            q = self._q0[cache_key] = torch.randn(*shape, generator=g, dtype=like.dtype).to(like.device)
        return q  # only read: the Q kept for the next step is a new tensor

    def _residual(self, rkey: Hashable, m: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """This matrix's residual storage and whether it holds last step's residual."""
        e = self.residuals.get(rkey)
        if e is None or e.numel() != m.numel() or e.device != m.device:
            e = torch.empty_like(m)
            self.residuals[rkey] = e
            return e, False
        e = e.view(m.shape)
        self.residuals[rkey] = e
        return e, True

    # -- communication -------------------------------------------------------------
    def reduce(self, flat: torch.Tensor, wire: Wire, key: Hashable, layout: Layout | None = None) -> torch.Tensor:
        n = wire.size
        mats, rest = self.split(flat.numel(), layout)
        ms = [flat[p.offset : p.offset + p.numel].view(p.rows, p.cols) for p in mats]
        units = param_units(key, layout)
        if units is not None:
            by_piece = dict(zip(layout, units, strict=True))
            qkeys = [by_piece[p] for p in mats]
        else:
            qkeys = [(key, i) for i in range(len(mats))]
        qs = []
        for qk, p in zip(qkeys, mats, strict=True):
            q = self.q.get(qk) if self.warm_start else None
            if q is None or q.shape != (p.cols, min(self.rank, p.rows, p.cols)):
                q = self._initial_q(qk, p, flat)
            qs.append(q)
        ef = self.use_error_feedback
        track = ef and self.track_signal
        grad_sq = torch.dot(flat.view(-1), flat.view(-1)) if track and mats else None
        # Residual storage per matrix (per parameter when the layout allows; 1-D and small
        # tensors are sent exactly, so they carry none).
        es = [self._residual(qk, m) if ef else (None, False) for qk, m in zip(qkeys, ms, strict=True)]
        # Collective 1: the Ps and the uncompressed pieces, in one buffer.
        rest_numel = sum(p.numel for p in rest)
        rest = _runs(rest)  # adjacent 1-D pieces (a norm's weight and bias) in one copy
        p_sizes = [m.shape[0] * q.shape[1] for m, q in zip(ms, qs, strict=True)]
        buf1 = torch.empty(rest_numel + sum(p_sizes), dtype=flat.dtype, device=flat.device)
        off = 0
        for p in rest:
            buf1[off : off + p.numel].copy_(flat[p.offset : p.offset + p.numel])
            off += p.numel
        ps = []
        # Pass 1: C = G + E in place, then P = C Q. Whole-matrix calls: on one core the
        # BLAS kernels stream a 4 MiB matrix faster than row blocks issued from Python.
        for m, q, size, (e, carried) in zip(ms, qs, p_sizes, es, strict=True):
            out = buf1[off : off + size].view(m.shape[0], q.shape[1])
            if carried:
                m.add_(e)
            torch.matmul(m, q, out=out)
            ps.append(out)
            off += size
        wire.allreduce(buf1)
        off = 0
        for p in rest:
            flat[p.offset : p.offset + p.numel].copy_(buf1[off : off + p.numel]).div_(n)
            off += p.numel
        if not ms:
            return flat
        # Overflow anywhere shows in the summed buffers, the same on every rank: the
        # uncompressed pieces travel as they are, and an inf/NaN in some C reaches its
        # column of Q^T = P^T C (inf*p is +-inf, inf*0 is NaN), so buf2 is non-finite and
        # so is that column of the output P Q^T: every rank's scaler sees the overflow.
        finite = all_finite(buf1)
        orthonormalize_all_(ps)
        # Collective 2: the Qs, stored transposed (r x cols): P^T C reads C row by row,
        # about twice as fast as C^T P on one core.
        buf2 = torch.empty(sum(q.numel() for q in qs), dtype=flat.dtype, device=flat.device)
        new_qs, off = [], 0
        for m, p, q in zip(ms, ps, qs, strict=True):
            qt_out = buf2[off : off + q.numel()].view(q.shape[1], q.shape[0])
            torch.matmul(p.t(), m, out=qt_out)
            new_qs.append(qt_out.t())
            off += q.numel()
        wire.allreduce(buf2)
        buf2.div_(n)
        finite = finite & all_finite(buf2)
        # On CPU the flag is read (nothing to stall): a finite step writes the residual
        # as it always did. Elsewhere the residual goes through a device-side select.
        host = host_reads_flags(finite.device)
        write = bool(finite) if host else True
        # Pass 3: E' = C - P Q^T straight into the residual (one fused addmm), then C = P Q^T.
        rsq = []
        for m, p, q, (e, carried) in zip(ms, ps, new_qs, es, strict=True):
            qt = q.t()
            if e is not None:
                if host and write:
                    torch.addmm(m, p, qt, alpha=-1, out=e)
                elif host:  # overflow step: keep last step's residual
                    if not carried:
                        e.zero_()
                else:  # E' in m for a moment (P Q^T overwrites it below), then a select into E
                    m.addmm_(p, qt, alpha=-1)
                    torch.where(finite, m, e if carried else m.new_zeros(()), out=e)
                if track:
                    ev = e.reshape(-1)
                    rsq.append(torch.dot(ev, ev))
            torch.mm(p, qt, out=m)
        if track:
            self._add_signal(finite, grad_sq, *rsq)
        # An overflow step leaves the warm start where it was.
        for qk, q, old in zip(qkeys, new_qs, qs, strict=True):
            self.q[qk] = torch.where(finite, q, old, out=torch.empty_like(q))
        return flat

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "rank": self.rank,
            "q": {key_str(k): v.clone() for k, v in self.q.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rank = int(state.get("rank", self.rank))
        self._q0 = {}
        self.q = {key_parse(k): v.clone() for k, v in state.get("q", {}).items()}

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + list(self.q.values())


def _runs(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with each stretch of adjacent ones merged into one 1-D piece."""
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].offset + out[-1].numel == p.offset:
            n = out[-1].numel + p.numel
            out[-1] = Piece(out[-1].offset, n, 1, n)
        else:
            out.append(p)
    return out
