"""slipstream run's settings win over the script's in accelerate(), and the replaced value is
named at start (issue #46, item 2; the rule itself: tests/config/test_precedence.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import slipstream


def test_a_launcher_setting_wins_over_the_scripts_and_is_named(single_process, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLIPSTREAM_CHECKPOINT_DIR", str(tmp_path / "flag"))  # slipstream run --checkpoint-dir
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path / "run"),
                                checkpoint_dir=str(tmp_path / "ckpt"), progress=False)  # the script's value
    assert run.config.checkpoint.dir == str(tmp_path / "flag")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(2):
        run.backward(nn.functional.mse_loss(run.model(x), y))
        run.step()
    run.finish()
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {tmp_path / 'flag'} (SLIPSTREAM_CHECKPOINT_DIR" in err
    assert f"overrides the script's checkpoint_dir='{tmp_path / 'ckpt'}'" in err
    assert (tmp_path / "flag" / "step_00000002").is_dir() and not (tmp_path / "ckpt").exists()
