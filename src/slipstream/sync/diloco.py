"""DiLoCo: local training with an outer step every H steps, for links far slower than a datacenter's.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023), and its streaming form (Douillard et al. 2025). Each data-parallel replica
trains alone with its own (inner) optimizer for ``inner_steps`` (H) steps: the DDP
comm hook hands every bucket back untouched, so backward sends nothing and each
rank steps on its own gradient. Then, on every rank at the same step, the outer step:

* pseudo-gradient ``delta = theta_outer - theta_local`` (how far this replica moved);
* one all-reduce averages it over the DDP model's process group;
* an outer optimizer, SGD (lr 0.7; Nesterov momentum with ``outer_momentum`` > 0, the
  paper's 0.9; 0 by default, measured better on runs of tens of outer steps: options.py),
  applies it to ``theta_outer``; every replica continues from the new ``theta_outer``. Floating-point buffers (BatchNorm statistics) are averaged too, at
  the end of each period (DDP's per-forward buffer broadcast is switched off).

**Sharded replicas** (``dp_shard`` > 1 with ``dp_replicate`` > 1; :func:`on_sharded_replicas`):
a replica is a ``dp_shard`` group whose model FSDP2 shards over its ranks (and reduces
gradients inside it, on every step: nothing crosses replicas). Each rank keeps the outer
copy and momentum of its own shard only, and the outer all-reduce joins the ranks holding
that shard in the other replicas (the ``dp_replicate`` group of the device mesh): the
same arithmetic as above, element by element, on 1/dp_shard of the model per rank.
Buffers (unsharded) are averaged over the same group; inside a replica they stay as
FSDP2 leaves them. At construction every replica takes the first replica's parameters
and buffers (FSDP2, unlike DDP, broadcasts nothing: replicas that started apart would
keep their distance through every outer step).

With H=1, outer_lr=1 and no momentum this is parameter averaging after every step; with
an inner SGD that is synchronous data-parallel SGD (tested). Otherwise the optimisation
is a different one: the result is not the synchronous run's.

``fragments`` F > 1 (streaming DiLoCo): the parameters are split in F parts of about
equal size, in parameter order, and part f has its outer step at the steps t with
``t mod H == (f+1) H / F mod H``: each outer all-reduce carries 1/F of the model.

The schedule is a function of the count of optimizer steps only (the same on every rank):
the training loop calls :meth:`DiLoCo.after_optimizer_step` after every optimizer step
(``slipstream.accelerate`` and the zero-change adopter do). Checkpoint state (per rank):
the step count, the outer parameters and momentum, and, because replicas differ between
outer steps, this rank's own parameters, buffers and inner-optimizer state (which the
shared checkpoint holds only as one replica's): a resumed run is bitwise the uninterrupted one.

Example::

    handle = sync.apply("diloco", ddp_model, inner_steps=20)     # or, FSDP2 inside replicas:
    # handle = sync.apply_to_replicas("diloco", fsdp_module, mesh.get_group("dp_replicate"), inner_steps=20)
    handle.attach_optimizer(opt)
    for x, y in loader:
        loss_fn(ddp_model(x), y).backward(); opt.step(); opt.zero_grad()
        handle.after_optimizer_step()          # every 20th step: the outer step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..network.link import allreduce_bytes
from .compress import make_codec
from .compress.base import Wire
from .compress.cast import Cast
from .options import SyncOptions

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Parameter indices in ``fragments`` contiguous groups of about equal total size.

    A parameter goes to the fragment its midpoint falls in. Pure.

    Example::

        split_fragments([4, 4, 4, 4], 2)     # [[0, 1], [2, 3]]
    """
    total = sum(numels) or 1
    out: list[list[int]] = [[] for _ in range(fragments)]
    before = 0
    for i, n in enumerate(numels):
        out[min(fragments - 1, int((before + n / 2) * fragments / total))].append(i)
        before += n
    return out


