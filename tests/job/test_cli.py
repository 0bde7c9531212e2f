"""validate / render / submit from the command line, and the vendored CRD schemas."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slipstream.job.validate import CRD_FILES, crd_schemas_from_yaml

from .conftest import EXAMPLES, REPO, run_cli, write_spec

FULL = str(EXAMPLES / "full.yaml")


def test_validate_reports_every_target(capsys):
    code, out, err = run_cli(["validate", FULL], capsys)
    assert code == 0, err
    for target in ("indexed-job", "jobset", "trainjob", "pytorchjob"):
        assert f"  {target}: " in out and "pass offline validation" in out


def test_validate_single_unsupported_target_fails(capsys):
    code, out, err = run_cli(["validate", str(EXAMPLES / "timeshare.yaml"), "--target", "trainjob"], capsys)
    assert code == 2 and "network.host_network: not supported by target trainjob" in err


def test_render_out_dir_writes_one_file_per_object(capsys, tmp_path):
    code, out, err = run_cli(["render", FULL, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["job-gpt-full.yaml", "service-gpt-full.yaml"]
    job = yaml.safe_load((tmp_path / "job-gpt-full.yaml").read_text())
    assert job["kind"] == "Job" and job["spec"]["completions"] == 4


def test_render_default_target_to_stdout(capsys):
    code, out, err = run_cli(["render", str(EXAMPLES / "local-2x1.yaml")], capsys)
    assert code == 0, err
    assert [d["kind"] for d in yaml.safe_load_all(out)] == ["Service", "Job"]


def test_render_unknown_target_is_a_usage_error(capsys):
    code, out, err = run_cli(["render", FULL, "--target", "helm"], capsys)
    assert code == 2 and "invalid choice: 'helm'" in err


def test_missing_spec_file(capsys, tmp_path):
    code, out, err = run_cli(["validate", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "job spec not found" in err


def test_submit_dry_run_needs_no_kubectl(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = run_cli(["submit", FULL, "--dry-run", "--target", "jobset"], capsys)
    assert code == 0, err
    assert out.startswith("# would run: kubectl apply -f -")
    assert [d["kind"] for d in yaml.safe_load_all(out)] == ["JobSet"]


def test_submit_without_kubectl_fails_clearly(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = run_cli(["submit", FULL], capsys)
    assert code == 2 and "kubectl not found" in err and "slipstream render" in err


def _fake_kubectl(tmp_path: Path, script: str) -> Path:
    exe = tmp_path / "kubectl"
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_submit_pipes_manifests_to_kubectl_apply(capsys, monkeypatch, tmp_path):
    got = tmp_path / "stdin.yaml"
    _fake_kubectl(tmp_path, f'echo "$@" > {tmp_path}/args; cat > {got}; echo "job.batch/gpt-full created"')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    code, out, err = run_cli(["submit", FULL], capsys)
    assert code == 0, err
    assert (tmp_path / "args").read_text().split() == ["apply", "-f", "-"]
    assert [d["kind"] for d in yaml.safe_load_all(got.read_text())] == ["Service", "Job"]
    assert "job.batch/gpt-full created" in out
    from slipstream.job.submissions import find_submission

    record = find_submission("gpt-full")  # for `slipstream status gpt-full`
    assert (record.target, record.engine_id) == ("indexed-job", "gpt-full")


@pytest.mark.parametrize(
    "said, needle",
    [
        ("The connection to the server localhost:8080 was refused - did you specify the right host or port?",
         "no Kubernetes cluster reachable"),
        ('error: resource mapping not found for name: "gpt-full": no matches for kind "JobSet"; ensure CRDs are installed first',
         "does not know the JobSet kind"),
    ],
)
def test_submit_explains_cluster_problems(capsys, monkeypatch, tmp_path, said, needle):
    _fake_kubectl(tmp_path, f"cat >/dev/null; echo '{said}' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    code, out, err = run_cli(["submit", FULL, "--target", "jobset"], capsys)
    assert code == 2 and needle in err and "Traceback" not in err


def test_submit_refused_by_cluster_is_exit_1(capsys, monkeypatch, tmp_path):
    _fake_kubectl(tmp_path, "cat >/dev/null; echo 'Error from server (Forbidden): jobs.batch is forbidden' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    code, out, err = run_cli(["submit", FULL], capsys)
    assert code == 1 and "kubectl apply failed (exit 1): Error from server (Forbidden)" in err


def test_invalid_spec_in_a_real_subprocess_has_no_traceback(tmp_path):
    path = write_spec({"name": "x", "image": "i", "command": ["python", "t.py"], "replicas": 0}, str(tmp_path))
    for cmd in (["run", path],):  # `run JOB.yaml`: the top-level command routes it to job/cli.py; in-process tests cover the rest
        proc = subprocess.run([sys.executable, "-m", "slipstream", *cmd], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr == f"slipstream {cmd[0]}: error: {path}: replicas: must be >= 1, got 0\n"


def test_kubernetes_validate_cli_agrees(tmp_path, capsys):
    """The rendered core objects also pass the kubernetes-validate command itself, --strict."""
    code, _, err = run_cli(["render", FULL, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    files = [str(p) for p in sorted(tmp_path.iterdir())]
    from slipstream.job.validate import k8s_version

    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", k8s_version(), *files],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARN" not in proc.stdout and proc.stdout.count("passed") == len(files)


# SHA-256 of the vendored schemas, as extracted (crd_schemas_from_yaml) from the upstream CRD files
# docs/job.md lists ("CRD schema sources", with the upstream files' own digests); a refresh changes both.
VENDORED_CRD_SHA256 = {
    "jobset.x-k8s.io_v1alpha2_jobset.json": "20a226345ef48828ecade5afe752bad59f117b98a2754132476a5ce66c6f2591",
    "kubeflow.org_v1_pytorchjob.json": "203d27463f31ee9c74457a5e6d033a894df297442d352cd46ecfb8c0939249a5",
    "trainer.kubeflow.org_v1alpha1_trainjob.json": "f451af0f4d002476c04903a6995e708d6acb70ee58ce6eaf3d76460adcb3e06b",
}


def test_vendored_crd_schemas_are_the_extracted_upstream_ones():
    """src/slipstream/job/crds/*.json are unchanged since their extraction from the upstream CRDs."""
    import hashlib

    pkg = REPO / "src" / "slipstream" / "job" / "crds"
    assert sorted(CRD_FILES.values()) == sorted(VENDORED_CRD_SHA256)
    for fname, digest in VENDORED_CRD_SHA256.items():
        assert hashlib.sha256((pkg / fname).read_bytes()).hexdigest() == digest, f"{fname} changed"


def test_crd_extraction_returns_each_served_version_schema_unchanged():
    """crd_schemas_from_yaml (what refreshes the vendored files) takes openAPIV3Schema as it is."""
    pkg = REPO / "src" / "slipstream" / "job" / "crds"
    for (api_version, kind), fname in CRD_FILES.items():
        group, version = api_version.split("/")
        schema = json.loads((pkg / fname).read_text())
        crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "spec": {"group": group, "names": {"kind": kind},
                        "versions": [{"name": version, "served": True, "schema": {"openAPIV3Schema": schema}}]}}
        assert crd_schemas_from_yaml(yaml.safe_dump(crd)) == {(api_version, kind): schema}


def test_dockerfile_is_consistent_with_the_repo_and_the_manifests():
    """What can be checked without a Docker engine (tests/container builds and runs the image):
    a CUDA base by default, every COPY source exists, every dependency is pinned, the examples
    land where pods look for them (WORKDIR), the rendezvous port is exposed, slipstream is the
    entry point."""
    import re
    import tomllib

    from slipstream.job.spec import RDZV_PORT, load_spec

    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+-cudnn-runtime-\S+$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS system$", text, re.M)
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY source {src} missing"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = {line.split("==")[0] for line in (REPO / "docker" / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    wanted = [*project["dependencies"], *project["optional-dependencies"]["job"],
              *project["optional-dependencies"]["data"]]
    names = {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-") for req in wanted}
    assert names - {"torch"} <= pinned, f"not pinned in docker/constraints.txt: {names - {'torch'} - pinned}"
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    assert re.search(rf"^COPY examples {workdir}/examples$", text, re.M)
    script = load_spec(EXAMPLES / "local-2x1.yaml").entrypoint.target
    assert (REPO / script).is_file() and script.startswith("examples/")
    assert f"EXPOSE {RDZV_PORT}" in text
    assert 'ENTRYPOINT ["slipstream"]' in text


def test_submit_succeeds_when_its_record_cannot_be_written(capsys, monkeypatch, tmp_path):
    """The job is on the cluster: a state directory that cannot be written is a warning, not a failure."""
    _fake_kubectl(tmp_path, 'cat > /dev/null; echo "job.batch/gpt-full created"')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("SLIPSTREAM_STATE_DIR", str(tmp_path / "not-a-dir"))
    code, out, err = run_cli(["submit", FULL], capsys)
    assert code == 0 and "job.batch/gpt-full created" in out, err
    assert "warning: submitted, but its record could not be written" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["render", "validate --spec-only", "submit --dry-run"])
def test_the_spec_commands_answer_under_job_too(capsys, command):
    # `slipstream job render` answered "invalid choice" (issue #46 item 10): the same parser now.
    name, *flags = command.split()
    top = run_cli([name, str(EXAMPLES / "local-2x1.yaml"), *flags], capsys)
    grouped = run_cli(["job", name, str(EXAMPLES / "local-2x1.yaml"), *flags], capsys)
    assert grouped[0] == 0, grouped
    assert grouped == top


def test_heal_flags_go_over_the_specs_restarts_heal_and_spares(base_spec, tmp_path):
    """`slipstream run [--heal|--no-heal] [--spares N] JOB.yaml`: the flags win over restarts.heal and
    restarts.spares (the launcher's rule); the local replicas' flags then carry the result."""
    from slipstream.cli import build_parser
    from slipstream.errors import UsageError
    from slipstream.job.cli import job_run_from_args
    from slipstream.job.commands import launcher_flags

    def flags(*given: str, **restarts) -> list[str]:
        path = write_spec({**base_spec, "replicas": 2, "restarts": restarts}, str(tmp_path))
        spec = job_run_from_args(build_parser().parse_args(["run", *given, path])).spec
        rendered = launcher_flags(spec, "2", "127.0.0.1:1", "0", "r")
        return rendered[rendered.index("--max-restarts") + 2:]  # what follows: the healing flags

    assert flags() == [] and flags(heal=False) == ["--no-heal"]
    assert flags("--no-heal") == ["--no-heal"]
    assert flags("--heal", heal=False) == []  # on: the launcher's default, rendered as no flag
    assert flags("--spares", "0") == ["--spares", "0"]
    with pytest.raises(UsageError, match="restarts.heal: false turns off"):
        flags("--spares", "0", heal=False)
    path = write_spec({**base_spec, "replicas": 2}, str(tmp_path))
    with pytest.raises(UsageError, match="--no-heal must come before the job spec"):
        job_run_from_args(build_parser().parse_args(["run", path, "--no-heal"]))
