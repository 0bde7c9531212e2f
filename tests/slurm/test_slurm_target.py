"""The Slurm target against the real two-node cluster (scripts/slurm_cluster.sh: n1 and n2 on this host).

* the seed-shaped spec renders a script ``sbatch --test-only`` accepts;
* examples/train_gpt.py as a 2-node job through ``slipstream submit --target slurm``: it
  completes with the loss falling, seen through ``slipstream status`` and ``slipstream logs``;
* the same job preempted (``scancel --signal=TERM``): emergency checkpoint, exit 143, the batch
  script requeues it, the requeued job resumes from the checkpoint and ends with weights bitwise
  equal to the uninterrupted run's (which the previous test made: one baseline, shared).

A tiny GPT (dim 32, one layer) so the three cost about a minute, most of it process start-up and
Slurm's requeue delay (cred_expire + 1 = 11 s on this cluster).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.harness import weights_difference

REPO = Path(__file__).resolve().parents[2]
TRAIN_GPT = str(REPO / "examples" / "train_gpt.py")
HELD_TRAIN_GPT = str(Path(__file__).with_name("held_train_gpt.py"))
STEPS = 130
HOLD_STEP = 20
"""The preempted job's ranks hold after optimizer step HOLD_STEP until SIGTERM reaches them
(held_train_gpt.py), so the signal lands while training runs, however loaded the machine. The
emergency save then comes at the ranks' next stop agreement, at most STOP_CHECK_MAX_STEPS (100) steps
later: by step 120, before the last."""
GPT_ARGS = ["--steps", str(STEPS), "--dim", "32", "--layers", "1", "--context", "32", "--batch-size", "4",
            "--corpus-mb", "0.5"]
JOB_TIMEOUT_S = 150.0


def write_job(directory: Path, name: str, held: bool = False) -> Path:
    """A 2-node CPU training spec for train_gpt.py that checkpoints to and writes its weights into ``directory``.

    ``held``: through held_train_gpt.py, which holds every rank after step HOLD_STEP until SIGTERM.
    """
    ckpt, out = directory / "ckpt", directory / "out"
    spec = {
        "name": name, "image": "slipstream:0.1.0",
        "command": ["python", HELD_TRAIN_GPT, str(directory), str(HOLD_STEP)] if held else ["python", TRAIN_GPT],
        # train_gpt.py saves its data position only with --checkpoint-dir; the spec's dir is the same one.
        "args": [*GPT_ARGS, "--checkpoint-dir", str(ckpt), "--out", str(out)],
        "replicas": 2, "gpu_count": 0, "checkpoint": {"dir": str(ckpt)},
        "restarts": {"max_restarts": 0},
        "slurm": {"time": "10:00"},
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def slipstream(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)


def submit(spec: Path, env: dict[str, str]) -> str:
    proc = slipstream(["submit", str(spec), "--target", "slurm"], env, spec.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split()[0]
    assert job_id.isdigit(), proc.stdout
    return job_id


def job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_done(job_id: str, env: dict[str, str]) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        fields = job_fields(job_id, env)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    pytest.fail(f"job {job_id} not finished after {JOB_TIMEOUT_S:.0f} s: {job_fields(job_id, env)}")


def losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"\] step \d+(?:/\d+)? \| loss ([0-9.]+)", log)]


@pytest.fixture(scope="module")
def baseline(slurm_env, tmp_path_factory):
    """One uninterrupted 2-node run, submitted through the CLI: (directory, job id, finished job's fields)."""
    directory = tmp_path_factory.mktemp("slurm-baseline")
    spec = write_job(directory, "gpt-base")
    job_id = submit(spec, slurm_env)
    return directory, job_id, wait_done(job_id, slurm_env)


def test_seed_spec_passes_sbatch_test_only(slurm_env, tmp_path):
    spec = tmp_path / "seed.yaml"
    spec.write_text(yaml.safe_dump({"name": "seed", "image": "slipstream:0.1.0",
                                    "replicas": 2, "gpu_count": 0, "command": ["python", "train.py"]}))
    proc = slipstream(["validate", str(spec), "--target", "slurm"], slurm_env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passes bash -n and sbatch --test-only" in proc.stdout and "n[1-2]" in proc.stdout, proc.stdout
    # and the script itself, straight to sbatch
    script = slipstream(["render", str(spec), "--target", "slurm"], slurm_env, tmp_path).stdout
    assert "#SBATCH --nodes=2" in script and "--ntasks-per-node=1" in script and "--gpus-per-node" not in script
    test = subprocess.run(["sbatch", "--test-only"], input=script, env=slurm_env, capture_output=True, text=True,
                          timeout=30)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr


def test_two_node_job_completes_with_falling_loss(baseline, slurm_env):
    directory, job_id, fields = baseline
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
    assert fields["NodeList"] == "n[1-2]", fields
    # status and logs by name, through the submission record
    status = slipstream(["status", "gpt-base"], slurm_env, directory)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "COMPLETED" in status.stdout and job_id in status.stdout, status.stdout
    assert f"step {STEPS}" in status.stdout, status.stdout  # from the job's run directory (runs/slurm-ID)
    logs = slipstream(["logs", "gpt-base"], slurm_env, directory)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert f"done: {STEPS} steps" in logs.stdout and "2 rank(s)" in logs.stdout, logs.stdout[-3000:]
    seen = losses(logs.stdout)
    assert len(seen) >= 2 and seen[-1] < seen[0] - 0.3, seen
    # one rank's lines: every worker line carries [rankR]: (the script's --tee 3 and prefix template)
    rank0 = slipstream(["logs", "gpt-base", "--rank", "0"], slurm_env, directory).stdout.splitlines()
    rank1 = slipstream(["logs", "gpt-base", "--rank", "1"], slurm_env, directory).stdout.splitlines()
    assert rank0 and all(line.startswith("[rank0]:") for line in rank0), rank0[:5]
    assert any(f"done: {STEPS} steps" in line for line in rank0), rank0[-5:]
    assert all(line.startswith("[rank1]:") for line in rank1) and not any("done:" in x for x in rank1), rank1[:5]
    assert (directory / "out" / "model.pt").is_file()
    # Quiet success (issue #46 item 4): the launcher's summary, then only the run directory; no
    # C++ warning, traceback or native frame anywhere in the job's output.
    out = (directory / f"slipstream-gpt-base-{job_id}.out").read_text()
    lines = out.splitlines()
    summary = max(i for i, line in enumerate(lines) if line.startswith(f"slipstream run: done: {STEPS} steps"))
    run_dir = directory / "runs" / f"slurm-{job_id}"
    assert lines[summary + 1:] == [f"slipstream run: run directory {run_dir} (see it with: slipstream report {run_dir})"], \
        lines[summary - 3:]
    for noise in ("Traceback", "frame #", "TCPStore.cpp", "socket.cpp", "failed to shutdown"):
        assert noise not in out, out[-3000:]


def test_preempted_job_requeues_and_resumes_bitwise(baseline, slurm_env, tmp_path):
    directory = tmp_path
    spec = write_job(directory, "gpt-preempt", held=True)
    job_id = submit(spec, slurm_env)
    output = directory / f"slipstream-gpt-preempt-{job_id}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    # SIGTERM to the job's steps (the agents), as the time limit's --signal would send it, once both
    # ranks hold mid-training.
    while not all((directory / f"held-rank{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, f"job {job_id} never held at step {HOLD_STEP}: {job_fields(job_id, slurm_env)}"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=slurm_env, check=True, timeout=30)
    fields = wait_done(job_id, slurm_env)
    log = output.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, log[-3000:])
    assert "preempted (exit 143): requeueing it" in log, log[-3000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed and HOLD_STEP <= int(resumed.group(1)) < STEPS, log[-3000:]
    assert f"done: {STEPS} steps" in log, log[-3000:]
    base_dir = baseline[0]
    diff = weights_difference(directory / "out" / "model.pt", base_dir / "out" / "model.pt")
    assert diff == "", f"{diff}\n{resumed.group(0)}\n{log[-3000:]}"
