"""Offline validation of rendered manifests: no API server needed.

Three layers, all of which must pass:

1. Core kinds (Service, Job, Deployment, and every pod template or Job
   template embedded in a custom resource) against the Kubernetes OpenAPI
   schemas bundled with ``kubernetes-validate``, in strict mode (unknown fields
   fail). A kind it has no schema for is a failure, not a warning.
2. Custom resources (JobSet, TrainJob, PyTorchJob) against the CRD schemas
   vendored in ``slipstream/job/crds/`` with jsonschema, made strict: every
   object schema that lists ``properties`` refuses unknown fields unless it says
   ``x-kubernetes-preserve-unknown-fields``. (CEL rules are not evaluated.)
3. Our own semantic checks: quantities parse, limits >= requests, extended
   resources are whole numbers, every pod has containers with images, Jobs
   use restartPolicy Never/OnFailure (Never with a podFailurePolicy), mounts
   name declared volumes, a podFailurePolicy names a real container, Services
   select the pods they are for.

Example::

    from slipstream.job import load_spec, render, validate_manifests
    validate_manifests(render(load_spec("job.yaml"), "trainjob"))   # raises ConfigError on failure
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from typing import Any, Iterable

from ..errors import ConfigError, UsageError
from ..extras import pip_install_hint
from .quantity import parse_quantity

K8S_VERSION = "1.37"
"""Kubernetes schema version core kinds are checked against."""

CRD_FILES = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_v1alpha2_jobset.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_v1alpha1_trainjob.json",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_v1_pytorchjob.json",
}
CORE_KINDS = {("v1", "Service"), ("batch/v1", "Job"), ("apps/v1", "Deployment"), ("v1", "PodTemplate")}
_STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# ---------------------------------------------------------------------------- CRD schemas


def strict_schema(schema: Any) -> Any:
    """A copy of an OpenAPI v3 (structural) schema in which every object that
    lists ``properties`` refuses unknown fields, unless it is marked
    ``x-kubernetes-preserve-unknown-fields`` or already says ``additionalProperties``."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        isinstance(schema.get("properties"), dict)
        and not schema.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


