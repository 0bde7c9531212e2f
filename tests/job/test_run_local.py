"""`slipstream run JOB.yaml` on this machine: replicas become local elastic agents."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from slipstream.errors import UsageError
from slipstream.cli import build_parser
from slipstream.job.cli import job_run_from_args
from slipstream.job.runner import JobRun, parse_emulate, run_job
from slipstream.job.spec import parse_spec
from tests.conftest import require_root

from .conftest import EXAMPLES, REPO

pytestmark = pytest.mark.distributed


def test_two_replica_spec_runs_to_completion(tmp_path):
    """The example spec, unchanged: 2 replicas x 1 CPU process, a gloo all_reduce, a file written."""
    out = tmp_path / "result.txt"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", str(EXAMPLES / "local-2x1.yaml"), "--", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    # world size 2, ranks 0 and 1 each contributed rank+1; the spec's env and sync options arrived.
    assert out.read_text().strip() == "world_size=2 sum=3 group_rank=0 job=allreduce-check precision=bf16"
    # The spec's training option reached the workers' entry, which says it found nothing to apply it to
    # (the script builds no DDP model and does not call accelerate(): docs/zero-change.md).
    assert "--precision not applied: the script built no DistributedDataParallel model" in proc.stderr
    print(f"2-replica local run: {elapsed:.1f} s")


def test_a_failing_replica_stops_the_others_and_sets_the_exit_code(monkeypatch):
    """The supervision loop, with plain processes standing in for agents (no torch start-up cost)."""
    from slipstream.job import runner
    from slipstream.launch.proc import stop_processes

    monkeypatch.setattr(runner, "STOP_GRACE_S", 0.5)
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
             subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])]
    try:
        code = runner._wait_all(procs)
    finally:
        stop_processes(procs, grace_s=runner.KILL_GRACE_S)
    assert code == 1
    assert procs[0].returncode is not None and time.monotonic() - started < 30
    ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert runner._wait_all(ok) == 0
    preempted = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(143)"])]
    assert runner._wait_all(preempted) == 143


def _run_request(*argv: str) -> JobRun:
    """``slipstream run ARGV`` as the job runner gets it."""
    return job_run_from_args(build_parser().parse_args(["run", *argv]))


def test_topology_flags_conflict_with_a_spec(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: a\nimage: i\ncommand: [python, t.py]\n")
    with pytest.raises(UsageError, match="--nnodes cannot be combined with a job spec"):
        _run_request("--nnodes", "2", str(path))


@pytest.mark.parametrize("flags", [["--standalone"], ["--log-dir", "/tmp/logs"], ["--master-addr", "10.0.0.1"],
                                   ["--tee", "3"], ["--rdzv-backend", "c10d"]])
def test_torchrun_options_a_job_spec_cannot_honour_are_refused_by_name(tmp_path, flags):
    path = tmp_path / "j.yaml"
    path.write_text("name: a\nimage: i\ncommand: [python, t.py]\n")
    with pytest.raises(UsageError, match=f"{flags[0]} has no effect with a job spec"):
        _run_request(*flags, str(path))
    assert _run_request(str(path)).script_args == ()  # and nothing given: accepted


def test_missing_script_is_a_usage_error(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: a\nimage: i\ncommand: [python, does_not_exist.py]\n")
    with pytest.raises(UsageError, match="training script not found: does_not_exist.py"):
        run_job(_run_request(str(path)))


def test_emulate_shape_must_match_the_spec():
    spec = parse_spec({"name": "a", "image": "i", "command": ["python", "t.py"], "replicas": 2, "gpu_count": 2})
    parse_emulate(True, spec)
    parse_emulate("2x2", spec)
    with pytest.raises(UsageError, match="--emulate 4x1 does not match the job spec .2 replicas x 2 processes"):
        parse_emulate("4x1", spec)
    with pytest.raises(UsageError, match="--emulate must be NODESxPROCS"):
        parse_emulate("lots", spec)


def test_worker_shim_runs_script_as_main_with_args(tmp_path, monkeypatch, capsys):
    from slipstream.job import worker

    script = tmp_path / "s.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print('ARGS', sys.argv[1:])\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("SLIPSTREAM_GPU_MEMORY_FRACTION", "0.5")
    worker.main([str(script), "--a", "1"])
    assert "ARGS ['--a', '1']" in capsys.readouterr().out
    import torch

    applied = worker.apply_memory_fraction({"SLIPSTREAM_GPU_MEMORY_FRACTION": "0.5", "LOCAL_RANK": "0"})
    assert applied == (0.5 if torch.cuda.is_available() else None)
    with pytest.raises(SystemExit, match=r"must be in \(0, 1\], got '2'"):
        worker.apply_memory_fraction({"SLIPSTREAM_GPU_MEMORY_FRACTION": "2"})


@pytest.mark.root
def test_two_replica_spec_on_an_emulated_cluster(tmp_path):
    """The same spec, unchanged, on two network namespaces with 1 Gbit/s links (needs root)."""
    require_root()
    out = tmp_path / "result.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", "1gbit",
         str(EXAMPLES / "local-2x1.yaml"), "--", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "emulated cluster 2x1, link 1gbit" in proc.stderr
    assert out.read_text().strip() == "world_size=2 sum=3 group_rank=0 job=allreduce-check precision=bf16"
    # The spec's training option reached the workers' entry, which says it found nothing to apply it to
    # (the script builds no DDP model and does not call accelerate(): docs/zero-change.md).
    assert "--precision not applied: the script built no DistributedDataParallel model" in proc.stderr


def test_launcher_flags_after_the_spec_are_refused(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: a\nimage: i\ncommand: [python, t.py]\n")
    with pytest.raises(UsageError, match="--emulate must come before the job spec"):
        _run_request(str(path), "--emulate", "2x1")


def test_run_flags_override_the_spec_env(tmp_path):
    """`slipstream run --precision fp16 --collective-timeout-s 30 JOB.yaml`: flags win over the spec."""
    path = tmp_path / "j.yaml"
    path.write_text("name: a\nimage: i\ncommand: [python, t.py]\nsync: {precision: bf16, accumulate_steps: 2}\n")
    request = _run_request("--precision", "fp16", "--collective-timeout-s", "30", "--rdzv-conf", "a=1", str(path),
                           "--", "--steps", "3")
    env = request.spec.worker_env()
    env.update(request.worker_env)
    assert env["SLIPSTREAM_PRECISION"] == "fp16" and env["SLIPSTREAM_ACCUMULATE_STEPS"] == "2"
    assert env["SLIPSTREAM_COLLECTIVE_TIMEOUT_S"] == "30.0"
    assert (request.script_args, request.rdzv_conf, request.max_restarts) == (("--steps", "3"), {"a": "1"}, None)


def test_prewarm_fills_the_cache_before_replicas_start(tmp_path):
    """data.prewarm runs the data pipeline's own `slipstream data prewarm` (locally here,
    as an init container in pods)."""
    from slipstream.data.pack import pack
    from slipstream.job.runner import prewarm_local

    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(3):
        (raw / f"s{i}.bin").write_bytes(bytes([i]) * 100)
    pack(str(raw), str(tmp_path / "ds"))
    cache = tmp_path / "cache"
    spec = parse_spec({"name": "a", "image": "i", "command": ["python", "t.py"],
                       "data": {"source": str(tmp_path / "ds"), "cache_dir": str(cache), "prewarm": True}})
    assert prewarm_local(spec, dict(os.environ)) == 0
    assert any(p.is_file() and p.stat().st_size > 0 for p in cache.rglob("*"))


def test_a_configuration_error_in_a_replica_exits_2_with_its_message(tmp_path):
    """Issue #22: through a job spec too, a worker's ConfigError ends the run with exit 2
    (not 1), its message shown, no restart spent although the spec allows two."""
    script = REPO / "tests" / "integration" / "scripts_config_error.py"
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: config-error\nimage: img:1\ncommand: [python, {script}]\nreplicas: 2\ngpu_count: 0\n"
                    "restarts:\n  max_restarts: 2\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.run([sys.executable, "-m", "slipstream", "run", str(spec), "--", "--marker", str(marks)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    report = proc.stderr.split("slipstream run: configuration error in")[-1]
    assert "slipstream: error (rank " in report and "checkpoint_dir exists and is not a directory" in report
    assert "training failed" not in proc.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["start-rank0-attempt0", "start-rank1-attempt0"]


def test_a_replica_usage_error_decides_the_exit_code():
    """A peer replica that noticed the departure first (exit 1) does not hide the cause (exit 2)."""
    from slipstream.job import runner
    from slipstream.launch.proc import stop_processes

    # Ordered by an event, not a window: replica 1 exits 2 when it sees replica 0 leave (the
    # end of a pipe only replica 0 holds open), as a worker sees its peer's departure. The test
    # once gave replica 1 a 0.5 s sleep against a 0.5 s grace that started when replica 0's exit
    # was polled: the margin was the difference between two Python start-ups (about 0.1 s), and
    # under the full suite's load (CPU-bound neighbours, processes other tests left running)
    # one start-up ran more than that behind the other, and replica 1 was stopped first.
    read_fd, write_fd = os.pipe()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"], pass_fds=(write_fd,)),
                 subprocess.Popen([sys.executable, "-c",
                                   f"import os, sys\nwhile os.read({read_fd}, 1): pass\nsys.exit(2)"],
                                  pass_fds=(read_fd,))]
    finally:
        os.close(write_fd)  # only replica 0 holds the write end now: its exit is replica 1's EOF
        os.close(read_fd)
    try:
        assert runner._wait_all(procs) == 2
        assert [p.returncode for p in procs] == [1, 2], "replica 1 left by itself, after replica 0"
    finally:
        stop_processes(procs, grace_s=runner.KILL_GRACE_S)



def test_the_local_rendezvous_port_has_the_healing_stores_port_free_after_it(monkeypatch):
    """Healing is on by default for a spec's local replicas, whose launcher hosts its store on the
    rendezvous port + 1: run_local's port is one whose next port is free too (here the first
    port offered has its next one taken, so a second is drawn)."""
    from slipstream.job import runner

    asked: list[int] = []

    def bindable(host: str, port: int) -> bool:
        asked.append(port)
        return len(asked) > 1

    monkeypatch.setattr(runner, "_bindable", bindable)
    port = runner.free_port(count=2)
    assert len(asked) == 2 and port + 1 == asked[1]
    assert runner.free_port() and len(asked) == 2  # one port: nothing after it is asked about
