"""slipstream status|logs|cancel without a cluster: records, resolution, kubectl argument lists,
state from kubectl JSON, rank filtering, metrics; and, for real, a missing kubectl and an
unreachable API server each give one line and exit 2, fast."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest

from slipstream.cli import main as slipstream_main
from slipstream.errors import ConfigError
from slipstream.job.lifecycle import k8s
from slipstream.job.lifecycle import Action, LifecycleRequest, resolve
from slipstream.job.lifecycle.model import (
    Engine, JobNotFound, JobRef, JobStatus, LastMetrics, filter_rank, format_status, last_metrics, line_rank,
    parse_duration_s,
)
from slipstream.job.lifecycle.slurm import parse_scontrol
from tests.conftest import need_command
from slipstream.job.submissions import (
    SubmissionNotFound, find_submission, list_submissions, record_submission, state_dir,
)


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


# ---------------------------------------------------------------------------- records


def test_a_record_is_found_by_name_or_engine_id_and_the_newest_name_wins(state, tmp_path):
    first = record_submission(name="gpt", target="slurm", engine_id="41", run_dir=str(tmp_path))
    record_submission(name="gpt", target="slurm", engine_id="42")
    record_submission(name="other", target="jobset", engine_id="other", namespace="ml")
    assert first.parent == state and json.loads(first.read_text())["engine_id"] == "41"
    assert not list(state.glob(".tmp-*"))  # written through a temporary file, renamed
    assert find_submission("gpt").engine_id == "42"
    assert find_submission("41").run_dir == str(tmp_path)
    assert find_submission("other").namespace == "ml"
    assert [s.engine_id for s in list_submissions()] == ["41", "42", "other"]


def test_no_record_is_one_clear_error_with_a_suggestion():
    record_submission(name="gpt-small", target="slurm", engine_id="7")
    with pytest.raises(SubmissionNotFound, match="did you mean 'gpt-small'") as err:
        find_submission("gpt-smal")
    assert err.value.exit_code == 2


def test_the_state_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIPSTREAM_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "slipstream" / "jobs"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert state_dir() == Path.home() / ".local" / "state" / "slipstream" / "jobs"


# ---------------------------------------------------------------------------- resolution


def test_resolution_from_the_record_or_the_target(tmp_path):
    record_submission(name="gpt", target="jobset", engine_id="gpt", namespace="ml", run_dir=str(tmp_path))
    ref = resolve(LifecycleRequest(Action.STATUS, "gpt"))
    assert ref == JobRef(Engine.KUBERNETES, "gpt", "gpt", flavour="jobset", namespace="ml", run_dir=str(tmp_path),
                         submitted_at=find_submission("gpt").submitted_at - 5)
    assert resolve(LifecycleRequest(Action.STATUS, "gpt", namespace="other")).namespace == "other"
    raw = resolve(LifecycleRequest(Action.STATUS, "1234", target="slurm"))
    assert (raw.engine, raw.job_id, raw.flavour) == (Engine.SLURM, "1234", "")
    named = resolve(LifecycleRequest(Action.LOGS, "train", target="kubernetes", namespace="ml"))
    assert (named.engine, named.job_id, named.flavour, named.namespace) == (Engine.KUBERNETES, "train", "", "ml")
    with pytest.raises(SubmissionNotFound):
        resolve(LifecycleRequest(Action.STATUS, "nothing"))
    with pytest.raises(ConfigError, match="Slurm job id"):
        resolve(LifecycleRequest(Action.STATUS, "train", target="slurm"))
    with pytest.raises(ConfigError, match="--target"):
        LifecycleRequest(Action.STATUS, "x", target="nomad")


# ---------------------------------------------------------------------------- kubectl arguments


def test_kubectl_argument_lists_select_by_the_renderers_label():
    ref = JobRef(Engine.KUBERNETES, "gpt", "gpt", flavour="jobset", namespace="ml")
    assert k8s.get_argv(ref, "kubectl", "job") == [
        "kubectl", "get", "jobsets.jobset.x-k8s.io", "-l", "slipstream.dev/job=gpt", "-o", "json",
        "-n", "ml", "--request-timeout=10s"]
    assert k8s.get_argv(ref, "kubectl", "pods")[2:5] == ["pods", "-l", "slipstream.dev/job=gpt"]
    assert k8s.delete_argv(ref, "/opt/kubectl") == [
        "/opt/kubectl", "delete", "jobsets.jobset.x-k8s.io", "-l", "slipstream.dev/job=gpt", "--wait=false",
        "-n", "ml", "--request-timeout=10s"]
    logs = k8s.logs_argv(ref, "kubectl", follow=False, max_pods=8)
    assert logs[:4] == ["kubectl", "logs", "-l", "slipstream.dev/job=gpt"]
    assert {"--prefix", "--tail=-1", "--max-log-requests=8", "--all-containers=true", "--request-timeout=10s"} <= set(logs)
    follow = k8s.logs_argv(ref, "kubectl", follow=True)
    assert "-f" in follow and not any(a.startswith("--request-timeout") for a in follow)  # it would cut the stream


def test_each_flavour_names_its_objects_and_its_pods():
    plain = JobRef(Engine.KUBERNETES, "j", "j")  # --target kubernetes: the default flavour, indexed-job
    assert k8s.get_argv(plain, "kubectl", "job")[2] == "jobs.batch"
    assert k8s.delete_argv(plain, "kubectl")[2] == "jobs.batch,services"  # the headless Service too
    assert "-n" not in k8s.get_argv(plain, "kubectl", "job")  # kubectl's current namespace
    train = JobRef(Engine.KUBERNETES, "j", "j", flavour="trainjob")
    assert k8s.get_argv(train, "kubectl", "job")[2:5] == ["trainjobs.trainer.kubeflow.org", "-l", "slipstream.dev/job=j"]
    assert k8s.get_argv(train, "kubectl", "pods")[4] == "jobset.sigs.k8s.io/jobset-name=j"
    assert k8s.get_argv(JobRef(Engine.KUBERNETES, "j", "j", flavour="pytorchjob"), "k", "job")[2] == "pytorchjobs.kubeflow.org"


def _pod(name, phase, node, restarts=0):
    return {"metadata": {"name": name}, "spec": {"nodeName": node},
            "status": {"phase": phase, "containerStatuses": [{"restartCount": restarts}]}}


def test_state_nodes_restarts_and_elapsed_from_kubectl_json():
    ref = JobRef(Engine.KUBERNETES, "gpt", "gpt")
    now = datetime.datetime(2026, 1, 1, 0, 10, tzinfo=datetime.timezone.utc)
    job = {"metadata": {"name": "gpt", "creationTimestamp": "2026-01-01T00:00:00Z"},
           "status": {"startTime": "2026-01-01T00:00:05Z", "failed": 1}}
    st = k8s.summarize(ref, [job], [_pod("gpt-0", "Running", "node-a", 2), _pod("gpt-1", "Running", "node-b")], now)
    assert (st.state, st.nodes, st.restarts, st.elapsed_s) == ("RUNNING", ("node-a", "node-b"), 3, 595.0)
    assert st.pods[0] == "gpt-0 Running on node-a, 2 restart(s)"
    done = {**job, "status": {"startTime": "2026-01-01T00:00:05Z", "completionTime": "2026-01-01T00:01:05Z",
                              "conditions": [{"type": "Complete", "status": "True"}]}}
    assert (k8s.summarize(ref, [done], [], now).state, k8s.summarize(ref, [done], [], now).elapsed_s) == ("COMPLETED", 60.0)
    late = {**job, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
    assert k8s.job_state(late, []) == ("TIMEOUT", "DeadlineExceeded")
    assert k8s.job_state({"status": {"conditions": [{"type": "Suspended", "status": "True"}]}}, [])[0] == "SUSPENDED"
    assert k8s.job_state(job, [])[0] == "PENDING"
    with pytest.raises(JobNotFound, match="slipstream.dev/job=gpt"):
        k8s.summarize(ref, [], [])


def test_kubectl_errors_lose_their_klog_lines():
    err = ('E1130 21:40:51.807968 10787 memcache.go:265] "Unhandled Error" err="couldn\'t get ..."\n'
           "The connection to the server 127.0.0.1:9 was refused - did you specify the right host or port?\n")
    assert k8s.kubectl_error(err).startswith("The connection to the server 127.0.0.1:9 was refused")


# ---------------------------------------------------------------------------- pure helpers


def test_rank_prefixes_of_the_launcher_srun_and_kubectl():
    assert line_rank("[rank1]:step 5") == 1
    assert line_rank("[default0]:hello") == 0  # slipstream run --tee 3 (torch elastic's default template)
    assert line_rank("12: hello") == 12  # srun --label
    assert line_rank("[pod/gpt-0-abc/trainer] [rank3]:x") == 3
    assert line_rank("step 5 loss 3.1") is None and line_rank("[rankx]: no") is None
    lines = ["[rank0]:a", "[rank1]:b", "plain", "[rank1]:c"]
    assert list(filter_rank(lines, 1)) == ["[rank1]:b", "[rank1]:c"]
    assert list(filter_rank(lines, None)) == lines


def test_scontrol_one_line_output_and_slurm_durations():
    d = parse_scontrol("JobId=4 JobName=my job UserId=root(0) JobState=RUNNING Reason=None Restarts=1 "
                       "RunTime=00:01:02 StdOut=/tmp/slurm-4.out Power=")
    assert (d["JobId"], d["JobName"], d["JobState"], d["Restarts"], d["StdOut"], d["Power"]) == (
        "4", "my job", "RUNNING", "1", "/tmp/slurm-4.out", "")
    assert parse_duration_s("1-02:00:05") == 93605.0
    assert parse_duration_s("0:07") == 7.0 and parse_duration_s("01:00:00") == 3600.0
    assert parse_duration_s("INVALID") is None


def test_the_last_step_and_loss_come_from_the_metrics_tail(tmp_path):
    (tmp_path / "metrics").mkdir()
    recs = [{"step": s, "loss": 5.0 - s / 100, "time_s": s * 0.5} for s in range(1, 2001)]
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"step": 2001, "lo'  # a record half written
    (tmp_path / "metrics" / "rank0.jsonl").write_text(text)
    path = str(tmp_path / "metrics" / "rank0.jsonl")
    assert last_metrics(str(tmp_path)) == LastMetrics(step=2000, loss=pytest.approx(-15.0), time_s=1000.0, path=path)
    assert last_metrics(str(tmp_path / "nowhere")) is None and last_metrics(None) is None


def test_a_run_that_chose_its_own_directory_is_found_under_runs(tmp_path):
    """Submitted from DIR, a run without --run-dir writes DIR/runs/<timestamp>/: the newest one
    written since the submission is the job's; older ones are not."""
    for name, step, age_s in (("20260101-000000", 3, 3600), ("20260101-010000", 9, 0)):
        (tmp_path / "runs" / name / "metrics").mkdir(parents=True)
        f = tmp_path / "runs" / name / "metrics" / "rank0.jsonl"
        f.write_text(json.dumps({"step": step, "loss": 1.0}) + "\n")
        os.utime(f, (time.time() - age_s, time.time() - age_s))
    assert last_metrics(str(tmp_path), since=time.time() - 60).step == 9
    assert last_metrics(str(tmp_path), since=time.time() + 60) is None


