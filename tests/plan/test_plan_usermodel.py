"""``slipstream plan --model PATH.py:FUNCTION`` and ``--model config.json``: the user's own model,
measured on the meta device; ``--explain``; bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.plan.usermodel import load_user_model
from tests.conftest import need_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128,
             "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "slipstream", "plan", *argv], capture_output=True, text=True,
                          check=False, env=env, cwd=ROOT, timeout=120)


def test_example_gpt_from_the_cli_with_explain():
    r = _run("--model", "examples/train_gpt.py:GPT", "--gpus", "16", "--gpu-type", "A100", "--network",
             "100gbit-ib", "--samples", "1M", "--global-batch", "512", "--top", "3", "--explain")
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    # the table carries the range; --explain names each term's source
    assert "±" in out and "validation set" in out
    for text in ("compute", "exposed", "measured on the meta device (FlopCounterMode)", "spec sheet",
                 "Memory per GPU", "parameters", "optimizer state", "activations", "[fitted: cv"):
        assert text in out, text
    # activation checkpointing names the model's own repeated block
    assert "SLIPSTREAM_ACTIVATION_CHECKPOINTING" not in out or "Block" in out


def test_measured_figures_match_the_real_models():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_resnet
    finally:
        sys.path.remove(str(EXAMPLES))
    spec = load_user_model(f"{EXAMPLES}/train_resnet.py:ResNet18", input_shape=(3, 32, 32))
    real = train_resnet.ResNet18()
    assert spec.params == sum(p.numel() for p in real.parameters())
    with FlopCounterMode(display=False) as counter:  # the same count on real tensors
        real(torch.zeros(1, 3, 32, 32))
    assert spec.fwd_flops_per_sample == counter.get_total_flops()
    assert spec.block_class == "BasicBlock" and spec.kind == "cnn"
    # saved activations: more than the input and the output, less than 100x the conv outputs
    assert 3 * 32 * 32 * 4 < spec.act_bytes_per_sample("fp32") < 50e6
    gpt = load_user_model(f"{EXAMPLES}/train_gpt.py:GPT")  # context inferred: the positional embedding (64)
    assert gpt.block_class == "Block" and gpt.params == 437760  # tied embedding counted once


def test_hugging_face_config(tmp_path):
    transformers = need_module("transformers", "pip install 'slipstream[hf]'")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_GPT2))
    spec = load_user_model(str(cfg))
    real = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in TINY_GPT2.items()
                                                                  if k != "model_type"}))
    assert spec.params == real.num_parameters()
    assert spec.kind == "transformer" and (spec.layers, spec.d_model, spec.heads, spec.seq_len) == (2, 64, 4, 128)
    # forward FLOPs ~ 2 x non-embedding params x tokens + the LM head + attention
    dense = 2 * (12 * 2 * 64 * 64 + 64 * 1000) * 128
    assert dense < spec.fwd_flops_per_sample < 1.5 * dense
    assert main(["plan", "--model", str(cfg), "--gpus", "8", "--gpu-type", "H100", "--network", "400gbit-ib",
                 "--tokens", "1B", "--json", "--top", "2"]) == 0


@pytest.mark.parametrize("model, message", [
    ("nope/missing.py:build", "no such file"),
    ("examples/train_gpt.py:nothere", "has no function 'nothere'"),
    ("{tmp}/notmodule.py:build", "must return a torch.nn.Module, got int"),
    ("{tmp}/bad.json", "is not valid JSON"),
    ("{tmp}/nomodel.json", "not a Hugging Face config"),
])
def test_bad_user_model_one_line_exit_2(model, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "notmodule.py").write_text("def build():\n    return 3\n")
    (tmp_path / "bad.json").write_text('{"model_type": ')
    (tmp_path / "nomodel.json").write_text('{"n_layer": 2}')
    rc = main(["plan", "--model", model.format(tmp=tmp_path), "--gpus", "8", "--gpu-type", "H100",
               "--network", "1gbit"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and message in err and err.startswith("slipstream plan: error:"), err


def test_missing_transformers_is_one_clear_line(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_GPT2))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    rc = main(["plan", "--model", str(cfg), "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "optional dependency transformers" in err and err.count("\n") == 0
