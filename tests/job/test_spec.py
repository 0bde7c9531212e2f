"""The job spec: defaults, derived values, and the exact wording of errors."""

from __future__ import annotations

from decimal import Decimal

import pytest

from slipstream.errors import ConfigError, UsageError
from slipstream.job.quantity import parse_quantity
from slipstream.job.spec import load_spec, load_spec_text, parse_entrypoint, parse_spec

from .conftest import EXAMPLES, write_spec


def spec_of(**over):
    data = {"name": "t", "image": "img:1", "command": ["python", "train.py"]}
    data.update(over)
    return parse_spec(data)


def error_of(**over) -> str:
    with pytest.raises(ConfigError) as info:
        spec_of(**over)
    return str(info.value)


def test_defaults():
    s = spec_of()
    assert (s.kind, s.replicas, s.gpu_count, s.procs_per_replica, s.nnodes) == ("training", 1, 0, 1, "1")
    assert s.restarts.max_restarts == 3 and s.restarts.max_pod_restarts == 3
    assert s.gpu_resource is None
    assert s.worker_env() == {"SLIPSTREAM_JOB_NAME": "t"}  # default sync options add nothing


def test_gpu_count_is_processes_per_replica_and_resource():
    s = spec_of(replicas=3, gpu_count=4)
    assert s.procs_per_replica == 4 and s.gpu_resource == "nvidia.com/gpu"
    assert spec_of(gpu_count=4, processes_per_replica=2).procs_per_replica == 2
    assert spec_of(gpu_count=1, gpu_slice={"mig": "1g.10gb"}).gpu_resource == "nvidia.com/mig-1g.10gb"
    assert spec_of(gpu_count=1, gpu_slice={"time_sliced": True}).gpu_resource == "nvidia.com/gpu.shared"


def test_elastic_range_becomes_nnodes():
    assert spec_of(replicas=3, elastic={"min_replicas": 2, "max_replicas": 5}).nnodes == "2:5"
    assert spec_of(replicas=3, elastic={}).nnodes == "3"


def test_worker_env_carries_training_options():
    s = spec_of(sync={"strategy": "bf16", "precision": "bf16", "accumulate_steps": 4},
                checkpoint={"dir": "/ck", "interval_steps": 100},
                data={"source": "s3://b/p", "cache_dir": "/c", "prewarm": True},
                env={"A": 1, "B": True})
    env = s.worker_env()
    assert env["SLIPSTREAM_SYNC"] == "bf16" and env["SLIPSTREAM_PRECISION"] == "bf16"
    assert env["SLIPSTREAM_ACCUMULATE_STEPS"] == "4"
    assert env["SLIPSTREAM_CHECKPOINT_DIR"] == "/ck" and env["SLIPSTREAM_CHECKPOINT_EVERY_STEPS"] == "100"
    assert env["SLIPSTREAM_DATA_SOURCE"] == "s3://b/p" and env["SLIPSTREAM_DATA_PREWARM"] == "1"
    assert env["A"] == "1" and env["B"] == "true"
    # The same variables TrainConfig reads back.
    from slipstream.config import TrainConfig

    flat = TrainConfig.from_env(environ=env).flat()
    assert (flat["sync"], flat["precision"], flat["accumulate_steps"]) == ("bf16", "bf16", 4)
    assert (flat["checkpoint_dir"], flat["checkpoint_every_steps"]) == ("/ck", 100)


def test_parallel_and_checkpoint_options_reach_the_engine():
    """Keys the spec leaves unset take the engine's defaults; given ones become its SLIPSTREAM_* variables."""
    s = spec_of(replicas=2, gpu_count=2, parallel={"dp_shard": -1, "tp": 2, "zero_stage": 2},
                checkpoint={"dir": "/ck", "verify": "size", "max_failures": 5})
    env = s.worker_env()
    assert (env["SLIPSTREAM_DP_SHARD"], env["SLIPSTREAM_TP"], env["SLIPSTREAM_ZERO_STAGE"]) == ("-1", "2", "2")
    assert (env["SLIPSTREAM_CHECKPOINT_VERIFY"], env["SLIPSTREAM_CHECKPOINT_MAX_FAILURES"]) == ("size", "5")
    assert "SLIPSTREAM_PP_SCHEDULE" not in env and s.parallel.pp is None
    # A spec without the section keeps the layout in env, as `slipstream plan --write-job` writes it.
    assert spec_of(env={"SLIPSTREAM_TP": "2"}).worker_env()["SLIPSTREAM_TP"] == "2"


