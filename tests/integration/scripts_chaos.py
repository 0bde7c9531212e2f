"""Kill-anywhere injection for the fault-injection worker (scripts_ft_train.py --chaos).

``--chaos R:S:PHASE[:SIG][,...]`` delivers SIG (KILL, the default, or STOP) to rank R's
training process while PHASE is really running during the iteration of step S (the loop's
``run.step_count`` at the top of the iteration), once each: a marker file
``chaos_R_S_PHASE`` in OUT is created (exclusively) first, so a replacement that runs the
same step again does not fire it again. The phases, each reached by wrapping the function
that runs it (test-side only; the product has no hook for this):

* ``data``: while the step's samples are being built (the script calls :meth:`Chaos.point`);
* ``forward``: a forward pre-hook on the model's last layer (half the forward done);
* ``backward``: a backward pre-hook on the model's last layer (autograd running, the last
  layer's gradients not computed, so no gradient all-reduce launched yet; a module hook, since
  FSDP2 replaces the parameters and a hook on the weight would never fire);
* ``comm-hook``: inside DDP's comm hook, once the bucket's all-reduce is in flight (the
  script's ``--wrap-comm-hook`` wraps the strategy's hook, or registers torch's
  ``allreduce_hook`` when the strategy has none: give it to the reference run too);
* ``optimizer``: an optimizer step pre-hook (inside ``optimizer.step()``);
* ``save``: inside DCP's ``FileSystemWriter.write_data`` of the disk checkpoint that
  step S's ``run.step()`` writes, this rank's data on disk, the checkpoint unfinished;
* ``snapshot``: inside the in-memory snapshot step S's ``run.step()`` takes, the slot
  filled, its index not committed;
* ``peer-copy``: inside the background peer copy's exchange (only where one runs);
* ``heal``: at the entry of ``Healer._join`` of generation S (S is a generation here: a
  second failure while the group forms again).
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

PHASES = ("data", "forward", "backward", "comm-hook", "optimizer", "save", "snapshot", "peer-copy", "heal")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


class Chaos:
    """The faults of one rank's process, parsed from ``--chaos``."""

    def __init__(self, spec: str, out: str, rank: int) -> None:
        self.out, self.rank = out, rank
        self.step = -1  # the loop's current step (set by the script)
        self.faults: dict[tuple[int, str], int] = {}
        for item in filter(None, spec.split(",")):
            parts = item.split(":")
            if len(parts) not in (3, 4) or parts[2] not in PHASES or (len(parts) == 4 and parts[3] not in SIGNALS):
                raise SystemExit(f"--chaos: {item!r} is not R:S:PHASE[:KILL|STOP] with PHASE one of {PHASES}")
            if int(parts[0]) == rank:
                self.faults[(int(parts[1]), parts[2])] = SIGNALS[parts[3] if len(parts) == 4 else "KILL"]

    def point(self, phase: str, step: int | None = None) -> None:
        """Deliver the fault of ``phase`` at ``step`` (default: the loop's) if one is due and not yet fired."""
        step = self.step if step is None else step
        signum = self.faults.get((step, phase))
        if signum is None:
            return
        try:
            os.close(os.open(os.path.join(self.out, f"chaos_{self.rank}_{step}_{phase}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # fired before, by this rank's predecessor
            return
        os.kill(os.getpid(), signum)

    def wants(self, phase: str) -> bool:
        return any(p == phase for _, p in self.faults)

    # --- wrapping the phases --------------------------------------------------------------------
    def install_early(self) -> None:
        """Before slipstream.init(): the phases that run inside the product's own functions."""
        if self.wants("heal"):
            from slipstream.resilience import heal

            real_join = heal.Healer._join

            def join(healer: Any, generation: int) -> None:
                self.point("heal", generation)
                real_join(healer, generation)

            heal.Healer._join = join
        if self.wants("save"):
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            real_write = FileSystemWriter.write_data

            def write_data(writer: Any, plan: Any, planner: Any) -> Any:
                fut = real_write(writer, plan, planner)
                fut.wait()  # this rank's data on disk, the checkpoint not finished
                self.point("save")
                return fut

            FileSystemWriter.write_data = write_data
        if self.wants("snapshot"):
            from slipstream.checkpoint.snapshots import Slots

            real_commit = Slots.commit

            def commit(slots: Any, step: int, slot: int, index: bytes) -> None:
                self.point("snapshot")  # the slot's bytes copied, its index not written
                real_commit(slots, step, slot, index)

            Slots.commit = commit
        if self.wants("peer-copy"):
            from slipstream.checkpoint.peer import PeerCopy

            real_exchange = PeerCopy._exchange

            def exchange(copy: Any, step: int, buffer: Any, index: bytes) -> None:
                self.point("peer-copy", step - 1)  # the snapshot of step S+1 is step S's
                real_exchange(copy, step, buffer, index)

            PeerCopy._exchange = exchange

    def install_on_model(self, model: Any) -> None:
        """Before accelerate(): forward and backward hooks on the plain model's last layer."""
        last = [m for m in model.modules() if hasattr(m, "weight") and m.weight is not None][-1]
        if self.wants("forward"):
            last.register_forward_pre_hook(lambda _m, _args: self.point("forward"))
        if self.wants("backward"):  # a module hook: FSDP2 swaps the parameters for DTensors, not the modules
            last.register_full_backward_pre_hook(lambda _m, _grad_output: self.point("backward"))

    def install_on_run(self, run: Any) -> None:
        """After accelerate(): the optimizer step."""
        if self.wants("optimizer"):
            run.optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.point("optimizer"))

    def comm_hook(self, inner: Any) -> Any:
        """``inner`` (a DDP comm hook) with the ``comm-hook`` fault once its all-reduce is in flight."""
        @functools.wraps(inner)  # DDP checks the hook's annotations (inspect follows __wrapped__)
        def hook(state, bucket):
            fut = inner(state, bucket)
            self.point("comm-hook")
            return fut

        return hook


def wrap_comm_hooks(chaos: Chaos) -> list:
    """Before accelerate(): every comm hook a strategy registers goes through ``chaos``. Returns
    the list the registered hooks are appended to (empty after accelerate(): no strategy hook)."""
    from torch.nn.parallel import DistributedDataParallel

    registered: list = []
    real_register = DistributedDataParallel.register_comm_hook

    def register(ddp: Any, state: Any, hook: Any) -> None:
        registered.append(hook)
        real_register(ddp, state, chaos.comm_hook(hook))

    DistributedDataParallel.register_comm_hook = register
    return registered


def default_comm_hook(chaos: Chaos, ddp: Any) -> None:
    """After accelerate(), when no strategy registered a hook: torch's ``allreduce_hook`` (the
    default reduction, written in Python) with the fault. Its state None: it reduces over the
    default group of the moment, so it follows a heal's new group."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(ddp, DistributedDataParallel):  # FSDP2 has no comm hook: the phase does not apply there
        ddp.register_comm_hook(None, allreduce_hook)
