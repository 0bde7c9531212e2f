"""The sbatch script the Slurm target renders, and the CLI around it, without a cluster (milliseconds)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from slipstream.job import load_spec, parse_spec
from slipstream.job.render import TargetUnsupported
from slipstream.job.slurm import check_syntax, render_sbatch, sbatch_options
from tests.conftest import need_command
from tests.job.conftest import run_cli, write_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("SLIPSTREAM_UPDATE_GOLDEN") == "1"
SEED = {"name": "seed", "image": "slipstream:0.1.0", "replicas": 2, "gpu_count": 0,
        "command": ["python", "train.py"]}


def spec_of(**more):
    return parse_spec({**SEED, **more})


@pytest.mark.parametrize("example", ["local-2x1", "full"])
def test_golden(example):
    """The whole script for two example specs (SLIPSTREAM_UPDATE_GOLDEN=1 rewrites the files)."""
    path = f"examples/jobs/{example}.yaml"
    text = render_sbatch(load_spec(REPO / path), path)
    golden = GOLDEN / f"{example}.sbatch"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()
    check_syntax(text)


def test_seed_spec_options():
    opts = sbatch_options(spec_of())
    assert opts[:3] == ["--job-name=seed", "--nodes=2", "--ntasks-per-node=1"]
    assert "--requeue" in opts and "--signal=TERM@120" in opts and not any("gpu" in o for o in opts)
    assert not any(o.startswith(("--time", "--partition", "--account", "--qos", "--mem")) for o in opts)
    # One CPU per worker without `cpu` (Slurm would give the node's one task a single CPU).
    assert "--cpus-per-task=1" in opts
    assert "--cpus-per-task=8" in sbatch_options(spec_of(gpu_count=8))


@pytest.mark.parametrize("more, expected", [
    ({"gpu_count": 8}, "--gpus-per-node=8"),
    ({"gpu_count": 2, "gpu_slice": {"mig": "1g.10gb"}}, "--gres=gpu:1g.10gb:2"),
    ({"gpu_count": 1, "gpu_slice": {"time_sliced": True}}, "--gres=shard:1"),
    ({"cpu": "500m"}, "--cpus-per-task=1"),
    ({"cpu": "6"}, "--cpus-per-task=6"),
    ({"memory": "16Gi"}, "--mem=16384M"),
    ({"elastic": {"min_replicas": 1, "max_replicas": 4}}, "--nodes=1-4"),
    ({"slurm": {"time": "1-00:00", "partition": "gpu", "account": "ml", "qos": "high"}}, "--time=1-00:00"),
    ({"slurm": {"partition": "gpu"}}, "--partition=gpu"),
    ({"slurm": {"account": "ml"}}, "--account=ml"),
    ({"slurm": {"qos": "high"}}, "--qos=high"),
    ({"slurm": {"signal_grace_s": 300}}, "--signal=TERM@300"),
    ({"slurm": {"requeue": False}}, "--no-requeue"),
])
def test_spec_keys_become_sbatch_options(more, expected):
    assert expected in sbatch_options(spec_of(**more))


def test_script_runs_one_agent_per_node_with_the_spec_environment():
    text = render_sbatch(spec_of(checkpoint={"dir": "/ckpt/seed"}, env={"A": "x y"}))
    assert "export SLIPSTREAM_CHECKPOINT_DIR=/ckpt/seed" in text and "export A='x y'" in text
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1" in text
    assert '--node-rank "$SLURM_NODEID" --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"' in text
    assert "srun --ntasks-per-node=1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "scontrol requeue" not in render_sbatch(spec_of(slurm={"requeue": False}))
    check_syntax(text)


def test_slurm_keys_are_checked():
    with pytest.raises(Exception, match=r"slurm.time: must be a Slurm time limit"):
        spec_of(slurm={"time": "1h"})
    with pytest.raises(Exception, match=r"slurm.partition"):
        spec_of(slurm={"partition": "a b"})


def test_inference_is_refused():
    spec = parse_spec({**SEED, "kind": "inference", "command": ["serve"]})
    with pytest.raises(TargetUnsupported, match="training jobs only"):
        render_sbatch(spec)


def test_cli_render_out_and_validate_all_targets(tmp_path, capsys):
    path = write_spec(SEED, str(tmp_path))
    code, out, _ = run_cli(["render", path, "--target", "slurm", "--out", str(tmp_path / "o")], capsys)
    assert code == 0 and (tmp_path / "o" / "seed.sbatch").read_text().startswith("#!/bin/bash")
    code, out, _ = run_cli(["validate", path], capsys)
    assert code == 0 and "slurm: sbatch script: passes bash -n" in out


def test_no_sbatch_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    path = write_spec(SEED, str(tmp_path))
    code, _, err = run_cli(["submit", path, "--target", "slurm", "--sbatch", str(tmp_path / "no-sbatch")], capsys)
    assert code == 2 and "sbatch not found" in err and len(err.strip().splitlines()) == 1
    # validate still passes its offline checks, and says why sbatch --test-only did not run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))  # bash -n still runs; sbatch is missing
    monkeypatch.setenv("PATH", str(bin_dir))
    code, out, _ = run_cli(["validate", path, "--target", "slurm"], capsys)
    assert code == 0 and "passes bash -n; sbatch --test-only skipped: sbatch is not installed" in out


def test_unreachable_controller_is_exit_2(tmp_path, capsys, monkeypatch):
    need_command("sbatch")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    path = write_spec(SEED, str(tmp_path))
    code, _, err = run_cli(["submit", path, "--target", "slurm"], capsys)
    assert code == 2 and "no Slurm configuration" in err


def test_dry_run_prints_the_script(tmp_path, capsys):
    path = write_spec(SEED, str(tmp_path))
    code, out, _ = run_cli(["submit", path, "--target", "slurm", "--dry-run"], capsys)
    assert code == 0 and out.startswith("# would run: sbatch --parsable") and "#SBATCH --nodes=2" in out


def _agent_argv(script: str, tmp_path: Path) -> list[str]:
    """The words each node's agent is started with: the script's srun line run by bash as srun
    would (``bash -c 'exec slipstream run ...'``), with stand-ins for ``slipstream`` (it records
    its arguments) and ``scontrol``, and the variables Slurm sets."""
    import json
    import shlex
    import subprocess
    import sys

    (line,) = [x for x in script.splitlines() if x.startswith("srun ") and "bash -c" in x]
    words = shlex.split(line.rstrip(" &"))
    command = words[words.index("-c") + 1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "slipstream").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                        "json.dump(sys.argv[1:], open(os.environ['ARGV_OUT'], 'w'))\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'NodeName=n0 NodeAddr=10.0.0.1 State=IDLE'\n")
    for stub in ("slipstream", "scontrol"):
        (bin_dir / stub).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_OUT": str(tmp_path / "argv.json"), "SLURM_NODEID": "0",
           "RDZV_HOST": "10.0.0.1", "RDZV_PORT": "29400", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURMD_NODENAME": "n0"}
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    return json.loads((tmp_path / "argv.json").read_text())


@pytest.mark.parametrize("replicas,restarts,expected", [
    (1, {}, {"SLIPSTREAM_HEAL": "1", "SLIPSTREAM_HEAL_SPARES": "1"}),  # on by default: no flag rendered
    (1, {"heal": False}, {}),
    (1, {"spares": 0}, {"SLIPSTREAM_HEAL": "1", "SLIPSTREAM_HEAL_SPARES": "0"}),
    # Across nodes the launcher's default is off (a lost node comes back through the rendezvous).
    (2, {}, {}),
])
def test_heal_and_spares_round_trip_from_the_spec_to_each_nodes_launcher(replicas, restarts, expected, tmp_path,
                                                                          monkeypatch):
    """restarts.heal / restarts.spares reach every node's `slipstream run` (--no-heal / --spares), and
    through its parser the workers' environment: no supervisor under heal: false."""
    from slipstream.cli import build_parser
    from slipstream.launch.heal_setup import NAMES, set_heal_env
    from slipstream.launch.cli import launch_options_from_args

    argv = _agent_argv(render_sbatch(spec_of(restarts=restarts, replicas=replicas, processes_per_replica=2)), tmp_path)
    assert argv[0] == "run" and ("--no-heal" in argv) == (restarts.get("heal") is False)
    for name in NAMES:  # recorded, so that the test's end takes back what set_heal_env writes
        monkeypatch.setenv(name, "stale")
    set_heal_env(launch_options_from_args(build_parser().parse_args(argv)))
    assert {k: v for k, v in os.environ.items() if k.startswith("SLIPSTREAM_HEAL")} == expected