def fragment_phases(inner_steps: int, fragments: int) -> list[int]:
    """The step of the period (t mod H) at which each fragment has its outer step.

    Example::

        fragment_phases(10, 2)     # [5, 0]: fragment 0 at steps 5, 15, ...; fragment 1 at 10, 20, ...
    """
    return [((f + 1) * inner_steps // fragments) % inner_steps for f in range(fragments)]


def _local_gradient_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
    """``(DiLoCo, GradBucket) -> Future[Tensor]``: the bucket as it is, no collective. DDP's
    reducer divides by the world size only when no hook is registered, so each rank keeps
    its own unscaled gradient (tested)."""
    state.count_bucket(bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``: a DTensor's local shard (a view: writing it writes the
    parameter), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class DiLoCo:
    """The ``diloco`` strategy's state, a :class:`~slipstream.sync.SyncHandle` (see the module docstring).

    ``module``: the model (parameters plain, or DTensors sharded inside the replica);
    ``group``: the process group that joins the replicas, each rank with the ranks that
    hold the same values in the other replicas; ``options``: a parsed :class:`SyncOptions`.
    Built by :func:`on_ddp` or :func:`on_sharded_replicas` (through :func:`slipstream.sync.apply`
    and :func:`slipstream.sync.apply_to_replicas`).
    """

    @property
    def steps_between_syncs(self) -> int:
        """H: the ranks meet at every H-th step (a fragment's sync included: the last fragment's is at H)."""
        return self.opts.inner_steps

    def __init__(self, module: nn.Module, group: Any, options: SyncOptions, name: str = "diloco", *,
                 align_replicas: bool = False) -> None:
        self.name = name
        self.opts = options
        self._module = module
        self.group = group
        self.wire = Wire(group)
        codec = "allreduce" if options.outer_codec == "none" else options.outer_codec
        self.codec = make_codec(codec)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if len(named) < options.fragments:
            raise ConfigError(f"fragments({options.fragments}) is more than the model's {len(named)} trainable "
                              "parameter tensors: use fewer fragments")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        # Whole-tensor sizes (a DTensor's numel is the global one): every rank cuts the same fragments.
        self.fragments = split_fragments([p.numel() for p in self.params], options.fragments)
        self.phases = fragment_phases(options.inner_steps, options.fragments)
        if align_replicas:
            self._take_first_replicas()
        with torch.no_grad():
            # Equal in every replica: DDP broadcast rank 0's, or _take_first_replicas did.
            self.outer = [local_part(p).detach().clone() for p in self.params]
        self.momentum: list[torch.Tensor | None] = [None] * len(self.params)
        # overlap_steps > 0: fragments whose outer all-reduce is in flight, by fragment index
        self.pending: dict[int, _InFlight] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        grad_bytes = sum(local_part(p).numel() * p.element_size() for p in self.params)
        self.allreduce_bytes_per_step = allreduce_bytes(grad_bytes, self.wire.size)
        # counters (checkpointed)
        self.step = 0  # optimizer steps seen
        self.outer_steps = 0  # fragment outer steps done
        self.bytes_sent_total = 0.0
        # stats of the last step
        self.last_bytes = 0.0
        self.last_mode = "inner"
        self.backwards = 0  # synchronising backwards the DDP hook saw (none of them communicated)

    @property
    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The model's buffers, by name (looked up when used: a wrapper may have replaced them)."""
        return list(self._module.named_buffers())

    @torch.no_grad()
    def _take_first_replicas(self) -> None:
        """Every rank takes the values its peer in the group's first replica holds (one
        broadcast per dtype, parameters and buffers)."""
        tensors = [local_part(p) for p in self.params] + [b for _, b in self.buffers]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        src = dist.get_global_rank(self.group, 0)
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=self.group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def count_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.backwards += 1

    # --- the schedule -----------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer: its per-rank state goes into :meth:`state_dict` (replicas differ)."""
        self.optimizer = optimizer

    def after_optimizer_step(self) -> None:
        """Count one optimizer step; run the outer step of every fragment due at it. Every rank
        calls it after every optimizer step (a collective on outer steps)."""
        self.step += 1
        phase = self.step % self.opts.inner_steps
        sent_before = self.wire.bytes_sent
        landing = sorted(f for f, flight in self.pending.items() if flight.due == self.step)
        for f in landing:
            self._land(self.pending.pop(f))
        due = [f for f, at in enumerate(self.phases) if at == phase and self.fragments[f]]
        for f in due:
            if self.opts.overlap_steps:
                self.pending[f] = self._start(self.fragments[f], self.step + self.opts.overlap_steps)
            else:
                self._outer_step(self.fragments[f])
        if phase == 0:
            self._average_buffers()
        self.last_bytes = self.wire.bytes_sent - sent_before
        self.bytes_sent_total += self.last_bytes
        self.last_mode = "outer" if (due or landing) else "inner"

    @torch.no_grad()
    def _outer_step(self, indices: list[int]) -> None:
        params = [local_part(self.params[i]) for i in indices]
        flat = torch.cat([(self.outer[i] - p).reshape(-1) for i, p in zip(indices, params)])
        if flat.numel():  # a shard can be empty (uneven sharding); so is its peers' in the group
            flat = self.codec.reduce(flat, self.wire, key=("diloco", indices[0]))
        self._apply(indices, flat)

    @torch.no_grad()
    def _start(self, indices: list[int], due: int) -> "_InFlight":
        """Start the fragment's outer all-reduce (overlap_steps > 0); it lands at step ``due``."""
        params = [local_part(self.params[i]) for i in indices]
        flat = torch.cat([(self.outer[i] - p).reshape(-1) for i, p in zip(indices, params)])
        flight = _InFlight(indices, due, flat)
        if flat.numel():
            flight.payload = self.codec.encode(flat, self.wire.size) if isinstance(self.codec, Cast) else flat
            flight.work = self.wire.allreduce_async(flight.payload)
        else:
            flight.reduced = True
        return flight

    def _finish(self, flight: "_InFlight") -> None:
        """Wait for the fragment's all-reduce; ``flight.flat`` then holds the averaged pseudo-gradient."""
        if flight.reduced:
            return
        if flight.work is not None:
            flight.work.wait()
        if isinstance(self.codec, Cast):
            self.codec.decode(flight.payload, flight.flat, self.wire.size)
        else:
            flight.flat.div_(self.wire.size)
        flight.work = flight.payload = None
        flight.reduced = True

    @torch.no_grad()
    def _land(self, flight: "_InFlight") -> None:
        self._finish(flight)
        self._apply(flight.indices, flight.flat)

    def _apply(self, indices: list[int], flat: torch.Tensor) -> None:
        """The outer optimizer's step on the averaged pseudo-gradient ``flat`` of the fragment's
        parameters; the replica then takes the new outer values (``overlap_mix`` 0) or mixes them in."""
        params = [local_part(self.params[i]) for i in indices]
        lr, mu = self.opts.outer_lr, self.opts.outer_momentum
        offset = 0
        for i, p in zip(indices, params):
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            update = g
            if mu > 0.0:
                buf = self.momentum[i]
                if buf is None:
                    buf = self.momentum[i] = g.clone()  # torch's SGD: the first buffer is the gradient
                else:
                    buf.mul_(mu).add_(g)
                update = g.add(buf, alpha=mu) if self.opts.outer_nesterov else buf
            self.outer[i].add_(update, alpha=-lr)
            if self.opts.overlap_mix:
                p.lerp_(self.outer[i], 1.0 - self.opts.overlap_mix)
            else:
                p.copy_(self.outer[i])
        self.outer_steps += 1

    @torch.no_grad()
    def _average_buffers(self) -> None:
        floats = [b for _, b in self.buffers if b.is_floating_point() and b.numel()]
        if not floats:
            return
        flat = torch.cat([b.reshape(-1) for b in floats])
        flat = self.codec.reduce(flat, self.wire, key=("diloco", "buffers"))
        offset = 0
        for b in floats:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    # --- SyncHandle ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        would_send = self.allreduce_bytes_per_step * self.step
        return {
            "sync_strategy": self.name,
            "sync_mode": self.last_mode,
            # DDP: backwards its hook saw; sharded: FSDP2 reduces inside the replica at every step
            "sync_steps": self.step if self.sharded else self.backwards,
            "sync_bytes_sent": self.last_bytes,
            "sync_uncompressed_bytes": self.allreduce_bytes_per_step,
            "sync_bytes_sent_total": self.bytes_sent_total,
            # over the run so far: what all-reduce at every step would have sent / what was sent
            "sync_compression_ratio": would_send / self.bytes_sent_total if self.bytes_sent_total else 1.0,
            "sync_outer_steps": self.outer_steps,
            "sync_decision": self.decision_summary(),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as plain tensors (a sharded parameter's: its local shard)."""
        inner, sharded = optimizer_state_local(self.optimizer) if self.optimizer is not None else (None, [])
        return {
            "name": self.name,
            "step": self.step,
            "outer_steps": self.outer_steps,
            "bytes_sent_total": self.bytes_sent_total,
            "outer": dict(zip(self.names, self.outer)),
            "momentum": {n: m for n, m in zip(self.names, self.momentum) if m is not None},
            "local": {n: local_part(p).detach() for n, p in zip(self.names, self.params)},
            "buffers": dict(self.buffers),
            "inner_optimizer": inner,
            "inner_optimizer_sharded": sharded,
            # overlap_steps: fragments in flight, reduced (waited for here) but not yet applied
            "in_flight": {f: {"due": flight.due, "reduced": self._reduced(flight)} for f, flight in self.pending.items()},
        }

    def _reduced(self, flight: "_InFlight") -> torch.Tensor:
        self._finish(flight)
        return flight.flat

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's state, its own parameters, buffers and inner-optimizer state
        included (loaded after the shared checkpoint, which holds one replica's)."""
        missing = sorted(set(self.names) - set(state["outer"]))
        if missing:
            raise ConfigError(f"the diloco checkpoint state has no outer copy of {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}: it was written for another model")
        for n, mine in zip(self.names, self.outer):
            saved = state["outer"][n]
            if saved.shape != mine.shape:
                raise ConfigError(f"the diloco checkpoint state holds {n} as {tuple(saved.shape)} on this rank, "
                                  f"which holds {tuple(mine.shape)}: it was written by another layout "
                                  "(dp_shard/dp_replicate)")
        self.step = int(state["step"])
        self.outer_steps = int(state.get("outer_steps", 0))
        self.bytes_sent_total = float(state.get("bytes_sent_total", 0.0))
        for i, n in enumerate(self.names):
            self.outer[i].copy_(state["outer"][n])
            local_part(self.params[i]).copy_(state["local"][n])
            m = state["momentum"].get(n)
            self.momentum[i] = None if m is None else m.to(self.outer[i].device, copy=True)
        for n, b in self.buffers:
            if n in state.get("buffers", {}):
                b.copy_(state["buffers"][n])
        if self.optimizer is not None and state.get("inner_optimizer") is not None:
            load_optimizer_state_local(self.optimizer, state["inner_optimizer"],
                                       state.get("inner_optimizer_sharded", []))
        self.close()
        self.pending = {}
        for f, saved in state.get("in_flight", {}).items():
            f = int(f)
            if not 0 <= f < len(self.fragments):
                raise ConfigError(f"the diloco checkpoint state has fragment {f} in flight, and this run has "
                                  f"{len(self.fragments)} fragments: it was written with other options")
            flight = _InFlight(self.fragments[f], int(saved["due"]), saved["reduced"].to(self.outer[0].device, copy=True))
            flight.reduced = True
            self.pending[f] = flight

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """No convergence guard: nothing is compressed with error feedback."""

    def request_probe(self) -> None:
        """Nothing here depends on the link."""

    def decision_summary(self) -> str:
        o = self.opts
        frag = f", {o.fragments} fragments" if o.fragments > 1 else ""
        codec = f", outer {o.outer_codec}" if o.outer_codec != "none" else ""
        shards = " on sharded replicas" if self.sharded else ""
        overlap = f", overlapped {o.overlap_steps} step(s)" if o.overlap_steps else ""
        mix = f", mix {o.overlap_mix}" if o.overlap_mix else ""
        return (f"diloco (H={o.inner_steps}, outer lr {o.outer_lr} momentum {o.outer_momentum}{frag}{codec}"
                f"{overlap}{mix}){shards}")

    def use_loss_scale(self, scale: Callable[[], torch.Tensor | None] | None) -> None:
        """Gradients are not sent: the scale does not matter."""

    def close(self) -> None:
        """Wait for any outer all-reduce still in flight (overlap_steps): nothing is left
        running on the group."""
        for flight in self.pending.values():
            self._finish(flight)

    def leave(self) -> None:
        """Healing in place, the group destroyed: an outer all-reduce in flight is dropped, not
        waited for (its peer is gone; the snapshot's state, loaded next, holds what was reduced
        by then), and the group is let go so its sockets close."""
        self.pending = {}
        self.group = self.wire.group = None

    def rejoined(self, group: Any = None) -> None:
        """Healing in place: the outer step runs over ``group`` from now on (None: the new default
        group, the DDP model's; on sharded replicas the mesh's new ``dp_replicate`` group). Its
        size is the old one's (the same ranks came back). No collective: the schedule, the outer
        copy and momentum, this rank's parameters and inner-optimizer state come back from the
        snapshot (:meth:`load_state_dict`)."""
        group = dist.group.WORLD if group is None else group
        size = dist.get_world_size(group)
        if size != self.wire.size:
            raise ValueError(f"diloco rejoined a group of {size} ranks; it joined {self.wire.size}")
        self.pending = {}
        self.group = self.wire.group = group


class _InFlight:
    """One fragment's outer all-reduce started at some step and applied at ``due``."""

    __slots__ = ("indices", "due", "flat", "payload", "work", "reduced")

    def __init__(self, indices: list[int], due: int, flat: torch.Tensor) -> None:
        self.indices, self.due, self.flat = indices, due, flat
        self.payload: torch.Tensor | None = None
        self.work: Any = None
        self.reduced = False


def on_ddp(ddp_model: DistributedDataParallel, options: SyncOptions) -> DiLoCo:
    """DiLoCo over the DDP model's ranks, each its own replica: a comm hook that sends nothing,
    and DDP's per-forward buffer broadcast switched off (buffers are averaged with the
    parameters at the end of each period instead of sending rank 0's at every step)."""
    state = DiLoCo(ddp_model.module, ddp_model.process_group, options)
    ddp_model.broadcast_buffers = False
    ddp_model.register_comm_hook(state, _local_gradient_hook)
    return state


def on_sharded_replicas(module: nn.Module, replica_group: Any, options: SyncOptions) -> DiLoCo:
    """DiLoCo over replicas that FSDP2 shards inside (``module``'s parameters are DTensors
    over the replica's ``dp_shard`` ranks, gradients reduced there): the outer step runs over
    ``replica_group`` (the mesh's ``dp_replicate`` group), shard by shard. Collective over
    ``replica_group``: every replica starts from the first one's parameters and buffers."""
    return DiLoCo(module, replica_group, options, align_replicas=True)


# --- the inner optimizer's state, with sharded entries as local tensors ------------------------

def optimizer_state_local(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[list[Any]]]:
    """``optimizer.state_dict()`` with each DTensor entry (AdamW's moments of a sharded
    parameter) replaced by its local shard, and the ``[index, key]`` of those entries:
    plain tensors, which a per-rank file holds and loads with ``weights_only``."""
    sd = optimizer.state_dict()
    sharded: list[list[Any]] = []
    state: dict[Any, dict[str, Any]] = {}
    for index, entry in sd["state"].items():
        state[index] = {}
        for key, value in entry.items():
            if isinstance(value, DTensor):
                sharded.append([index, key])
                value = value.to_local()
            state[index][key] = value
    return {**sd, "state": state}, sharded


def load_optimizer_state_local(optimizer: torch.optim.Optimizer, sd: dict[str, Any], sharded: list[list[Any]]) -> None:
    """Load what :func:`optimizer_state_local` returned: the listed entries become DTensors
    again, on their parameter's mesh and placements."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: dict(entry) for index, entry in sd["state"].items()}
    for index, key in sharded:
        p = params[int(index)]
        if not isinstance(p, DTensor):
            raise ConfigError(f"the diloco checkpoint state holds sharded optimizer state ({key}) of parameter "
                              f"{index}, which is not sharded here: it was written by another layout")
        state[index][key] = DTensor.from_local(state[index][key].to(p.device), p.device_mesh, p.placements,
                                               run_check=False, shape=p.shape, stride=p.stride())
    optimizer.load_state_dict({**sd, "state": state})


__all__ = ["DiLoCo", "fragment_phases", "load_optimizer_state_local", "local_part", "on_ddp", "on_sharded_replicas",
           "optimizer_state_local", "split_fragments"]
