"""Checkpoints are verified before they are loaded; a bad one is moved aside and the
previous good one is loaded, and the run then ends bitwise equal to one that never
met the bad checkpoint (issue #22, parts 1 and 4).

Small model, CheckpointManager directly: the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from slipstream.checkpoint import layout, verify
from slipstream.checkpoint.manager import CheckpointManager, NoUsableCheckpoint
from slipstream.checkpoint.states import ModelOptimizerState
from slipstream.errors import ConfigError

from tests.harness import run_ranks  # the one rank-spawning harness


class Counter:
    """Per-rank state: makes the manager write rank<R>.pt."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model, opt, first: int, last: int, mgr: CheckpointManager | None = None, counter=None) -> None:
    """Steps first+1 .. last; the batch of step s is a function of s alone."""
    for step in range(first + 1, last + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if counter is not None:
            counter.value = step
        if mgr is not None and step % 10 == 0:
            mgr.save(step)


def _manager(directory, **kw):
    model, opt = _model()
    counter = Counter()
    mgr = CheckpointManager(str(directory), handle_sigterm=False, **kw)
    mgr.register("model_optimizer", ModelOptimizerState(model, opt))
    mgr.register("counter", counter, per_rank=True)
    return mgr, model, opt, counter


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def uninterrupted() -> list[torch.Tensor]:
    model, opt = _model()
    _train(model, opt, 0, 40)
    return _params(model)


def _three_checkpoints(tmp_path) -> Path:
    mgr, model, opt, counter = _manager(tmp_path, keep_last=3)
    _train(model, opt, 0, 30, mgr, counter)
    mgr.close()
    assert [c.step for c in layout.list_complete(str(tmp_path))] == [10, 20, 30]
    return tmp_path / "step_00000030"


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


def _truncate(ckpt: Path) -> None:
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _flip(ckpt: Path) -> None:
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))


def _remove(ckpt: Path) -> None:
    (ckpt / "rank0.pt").unlink()


@pytest.mark.parametrize("damage, verify_mode, expected", [
    (_truncate, "size", "truncated"),
    (_flip, "full", "checksum crc32"),
    (_remove, "size", "rank0.pt: missing"),
])
def test_a_damaged_checkpoint_is_moved_aside_and_the_previous_one_loaded(
    damage, verify_mode, expected, tmp_path, uninterrupted, caplog
):
    bad = _three_checkpoints(tmp_path)
    damage(bad)
    mgr, model, opt, counter = _manager(tmp_path, verify=verify_mode)
    with caplog.at_level(logging.ERROR, logger="slipstream.checkpoint"):
        assert mgr.restore_latest() == 20
    assert counter.value == 20
    assert expected in caplog.text and str(bad) in caplog.text, caplog.text
    aside = verify.moved_aside(str(tmp_path))
    assert len(aside) == 1 and aside[0].startswith("step_00000030.corrupt-"), aside  # kept, not deleted
    assert not bad.exists()
    _train(model, opt, 20, 40, mgr, counter)
    mgr.close()
    for mine, ref in zip(_params(model), uninterrupted):
        assert torch.equal(mine, ref)
    assert [c.step for c in layout.list_complete(str(tmp_path))] == [10, 20, 30, 40][-3:]


def test_the_marker_records_every_file_with_size_and_checksum(tmp_path):
    ckpt = _three_checkpoints(tmp_path)
    info = json.loads((ckpt / layout.MARKER).read_text())
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != layout.MARKER)
    assert sorted(info["files"]) == on_disk and ".metadata" in on_disk and "rank0.pt" in on_disk
    for name, entry in info["files"].items():
        assert entry["bytes"] == (ckpt / name).stat().st_size
        assert entry["crc32"] == f"{verify.file_crc32(str(ckpt / name)):08x}"
    # checkpoint_verify=size spares the save its checksums: sizes only, which full then checks.
    mgr, model, opt, counter = _manager(tmp_path, verify="size")
    mgr.save(40)
    sized = json.loads((tmp_path / "step_00000040" / layout.MARKER).read_text())["files"]
    assert sized and all(set(entry) == {"bytes"} for entry in sized.values())
    assert not verify.check(layout.find_latest(str(tmp_path)), "full").failed


def test_size_mode_does_not_read_contents_and_off_checks_only_the_marker(tmp_path):
    ckpt = _three_checkpoints(tmp_path)
    _flip(ckpt)
    entry = layout.CheckpointDir(str(ckpt), 30)
    assert not verify.check(entry, "size").failed  # same sizes: only a checksum sees it
    assert "checksum" in verify.check(entry, "full").reason
    _truncate(ckpt)
    assert not verify.check(entry, "off").failed
    with pytest.raises(ValueError, match="checkpoint_verify must be one of full, size, off, got 'fast'"):
        verify.check(entry, "fast")
    with pytest.raises(ConfigError, match="checkpoint_verify must be one of full, size, off, got 'fast'"):
        CheckpointManager(str(tmp_path), handle_sigterm=False, verify="fast")


