"""In-memory snapshots (slipstream.checkpoint.snapshots), in one process: what a restarted worker
loads, what it never loads, and what the launcher deletes. The restart itself, through the elastic
agent at 2 ranks, is tests/integration/test_fault_tolerance.py's in-memory case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from slipstream.checkpoint import snapshots
from tests.conftest import require_root
from slipstream.checkpoint.snapshots import MemorySnapshots
from slipstream.checkpoint.states import ModelOptimizerState, RNGState


def trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def env(tmp_path, restart: int) -> dict[str, str]:
    return {"SLIPSTREAM_SNAPSHOT_DIR": str(tmp_path), "TORCHELASTIC_RESTART_COUNT": str(restart)}


def test_a_restart_loads_the_newest_snapshot_bitwise_and_keeps_two(tmp_path):
    model, optimizer = trained(0, 3)
    snaps = MemorySnapshots.for_run("ckpt", 0, 1, every_steps=1, environ=env(tmp_path, 0))
    torch.manual_seed(123)
    for step in (1, 2, 3):
        snaps.take(step, {"mo": ModelOptimizerState(model, optimizer)}, {"rng": RNGState()})
    assert snaps.steps() == [2, 3] and len(snaps.stall_s) == 3
    assert oct(os.stat(snaps.directory).st_mode & 0o777) == "0o700"
    expected_draw = torch.rand(5)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]

    other, other_optimizer = trained(1, 1)  # the restarted worker: a fresh model, other values
    again = MemorySnapshots.for_run("ckpt", 0, 1, every_steps=1, environ=env(tmp_path, 1))
    step = again.agreed_newest()
    assert step == 3
    again.load(step, {"mo": ModelOptimizerState(other, other_optimizer)}, {"rng": RNGState()})
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    assert all(torch.equal(other_optimizer.state[p]["exp_avg"], m) for p, m in zip(other.parameters(), want_moments))
    assert torch.equal(torch.rand(5), expected_draw)  # the RNG stream goes on where the snapshot left it


def test_a_new_job_on_the_same_directory_never_loads_an_earlier_jobs_snapshot(tmp_path):
    model, optimizer = trained(0, 1)
    MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0)).take(7, {"mo": ModelOptimizerState(model, optimizer)}, {})
    assert MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0)).agreed_newest() is None  # a new job
    # nor a first attempt reading what is there, nor another checkpoint directory or world size
    MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0)).take(7, {"mo": ModelOptimizerState(model, optimizer)}, {})
    assert MemorySnapshots.for_run("other", 0, 1, 1, environ=env(tmp_path, 1)).agreed_newest() is None
    assert MemorySnapshots.for_run("ckpt", 0, 2, 1, environ=env(tmp_path, 1)).agreed_newest() is None
    assert MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 1)).agreed_newest() == 7


def test_an_agent_that_joined_again_keeps_its_workers_snapshots(tmp_path):
    """The rendezvous host's node lost: the other node's launcher runs a new agent (restart count
    0 again) with SLIPSTREAM_AGENT_REJOINS set; its workers are not a new job's."""
    model, optimizer = trained(0, 1)
    MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0)).take(7, {"mo": ModelOptimizerState(model, optimizer)}, {})
    rejoined = {**env(tmp_path, 0), "SLIPSTREAM_AGENT_REJOINS": "1"}
    assert MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=rejoined).agreed_newest() == 7


def test_a_snapshot_cut_short_is_not_a_snapshot(tmp_path):
    """A worker killed while copying into a slot (its index already deleted) or while writing the
    index (a .tmp left behind) leaves that slot out; the other slot's step stays loadable."""
    snaps = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0))
    model, optimizer = trained(0, 1)
    state = {"mo": ModelOptimizerState(model, optimizer)}
    for step in (3, 4, 5):
        snaps.take(step, state, {})
    assert snaps.steps() == [4, 5]
    os.remove(os.path.join(snaps.directory, "step_00000004.slot1"))  # step 6 began to overwrite slot 1 ...
    with open(os.path.join(snaps.directory, "step_00000006.slot1.tmp"), "wb") as fh:  # ... and died in its index
        fh.write(b"\x80\x02partial")
    again = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 1))
    assert again.agreed_newest() == 5
    again.load(5, state, {})


def test_a_pickled_object_in_a_snapshot_index_is_refused(tmp_path):
    snaps = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0))
    snaps.take(1, {"m": nn.Linear(2, 2)}, {})
    index = os.path.join(snaps.directory, "step_00000001.slot0")
    torch.save({"size": 64, "places": [], "tree": {"shared": {"m": ValueError("x")}, "per_rank": {}}}, index)
    with pytest.raises(Exception, match="Weights only load failed"):
        snaps.load(1, {}, {})


