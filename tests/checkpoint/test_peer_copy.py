"""Peer copies of in-memory snapshots (slipstream.checkpoint.peer): who holds whose copy, what a
restart chooses, and, in 4 ranks laid out as 2 "nodes" (each with its own snapshot directory),
that a node whose memory is gone is restored bitwise from the copies on the other node. The
whole-node loss on the emulated cluster, agent included, is tests/cluster/test_node_loss.py."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from slipstream.checkpoint import peer
from slipstream.checkpoint.peer import Choice, buddies, choose
from tests.harness import run_ranks


def test_each_rank_has_a_buddy_on_the_next_node_and_none_on_one_node():
    assert buddies([(0, 0), (0, 1), (1, 0), (1, 1)]) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert buddies([(0, 0), (1, 0), (2, 0)]) == {0: 1, 1: 2, 2: 0}  # a ring of nodes
    assert buddies([(0, 0), (0, 1)]) == {}
    assert buddies([(0, 0), (0, 1), (1, 0)]) == {0: 2, 1: 2, 2: 0}  # uneven nodes: still another node's rank


def held(local, copies=None):
    return {"local": local, "held": copies or {}}


def test_a_restart_takes_the_newest_step_held_for_every_rank_locally_or_by_a_peer():
    # node 1 (rank 1) lost: its step 5 is on rank 0
    assert choose([held([4, 5], {1: [4, 5]}), held([])]) == Choice(5, {1: 0})
    # killed while its peer copy of 6 travelled: rank 0 holds 5 and 6, rank 1's copy only up to 5
    assert choose([held([5, 6], {1: [4, 5]}), held([])]) == Choice(5, {1: 0})
    # nothing lost: every rank's own
    assert choose([held([4, 5], {1: [4, 5]}), held([4, 5], {0: [4, 5]})]) == Choice(5, {})
    # no peer copy (off), a node lost: nobody holds rank 1's state
    assert choose([held([4, 5]), held([])]) == Choice(None, {}, (1,))
    # a first attempt offers nothing
    assert choose([held([]), held([])]) == Choice(None, {}, (0, 1))
    assert choose([held([3])]) == Choice(3, {})


def _trained(rank: int, steps: int, mgr, model, optimizer) -> None:
    for step in range(1, steps + 1):
        model(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        mgr.maybe_snapshot(step)


def _node_loss(rank: int, world: int, tmp: str, peer_copy: bool, no_room_on: int | None) -> dict:
    """Two nodes of two ranks; 3 steps with a snapshot each; node 1 loses its memory; every
    rank restarts (a new manager, fresh objects) and restores. Returns what each rank saw."""
    from slipstream.checkpoint import CheckpointManager
    from slipstream.checkpoint.states import ModelOptimizerState, RNGState

    node = rank // 2
    os.environ.update(SLIPSTREAM_SNAPSHOT_DIR=os.path.join(tmp, f"node{node}"), TORCHELASTIC_RUN_ID="peer-test",
                      TORCHELASTIC_RESTART_COUNT="0")
    if node == no_room_on:  # this node's tmpfs has room for its ranks' own snapshots, not for peer copies
        real = os.posix_fallocate

        def fallocate(fd, offset, size):
            if "/peer" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, offset, size)

        os.posix_fallocate = fallocate
    dist.init_process_group("gloo")
    ckpt = os.path.join(tmp, "ckpt")

    def manager(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = CheckpointManager(ckpt, snapshot_every_steps=1, snapshot_peer_copy=peer_copy, handle_sigterm=False,
                                verify="size")
        mgr.register("model_optimizer", ModelOptimizerState(model, optimizer))
        mgr.register("rng", RNGState(), per_rank=True)
        return mgr, model, optimizer

    mgr, model, optimizer = manager(100 + rank)
    _trained(rank, 3, mgr, model, optimizer)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_draw = torch.rand(4)  # the RNG stream after step 3, drawn once: restored, it draws this again
    copy = mgr.snapshots.peer
    if copy is not None:
        copy.wait()  # the copy of step 3 is still travelling in the background
    seen = {"has_peer": copy is not None, "local": mgr.snapshots.steps(), "held": mgr.snapshots.held_for_others(),
            "transfers": len(copy.transfer_s) if copy else 0}
    mgr.close()
    dist.barrier()
    if rank == 2:
        shutil.rmtree(os.path.join(tmp, "node1"))  # node 1 lost: its memory with it
    dist.barrier()

    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    again, fresh, _ = manager(7)
    seen["restored"] = again.restore_latest()
    seen["restored_from"] = again.restored_from
    seen["bitwise"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    seen["rng"] = torch.equal(torch.rand(4), want_draw)
    again.close()
    return seen


def test_a_node_whose_memory_is_gone_restores_from_the_peer_copies_bitwise(tmp_path):
    seen = run_ranks(_node_loss, 4, str(tmp_path), True, None, local_world_size=2, timeout_s=240)
    assert [s["has_peer"] for s in seen] == [True] * 4
    assert [s["held"] for s in seen] == [{2: [2, 3]}, {3: [2, 3]}, {0: [2, 3]}, {1: [2, 3]}]
    assert all(s["local"] == [2, 3] and s["transfers"] == 3 for s in seen)
    assert [s["restored"] for s in seen] == [3] * 4
    assert all(s["bitwise"] and s["rng"] for s in seen), seen
    assert seen[0]["restored_from"].startswith(
        "an in-memory snapshot (rank 2 from its peer copy on rank 0; rank 3 from its peer copy on rank 1; ")


@pytest.mark.parametrize("peer_copy,no_room_on", [(False, None), (True, 0)])
def test_without_a_peer_copy_a_lost_node_goes_back_to_disk(tmp_path, peer_copy, no_room_on, capfd):
    """Turned off, or no room on the holders' node (one line, and their own snapshots go on):
    nothing holds node 1's state, so no rank loads a snapshot (no disk checkpoint here: step 0)."""
    seen = run_ranks(_node_loss, 4, str(tmp_path), peer_copy, no_room_on, local_world_size=2, timeout_s=240)
    assert [s["has_peer"] for s in seen] == [peer_copy] * 4
    assert [s["held"] for s in seen][:2] == [{}, {}]
    assert all(s["local"] == [2, 3] for s in seen)
    assert [s["restored"] for s in seen] == [0] * 4 and not any(s["bitwise"] for s in seen)
    err = capfd.readouterr().err
    assert "no step is held for every rank (rank(s) 2, 3 hold none, nor does a peer copy)" in err
    if no_room_on is not None:
        assert err.count("peer copy of rank 2's snapshots is off: rank 0 cannot hold it") == 1, err
        assert "No space left on device" in err