def crd_schemas_from_yaml(text: str) -> dict[tuple[str, str], dict]:
    """``{(apiVersion, kind): openAPIV3Schema}`` for every served version in a CRD file."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = {}
    for doc in yaml.load_all(text, Loader=loader):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        group = doc["spec"]["group"]
        kind = doc["spec"]["names"]["kind"]
        for version in doc["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return out


@functools.lru_cache(maxsize=None)
def _crd_validator(api_version: str, kind: str):
    import jsonschema

    fname = CRD_FILES[(api_version, kind)]
    with resources.files(__package__).joinpath("crds", fname).open("r", encoding="utf-8") as fh:
        schema = json.load(fh)
    # OpenAPI v3.0 schemas are closest to JSON Schema draft 4 (no "nullable": we never emit null).
    return jsonschema.Draft4Validator(strict_schema(schema))


# ---------------------------------------------------------------------------- core kinds


def _kv():
    try:
        import kubernetes_validate.utils as kvu
    except ImportError:
        raise UsageError(
            f"manifest validation needs kubernetes-validate and jsonschema: {pip_install_hint('job')}"
        ) from None
    return kvu


@functools.lru_cache(maxsize=None)
def k8s_version() -> str:
    """K8S_VERSION, or the newest schema set the installed kubernetes-validate has if older."""
    kvu = _kv()
    latest = kvu.major_minor(kvu.latest_version())

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    return K8S_VERSION if key(latest) >= key(K8S_VERSION) else latest


def _core_errors(obj: dict, where: str) -> list[str]:
    kvu = _kv()
    try:
        kvu.validate(obj, k8s_version(), strict=True)
    except kvu.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path) or "(top)"
        return [f"{where}: {path}: {exc.message} (kubernetes-validate --strict, Kubernetes {exc.version})"]
    except kvu.SchemaNotFoundError as exc:
        return [f"{where}: unknown kind: {exc.message}"]
    except (kvu.InvalidSchemaError, kvu.VersionNotSupportedError) as exc:
        return [f"{where}: kubernetes-validate could not check it: {exc.message}"]
    return []


def _crd_errors(obj: dict, where: str) -> list[str]:
    validator = _crd_validator(obj["apiVersion"], obj["kind"])
    errs = []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(str(p) for p in e.absolute_path) or "(top)"
        errs.append(f"{where}: {path}: {e.message} (CRD schema {obj['apiVersion']} {obj['kind']}, strict)")
    # The CRD says only "metadata: object"; check it as the API server would.
    errs += _core_errors(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": obj.get("metadata", {}), "template": {}},
        f"{where} metadata",
    )
    return errs


def _embedded_templates(obj: dict) -> Iterable[tuple[str, dict]]:
    """Core objects embedded in a custom resource, rebuilt as standalone objects."""
    kind = obj.get("kind")
    spec = obj.get("spec", {})
    if kind == "JobSet":
        for i, rj in enumerate(spec.get("replicatedJobs", [])):
            tpl = rj.get("template", {})
            meta = dict(tpl.get("metadata") or {})
            meta["name"] = f"{obj['metadata']['name']}-{rj.get('name', i)}"
            yield (f"replicatedJobs[{i}].template", {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                                                     "spec": tpl.get("spec", {})})
    elif kind == "PyTorchJob":
        for rtype, rs in spec.get("pytorchReplicaSpecs", {}).items():
            yield (f"pytorchReplicaSpecs.{rtype}.template", {"apiVersion": "v1", "kind": "PodTemplate",
                                                             "metadata": {"name": "t"}, "template": rs.get("template", {})})


# ---------------------------------------------------------------------------- semantics


def _pod_templates(obj: dict) -> Iterable[tuple[str, dict, str | None]]:
    """(path, pod template, owning workload kind) for every pod template we render."""
    kind = obj.get("kind")
    spec = obj.get("spec", {})
    if kind in ("Job", "Deployment"):
        yield "spec.template", spec.get("template", {}), kind
    elif kind == "JobSet":
        for i, rj in enumerate(spec.get("replicatedJobs", [])):
            yield f"spec.replicatedJobs[{i}].template.spec.template", rj["template"]["spec"].get("template", {}), "Job"
    elif kind == "PyTorchJob":
        for rtype, rs in spec.get("pytorchReplicaSpecs", {}).items():
            yield f"spec.pytorchReplicaSpecs.{rtype}.template", rs.get("template", {}), None


def _check_resources(res: dict, where: str, errs: list[str]) -> None:
    parsed: dict[str, dict[str, Any]] = {}
    for section in ("requests", "limits"):
        for name, value in (res.get(section) or {}).items():
            try:
                q = parse_quantity(value)
            except ValueError:
                errs.append(f"{where}.{section}.{name}: must be a quantity, got {value!r}")
                continue
            if q < 0:
                errs.append(f"{where}.{section}.{name}: must be >= 0, got {value!r}")
            if name not in _STANDARD_RESOURCES and not name.startswith("hugepages-") and q != q.to_integral_value():
                errs.append(f"{where}.{section}.{name}: extended resources must be whole numbers, got {value!r}")
            parsed.setdefault(section, {})[name] = q
    for name, req in parsed.get("requests", {}).items():
        lim = parsed.get("limits", {}).get(name)
        if lim is not None and lim < req:
            errs.append(f"{where}.limits.{name}: must be >= requests.{name} ({req}), got {lim}")
        if name not in _STANDARD_RESOURCES and not name.startswith("hugepages-") and lim is not None and lim != req:
            errs.append(f"{where}.requests.{name}: extended resources need requests == limits, got {req} and {lim}")


def _check_pod(path: str, tpl: dict, owner: str | None, errs: list[str]) -> set[str]:
    pod = tpl.get("spec") or {}
    containers = pod.get("containers") or []
    if not containers:
        errs.append(f"{path}.spec.containers: must list at least one container, got none")
    volumes = {v.get("name") for v in pod.get("volumes") or []}
    names = set()
    every = [("containers", i, c) for i, c in enumerate(containers)]
    every += [("initContainers", i, c) for i, c in enumerate(pod.get("initContainers") or [])]
    for section, i, c in every:
        where = f"{path}.spec.{section}[{i}]"
        if not c.get("image"):
            errs.append(f"{where}.image: is required, got {c.get('image')!r}")
        if c.get("name") in names:
            errs.append(f"{where}.name: must be unique in the pod, got {c.get('name')!r} twice")
        names.add(c.get("name"))
        if not c.get("command") and not c.get("args"):
            errs.append(f"{where}.command: must be set (the image entrypoint is not ours), got none")
        _check_resources(c.get("resources") or {}, f"{where}.resources", errs)
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volumes:
                errs.append(f"{where}.volumeMounts: names volume {m.get('name')!r}, which the pod does not declare")
    for v in pod.get("volumes") or []:
        limit = (v.get("emptyDir") or {}).get("sizeLimit")
        if limit is not None:
            try:
                parse_quantity(limit)
            except ValueError:
                errs.append(f"{path}.spec.volumes.{v.get('name')}.emptyDir.sizeLimit: must be a quantity, got {limit!r}")
    if owner == "Job":
        rp = pod.get("restartPolicy")
        if rp not in ("Never", "OnFailure"):
            errs.append(f"{path}.spec.restartPolicy: must be Never or OnFailure for a Job, got {rp!r}")
    if owner == "Deployment" and pod.get("restartPolicy", "Always") != "Always":
        errs.append(f"{path}.spec.restartPolicy: must be Always for a Deployment, got {pod.get('restartPolicy')!r}")
    return names


def _check_job_spec(path: str, job: dict, errs: list[str]) -> None:
    tpl = job.get("template") or {}
    pod = tpl.get("spec") or {}
    names = {c.get("name") for c in (pod.get("containers") or []) + (pod.get("initContainers") or [])}
    if job.get("podFailurePolicy"):
        if pod.get("restartPolicy") != "Never":
            errs.append(f"{path}.podFailurePolicy: needs template restartPolicy Never, got {pod.get('restartPolicy')!r}")
        for i, rule in enumerate(job["podFailurePolicy"].get("rules", [])):
            cname = (rule.get("onExitCodes") or {}).get("containerName")
            if cname is not None and cname not in names:
                errs.append(f"{path}.podFailurePolicy.rules[{i}].onExitCodes.containerName: must name a container "
                            f"of the pod ({', '.join(sorted(map(str, names)))}), got {cname!r}")
    if job.get("completionMode") == "Indexed":
        if job.get("completions") is None:
            errs.append(f"{path}.completions: required for an Indexed Job, got none")
        elif job.get("parallelism", 1) != job.get("completions"):
            errs.append(f"{path}.parallelism: must equal completions ({job.get('completions')}) so every replica runs "
                        f"at once, got {job.get('parallelism')}")
    if "backoffLimitPerIndex" in job and job.get("completionMode") != "Indexed":
        errs.append(f"{path}.backoffLimitPerIndex: needs completionMode Indexed, got {job.get('completionMode')!r}")


def _check_labels(path: str, meta: dict, errs: list[str]) -> None:
    for k, v in (meta.get("labels") or {}).items():
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE_RE.match(v):
            errs.append(f"{path}.labels.{k}: must be a label value (<= 63 chars, alphanumerics, '-', '_', '.'), got {v!r}")


def semantic_errors(objs: list[dict]) -> list[str]:
    """Our own checks over the whole set of objects (see the module docstring)."""
    errs: list[str] = []
    pod_labels: list[dict] = []
    for obj in objs:
        where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        meta = obj.get("metadata") or {}
        name = meta.get("name") or ""
        if not _DNS_SUBDOMAIN_RE.match(name) or len(name) > 253:
            errs.append(f"{where}: metadata.name: must be a DNS-1123 subdomain, got {name!r}")
        _check_labels(f"{where} metadata", meta, errs)
        for path, tpl, owner in _pod_templates(obj):
            _check_labels(f"{where} {path}.metadata", tpl.get("metadata") or {}, errs)
            _check_pod(f"{where} {path}", tpl, owner, errs)
            pod_labels.append((tpl.get("metadata") or {}).get("labels") or {})
        if obj.get("kind") == "Job":
            _check_job_spec(f"{where} spec", obj.get("spec", {}), errs)
        elif obj.get("kind") == "Deployment":
            spec = obj.get("spec", {})
            match = (spec.get("selector") or {}).get("matchLabels") or {}
            labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not match or any(labels.get(k) != v for k, v in match.items()):
                errs.append(f"{where}: spec.selector.matchLabels {match} must be non-empty and match the pod "
                            f"template labels {labels}")
        elif obj.get("kind") == "JobSet":
            for i, rj in enumerate(obj["spec"].get("replicatedJobs", [])):
                _check_job_spec(f"{where} spec.replicatedJobs[{i}].template.spec", rj["template"].get("spec", {}), errs)
        elif obj.get("kind") == "TrainJob":
            trainer = obj["spec"].get("trainer") or {}
            if not trainer.get("image") or not trainer.get("command"):
                errs.append(f"{where}: spec.trainer: must set image and command, got {sorted(trainer)}")
            if "resourcesPerNode" in trainer:
                _check_resources(trainer["resourcesPerNode"], f"{where} spec.trainer.resourcesPerNode", errs)
            if (trainer.get("numProcPerNode") or 1) < 1:
                errs.append(f"{where}: spec.trainer.numProcPerNode: must be >= 1, got {trainer.get('numProcPerNode')}")
    for obj in objs:
        if obj.get("kind") == "Service":
            sel = (obj.get("spec") or {}).get("selector") or {}
            if sel and not any(all(lbl.get(k) == v for k, v in sel.items()) for lbl in pod_labels):
                errs.append(f"Service/{obj['metadata']['name']}: spec.selector {sel} matches no pod template rendered with it")
    return errs


# ---------------------------------------------------------------------------- entry point


def manifest_errors(objs: list[dict]) -> list[str]:
    """Every problem found in ``objs`` by the three layers; empty when all pass."""
    errs: list[str] = []
    for i, obj in enumerate(objs):
        if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
            errs.append(f"object {i}: must have apiVersion and kind")
            continue
        key = (obj["apiVersion"], obj["kind"])
        where = f"{obj['kind']}/{(obj.get('metadata') or {}).get('name')}"
        if key in CRD_FILES:
            errs += _crd_errors(obj, where)
            for path, core in _embedded_templates(obj):
                errs += _core_errors(core, f"{where} {path}")
        elif key in CORE_KINDS:
            errs += _core_errors(obj, where)
        else:
            # Still ask kubernetes-validate: it knows every core kind, and fails
            # (instead of warning) on ones it does not.
            errs += _core_errors(obj, where)
    errs += semantic_errors(objs)
    return errs


def validate_manifests(objs: list[dict]) -> None:
    """Raise :class:`ConfigError` listing every problem in ``objs`` (see module docstring)."""
    errs = manifest_errors(copy.deepcopy(objs))
    if errs:
        lines = "\n".join(f"  {e}" for e in errs)
        raise ConfigError(f"rendered manifests failed validation ({len(errs)} problem(s)):\n{lines}")


__all__ = ["validate_manifests", "manifest_errors", "semantic_errors", "strict_schema", "crd_schemas_from_yaml",
           "CRD_FILES", "K8S_VERSION", "k8s_version"]
