"""Kubernetes manifests from a :class:`~slipstream.job.spec.JobSpec`.

One function per target, each returning a list of plain dicts (one per
object, in apply order). Training targets:

* ``indexed-job`` (default): a headless Service and an Indexed batch/v1 Job.
  Works on any cluster (no CRDs). Pod ``i`` runs ``slipstream run --node-rank i``;
  pod 0 hosts the c10d rendezvous store at ``<name>-0.<name>:29400``.
* ``jobset``: a JobSet (jobset.x-k8s.io/v1alpha2) with one replicated Job;
  the JobSet controller makes the headless Service.
* ``trainjob``: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1,
  Trainer v2.3 line) on the ``torch-distributed`` ClusterTrainingRuntime;
  the runtime injects PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT.
* ``pytorchjob``: a Kubeflow PyTorchJob (kubeflow.org/v1, training-operator
  v1.9) in its elastic form; the operator injects PET_RDZV_ENDPOINT and PET_NNODES.

``kind: inference`` renders a Deployment and a Service whatever the target.

Example::

    from slipstream.job import load_spec, render
    objs = render(load_spec("examples/jobs/mlp.yaml"), "jobset")
    [o["kind"] for o in objs]   # ['JobSet']
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import EXIT_PREEMPTED, EXIT_USAGE, ConfigError
from .commands import (POD_IP_ENV, RANK_PREFIX, RANK_PREFIX_ENV, entry_argv, launcher_command, launcher_flags,
                       prewarm_command)
from .kubectl import JOB_LABEL
from .spec import RDZV_PORT, JobSpec

TARGETS = ("indexed-job", "jobset", "trainjob", "pytorchjob")
DEFAULT_TARGET = "indexed-job"
CONTAINER = "trainer"
"""Container name for indexed-job and jobset; trainjob uses the runtime's
("node") and pytorchjob the operator's required name ("pytorch")."""
TRAINJOB_RUNTIME = "torch-distributed"
TRAINJOB_CONTAINER = "node"
TRAINJOB_REPLICATED_JOB = "node"
PYTORCHJOB_CONTAINER = "pytorch"
PYTORCHJOB_PORT_NAME = "pytorchjob-port"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


class TargetUnsupported(ConfigError):
    """The spec is valid but this target cannot express part of it (the message says which)."""

SHM_VOLUME = "dshm"
CKPT_VOLUME = "checkpoint"
CACHE_VOLUME = "data-cache"


def render(spec: JobSpec, target: str = DEFAULT_TARGET) -> list[dict[str, Any]]:
    """The manifests for ``spec`` on ``target`` (ignored for ``kind: inference``)."""
    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")
    if spec.kind == "inference":
        return render_inference(spec)
    return {
        "indexed-job": render_indexed_job,
        "jobset": render_jobset,
        "trainjob": render_trainjob,
        "pytorchjob": render_pytorchjob,
    }[target](spec)


# ---------------------------------------------------------------------------- pieces


def _labels(spec: JobSpec, queue: bool = False) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": spec.name,
        "app.kubernetes.io/managed-by": "slipstream",
        JOB_LABEL: spec.name,
    }
    if queue and spec.queue:
        labels[QUEUE_LABEL] = spec.queue
    return labels


