"""One job spec from laptop to Kubernetes.

``slipstream validate|render|submit|run JOB.yaml``; the Python API underneath:

Example::

    from slipstream.job import load_spec, render, validate_manifests, to_yaml
    spec = load_spec("examples/jobs/mlp.yaml")
    objs = render(spec, "indexed-job")     # Service + Indexed Job
    validate_manifests(objs)               # kubernetes-validate --strict + CRD schemas + our checks
    print(to_yaml(objs))
"""

from .render import DEFAULT_TARGET, EXIT_PREEMPTED, TARGETS, render, to_yaml
from .spec import JobSpec, load_spec, load_spec_text, parse_spec
from .validate import manifest_errors, validate_manifests

__all__ = [
    "JobSpec", "load_spec", "load_spec_text", "parse_spec", "render", "to_yaml", "TARGETS",
    "DEFAULT_TARGET", "EXIT_PREEMPTED", "validate_manifests", "manifest_errors",
]