@pytest.mark.parametrize(
    "over, expected",
    [
        ({"replicas": 0}, "replicas: must be >= 1, got 0"),
        ({"replicas": "2"}, "replicas: must be a whole number, got string '2'"),
        ({"replicas": True}, "replicas: must be a whole number, got boolean true"),
        ({"gpu_count": -1}, "gpu_count: must be >= 0, got -1"),
        ({"name": "Bad_Name"}, "name: must be a DNS-1123 label"),
        ({"name": "a" * 41}, "name: must be at most 40 characters, got 41"),
        ({"kind": "batch"}, "kind: must be one of training, inference, got 'batch'"),
        ({"command": "python train.py"}, "command: must be a list of strings, got string 'python train.py'"),
        ({"command": []}, "command: must not be empty, got []"),
        ({"command": ["torchrun", "train.py"]}, "command: must be the training script itself"),
        ({"command": ["bash", "run.sh"]}, "command: must start with python (or python3) or a .py script"),
        ({"command": ["python", "-O", "t.py"]}, "command: python option '-O' is not supported"),
        ({"cpu": "lots"}, "cpu: must be a Kubernetes quantity (e.g. 4, 500m, 16Gi), got string 'lots'"),
        ({"memory": 0}, "memory: must be > 0, got 0"),
        ({"memory": "1Gi", "shm_size": "2Gi"}, "shm_size: must be <= memory (1Gi)"),
        ({"gpu_slice": {"mig": "1g.10gb"}}, "gpu_slice: needs gpu_count >= 1"),
        ({"gpu_count": 1, "gpu_slice": {"mig": "big"}}, "gpu_slice.mig: must be a MIG profile such as mig-1g.10gb"),
        ({"gpu_count": 1, "gpu_slice": {"mig": "1g.5gb", "time_sliced": True}}, "gpu_slice: mig and time_sliced are exclusive"),
        ({"gpu_count": 1, "gpu_slice": {"memory_fraction": 1.5}}, "gpu_slice.memory_fraction: must be <= 1, got 1.5"),
        ({"gpu_count": 1, "gpu_slice": {"memory_fraction": 0}}, "gpu_slice.memory_fraction: must be > 0, got 0"),
        ({"gpu_count": 2, "processes_per_replica": 3}, "processes_per_replica: must be <= gpu_count (2) when GPUs are requested, got 3"),
        ({"replicas": 2, "elastic": {"min_replicas": 3}}, "elastic.min_replicas: must be <= replicas (2), got 3"),
        ({"replicas": 2, "elastic": {"max_replicas": 1}}, "elastic.max_replicas: must be >= replicas (2), got 1"),
        ({"restarts": {"max_restarts": -1}}, "restarts.max_restarts: must be >= 0, got -1"),
        ({"checkpoint": {"interval_steps": 5}}, "checkpoint.dir: is required"),
        ({"checkpoint": {"dir": "ck", "volume_claim": "pvc"}}, "checkpoint.dir: must be an absolute path"),
        ({"data": {"source": "s3://x", "cache_size": "1Gi"}}, "data.cache_size: needs data.cache_dir"),
        ({"sync": {"precision": "fp8"}}, "sync.precision: must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"sync": {"strategy": "magic"}}, "sync.strategy: must be one of allreduce"),
        ({"sync": {"accumulate_steps": 0}}, "sync.accumulate_steps: must be >= 1, got 0"),
        ({"queue": "Team A"}, "queue: must be a DNS-1123 label"),
        ({"network": {"rdma_resource": "hca"}}, "network.rdma_resource: must be an extended resource name"),
        ({"env": {"1BAD": "x"}}, "env.1BAD: name must match"),
        ({"env": {"SLIPSTREAM_PRECISION": "bf16"}}, "env.SLIPSTREAM_PRECISION: is set by the spec itself"),
        ({"env": {"X": [1]}}, "env.X: must be a string, number or boolean, got list [1]"),
        ({"gpu_cont": 1}, "gpu_cont: unknown key (did you mean 'gpu_count'?)"),
        ({"serve": {"port": 80}}, "serve: is only for kind inference, got kind training"),
        ({"kind": "inference", "checkpoint": {"dir": "/c"}}, "checkpoint: is only for kind training, got kind inference"),
        ({"kind": "inference", "serve": {"port": 29400}}, "serve.port: must not be 29400"),
        ({"image": None}, "image: is required"),
        ({"checkpoint": {"dir": "/c", "verify": "crc"}}, "checkpoint.verify: must be one of full, size, off, got 'crc'"),
        ({"parallel": {"zero_stage": 1}}, "parallel.zero_stage: must be one of 2, 3, got 1"),
        ({"parallel": {"pp_schedule": "zb"}}, "parallel.pp_schedule: must be one of gpipe, 1f1b, got 'zb'"),
        ({"parallel": {"tp": 0}}, "parallel.tp: must be >= 1, got 0"),
        ({"replicas": 4, "parallel": {"pp": 4, "pp_microbatches": 3}},
         "parallel.pp_microbatches: pp_microbatches(3) must be >= pp(4) for the 1f1b schedule"),
        ({"replicas": 2, "parallel": {"tp": 4}}, "parallel.tp: "),
        ({"parallel": {"tp": 2}, "replicas": 2, "env": {"SLIPSTREAM_TP": "2"}},
         "env.SLIPSTREAM_TP: is set by parallel.tp too; set it in one place, got both"),
        ({"kind": "inference", "parallel": {"tp": 2}}, "parallel: is only for kind training, got kind inference"),
    ],
)
def test_error_names_field_rule_and_value(over, expected):
    assert expected in error_of(**over)


def test_all_errors_are_reported_together():
    msg = error_of(replicas=0, gpu_count=-2, cpu="x")
    assert msg.startswith("3 problems in the job spec:")
    assert "replicas: must be >= 1, got 0" in msg and "gpu_count: must be >= 0, got -2" in msg


def test_inference_allows_any_command():
    s = spec_of(kind="inference", command=["vllm", "serve", "m"], serve={"port": 9000})
    assert s.serve.port == 9000 and s.full_command == ["vllm", "serve", "m"]


@pytest.mark.parametrize(
    "cmd, expected",
    [
        (["python", "t.py", "--a", "1"], ("t.py", False, ("--a", "1"))),
        (["python3", "-u", "t.py"], ("t.py", False, ())),
        (["/usr/bin/python3.11", "-m", "pkg.train", "-x"], ("pkg.train", True, ("-x",))),
        (["t.py", "--x"], ("t.py", False, ("--x",))),
    ],
)
def test_entrypoint(cmd, expected):
    ep = parse_entrypoint(cmd)
    assert (ep.target, ep.module, ep.args) == expected


def test_yaml_problems_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"duplicate key 'replicas'"):
        load_spec_text("name: a\nimage: i\ncommand: [python, t.py]\nreplicas: 1\nreplicas: 2\n", "x.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 2, column 1\)"):
        load_spec_text("name: [a\n", "x.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_spec_text("- a\n- b\n", "x.yaml")
    with pytest.raises(ConfigError, match="exactly one YAML document"):
        load_spec_text("a: 1\n---\nb: 2\n", "x.yaml")
    with pytest.raises(UsageError, match="job spec not found"):
        load_spec(tmp_path / "missing.yaml")


def test_examples_load():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        load_spec(path)


def test_file_errors_name_the_file():
    path = write_spec("name: a\nimage: i\ncommand: [python, t.py]\nreplicas: -3\n")
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}: replicas: must be >= 1, got -3"


@pytest.mark.parametrize(
    "text, value",
    [("16Gi", 16 * 2**30), ("500m", Decimal("0.5")), ("1.5", Decimal("1.5")), ("2e3", 2000),
     ("1k", 1000), (4, 4), (0.25, Decimal("0.25")), ("+1Mi", 2**20)],
)
def test_quantities(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.5.2", "1GB", "1 Gi", "one", True, None, [1], float("nan")])
def test_bad_quantities(text):
    with pytest.raises(ValueError):
        parse_quantity(text)
