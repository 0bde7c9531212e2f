"""`slipstream export`: a checkpoint of any layout becomes the plain model's state_dict (issue #17 item 5).

One spawn of two ranks trains the tiny GPT of tests/parallel two steps in each
layout (DDP, FSDP2, TP, PP), checkpointing every step; each checkpoint is
exported here, in this process without a process group, to both formats,
loaded into a freshly built plain GPT with strict=True, and compared bitwise
with the full state dict the run itself gathered at the end.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from slipstream.cli import main
from slipstream.checkpoint.export import ExportError, ExportRequest, export_checkpoint, strip_wrapper_prefixes
from tests.harness import run_ranks
from tests.parallel.parallel_workers import example, make_gpt, train

pytestmark = pytest.mark.distributed

STEPS = 2
LAYOUTS = {
    "ddp": {},
    "fsdp2": {"dp_shard": 2},
    "tp": {"tp": 2},
    "pp": {"pp": 2, "pp_microbatches": 2},
}


def checkpoints_worker(rank: int, world: int, root: str) -> dict | None:
    """Every layout, one after the other in one process group, each into its own checkpoint
    directory; rank 0 returns each run's final full state dict."""
    import slipstream

    os.environ["SLIPSTREAM_RUN_DIR"] = os.path.join(root, "run")
    slipstream.init()
    states = {name: train(dict(layout), STEPS, checkpoint_dir=os.path.join(root, name), every=1)["state"]
              for name, layout in LAYOUTS.items()}
    slipstream.shutdown()
    return states if rank == 0 else None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    states = run_ranks(checkpoints_worker, 2, str(root), timeout_s=240)[0]
    return root, states


def _load(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_loads_strictly_into_the_plain_model_bitwise(trained, layout, tmp_path):
    root, states = trained
    expected = states[layout]
    for fmt in ("safetensors", "torch"):
        out = tmp_path / f"model.{fmt}"
        result = export_checkpoint(ExportRequest(str(root / layout), str(out), fmt))
        assert result.step == STEPS and result.source.endswith(f"step_{STEPS:08d}")
        exported = _load(out, fmt)
        model = make_gpt(example())
        model.load_state_dict(exported, strict=True)
        assert set(exported) == set(model.state_dict()) == set(expected), layout
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected[name]), (layout, fmt, name)
            assert torch.equal(exported[name], expected[name]), (layout, fmt, name)


def test_one_step_directory_and_the_command_line(trained, tmp_path, capsys):
    """`slipstream export` through the command's main() in this process (an interpreter that
    imports torch costs ~8 s here); CLI start-up without torch is tests/packaging's."""
    root, states = trained
    step_one = root / "fsdp2" / f"step_{1:08d}"
    assert step_one.is_dir()
    out = tmp_path / "one.pt"
    assert main(["export", str(step_one), "--format", "torch", "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "step 1)" in printed and str(out) in printed, printed
    state = torch.load(out, weights_only=True)
    make_gpt(example()).load_state_dict(state, strict=True)
    # After one step, not the final weights.
    assert not torch.equal(state["blocks.0.attn.q.weight"], states["fsdp2"]["blocks.0.attn.q.weight"])


def test_bad_inputs_give_one_line_and_exit_2(trained, tmp_path, capsys):
    """Through the command's main() in this process, as above."""
    root, _ = trained
    existing = tmp_path / "exists.safetensors"
    existing.write_bytes(b"x")
    partial = tmp_path / "step_00000005.partial"
    shutil.copytree(root / "ddp" / f"step_{STEPS:08d}", partial)
    (partial / "COMMITTED").unlink()
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("hello")
    damaged = tmp_path / "damaged" / f"step_{STEPS:08d}"
    shutil.copytree(root / "tp" / f"step_{STEPS:08d}", damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    cases = {
        "no checkpoint at": (str(tmp_path / "missing"), "--out", str(tmp_path / "a.pt")),
        "expected a checkpoint directory": (str(stranger), "--out", str(tmp_path / "b.pt")),
        "unfinished checkpoint": (str(partial), "--out", str(tmp_path / "c.pt")),
        "unknown format 'onnx'": (str(root / "ddp"), "--format", "onnx", "--out", str(tmp_path / "d.pt")),
        "pass --force": (str(root / "ddp"), "--out", str(existing)),
        "failed verification (--verify full)": (str(damaged.parent), "--out", str(tmp_path / "e.pt")),
    }
    for needle, argv in cases.items():
        code = main(["export", *argv])
        err = capsys.readouterr().err
        assert code == 2, (needle, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (needle, err)
    assert existing.read_bytes() == b"x"
    assert main(["export", str(root / "ddp"), "--out", str(existing), "--force"]) == 0, capsys.readouterr().err
    assert existing.stat().st_size > 1000


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_without_model_entries_is_not_a_slipstream_one(tmp_path):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / f"step_{3:08d}"
    dcp.save({"weights": {"w": torch.ones(2)}}, checkpoint_id=str(step), no_dist=True)
    (step / "COMMITTED").write_text('{"step": 3, "world_size": 1}')
    with pytest.raises(ExportError, match="not a slipstream training checkpoint"):
        export_checkpoint(ExportRequest(str(tmp_path), str(tmp_path / "out.pt"), "torch", verify="off"))


def test_wrapper_prefixes_are_removed():
    w = torch.zeros(1)
    assert list(strip_wrapper_prefixes({"module._orig_mod.fc.weight": w, "module.b": w})) == ["fc.weight", "b"]
    assert list(strip_wrapper_prefixes({"module.fc.weight": w, "fc.bias": w})) == ["module.fc.weight", "fc.bias"]
    with pytest.raises(ExportError, match="both become"):
        strip_wrapper_prefixes({"_orig_mod.fc.weight": w, "fc.weight": w})
