"""The GPU table of the planner: the names users type for a GPU and its memory variant."""

from __future__ import annotations

import pytest

from slipstream.cli import main


@pytest.mark.parametrize("name, key, memory_gib", [
    ("A100-40GB", "A100-40GB", 40), ("A100-80GB", "A100-80GB", 80), ("H100-80GB", "H100-80GB", 80),
    ("nvidia h100 80gb", "H100-80GB", 80), ("V100_16G", "V100-16GB", 16), ("h200-141gb", "H200-141GB", 141e9 / 2**30),
])
def test_gpu_names_with_their_memory_variant_are_accepted(name, key, memory_gib):
    # `--gpu-type A100-40GB` was refused (issue #46 item 10).
    from slipstream.plan.specs import GIB, GPUS, get_gpu

    gpu = get_gpu(name)
    assert gpu is GPUS[key] and gpu.name == key
    assert gpu.memory_bytes / GIB == pytest.approx(memory_gib)
    base = GPUS[key.split("-")[0]]
    assert (gpu.fp32_flops, gpu.bf16_flops, gpu.price_per_hour) == (base.fp32_flops, base.bf16_flops, base.price_per_hour)


def test_plan_takes_a_memory_variant_on_the_command_line(capsys):
    assert main(["plan", "--model", "resnet50", "--gpus", "8", "--gpu-type", "A100-40GB", "--network", "100gbit-ib"]) == 0
    out = capsys.readouterr().out
    assert "resnet50 on 8 x A100-40GB" in out and "/37 GiB" in out  # 40 GiB less the planner's reserve


def test_a_near_miss_is_answered_with_the_closest_name(capsys):
    assert main(["plan", "--model", "resnet50", "--gpus", "8", "--gpu-type", "A100-40", "--network", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-type" in err and "did you mean 'A100-40GB'?" in err
