"""Renderers: golden files, the fields each target must carry, and a validator that bites."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from slipstream.job import TARGETS, load_spec, manifest_errors, render, to_yaml
from slipstream.job.render import EXIT_PREEMPTED, TargetUnsupported
from slipstream.job.spec import parse_spec

from .conftest import EXAMPLES, GOLDEN

GOLDEN_SPECS = ["full", "local-2x1", "serve-mig", "timeshare"]
UPDATE = os.environ.get("SLIPSTREAM_UPDATE_GOLDEN") == "1"


def _cases():
    for name in GOLDEN_SPECS:
        spec = load_spec(EXAMPLES / f"{name}.yaml")
        for target in (TARGETS if spec.kind == "training" else ("indexed-job",)):
            yield name, target


@pytest.mark.parametrize("name, target", list(_cases()))
def test_golden(name, target):
    """Rendered manifests are byte-for-byte the reviewed ones (SLIPSTREAM_UPDATE_GOLDEN=1 rewrites)."""
    spec = load_spec(EXAMPLES / f"{name}.yaml")
    path = GOLDEN / f"{name}.{target if spec.kind == 'training' else 'inference'}.yaml"
    try:
        objs = render(spec, target)
    except TargetUnsupported as exc:
        text = f"# not available: {exc}\n"
    else:
        assert manifest_errors(objs) == []
        text = to_yaml(objs)
    if UPDATE:
        path.write_text(text)
    assert path.read_text() == text


def _spec(**over):
    data = {"name": "job", "image": "img:1", "command": ["python", "train.py", "--lr", "0.1"], "replicas": 3}
    data.update(over)
    return parse_spec(data)


def _containers(obj):
    kind = obj["kind"]
    if kind in ("Job", "Deployment"):
        return obj["spec"]["template"]["spec"]["containers"], obj["spec"]["template"]["spec"]
    if kind == "JobSet":
        pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return pod["containers"], pod
    if kind == "PyTorchJob":
        pod = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        return pod["containers"], pod
    raise AssertionError(kind)


def test_indexed_job_launches_slipstream_with_rendezvous_on_index_0():
    svc, job = render(_spec(gpu_count=2), "indexed-job")
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "job"
    cmd = pod["containers"][0]["command"]
    assert cmd[:2] == ["slipstream", "run"]
    flags = dict(zip(cmd[2:-3:2], cmd[3:-3:2]))
    assert flags == {"--nnodes": "3", "--nproc-per-node": "2", "--node-rank": "$(JOB_COMPLETION_INDEX)",
                     "--rdzv-endpoint": "job-0.job:29400", "--rdzv-id": "job", "--max-restarts": "3",
                     "--local-addr": "$(SLIPSTREAM_POD_IP)", "--tee": "3"}
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]
    # The agent publishes its pod IP, taken from the downward API.
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    # Worker lines carry their rank, for `slipstream logs JOB --rank R`.
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"]["value"] == "[rank${rank}]:"
    assert env["SLIPSTREAM_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_preemption_exit_code_is_not_counted():
    assert EXIT_PREEMPTED == 143
    _, job = render(_spec(), "indexed-job")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]}} in rules
    assert rules[-1]["action"] == "FailJob" and rules[-1]["onExitCodes"]["values"] == [2]
    assert job["spec"]["backoffLimitPerIndex"] == 3 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    (js,) = render(_spec(), "jobset")
    jrules = js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert jrules == rules
    assert js["spec"]["failurePolicy"]["rules"][0]["action"] == "FailJobSet"


def test_queue_priority_shm_checkpoint_rdma_everywhere():
    spec = _spec(gpu_count=1, gpu_slice={"mig": "mig-2g.20gb"}, queue="team-a", priority_class="train-low",
                 shm_size="8Gi", memory="64Gi", checkpoint={"dir": "/ck", "volume_claim": "pvc-1"},
                 network={"rdma_resource": "rdma/hca"})
    for target in TARGETS:
        objs = render(spec, target)
        assert manifest_errors(objs) == [], target
        main = objs[-1]
        assert main["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        suspended = {
            "Job": lambda o: o["spec"]["suspend"], "JobSet": lambda o: o["spec"]["suspend"],
            "TrainJob": lambda o: o["spec"]["suspend"], "PyTorchJob": lambda o: o["spec"]["runPolicy"]["suspend"],
        }[main["kind"]](main)
        assert suspended is True, target
        if main["kind"] == "TrainJob":
            res = main["spec"]["trainer"]["resourcesPerNode"]
            patch = main["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            pod = patch["template"]["spec"]["template"]["spec"]
            assert main["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "train-low"
            mounts = pod["containers"][0]["volumeMounts"]
        else:
            (c,), pod = _containers(main)
            res, mounts = c["resources"], c["volumeMounts"]
            assert pod["priorityClassName"] == "train-low"
        assert res["limits"]["nvidia.com/mig-2g.20gb"] == "1" and res["limits"]["rdma/hca"] == "1"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert vols["checkpoint"]["persistentVolumeClaim"]["claimName"] == "pvc-1"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts


def test_pytorchjob_is_elastic_with_min_max():
    (pj,) = render(_spec(elastic={"min_replicas": 1, "max_replicas": 5}), "pytorchjob")
    ep = pj["spec"]["elasticPolicy"]
    assert (ep["rdzvBackend"], ep["minReplicas"], ep["maxReplicas"]) == ("c10d", 1, 5)
    (c,), _ = _containers(pj)
    assert c["name"] == "pytorch" and "$(PET_RDZV_ENDPOINT)" in c["command"]
    assert c["ports"][0]["name"] == "pytorchjob-port"


def test_trainjob_uses_trainer_env_and_runtime():
    (tj,) = render(_spec(gpu_count=4), "trainjob")
    assert tj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert tj["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    t = tj["spec"]["trainer"]
    assert (t["numNodes"], t["numProcPerNode"]) == (3, 4)
    assert "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in t["command"] and "$(PET_NODE_RANK)" in t["command"]


def test_trainjob_refuses_host_network_clearly():
    with pytest.raises(TargetUnsupported, match="network.host_network: not supported by target trainjob"):
        render(_spec(network={"host_network": True}), "trainjob")


def test_inference_renders_deployment_and_service():
    spec = parse_spec({"name": "srv", "kind": "inference", "image": "vllm:1", "command": ["vllm", "serve", "m"],
                       "gpu_count": 1, "gpu_slice": {"time_sliced": True}, "priority_class": "serve-high",
                       "serve": {"port": 8080, "health_path": "/health"}})
    for target in TARGETS:  # the target does not matter for a serving spec
        dep, svc = render(spec, target)
        assert (dep["kind"], svc["kind"]) == ("Deployment", "Service")
        (c,), pod = _containers(dep)
        assert c["command"] == ["vllm", "serve", "m"] and c["ports"][0]["containerPort"] == 8080
        assert c["resources"]["limits"]["nvidia.com/gpu.shared"] == "1"
        assert pod["priorityClassName"] == "serve-high"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert manifest_errors([dep, svc]) == []


def test_memory_fraction_runs_under_worker_shim():
    (pj,) = render(_spec(gpu_count=1, gpu_slice={"memory_fraction": 0.5}), "pytorchjob")
    (c,), _ = _containers(pj)
    i = c["command"].index("-m")
    assert c["command"][i:i + 3] == ["-m", "slipstream.job.worker", "train.py"]
    assert {"name": "SLIPSTREAM_GPU_MEMORY_FRACTION", "value": "0.5"} in c["env"]


# The validator must fail on real mistakes, in each of its three layers.
def _mutations():
    def pod_of(objs):
        return _containers(objs[-1])[1]

    yield "indexed-job", "unknown container field", lambda o: pod_of(o)["containers"][0].update(bogus=1), "bogus"
    yield "indexed-job", "restartPolicy", lambda o: pod_of(o).update(restartPolicy="Always"), "restartPolicy"
    yield "indexed-job", "no containers", lambda o: pod_of(o).update(containers=[]), "containers"
    yield "indexed-job", "bad quantity", lambda o: pod_of(o)["containers"][0].update(
        resources={"limits": {"memory": "lots"}}), "memory"
    yield "indexed-job", "limit < request", lambda o: pod_of(o)["containers"][0].update(
        resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}), "limits.cpu"
    yield "indexed-job", "mount without volume", lambda o: pod_of(o)["containers"][0].update(
        volumeMounts=[{"name": "nope", "mountPath": "/x"}]), "nope"
    yield "indexed-job", "selector", lambda o: o[0]["spec"]["selector"].update(x="y"), "matches no pod"
    yield "indexed-job", "unknown kind", lambda o: o[1].update(kind="Jobb"), "unknown kind"
    yield "jobset", "unknown jobset field", lambda o: o[0]["spec"].update(extra=1), "extra"
    yield "jobset", "wrong enum", lambda o: o[0]["spec"]["failurePolicy"]["rules"][0].update(action="Explode"), "Explode"
    yield "trainjob", "unknown trainer field", lambda o: o[0]["spec"]["trainer"].update(gpus=1), "gpus"
    yield "trainjob", "bad metadata", lambda o: o[0]["metadata"].update(owner="me"), "owner"
    yield "pytorchjob", "template metadata", lambda o: o[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "metadata"].update(lables={}), "lables"
    yield "pytorchjob", "type", lambda o: o[0]["spec"]["elasticPolicy"].update(minReplicas="one"), "minReplicas"


@pytest.mark.parametrize("target, what, mutate, needle", list(_mutations()), ids=lambda x: x if isinstance(x, str) else "")
def test_validator_catches(target, what, mutate, needle):
    objs = copy.deepcopy(render(_spec(gpu_count=1, memory="1Gi"), target))
    assert manifest_errors(objs) == []
    mutate(objs)
    errs = manifest_errors(objs)
    assert errs and any(needle in e for e in errs), errs


def test_validator_checks_deployment_selector():
    spec = parse_spec({"name": "srv", "kind": "inference", "image": "i:1", "command": ["serve"]})
    dep, svc = render(spec, "indexed-job")
    dep["spec"]["selector"]["matchLabels"] = {"app": "other"}
    assert any("matchLabels" in e for e in manifest_errors([dep, svc]))


def test_to_yaml_round_trips():
    objs = render(load_spec(EXAMPLES / "full.yaml"), "jobset")
    assert list(yaml.safe_load_all(to_yaml(objs))) == objs


def test_prewarm_init_container_fills_the_cache_first():
    spec = _spec(memory="8Gi", data={"source": "s3://b/shards", "cache_dir": "/cache", "cache_size": "100G",
                                     "prewarm": True})
    for target in ("indexed-job", "jobset", "pytorchjob"):
        objs = render(spec, target)
        assert manifest_errors(objs) == []
        (c,), pod = _containers(objs[-1])
        (init,) = pod["initContainers"]
        assert init["command"] == ["slipstream", "data", "prewarm", "s3://b/shards", "--cache", "/cache",
                                   "--max-cache-gb", "90", "--no-progress"]
        assert init["volumeMounts"] == [{"name": "data-cache", "mountPath": "/cache"}]
        assert init["image"] == c["image"] and "limits" not in init.get("resources", {})
        broken = copy.deepcopy(objs)
        _containers(broken[-1])[1]["initContainers"][0]["volumeMounts"][0]["name"] = "gone"
        assert any("initContainers[0].volumeMounts" in e for e in manifest_errors(broken))
    # TrainJob runtime patches cannot add containers: the workers get SLIPSTREAM_DATA_PREWARM instead.
    (tj,) = render(spec, "trainjob")
    assert {"name": "SLIPSTREAM_DATA_PREWARM", "value": "1"} in tj["spec"]["trainer"]["env"]
    assert "initContainers" not in str(tj)


def _launched(cmd: list[str], nnodes: int = 3):
    """What a pod's ``slipstream run`` command starts: its flags through the launcher's own parser,
    with the values the kubelet substitutes filled in (the job index, the pod IP, PET_* of PyTorchJob)."""
    from slipstream.cli import build_parser
    from slipstream.launch.cli import launch_options_from_args

    values = {"$(JOB_COMPLETION_INDEX)": "0", "$(SLIPSTREAM_POD_IP)": "10.0.0.1", "$(PET_NNODES)": str(nnodes),
              "$(PET_RDZV_ENDPOINT)": "job-0:29400", "$(PET_NODE_RANK)": "0", "$(PET_MASTER_ADDR)": "job-0",
              "$(PET_MASTER_PORT)": "29400"}

    def filled(word: str) -> str:
        for name, value in values.items():
            word = word.replace(name, value)
        assert "$(" not in word, word
        return word

    assert cmd[:2] == ["slipstream", "run"]
    return launch_options_from_args(build_parser().parse_args(["run", *map(filled, cmd[2:])]))


@pytest.mark.parametrize("target", TARGETS)
def test_heal_and_spares_round_trip_from_the_spec_to_the_pods_launcher(target, monkeypatch):
    """restarts.heal / restarts.spares reach each pod's `slipstream run` as --no-heal / --spares, and so
    the workers' environment: no SLIPSTREAM_HEAL (no supervisor) under heal: false, 1 spare by default."""
    from slipstream.launch.heal_setup import NAMES, set_heal_env
    from slipstream.resilience import heal_env

    def workers_env(replicas: int = 1, **restarts) -> dict[str, str]:
        (obj,) = [o for o in render(_spec(gpu_count=2, replicas=replicas, restarts=restarts), target)
                  if o["kind"] != "Service"]
        container = obj["spec"]["trainer"] if obj["kind"] == "TrainJob" else _containers(obj)[0][0]
        for name in NAMES:  # recorded, so that the test's end takes back what set_heal_env writes
            monkeypatch.setenv(name, "stale")
        set_heal_env(_launched(container["command"], nnodes=replicas))
        return {k: v for k, v in os.environ.items() if k in (heal_env.HEAL, heal_env.SPARES)}

    assert workers_env() == {heal_env.HEAL: "1", heal_env.SPARES: "1"}  # on by default, no flag rendered
    assert workers_env(heal=False) == {}
    assert workers_env(spares=0) == {heal_env.HEAL: "1", heal_env.SPARES: "0"}
    assert workers_env(heal=False, spares=0) == {}  # spares only count while healing is on
    # Across replicas the launcher's default is off (a lost replica comes back through the rendezvous).
    assert workers_env(replicas=3) == {} == workers_env(replicas=3, heal=False)
