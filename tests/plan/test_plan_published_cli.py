"""Every row of the published record through ``slipstream plan``'s own code path (issue #35).

For each case the CLI can print (a built-in model, a layout slipstream can run), ``slipstream plan
... --framework F --json`` is run with the case's arguments and the row of the case's layout is
read from its output; its scaling efficiency must be what ``python -m slipstream.plan.published``
predicts for the case (for Goyal et al., whose efficiency is from one server of 8, the ratio of
the CLI's figures at 256 and at 8 GPUs). The Megatron rows cannot be printed by the CLI (fp16
with tensor parallel is refused by TrainConfig, and their shapes are not built-in models); for
them the record's prediction must be the planner's per-layout prediction, unchanged."""

from __future__ import annotations

import json

import pytest

from slipstream.cli import main
from slipstream.plan.network import parse_network
from slipstream.plan.planner import train_config_error
from slipstream.plan.published import CASES, case_layout, case_model, evaluate
from slipstream.plan.rates import predict_layout
from slipstream.plan.specs import MODELS, get_gpu


def cli_row(capsys, c, gpus: int) -> dict:
    """The ranking row ``slipstream plan`` prints (--json) for the case's layout on ``gpus`` GPUs."""
    L = case_layout(c, gpus)
    argv = ["plan", "--model", c.model, "--gpus", str(gpus), "--gpu-type", c.gpu,
            "--gpus-per-node", str(min(gpus, c.gpus_per_node)), "--network", c.network, "--precision", c.precision,
            "--framework", c.framework, "--global-batch", str(L.global_batch), "--top", "100000", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["ranking"]
    match = [r for r in rows if r["layout"] == L.label() and r["sync"] == "allreduce"
             and r["micro_batch"] == c.micro_batch and r["microbatches_per_step"] == 1
             and not r["activation_checkpointing"]]
    assert len(match) == 1, (c.key, L.label(), len(rows))
    return match[0]


def printable(c) -> bool:
    return c.model in MODELS and train_config_error(case_layout(c).train_fields()) is None


@pytest.mark.parametrize("c", [c for c in CASES if printable(c)], ids=lambda c: c.key)
def test_cli_prints_what_the_record_predicts(c, capsys):
    r = evaluate(c)
    row = cli_row(capsys, c, c.gpus)
    assert row["scaling_efficiency"] == pytest.approx(r["prediction"].scaling_efficiency, rel=1e-9)
    assert row["step_s"] == pytest.approx(r["step_s"], rel=1e-9)
    eff = row["scaling_efficiency"]
    if c.baseline_gpus > 1:
        eff /= cli_row(capsys, c, c.baseline_gpus)["scaling_efficiency"]
    assert eff == pytest.approx(r["predicted"], rel=1e-9), (c.key, eff, r["predicted"])


@pytest.mark.parametrize("c", [c for c in CASES if not printable(c)], ids=lambda c: c.key)
def test_rows_the_cli_cannot_print_are_the_planners_prediction(c):
    # Why the CLI does not print it: not a built-in model, or a layout slipstream refuses.
    assert c.model not in MODELS or train_config_error(case_layout(c).train_fields())
    p = predict_layout(case_model(c.model), get_gpu(c.gpu), parse_network(c.network), case_layout(c),
                       min(c.gpus, c.gpus_per_node), c.framework)
    assert evaluate(c)["step_s"] == pytest.approx(p.step_s, rel=1e-12)


def test_the_cli_uses_the_measured_one_gpu_rate(capsys):
    # VGG-16 on a P100: the published one-GPU throughput (rates.py) replaces the assumed MFU, so the
    # plain DDP row is no longer the 92.6 % the assumed MFU gave (issue #35), and --explain says so.
    c = next(c for c in CASES if c.key == "horovod-vgg16")
    ddp = cli_row(capsys, type(c)(**{**c.__dict__, "framework": "ddp"}), c.gpus)
    assert ddp["scaling_efficiency"] < 0.85
    assert main(["plan", "--model", "vgg16", "--gpus", "8", "--gpu-type", "P100", "--gpus-per-node", "4",
                 "--network", "25gbit-roce", "--precision", "fp32", "--top", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "[measured: " in out and "VGG16 132 img/s" in out.replace("\n", "")
