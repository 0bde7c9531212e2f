"""The training image, run for real on this machine's Docker engine.

* ``docker run --rm IMAGE run -n 2 examples/train_gpt.py`` trains, and the loss falls;
* ``slipstream validate``, ``render`` and ``plan`` work inside the image with no network;
* the seed-shaped spec (name, image, replicas: 2, gpu_count, command) runs as two containers on a
  Docker network, one node each, with the rendezvous on the first: each container gets the
  ``slipstream run`` flags a pod of the rendered manifests gets (``job.commands.launcher_flags``),
  its container name standing in for the pod's address;
* one of the two is killed (``docker kill``) mid-run and started again, as a pod restart would
  be: the job resumes from its checkpoint on the shared volume and ends with weights bitwise
  equal to the uninterrupted run's.

A tiny GPT (dim 32, one layer), so the four cost about a minute, most of it container start-up
and the restart.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from slipstream.checkpoint.layout import MARKER
from slipstream.job.commands import entry_argv, launcher_flags
from slipstream.job.spec import RDZV_PORT, load_spec
from tests.harness import weights_difference

TINY = ["--dim", "32", "--layers", "1", "--context", "32", "--batch-size", "4", "--corpus-mb", "0.5"]
STEPS = 150
CHECKPOINT_EVERY = 25
"""A 2-node step of this GPT takes 10 to 30 ms in the containers here, so the 125 steps after the
first checkpoint (where the kill is sent) leave 1.2 s or more before the end. Checkpoints are
few because each one costs more than 25 steps here (DCP on two ranks, fsync)."""
JOB_TIMEOUT_S = 180


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    if check:
        assert proc.returncode == 0, f"docker {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+(?:/\d+)? \| loss ([0-9.]+)", log)]


def test_image_trains_with_two_workers(docker_image):
    proc = docker("run", "--rm", docker_image, "run", "-n", "2", "examples/train_gpt.py", "--steps", "20", *TINY,
                  timeout_s=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "done: 20 steps" in out and "2 rank(s)" in out, out[-3000:]
    seen = losses(out)
    assert len(seen) == 2 and seen[-1] < seen[0] - 0.3, seen


def test_validate_render_and_plan_work_offline(docker_image, tmp_path):
    spec = {"name": "seed", "image": docker_image, "replicas": 2, "gpu_count": 8,
            "command": ["python", "examples/train_gpt.py"]}
    (tmp_path / "seed.yaml").write_text(yaml.safe_dump(spec))
    tmp_path.chmod(0o755)
    (tmp_path / "seed.yaml").chmod(0o644)
    script = "; ".join([
        "set -e",
        "slipstream validate /job/seed.yaml",
        "echo '--- render'", "slipstream render /job/seed.yaml",
        "echo '--- slurm'", "slipstream render /job/seed.yaml --target slurm",
        "echo '--- plan'",
        "slipstream plan --model gpt-125m --gpus 16 --gpu-type H100 --network 8x400gbit-ib --tokens 1B",
    ])
    proc = docker("run", "--rm", "--network", "none", "-v", f"{tmp_path}:/job:ro", "--entrypoint", "sh",
                  docker_image, "-c", script, timeout_s=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    validate, rest = out.split("--- render", 1)
    manifests, rest = rest.split("--- slurm", 1)
    sbatch, plan = rest.split("--- plan", 1)
    assert "seed.yaml" in validate and "error" not in validate.lower(), validate
    assert "kind: Job" in manifests and f"image: {docker_image}" in manifests, manifests[:2000]
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch, sbatch[:2000]
    assert "gpt-125m" in plan and "step" in plan.lower(), plan[-2000:]


class ContainerJob:
    """A job spec run as one container per replica on its own Docker network, with a shared
    volume at /shared (the checkpoint directory and the final weights)."""

    def __init__(self, image: str, shared: Path, name: str):
        self.image, self.shared, self.name = image, shared, name
        shared.mkdir(parents=True, exist_ok=True)
        shared.chmod(0o777)  # the image runs as uid 10001
        spec_doc = {
            "name": name, "image": image, "replicas": 2, "gpu_count": 0,
            "command": ["python", "examples/train_gpt.py"],
            "args": ["--steps", str(STEPS), *TINY, "--checkpoint-dir", "/shared/ckpt",
                     "--checkpoint-every-steps", str(CHECKPOINT_EVERY), "--out", "/shared/out"],
            "checkpoint": {"dir": "/shared/ckpt"},
            "restarts": {"max_restarts": 3},
        }
        path = shared.parent / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec_doc, sort_keys=False))
        self.spec = load_spec(path)
        self.network = f"{name}-net"
        self.containers = [f"{name}-{i}" for i in range(self.spec.replicas)]

    def start(self) -> None:
        docker("network", "create", self.network)
        endpoint = f"{self.containers[0]}:{RDZV_PORT}"  # the rendezvous on the first replica, as in the manifests
        env = [a for k, v in self.spec.worker_env().items() for a in ("-e", f"{k}={v}")]
        for i, container in enumerate(self.containers):
            flags = launcher_flags(self.spec, self.spec.nnodes, endpoint, str(i), self.name, local_addr=container)
            docker("run", "-d", "--name", container, "--hostname", container, "--network", self.network,
                   "-v", f"{self.shared}:/shared", *env, self.image, "run", *flags, *entry_argv(self.spec))

    def wait(self) -> list[int]:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        codes = []
        for container in self.containers:
            left = max(1.0, deadline - time.monotonic())
            proc = docker("wait", container, timeout_s=left, check=False)
            codes.append(int(proc.stdout.strip() or -1))
        return codes

    def logs(self) -> str:
        return "\n".join(f"=== {c}\n" + docker("logs", "-t", c, check=False).stdout + docker("logs", "-t", c, check=False).stderr
                         for c in self.containers)

    def remove(self) -> None:
        docker("rm", "-f", *self.containers, check=False)
        docker("network", "rm", self.network, check=False)


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(d.name.split("_")[1]) for d in ckpt.glob("step_*") if (d / MARKER).is_file())


@pytest.fixture(scope="module")
def uninterrupted(docker_image, tmp_path_factory):
    """One 2-container run from start to end: (shared directory, exit codes, logs)."""
    job = ContainerJob(docker_image, tmp_path_factory.mktemp("container-job") / "shared",
                       f"slip-base-{uuid.uuid4().hex[:6]}")
    try:
        job.start()
        codes = job.wait()
        return job.shared, codes, job.logs()
    finally:
        job.remove()


def test_seed_spec_runs_as_two_containers(uninterrupted):
    shared, codes, logs = uninterrupted
    assert codes == [0, 0], logs[-4000:]
    assert f"done: {STEPS} steps" in logs and "2 rank(s)" in logs, logs[-4000:]
    seen = losses(logs)
    assert len(seen) >= 2 and seen[-1] < seen[0] - 0.5, seen
    assert (shared / "out" / "model.pt").is_file()


def test_killed_container_restarts_and_the_job_resumes_bitwise(uninterrupted, docker_image, tmp_path):
    job = ContainerJob(docker_image, tmp_path / "shared", f"slip-kill-{uuid.uuid4().hex[:6]}")
    ckpt = job.shared / "ckpt"
    try:
        job.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (ckpt.exists() and committed_steps(ckpt)):
            assert time.monotonic() < deadline, f"no checkpoint committed: {job.logs()[-3000:]}"
            time.sleep(0.05)
        docker("kill", job.containers[1])  # the node is gone: agent and workers together
        killed_at = committed_steps(ckpt)[-1]
        before = docker("logs", job.containers[1], check=False)
        assert f"done: {STEPS} steps" not in before.stdout + before.stderr, "the kill came after the end"
        # Start it again once it has stopped (`docker kill` returns before; `docker start` on a
        # container still running is a no-op). Its sockets closed with it: the survivor sees its
        # peer gone before the pod comes back, with no fixed wait.
        gone = docker("wait", job.containers[1], timeout_s=30)
        assert gone.stdout.strip() == "137", gone.stdout  # SIGKILL
        docker("start", job.containers[1])
        codes = job.wait()
        logs = job.logs()
    finally:
        job.remove()
    assert codes == [0, 0], logs[-5000:]
    resumed = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", logs)]
    assert resumed and all(killed_at <= n < STEPS for n in resumed), (killed_at, resumed, logs[-5000:])
    assert f"done: {STEPS} steps" in logs, logs[-4000:]
    base_shared = uninterrupted[0]
    assert (diff := weights_difference(job.shared / "out" / "model.pt", base_shared / "out" / "model.pt")) == "", diff