def test_an_old_marker_without_a_file_list_still_loads(tmp_path, caplog):
    ckpt = _three_checkpoints(tmp_path)
    marker = ckpt / layout.MARKER
    info = json.loads(marker.read_text())
    del info["files"]
    marker.write_text(json.dumps(info))
    mgr, _model_, _opt, counter = _manager(tmp_path)
    with caplog.at_level(logging.INFO, logger="slipstream.checkpoint"):
        assert mgr.restore_latest() == 30
    assert counter.value == 30
    assert "without a file list" in caplog.text and "cannot be checked" in caplog.text


def test_with_no_good_checkpoint_left_the_run_refuses_to_start_from_scratch(tmp_path):
    _three_checkpoints(tmp_path)
    for ckpt in layout.list_complete(str(tmp_path)):
        _truncate(Path(ckpt.path))
    mgr, *_ = _manager(tmp_path)
    with pytest.raises(NoUsableCheckpoint, match="holds no checkpoint that verifies") as err:
        mgr.restore_latest()
    assert err.value.exit_code == 2
    assert len(verify.moved_aside(str(tmp_path))) == 3  # all kept
    # A relaunch over the same directory (everything moved aside now) refuses too.
    again, *_ = _manager(tmp_path)
    with pytest.raises(NoUsableCheckpoint, match="refusing to start from scratch"):
        again.restore_latest()


def test_a_checkpoint_dir_that_is_a_file_is_a_config_error(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match="checkpoint_dir exists and is not a directory") as err:
        CheckpointManager(str(path), handle_sigterm=False)
    assert err.value.exit_code == 2
    import slipstream

    slipstream.init()
    try:
        model, opt = _model()
        with pytest.raises(ConfigError, match="checkpoint_dir exists and is not a directory"):
            slipstream.accelerate(model, opt, checkpoint_dir=str(path), progress=False, run_dir=str(tmp_path / "run"))
    finally:
        slipstream.shutdown()


# --- two ranks: a marker from another world size ------------------------------------


def _two_rank_save(rank: int, world: int, directory: str) -> None:
    import slipstream

    slipstream.init()
    mgr, model, opt, counter = _manager(directory, keep_last=3)
    _train(model, opt, 0, 20, mgr, counter)
    mgr.close()
    slipstream.shutdown()


def _two_rank_resume(rank: int, world: int, directory: str) -> tuple[int, int, list[torch.Tensor]]:
    import slipstream

    slipstream.init()
    mgr, model, opt, counter = _manager(directory)
    step = mgr.restore_latest()
    restored = counter.value
    _train(model, opt, step, 40, mgr, counter)
    mgr.close()
    slipstream.shutdown()
    return step, restored, _params(model)


def test_a_marker_from_another_world_size_falls_back(tmp_path, uninterrupted):
    directory = str(tmp_path / "ckpt")
    run_ranks(_two_rank_save, 2, directory)
    # step 20's marker as a one-rank run would have written it: rank1.pt is not its file.
    marker = tmp_path / "ckpt" / "step_00000020" / layout.MARKER
    info = json.loads(marker.read_text())
    info["world_size"] = 1
    del info["files"]["rank1.pt"]
    marker.write_text(json.dumps(info))
    results = run_ranks(_two_rank_resume, 2, directory)
    for step, restored, params in results:  # both ranks loaded the same, older checkpoint
        assert (step, restored) == (10, 10)
        for mine, ref in zip(params, uninterrupted):
            assert torch.equal(mine, ref)
    assert verify.moved_aside(directory)[0].startswith("step_00000020.corrupt-")


def test_a_consistent_checkpoint_of_another_world_size_still_loads(tmp_path):
    """Resharding 2 -> 1 rank stays supported: the marker matches its files."""
    directory = str(tmp_path / "ckpt")
    run_ranks(_two_rank_save, 2, directory)
    mgr, _model_, _opt, counter = _manager(directory)
    assert mgr.restore_latest() == 20 and counter.value == 20
    assert verify.moved_aside(directory) == []


def test_the_options_are_train_config_fields_with_environment_variables():
    from slipstream.config import TrainConfig

    cfg = TrainConfig.from_env({"SLIPSTREAM_CHECKPOINT_VERIFY": "size", "SLIPSTREAM_CHECKPOINT_MAX_FAILURES": "5"})
    assert (cfg.checkpoint.verify, cfg.checkpoint.max_failures) == ("size", 5)
    assert (TrainConfig().checkpoint.verify, TrainConfig().checkpoint.max_failures) == ("full", 3)
    with pytest.raises(ConfigError, match="checkpoint_verify must be one of full, size, off, got 'crc'"):
        TrainConfig(checkpoint_verify="crc")
    with pytest.raises(ConfigError, match="checkpoint_max_failures must be >= 1, got 0"):
        TrainConfig(checkpoint_max_failures=0)