def test_status_text_is_one_fact_per_line():
    st = JobStatus(engine=Engine.SLURM, job_id="42", name="gpt", state="RUNNING", nodes=("n[1-2] (2 nodes)",),
                   restarts=1, elapsed_s=65, source="squeue", metrics=LastMetrics(120, 3.21404, 60.0))
    assert format_status(st).splitlines() == [
        "job:      gpt, 42 (slurm, squeue)", "state:    RUNNING", "nodes:    n[1-2] (2 nodes)",
        "requeues: 1", "elapsed:  1m05s", "progress: step 120, loss 3.2140"]


# ---------------------------------------------------------------------------- real failures, fast


def _one_line_exit_2(argv, capsys):
    t0 = time.monotonic()
    rc = slipstream_main(argv)
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1, err
    assert elapsed < 10, elapsed
    return err[0]


def test_a_missing_kubectl_is_one_line_and_exit_2(tmp_path, capsys):
    line = _one_line_exit_2(["status", "gpt", "--target", "kubernetes", "--kubectl", str(tmp_path / "kubectl")], capsys)
    assert "kubectl" in line and "not found" in line


def test_a_missing_slurm_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    line = _one_line_exit_2(["status", "42", "--target", "slurm"], capsys)
    assert "squeue not found" in line


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_an_unreachable_api_server_is_one_line_and_exit_2(command, monkeypatch, tmp_path, capsys):
    need_command("kubectl")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(  # a cluster on a port nothing listens on (9: discard, closed here)
        "apiVersion: v1\nkind: Config\nclusters:\n- {name: dead, cluster: {server: 'https://127.0.0.1:9'}}\n"
        "contexts:\n- {name: dead, context: {cluster: dead, user: u}}\ncurrent-context: dead\n"
        "users:\n- {name: u, user: {token: x}}\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    line = _one_line_exit_2([command, "gpt", "--target", "jobset", "--namespace", "ml"], capsys)
    assert "no Kubernetes cluster reachable" in line and "127.0.0.1:9" in line
    assert os.environ["KUBECONFIG"] == str(kubeconfig)
