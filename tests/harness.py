"""The one rank-spawning harness of the tests: run a function in N processes, collect what each returns.

The function is called as ``fn(rank, world_size, *args)`` after the torchrun
environment is set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), so ``slipstream.init()`` inside it joins the group. With
``local_world_size`` smaller than the world, ranks are laid out as several
"nodes" of that many ranks each (what the hierarchical sync tests need).
Processes are forked from a ``forkserver`` that imported torch once (see
``PRELOAD``), so a rank starts without paying torch's import again; ``fn`` must be
importable at the top level of a module under ``tests/`` (``tests.<package>.<module>``).
Each rank gets the caller's environment as it is at the call, as under ``spawn``.

Example::

    from tests.harness import run_ranks
    sums = run_ranks(all_reduce_one, 2)          # [2.0, 2.0]
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once, before it forks any rank: torch and what every rank of
# these tests imports next (DistributedDataParallel imports torch._dynamo in its constructor,
# 1.9 s of CPU; the checkpoint package imports DCP). Measured on 2 cores: a spawned rank spent
# 3-6 s of CPU before its first line, most of it these imports, and the suite starts hundreds.
# No slipstream module: one that read the environment at import would read the server's.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "numpy", "pytest"]


def _context() -> Any:
    """A forkserver context with PRELOAD imported in the server. The server forks before any
    rank has run a thread pool or a collective, so the forked ranks start clean."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _CallersFd:
    """The caller's stdout or stderr, sent to the rank (a forked rank holds the forkserver's,
    from its start; a test that reads its ranks' output with capfd needs the caller's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return dup.detach()


def _entry(fn, rank, world_size, local_world_size, port, caller, extra_env, args, results) -> None:
    caller_env, caller_out, caller_err = caller
    os.dup2(caller_out, 1)
    os.dup2(caller_err, 2)
    os.close(caller_out)
    os.close(caller_err)
    # A forked rank holds the forkserver's environment (from its start); give it the caller's.
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    os.environ.update(extra_env)
    try:
        import torch

        from tests.gpu_defaults import take_gpu_optimizer_defaults

        torch.set_num_threads(1)
        take_gpu_optimizer_defaults()  # optimizers as on a GPU: foreach by default
        value = fn(rank, world_size, *args)
        # Serialised to bytes: a tensor put on the queue directly would be
        # shared through a file descriptor that dies with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _next_result(results: Any, procs: list, reported: dict, deadline: float) -> tuple[int, str, Any]:
    """The next rank's report; a rank that died without one fails at once (not at the deadline)."""
    while True:
        try:
            return results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                raise
        dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]
        if dead:
            try:  # its report may still be in the pipe
                return results.get(timeout=2)
            except queue.Empty:
                return dead[0], "error", f"exited with code {procs[dead[0]].exitcode} without reporting a result"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = 180,
    local_world_size: int | None = None,
) -> list[Any]:
    """Return ``[fn's result on rank 0, rank 1, ...]``; raise if any rank failed (its traceback in the message)."""
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"world_size({world_size}) is not a multiple of local_world_size({local_world_size})")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), _CallersFd(1), _CallersFd(2))
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, local_world_size, port, caller, env or {}, args, results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(world_size):
            rank, status, value = _next_result(results, procs, out, deadline)
            if status == "ok":
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s} s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def weights_difference(path: Any, reference: Any, limit: int = 8) -> str:
    """What differs between two saved state_dicts, as text for an assertion message; "" when they
    are bitwise equal. Names the tensors missing on either side, and for each differing tensor its
    count of differing elements and the largest absolute difference, so an intermittent bitwise
    failure says whether it is one rounding (1e-7 on a few elements: an order of summation) or a
    lost or repeated step (every tensor, by the learning rate's scale).

    Example::

        assert (diff := weights_difference(out / "model.pt", base / "model.pt")) == "", diff
    """
    import torch

    got, ref = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    lines = [f"only in {path}: {name}" for name in sorted(set(got) - set(ref))]
    lines += [f"only in {reference}: {name}" for name in sorted(set(ref) - set(got))]
    differing = 0
    for name in sorted(set(got) & set(ref)):
        a, b = got[name].detach().cpu(), ref[name].detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            lines.append(f"{name}: {a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}")
            continue
        if torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):  # bits: NaN too
            continue
        differing += 1
        if differing <= limit:
            d = (a.double() - b.double()).abs()
            lines.append(f"{name}: {int((d > 0).sum())} of {a.numel()} elements differ, max |diff| {float(d.max()):.3g}"
                         f" (max |value| {float(b.double().abs().max()):.3g})")
    if differing > limit:
        lines.append(f"... {differing - limit} more differing tensors")
    if lines:
        lines.insert(0, f"{differing} of {len(set(got) & set(ref))} shared tensors differ:")
    return "\n".join(lines)


