"""``slipstream plan`` end to end: table, written config and job spec, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from slipstream.cli import main
from tests.conftest import cannot_run_here


def test_table_and_written_files(tmp_path, capsys):
    cfg, job = tmp_path / "plan.yaml", tmp_path / "job.yaml"
    rc = main(["plan", "--model", "gpt-1.3b", "--gpus", "16", "--gpu-type", "A100", "--network", "100gbit-ib",
               "--tokens", "10B", "--top", "5", "--write-config", str(cfg), "--write-job", str(job)])
    assert rc == 0
    out = capsys.readouterr().out
    for col in ("layout", "step", "time to train", "cost", "mem/GPU", "scaling eff"):
        assert col in out
    assert "slipstream run --nnodes 2 -n 8" in out
    # The written file is a run config: `slipstream run --config` reads it back.
    from slipstream.config import TrainConfig
    from slipstream.launch.run_config import load

    text = cfg.read_text()
    assert "# run: slipstream run --nnodes 2 -n 8" in text and "#   step_s: " in text
    train = TrainConfig(**load(str(cfg)))
    assert train.degrees(16)["dp_replicate"] * train.degrees(16)["dp_shard"] * train.parallel.tp * train.parallel.pp == 16
    assert yaml.safe_load(text)  # the layout is there, not only comments
    from slipstream.job.spec import load_spec

    spec = load_spec(str(job))
    assert spec.replicas == 2 and spec.gpu_count == 8


def test_written_job_passes_slipstream_validate(tmp_path):
    job = tmp_path / "job.yaml"
    assert main(["plan", "--model", "resnet50", "--gpus", "16", "--gpu-type", "V100", "--network", "25gbit-roce",
                 "--write-job", str(job), "--json"]) == 0
    r = subprocess.run([sys.executable, "-m", "slipstream", "validate", str(job)],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit"], "--model"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "Z80", "--network", "1gbit"], "--gpu-type"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "H100", "--network", "fast"], "--network"),
    (["--model", "gpt-7b", "--gpus", "0", "--gpu-type", "H100", "--network", "1gbit"], "--gpus"),
    (["--model", "gpt-7b", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit", "--tokens", "lots"], "--tokens"),
    (["--model", "resnet50", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit", "--tokens", "1B"], "--tokens"),
    (["--model", "resnet50", "--gpus", "8", "--gpu-type", "H100", "--network", "1gbit", "--framework", "horovd"],
     "--framework"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and err.startswith("slipstream plan: error:")


def test_probe_memory_without_cuda_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        cannot_run_here("this machine has a GPU: the probe would run")
    assert main(["plan", "--model", "gpt-125m", "--gpus", "1", "--gpu-type", "H100", "--network", "1gbit",
                 "--probe-memory"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_link_calibration_from_probe_figures(tmp_path, capsys):
    import json

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"ranks": 2, "alpha_s": 0.0, "bytes_per_s": 117e6,
                                 "sweep": [[8192, 0.0004], [4 << 20, 0.0362], [16 << 20, 0.1438]]}))
    assert main(["plan", "--model", "mlp", "--gpus", "2", "--gpus-per-node", "1", "--gpu-type", "V100",
                 "--network", "1gbit", "--link-calibration", str(probe), "--global-batch", "128"]) == 0
    assert "measured" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", "--model", "mlp", "--gpus", "2", "--gpu-type", "V100", "--network", "1gbit",
                 "--link-calibration", str(bad)]) == 2


GPT7B_64 = ["plan", "--model", "gpt-7b", "--gpus", "64", "--gpu-type", "H100", "--network", "8x400gbit-ib",
            "--tokens", "300B", "--top", "5"]


def _plan_out(argv, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(argv) == 0
    return capsys.readouterr().out


def _run_command(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("slipstream run ")]
    return line


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_table_fits_the_terminal_width_and_names_every_layout_in_full(columns, capsys, monkeypatch):
    from slipstream.plan.planner import plan

    out = _plan_out(GPT7B_64, capsys, monkeypatch, columns)
    copied = (_run_command(out), next(line for line in out.splitlines() if line.startswith("SLIPSTREAM_")))
    for line in out.splitlines():
        # Only the run command and the variables may be longer: printed whole, on one line, to be copied.
        assert line in copied or len(line) <= columns, (columns, line)
    assert "…" not in out
    if columns < 150:  # what is left out is named
        assert f"not shown at {columns} columns:" in out
    else:
        assert "not shown" not in out and "exposed comm" in out
    result = plan("gpt-7b", gpus=64, gpu_type="H100", network="8x400gbit-ib", tokens=300e9)
    for c in result.candidates[:5]:
        assert c.layout.label() in out, c.layout.label()


RESNET16 = ["plan", "--model", "resnet50", "--gpus", "16", "--gpu-type", "V100", "--network", "25gbit-roce"]


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_the_columns_that_tell_candidates_apart_stay_at_any_width(columns, capsys, monkeypatch):
    # At 120 columns the sync column was dropped and the ddp16 rows with powersgd, bf16 and
    # hierarchical+powersgd looked the same (issue #46 item 10); ckpt alone tells #1 from #10.
    import re

    out = _plan_out(RESNET16, capsys, monkeypatch, columns)
    rows = [line for line in out.splitlines() if re.match(r"│\s+\d+ │", line)]
    assert len(rows) == 10
    assert "…" not in out and all(len(line) <= columns for line in rows), out
    shown = [re.sub(r"^│\s+\d+ │", "", row) for row in rows]
    named = [" ".join(cell.strip() for cell in row.split("│")[:4]) for row in shown]  # layout, sync, micro x acc, ckpt
    assert len(set(named)) == 10, named
    assert "hierarchical+powersgd" in out and "ckpt" in out.splitlines()[2] + out.splitlines()[3]


def test_legend_explains_every_part_of_the_layout_names(capsys, monkeypatch):
    out = _plan_out(GPT7B_64, capsys, monkeypatch, 120)
    # The top 5 here hold fsdpN(zS), tpN and ddpN; each is explained, and only those shown.
    assert "fsdpN(zS)" in out and "ZeRO stage" in out
    assert "tpN" in out and "tensor parallel" in out
    assert "ddpN" in out and "replicas" in out
    assert "ppN(" not in out and "single =" not in out


def test_legend_names_only_the_parts_shown():
    from slipstream.plan.cli import layout_legend

    text = "\n".join(layout_legend(["pp4(1f1b,m8)xtp2", "single"]))
    assert "ppN(S,mM) = pipeline parallel" in text and "tpN = tensor parallel" in text
    assert "single = one GPU" in text and "AxB = both at once" in text
    assert "ddpN" not in text and "fsdpN" not in text
    assert layout_legend(["ddp8"])[0].startswith("layouts: ddpN = N data-parallel replicas")


def test_memory_headroom_warning_above_90_percent_of_device_memory(capsys, monkeypatch):
    out = _plan_out(GPT7B_64, capsys, monkeypatch, 120)
    # The pick needs 73.0 GiB of the H100's 80 GiB (91%): warned, with the next layout under 90%.
    flat = " ".join(out.split())  # the warning wraps at the terminal's width
    warning = flat[flat.index("warning: memory"):]
    assert out.count("warning: memory") == 1
    assert "73.0 GiB of 80 GiB" in warning and "91%" in warning and "90%" in warning
    assert "The best under 90%: #2 fsdp32(z3)xtp2, 67.0 GiB" in warning
    import json

    doc = json.loads(_plan_out([*GPT7B_64, "--json"], capsys, monkeypatch, 120))
    assert doc["memory_warning"].startswith("warning: memory: the chosen layout needs 73.0 GiB of 80 GiB")
    out = _plan_out(["plan", "--model", "resnet50", "--gpus", "16", "--gpu-type", "V100", "--network", "25gbit-roce"],
                    capsys, monkeypatch, 120)
    assert "warning: memory" not in out


@pytest.mark.parametrize("argv, nodes", [
    (GPT7B_64, 8),
    (["plan", "--model", "resnet50", "--gpus", "16", "--gpu-type", "V100", "--network", "25gbit-roce"], 2),
    (["plan", "--model", "gpt-125m", "--gpus", "4", "--gpu-type", "H100", "--network", "1gbit"], 1),
])
def test_printed_run_command_passes_the_launcher_checks(argv, nodes, capsys, monkeypatch, tmp_path):
    """The command as printed goes through `slipstream run`'s own parser and every check made
    before a worker starts (LaunchOptions.validate); across nodes the one thing to fill in is
    the first node's address, and the output says so."""
    import shlex

    from slipstream.cli import build_parser
    from slipstream.launch.cli import launch_options_from_args

    out = _plan_out(argv, capsys, monkeypatch, 120)
    words = shlex.split(_run_command(out))
    assert words[:2] == ["slipstream", "run"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    opts = launch_options_from_args(build_parser(words[1:]).parse_args(words[1:]))
    opts.validate()
    assert opts.max_nodes == nodes
    if nodes > 1:
        assert opts.rdzv_endpoint == "NODE0_HOST:29500"
        assert "NODE0_HOST" in out.split(_run_command(out))[1]  # explained after the command
        assert f"on each of the {nodes} nodes" in out
    else:
        assert opts.rdzv_endpoint is None