@pytest.mark.parametrize("features,steps", [(100, 2), (200, 1)])
def test_too_little_tmpfs_turns_snapshots_off_with_one_warning(features, steps, tmp_path, caplog):
    """64 KiB of tmpfs: one snapshot of 40 kB fits, not two (the second slot's reservation fails);
    one of 80 kB does not fit at all (the first one's fails)."""
    require_root("mounting a tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        model = nn.Linear(features, 100)
        snaps = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(small, 0))
        for step in range(1, steps + 1):
            snaps.take(step, {"m": model}, {})
        assert not snaps.enabled and not snaps.due(2) and snaps.steps() == []
        assert "in-memory snapshots are off for rank 0" in caplog.text and "recovery uses disk checkpoints" in caplog.text
        assert "No space left on device" in caplog.text and caplog.text.count("snapshots are off") == 1, caplog.text
        assert not [p for p in small.rglob("*") if p.is_file()]  # the memory given back
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


def test_the_launcher_deletes_its_own_and_dead_launchers_snapshots(tmp_path):
    environ = env(tmp_path, 0)
    mine = MemorySnapshots.for_run("a", 0, 1, 1, environ=environ)  # owner: this process's parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = MemorySnapshots.for_run("b", 0, 1, 1, environ=environ)
    with open(os.path.join(gone.directory, "owner"), "w") as fh:
        fh.write(f"{dead.pid} ")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = MemorySnapshots.for_run("c", 0, 1, 1, environ=environ)
        with open(os.path.join(other.directory, "owner"), "w") as fh:
            fh.write(f"{alive.pid} ")
        assert snapshots.sweep(environ) == [gone.directory]  # a launcher starting: the dead one's only
        assert sorted(snapshots.sweep(environ, owner=os.getppid())) == [mine.directory]  # ours, at exit
        assert os.path.isdir(other.directory)
    finally:
        alive.kill()
        alive.wait()


def test_a_sharded_tensor_comes_back_on_its_mesh(tmp_path):
    """FSDP2/TP state is DTensors: the snapshot holds the local shard and the load rebuilds it."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])

        class Holder:
            def __init__(self, t):
                self.t = t

            def state_dict(self):
                return {"w": self.t}

            def load_state_dict(self, state):
                assert isinstance(state["w"], DTensor) and state["w"].placements == (Shard(0),)
                self.t = state["w"]

        snaps = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 0))
        snaps.take(2, {"h": Holder(weight)}, {})
        back = Holder(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
        MemorySnapshots.for_run("ckpt", 0, 1, 1, environ=env(tmp_path, 1)).load(2, {"h": back}, {})
        assert torch.equal(back.t.full_tensor(), torch.arange(12.0).reshape(4, 3))
    finally:
        dist.destroy_process_group()


def test_the_manager_prefers_a_newer_snapshot_and_falls_back_to_disk(tmp_path, monkeypatch, caplog):
    """restore_latest(): the snapshot when it is at least as new as the disk's newest checkpoint;
    the disk checkpoint when the snapshot is older or cannot be read (nothing half-restored)."""
    from slipstream.checkpoint import CheckpointManager

    monkeypatch.setenv("SLIPSTREAM_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    ckpt = str(tmp_path / "ckpt")

    def manager(model):
        mgr = CheckpointManager(ckpt, snapshot_every_steps=1, handle_sigterm=False, verify="size")
        mgr.register("model", model)
        return mgr

    model = nn.Linear(3, 2)
    mgr = manager(model)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        if step == 2:
            assert mgr.save(2, blocking=True)
            at_two = model.weight.clone()
        assert mgr.maybe_snapshot(step)
    at_three = model.weight.clone()
    mgr.close()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fresh = nn.Linear(3, 2)
    again = manager(fresh)
    assert again.restore_latest() == 3 and again.restored_from.startswith("an in-memory snapshot")
    assert "step 2" in again.restored_from and torch.equal(fresh.weight, at_three)
    again.close()

    slot = next(p for p in (tmp_path / "shm").rglob("slot*.bin") if (p.parent / f"step_00000003.{p.stem}").exists())
    slot.write_bytes(b"cut")  # the slot of step 3 no longer holds its bytes
    fresh = nn.Linear(3, 2)
    third = manager(fresh)
    assert third.restore_latest() == 2 and third.restored_from == ckpt and torch.equal(fresh.weight, at_two)
    assert "the in-memory snapshot of step 3 cannot be read" in caplog.text
    third.close()


def test_an_unusable_snapshot_directory_turns_snapshots_off_not_the_run(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    snaps = MemorySnapshots.for_run("ckpt", 0, 1, 1, environ={"SLIPSTREAM_SNAPSHOT_DIR": str(blocker)})
    assert not snaps.enabled and not snaps.due(1) and snaps.agreed_newest() is None
    assert "in-memory snapshots are off for rank 0" in caplog.text
