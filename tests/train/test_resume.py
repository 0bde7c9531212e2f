"""What a resumed run is told (issue #46, item 3): what differs from its checkpoint, in one line;
a complete run says there was nothing to train; register_state restores what is built after
accelerate()."""

from __future__ import annotations

import torch
import torch.nn as nn

import slipstream


def _run(tmp_path, lr: float = 0.1, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return slipstream.accelerate(model, opt, run_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "ckpt"),
                                 progress=False, **options)


def _train(run, steps: int, batch: int) -> None:
    x, y = torch.randn(batch, 4), torch.randn(batch, 1)
    while run.step_count < steps:
        run.backward(nn.functional.mse_loss(run.model(x), y))
        run.step()


def test_a_resumed_run_says_in_one_line_what_differs_from_its_checkpoint(single_process, tmp_path, capsys):
    first = _run(tmp_path, lr=0.1, total_steps=10)
    _train(first, 4, batch=8)
    first.finish()
    capsys.readouterr()

    again = _run(tmp_path, lr=0.05, total_steps=20, accumulate_steps=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "resumed from" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[slipstream] resumed from {tmp_path / 'ckpt'} at step 4; this run differs")
    for change in ("accumulate_steps 1 -> 2", "total_steps 10 -> 20", "lr: the script's 0.05, the checkpoint's 0.1 "
                   "is used"):
        assert change in lines[0], lines[0]
    assert again.optimizer.param_groups[0]["lr"] == 0.1  # what torch restores, as the line says
    _train(again, 5, batch=3)  # 2 micro-steps of 3 samples: 6 per optimizer step, 8 before
    again.finish()
    out = capsys.readouterr().out
    assert "the batch differs from the checkpoint's: 6 samples per rank per optimizer step now, 8 in the run" in out

    same = _run(tmp_path, lr=0.1, total_steps=20, accumulate_steps=2)  # as the checkpoint: nothing to list
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'ckpt'} at step 5\n" in out
    _train(same, 6, batch=3)
    same.finish()
    assert "batch differs" not in capsys.readouterr().out


def test_a_complete_run_says_there_is_nothing_to_train(single_process, tmp_path, capsys):
    first = _run(tmp_path, total_steps=3)
    _train(first, 3, batch=8)
    first.finish()
    capsys.readouterr()

    again = _run(tmp_path, total_steps=3)  # the planned length is known: said at start
    out = capsys.readouterr().out
    assert "nothing to train: the run in" in out and "it holds step 3 and total_steps is 3" in out
    _train(again, 3, batch=8)
    again.finish()
    assert "nothing to train" not in capsys.readouterr().out  # once
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_00000003"]

    plain = _run(tmp_path)  # no total_steps: the loop's bound tells, at finish
    assert "nothing to train" not in capsys.readouterr().out
    _train(plain, 3, batch=8)
    plain.finish()
    assert "it holds step 3, where this script's loop ends" in capsys.readouterr().out


class _Position:
    """A stand-in for a data loader's position."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def test_state_registered_after_accelerate_is_saved_and_restored(single_process, tmp_path):
    first = _run(tmp_path, checkpoint_every_steps=1)
    position = first.register_state("data", _Position())
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(3):
        position.consumed += 8
        first.backward(nn.functional.mse_loss(first.model(x), y))
        first.step()
    first.finish()

    again = _run(tmp_path)
    assert again.register_state("data", _Position()).consumed == 24
    again.finish()
    fresh = _run(tmp_path / "other")
    assert fresh.register_state("data", _Position()).consumed == 0  # nothing to resume: left as built
    fresh.finish()


def test_state_registered_after_accelerate_comes_back_from_an_in_memory_snapshot(single_process, tmp_path,
                                                                                   monkeypatch):
    # As under an elastic agent: the first attempt, then its restart (snapshots under tmp_path).
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "resume-test")
    monkeypatch.setenv("SLIPSTREAM_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _run(tmp_path, snapshot_every_steps=1)  # no disk checkpoint before the end: the snapshot is newer
    position = first.register_state("data", _Position())
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(2):
        position.consumed += 8
        first.backward(nn.functional.mse_loss(first.model(x), y))
        first.step()
    first.checkpoints.close()  # a worker that died: no final save, its snapshots stay in host memory
    first.recorder.close()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = _run(tmp_path, snapshot_every_steps=1)
    assert again.resumed_from_step == 2 and "in-memory snapshot" in str(again.checkpoints.restored_from)
    assert again.register_state("data", _Position()).consumed == 16
    again.finish()


def test_the_record_and_the_comparison_in_words():
    import json

    from slipstream.config import TrainConfig
    from slipstream.train.resume import describe, differences, hyperparameter_differences, hyperparameters

    saved = json.loads(json.dumps(describe(TrainConfig(precision="bf16", sync="powersgd", sync_options={"rank": 2}),
                                           2, 2, 8)))  # as the marker holds it
    assert differences(saved, describe(TrainConfig(precision="bf16", sync="powersgd", sync_options={"rank": 2}),
                                       2, 2, 16)) == []  # the batch is compared at the first step, not here
    now = describe(TrainConfig(precision="fp32", sync="powersgd", sync_options={"rank": 4}), 4, 4, 8)
    assert differences(saved, now) == ["world size 2 -> 4", "precision bf16 -> fp32", "sync_options {'rank': 2} -> "
                                       "{'rank': 4}"]
    params = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    script = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.01}], lr=0.1, betas=(0.9, 0.95))
    restored = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.02}], lr=0.1, betas=(0.9, 0.99))
    assert hyperparameter_differences(hyperparameters(script), hyperparameters(restored)) == [
        "betas (group 0): the script's (0.9, 0.95), the checkpoint's (0.9, 0.99) is used",
        "betas (group 1): the script's (0.9, 0.95), the checkpoint's (0.9, 0.99) is used",
        "lr (group 1): the script's 0.01, the checkpoint's 0.02 is used"]