def _metadata(spec: JobSpec, name: str | None = None, queue: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name or spec.name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    meta["labels"] = _labels(spec, queue=queue)
    return meta


def _env_list(spec: JobSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in spec.worker_env().items()]
    if spec.kind == "training":
        env.append({"name": RANK_PREFIX_ENV, "value": RANK_PREFIX})
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def _resources(spec: JobSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = spec.memory
        limits["memory"] = spec.memory  # memory is not compressible: request == limit
    if spec.gpu_resource:
        # Extended resources cannot be overcommitted: Kubernetes wants them in limits.
        limits[spec.gpu_resource] = str(spec.gpu_count)
    if spec.network.rdma_resource:
        limits[spec.network.rdma_resource] = str(spec.network.rdma_count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for /dev/shm, the checkpoint claim and the data cache."""
    volumes: list[dict] = []
    mounts: list[dict] = []
    if spec.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if spec.checkpoint and spec.checkpoint.volume_claim:
        volumes.append({"name": CKPT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint.volume_claim}})
        mounts.append({"name": CKPT_VOLUME, "mountPath": spec.checkpoint.dir})
    if spec.data and spec.data.cache_dir and spec.data.cache_dir.startswith("/"):
        empty: dict[str, Any] = {}
        if spec.data.cache_size:
            empty["sizeLimit"] = spec.data.cache_size
        volumes.append({"name": CACHE_VOLUME, "emptyDir": empty})
        mounts.append({"name": CACHE_VOLUME, "mountPath": spec.data.cache_dir})
    return volumes, mounts


def _container(spec: JobSpec, name: str, command: list[str], ports: list[dict] | None = None) -> dict[str, Any]:
    _, mounts = _volumes(spec)
    c: dict[str, Any] = {"name": name, "image": spec.image, "command": command}
    env = _env_list(spec)
    if env:
        c["env"] = env
    if ports:
        c["ports"] = ports
    res = _resources(spec)
    if res:
        c["resources"] = res
    if mounts:
        c["volumeMounts"] = mounts
    return c


def _prewarm_container(spec: JobSpec, main: dict[str, Any]) -> dict[str, Any] | None:
    """Init container filling the node-local data cache before the trainer starts (same image)."""
    cmd = prewarm_command(spec)
    if cmd is None:
        return None
    c: dict[str, Any] = {"name": "prewarm", "image": spec.image, "command": cmd + ["--no-progress"]}
    if main.get("env"):
        c["env"] = copy.deepcopy(main["env"])  # object-store credentials and endpoints
    requests = {k: v for k, v in (main.get("resources") or {}).get("requests", {}).items() if k in ("cpu", "memory")}
    if requests:
        c["resources"] = {"requests": requests}
    c["volumeMounts"] = [dict(m) for m in main.get("volumeMounts", []) if m["name"] == CACHE_VOLUME]
    return c


def _pod_spec(spec: JobSpec, container: dict[str, Any], restart_policy: str | None) -> dict[str, Any]:
    volumes, _ = _volumes(spec)
    pod: dict[str, Any] = {}
    if restart_policy:
        pod["restartPolicy"] = restart_policy
    if spec.priority_class:
        pod["priorityClassName"] = spec.priority_class
    if spec.network.host_network:
        pod["hostNetwork"] = True
        # Keep cluster DNS (the rendezvous host name) working with the node's network.
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    # Time for the emergency checkpoint between SIGTERM and SIGKILL.
    pod["terminationGracePeriodSeconds"] = 120
    init = _prewarm_container(spec, container) if spec.kind == "training" else None
    if init is not None:
        pod["initContainers"] = [init]
    pod["containers"] = [container]
    if volumes:
        pod["volumes"] = volumes
    return pod


def _pod_failure_policy(container: str) -> dict[str, Any]:
    """Preemption (exit 143 after the emergency checkpoint, or a disruption) is not
    counted against the restart budget; a usage error (exit 2) fails at once."""
    return {
        "rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": container, "operator": "In", "values": [EXIT_PREEMPTED]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In", "values": [EXIT_USAGE]}},
        ]
    }


def _rdzv_port() -> dict[str, Any]:
    return {"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}


# ---------------------------------------------------------------------------- targets


def render_indexed_job(spec: JobSpec) -> list[dict[str, Any]]:
    """Headless Service + Indexed Job; pod i is node i, pod 0 hosts the rendezvous."""
    endpoint = f"{spec.name}-0.{spec.name}:{RDZV_PORT}"
    command = launcher_command(spec, spec.nnodes, endpoint, "$(JOB_COMPLETION_INDEX)", spec.name)
    container = _container(spec, CONTAINER, command, ports=[_rdzv_port()])
    pod = _pod_spec(spec, container, "Never")
    pod = {"subdomain": spec.name, **pod}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        "spec": {
            "clusterIP": "None",
            # Replicas must find index 0 before any pod is Ready.
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: spec.name},
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.replicas,
        "parallelism": spec.replicas,
        "backoffLimitPerIndex": spec.restarts.max_pod_restarts,
        "maxFailedIndexes": 0,
        "podFailurePolicy": _pod_failure_policy(CONTAINER),
    }
    if spec.queue:
        job_spec["suspend"] = True  # Kueue admits (unsuspends) it
    job_spec["template"] = {"metadata": {"labels": _labels(spec)}, "spec": pod}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(spec, queue=True), "spec": job_spec}
    return [service, job]


def render_jobset(spec: JobSpec) -> list[dict[str, Any]]:
    """JobSet with one replicated Job of ``replicas`` indexed pods."""
    rjob = "node"
    endpoint = f"{spec.name}-{rjob}-0-0.{spec.name}:{RDZV_PORT}"
    command = launcher_command(spec, spec.nnodes, endpoint, "$(JOB_COMPLETION_INDEX)", spec.name)
    container = _container(spec, CONTAINER, command, ports=[_rdzv_port()])
    pod = _pod_spec(spec, container, "Never")
    job_spec = {
        "completionMode": "Indexed",
        "completions": spec.replicas,
        "parallelism": spec.replicas,
        # A lost pod is replaced by the Job (not counted when preempted); any
        # other failure fails the Job and the JobSet restarts the whole group.
        "backoffLimit": 0,
        "podFailurePolicy": _pod_failure_policy(CONTAINER),
        "template": {"metadata": {"labels": _labels(spec)}, "spec": pod},
    }
    js_spec: dict[str, Any] = {}
    if spec.queue:
        js_spec["suspend"] = True
    js_spec["network"] = {"enableDNSHostnames": True, "subdomain": spec.name, "publishNotReadyAddresses": True}
    js_spec["failurePolicy"] = {
        "maxRestarts": spec.restarts.max_pod_restarts,
        "rules": [
            # The Job's podFailurePolicy FailJob rule fires only on exit code 2
            # (invalid configuration): restarting cannot help.
            {"name": "usageError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        ],
    }
    js_spec["replicatedJobs"] = [
        {"name": rjob, "replicas": 1, "template": {"metadata": {"labels": _labels(spec)}, "spec": job_spec}}
    ]
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(spec, queue=True),
             "spec": js_spec}]


def render_trainjob(spec: JobSpec) -> list[dict[str, Any]]:
    """Kubeflow Trainer v2 TrainJob on the torch-distributed runtime (Trainer v2.3 API)."""
    if spec.network.host_network:
        raise TargetUnsupported(
            "network.host_network: not supported by target trainjob (Trainer v2.3 runtimePatches cannot set "
            "hostNetwork; set it in the ClusterTrainingRuntime, or use --target indexed-job, jobset or pytorchjob), got true"
        )
    command = launcher_command(
        spec, "$(PET_NNODES)", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", "$(PET_NODE_RANK)", spec.name
    )
    if spec.elastic and spec.min_replicas != spec.max_replicas:
        command[command.index("--nnodes") + 1] = spec.nnodes
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": command,
        "numNodes": spec.replicas,
        "numProcPerNode": spec.procs_per_replica,
    }
    env = _env_list(spec)
    if env:
        trainer["env"] = env
    res = _resources(spec)
    if res:
        trainer["resourcesPerNode"] = res
    tj_spec: dict[str, Any] = {"runtimeRef": {"name": TRAINJOB_RUNTIME}, "trainer": trainer}
    if spec.queue:
        tj_spec["suspend"] = True
    volumes, mounts = _volumes(spec)
    if volumes:
        tj_spec["runtimePatches"] = [{
            "manager": "slipstream.dev/job",
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                "name": TRAINJOB_REPLICATED_JOB,
                "template": {"spec": {"template": {"spec": {
                    "volumes": volumes,
                    "containers": [{"name": TRAINJOB_CONTAINER, "volumeMounts": mounts}],
                }}}},
            }]}}},
        }]
    meta = _metadata(spec, queue=True)
    if spec.priority_class:
        # The runtime patch cannot set priorityClassName; Kueue orders and
        # preempts workloads by this WorkloadPriorityClass instead.
        meta["labels"][KUEUE_PRIORITY_LABEL] = spec.priority_class
    return [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta, "spec": tj_spec}]


def render_pytorchjob(spec: JobSpec) -> list[dict[str, Any]]:
    """PyTorchJob v1, elastic form: Worker replicas only, c10d rendezvous on worker-0."""
    command = launcher_command(spec, "$(PET_NNODES)", "$(PET_RDZV_ENDPOINT)", None, spec.name)
    port = {"name": PYTORCHJOB_PORT_NAME, "containerPort": RDZV_PORT, "protocol": "TCP"}
    container = _container(spec, PYTORCHJOB_CONTAINER, command, ports=[port])
    pod = _pod_spec(spec, container, None)
    run_policy: dict[str, Any] = {"backoffLimit": spec.restarts.max_pod_restarts, "cleanPodPolicy": "None"}
    if spec.queue:
        run_policy["suspend"] = True
    pj_spec = {
        "nprocPerNode": str(spec.procs_per_replica),
        "elasticPolicy": {
            "rdzvBackend": "c10d",
            "rdzvPort": RDZV_PORT,
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "maxRestarts": spec.restarts.max_restarts,
        },
        "runPolicy": run_policy,
        "pytorchReplicaSpecs": {
            "Worker": {
                "replicas": spec.replicas,
                # ExitCode: the operator restarts pods on retryable exit codes
                # (128+ signals, preemption included) and not on 1 or 2.
                "restartPolicy": "ExitCode",
                "template": {"metadata": {"labels": _labels(spec)}, "spec": pod},
            }
        },
    }
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(spec, queue=True),
             "spec": pj_spec}]


def render_inference(spec: JobSpec) -> list[dict[str, Any]]:
    """Deployment + Service for a serving container (its own GPU slice and priority)."""
    assert spec.serve is not None
    port = {"name": "http", "containerPort": spec.serve.port, "protocol": "TCP"}
    container = _container(spec, "server", spec.full_command, ports=[port])
    if spec.serve.health_path:
        probe = {"httpGet": {"path": spec.serve.health_path, "port": "http"}, "periodSeconds": 10}
        container["readinessProbe"] = probe
    pod = _pod_spec(spec, container, None)
    pod["terminationGracePeriodSeconds"] = 30
    pod_labels = _labels(spec)
    selector = {JOB_LABEL: spec.name}
    deploy_spec: dict[str, Any] = {
        "replicas": spec.replicas,
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": pod_labels}, "spec": pod},
    }
    meta = _metadata(spec, queue=True)
    if spec.queue:
        # Kueue's pod integration gates Deployment pods; the label must be on the pods too.
        deploy_spec["template"]["metadata"]["labels"][QUEUE_LABEL] = spec.queue
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deploy_spec}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": spec.serve.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """Multi-document YAML, keys in the order the renderers wrote them."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # never &id001 / *id001 in manifests
            return True

    def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Dumper.add_representer(str, _str)
    return "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False) for o in objs)


__all__ = [
    "render", "render_indexed_job", "render_jobset", "render_trainjob", "render_pytorchjob",
    "render_inference", "launcher_command", "launcher_flags", "entry_argv", "TargetUnsupported", "to_yaml", "TARGETS", "DEFAULT_TARGET", "EXIT_PREEMPTED",
]