def test_without_another_node_there_is_no_peer_copy_and_no_group(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(peer.dist, "new_group", lambda *a, **k: made.append(a))

    class OneGroup:
        pass

    monkeypatch.setattr(peer.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(peer.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [(0, 0), (0, 1)]))
    assert peer.PeerCopy.for_job(0, OneGroup(), lambda s: None) is None and made == []


def test_a_copy_slower_than_the_snapshots_is_named_once_per_stretch(caplog):
    """At 1 Gbit/s a 55 MiB copy took 1.1 s against 0.54 s steps: every step waited for it."""
    copy = peer.PeerCopy(0, 1, [1], lambda s: None, group=None)
    try:
        copy.transfer_s = [1.1, 1.1]
        for _ in range(peer.SLOW_OFFERS + 3):
            copy._note_waits(0.5, 0.55)
        copy._note_waits(0.0, 0.55)  # a quick one resets the count
        for _ in range(peer.SLOW_OFFERS):
            copy._note_waits(0.5, 0.55)
    finally:
        copy.close(timeout_s=1)
    assert caplog.text.count("the snapshots' peer copy takes 1.10 s, longer than the 0.55 s between two snapshots") == 2
    assert "about 2x less often" in caplog.text


def test_a_copy_left_by_a_heal_commits_nothing_more_and_destroys_no_group(tmp_path, monkeypatch):
    """Healing in place destroys every group, the copy's too: the copy in flight then ends on its own
    (its peer gone), and a half-received snapshot must not be committed over the slots the next
    generation's copy writes. Before, the heal refused to run with a peer copy at all."""
    committed, destroyed = [], []

    class Slots:
        def commit(self, step, slot, index):
            committed.append(step)

    monkeypatch.setattr(peer.dist, "destroy_process_group", destroyed.append)
    copy = peer.PeerCopy(0, 1, [1], lambda s: Slots(), group=object())
    copy.left()
    # what the thread did with the copy in flight when the groups went: its sends and receives returned
    monkeypatch.setattr(peer, "_wait_all", lambda works: None)
    monkeypatch.setattr(peer.dist, "isend", lambda *a, **k: None)
    monkeypatch.setattr(peer.dist, "irecv", lambda *a, **k: None)
    monkeypatch.setattr(copy, "_reserve", lambda *a: (0, torch.zeros(4, dtype=torch.uint8), 2))
    copy._exchange(5, torch.zeros(4, dtype=torch.uint8), b"ix")
    assert committed == [] and copy.retired and copy.group is None
    copy.offer(6, None, b"")  # nothing more travels: no wait, no error
    copy.close(timeout_s=1)
    assert destroyed == []
