"""The checks on the checker: each breach of the collective rule that
``tests/sync/strict_collectives.py`` exists for, injected on a one-rank gloo
group in this process, is caught; a clean run of the same shapes is not.

The cases are the ones the checker was once blind to: a float32 host-side
figure on a data group (``torch.tensor([...])``'s default dtype), a group or
backend passed by position, a ``ProcessGroup`` method called directly, a
figure built in another thread or inside a DDP comm hook, and a tensor on the
wrong device (simulated with the ``meta`` device, since this machine has one).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.sync.strict_collectives import DEVICE, HOST, StrictCollectives, placement

TIMEOUT_S = 123.0


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized(), "another test left a default process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def strict(data_device: str = "cpu") -> Iterator[StrictCollectives]:
    s = StrictCollectives(torch.device(data_device), TIMEOUT_S).install()
    try:
        yield s
    finally:
        s.uninstall()


def control_group():
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))


def device_tensor() -> torch.Tensor:
    """A gradient of a parameter: what lives on the training device on a GPU machine."""
    p = nn.Parameter(torch.ones(4))
    (p * 3).sum().backward()
    return p.grad


def caught(s: StrictCollectives, *words: str) -> None:
    assert s.violations, "the violation was not seen"
    assert all(any(w in v for v in s.violations) for w in words), s.violations


# -- each violation, injected --------------------------------------------------------------


def test_float32_host_figure_on_a_data_group():
    with strict() as s:
        figure = torch.tensor([1.0, 2.0])  # float32: torch.tensor's default
        assert figure.dtype == torch.float32 and placement(figure) == HOST
        dist.all_reduce(figure)
    caught(s, "dist.all_reduce on a data group with a tensor the host built", "torch.float32")


def test_host_figure_after_arithmetic_on_a_data_group():
    with strict() as s:
        votes = torch.zeros(3)
        votes[1] = 1.0
        dist.all_reduce((votes / 2).to(torch.float32))
    caught(s, "tensor the host built")


def test_float64_figure_on_a_data_group():
    with strict() as s:
        dist.all_reduce(torch.tensor([1.0], dtype=torch.float64, device=torch.device("cpu")))
    caught(s, "float64 host-side figure")


def test_group_passed_by_position():
    with strict() as s:
        control = control_group()
        dist.all_reduce(device_tensor(), dist.ReduceOp.SUM, control)
    caught(s, "dist.all_reduce on a host (gloo) group with a tensor from the training device")


def test_backend_passed_by_position_makes_a_host_group():
    with strict() as s:
        control = dist.new_group([0], datetime.timedelta(seconds=TIMEOUT_S), "gloo")
        dist.broadcast(device_tensor(), 0, control)
    caught(s, "dist.broadcast on a host (gloo) group")


def test_timeout_of_a_group_passed_by_position():
    with strict() as s:
        short = dist.new_group(timeout=datetime.timedelta(seconds=7))  # not the configured timeout
        dist.all_reduce(device_tensor(), dist.ReduceOp.SUM, short)
    caught(s, "timeout is 0:00:07")


@pytest.mark.parametrize("method", ["allreduce", "broadcast", "allgather"])
def test_process_group_methods(method):
    with strict() as s:
        pg = dist.group.WORLD
        figure = torch.tensor([1.0, 2.0])
        if method == "allreduce":
            pg.allreduce([figure]).wait()
        elif method == "broadcast":
            pg.broadcast([figure]).wait()
        else:
            pg.allgather([[torch.empty(2, device=torch.device("cpu"))]], [figure]).wait()
    caught(s, f"ProcessGroup.{method} on a data group with a tensor the host built")


def test_device_tensor_on_a_host_group_through_a_process_group_method():
    with strict() as s:
        control = control_group()
        control.allreduce([device_tensor()]).wait()
    caught(s, "ProcessGroup.allreduce on a host (gloo) group with a tensor from the training device")


def test_host_figure_built_in_another_thread():
    with strict() as s:
        def work() -> None:
            dist.all_reduce(torch.tensor([float(threading.get_ident() % 7)]))

        t = threading.Thread(target=work)
        t.start()
        t.join()
    caught(s, "tensor the host built")


def test_host_figure_built_in_a_comm_hook():
    with strict() as s:
        model = DDP(nn.Linear(4, 2))

        def hook(state, bucket):
            dist.all_reduce(torch.tensor([float(bucket.index())]))  # a host count on the data group
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)
        model(torch.randn(3, 4)).sum().backward()
    caught(s, "tensor the host built")


def test_tensor_on_another_device_on_a_data_group():
    # What a CPU tensor on NCCL is on a GPU machine: a device other than the data device.
    with strict(data_device="meta") as s:
        dist.all_reduce(device_tensor())
    caught(s, "dist.all_reduce on a data group with a tensor on cpu (data device meta)")


def test_tensor_off_the_cpu_on_a_host_group():
    with strict() as s:
        control = control_group()
        with contextlib.suppress(Exception):  # whether gloo takes it or not, the checker saw it first
            dist.all_reduce(torch.empty(2, device="meta"), group=control)
    caught(s, "host (gloo) group with a tensor on meta")


# -- the clean shapes pass ---------------------------------------------------------------


def test_a_clean_run_passes():
    from slipstream.sync.control import ControlWire

    with strict() as s:
        control = control_group()
        wire = ControlWire(control)
        model = DDP(nn.Linear(4, 2))

        def hook(state, bucket):
            buf = bucket.buffer()
            assert placement(buf) == DEVICE
            count = torch.ones(1, device=buf.device)  # a figure placed on the data device
            dist.all_reduce(count)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)
        for _ in range(2):
            loss = model(torch.randn(3, 4)).sum()
            loss.backward()
            # Host figures on the host group, as ControlWire builds them; a device value
            # read back to the host first.
            wire.agree([1.0, 2.0])
            dist.all_reduce(loss.detach().cpu(), group=control)
            dist.all_reduce(loss.detach())  # the loss, on the data group, stays on the device
        dist.all_gather_object([None], {"a": 1})  # torch's own object collectives
        dist.broadcast_object_list([1], src=0, group=control)
        dist.all_reduce(torch.zeros(2, device=torch.device("cpu")))  # placed explicitly: not judged
    assert s.violations == []
    kinds = {(c[0], c[1], c[4]) for c in s.calls}
    assert ("dist.all_reduce", "host", "host") in kinds and ("dist.all_reduce", "data", "device") in kinds, kinds
    # dist.all_reduce reaches ProcessGroup.allreduce inside torch: one call, checked once.
    assert not any(c[0].startswith("ProcessGroup.") for c in s.calls)


def test_uninstall_restores_torch():
    originals = (dist.all_reduce, dist.new_group, dist.ProcessGroup.__dict__["allreduce"],
                 DDP.register_comm_hook, threading.Thread._bootstrap_inner)
    with strict():
        assert dist.all_reduce is not originals[0]
    assert (dist.all_reduce, dist.new_group, dist.ProcessGroup.__dict__["allreduce"],
            DDP.register_comm_hook, threading.Thread._bootstrap_inner) == originals
    dist.barrier()  # the ProcessGroup methods still bind after the restore
    assert torch.overrides._get_current_function_mode_stack() == []
