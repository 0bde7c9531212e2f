"""Checkpoints in an object store (issue #17 item 3), against moto's S3 server on loopback.

No rename there: a checkpoint's objects go straight to ``step_N/`` and the
``COMMITTED`` marker, put last, is the commit. An unmarked prefix (a save
killed during the upload) is never loaded and is deleted by the next prune.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from slipstream.checkpoint import CheckpointManager, layout, remote
from slipstream.checkpoint.states import RNGState
from slipstream.errors import ConfigError
from slipstream.extras import pip_install_hint
from slipstream.launch.proc import kill_tree

from ..data.conftest import s3, s3_endpoint  # noqa: F401 - the moto S3 server fixtures
from ..integration.test_fault_tolerance import REPO, SCRIPT, assert_state_equal, consumed, final, launch


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the manager catches it, nothing after it runs."""


class Model:
    """A model with Adam state: weights and optimizer moments are saved together."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=0.01)
        self.train(1)  # Adam's moments exist: DCP loads into the state that is there

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            self.net(torch.randn(5, 8)).square().mean().backward()
            self.opt.step()

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])


def manager(url: str, opts: dict, model: Model, **kw) -> CheckpointManager:
    # fsspec's instance cache on: every manager, DCP writer and reader then shares one
    # s3fs client (a new one costs about a second here), as in a real run.
    opts = {k: v for k, v in opts.items() if k != "skip_instance_cache"}
    mgr = CheckpointManager(url, handle_sigterm=False, storage_options=opts, **kw)
    mgr.register("model", model)
    mgr.register("rng", RNGState(), per_rank=True)
    return mgr


def keys(client, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def assert_bitwise(a: Model, b: Model) -> None:
    for (name, x), (_, y) in zip(a.net.state_dict().items(), b.net.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(torch.as_tensor(sa[pid][name]), torch.as_tensor(sb[pid][name])), (pid, name)


def test_round_trip_is_bitwise_with_the_marker_written_last(s3, tmp_path, monkeypatch):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    monkeypatch.chdir(tmp_path)  # the old bug: per-rank files went to a local folder named "s3:"
    model = Model(0)
    model.train(3)
    mgr = manager(f"{url}/run", opts, model)
    assert mgr.save(3)
    mgr.close()
    objects = keys(client, bucket)
    assert objects == [f"run/step_00000003/{n}" for n in (".metadata", "COMMITTED", "__0_0.distcp", "rank0.pt")], objects
    marker = json.loads(client.get_object(Bucket=bucket, Key="run/step_00000003/COMMITTED")["Body"].read())
    assert marker["step"] == 3 and marker["world_size"] == 1
    assert set(marker["files"]) == {".metadata", "__0_0.distcp", "rank0.pt"} and all("crc32" in e for e in marker["files"].values())
    assert not os.path.exists(REPO / "s3:")  # the old bug: per-rank files in a local folder "s3:" (cwd), os.listdir(tmp_path)

    fresh = Model(1)
    reader = manager(f"{url}/run", opts, fresh)  # checkpoint_verify=full: sizes and checksums of the objects
    assert reader.restore_latest() == 3
    reader.close()
    assert_bitwise(model, fresh)


def test_a_damaged_object_is_caught_and_moved_aside(s3):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    model = Model(0)
    mgr = manager(f"{url}/run", opts, model)
    assert mgr.save(1)
    model.train(1)
    assert mgr.save(2)
    mgr.close()
    key = "run/step_00000002/__0_0.distcp"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body[:-8])  # truncated
    reader = manager(f"{url}/run", opts, Model(1))
    assert reader.restore_latest() == 1
    reader.close()
    aside = [k for k in keys(client, bucket) if ".corrupt-" in k]
    assert any(k.endswith("/COMMITTED") for k in aside) and any(k.endswith("/__0_0.distcp") for k in aside), aside
    assert not [k for k in keys(client, bucket) if k.startswith("run/step_00000002/")]


def test_a_save_killed_before_its_marker_is_debris_ignored_then_pruned(s3, monkeypatch):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    model = Model(0)
    mgr = manager(f"{url}/run", opts, model, keep_last=2)
    assert mgr.save(2)
    saved = Model(0)
    saved.load_state_dict(copy.deepcopy(model.state_dict()))
    model.train(2)

    def killed(*args, **kwargs):  # every object of step 4 is uploaded; the process dies before the marker
        raise Killed()

    monkeypatch.setattr(layout, "commit_marker", killed)
    with pytest.raises(Killed):
        mgr.save(4)
    monkeypatch.undo()
    debris = [k for k in keys(client, bucket) if k.startswith("run/step_00000004/")]
    assert "run/step_00000004/.metadata" in debris and "run/step_00000004/rank0.pt" in debris, debris
    assert "run/step_00000004/COMMITTED" not in debris

    # The relaunch (the same run: it keeps the lease) resumes from step 2, the debris ignored.
    fresh = Model(1)
    again = manager(f"{url}/run", opts, fresh, keep_last=2)
    assert [c.step for c in layout.list_complete(f"{url}/run", again.fs)] == [2]
    assert again.restore_latest() == 2
    assert_bitwise(saved, fresh)
    assert again.save(3)  # its prune deletes the debris
    again.close()
    assert not [k for k in keys(client, bucket) if k.startswith("run/step_00000004/")], keys(client, bucket)


def test_keep_last_prunes_whole_prefixes_marker_first(s3):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    model = Model(0)
    mgr = manager(f"{url}/run", opts, model, keep_last=2)
    for step in (1, 2, 3, 4):
        model.train(1)
        assert mgr.save(step)
    prefixes = {k.split("/")[1] for k in keys(client, bucket) if k.startswith("run/step_")}
    assert prefixes == {"step_00000003", "step_00000004"}, prefixes

    # A delete cut short after the marker: the rest is debris, never a complete checkpoint.
    fs = mgr.fs
    real_rm = fs.rm

    def rm_fails(*args, **kwargs):
        raise Killed()

    fs.rm = rm_fails
    try:
        with pytest.raises(Killed):
            layout.remove(f"{url}/run/step_00000003", fs)
    finally:
        fs.rm = real_rm
    assert "run/step_00000003/.metadata" in keys(client, bucket)
    assert [c.step for c in layout.list_complete(f"{url}/run", fs)] == [4]
    model.train(1)
    assert mgr.save(5)
    mgr.close()
    prefixes = {k.split("/")[1] for k in keys(client, bucket) if k.startswith("run/step_")}
    assert prefixes == {"step_00000004", "step_00000005"}, prefixes


def test_async_save_commits_in_the_writer_thread(s3):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    model = Model(0)
    mgr = manager(f"{url}/run", opts, model, keep_last=2, async_save=True)
    for step in (1, 2, 3):
        model.train(1)
        assert mgr.save(step)
    assert mgr.wait()
    mgr.close()
    assert [c.step for c in layout.list_complete(f"{url}/run", mgr.fs)] == [2, 3]
    assert {k.split("/")[1] for k in keys(client, bucket) if k.startswith("run/step_")} == {"step_00000002", "step_00000003"}
    fresh = Model(1)
    reader = manager(f"{url}/run", opts, fresh)
    assert reader.restore_latest() == 3
    reader.close()
    assert_bitwise(model, fresh)


def test_a_url_without_fsspec_is_one_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # `import fsspec` raises ImportError
    expected = f"checkpoint_dir s3://bucket/run is a URL, which needs fsspec: {pip_install_hint('data')}"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        CheckpointManager("s3://bucket/run", handle_sigterm=False)


@pytest.mark.distributed
def test_two_ranks_killed_mid_upload_resume_from_s3_bitwise(s3, s3_endpoint, tmp_path):  # noqa: F811
    """A real SIGKILL of rank 1 once its shard of step 6 is uploaded: the restart resumes
    from step 3 in the bucket and ends bitwise equal to an uninterrupted local run."""
    url, _opts, client = s3
    bucket = url[len("s3://"):]
    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    common = ["--steps", "8", "--dropout", "0.1"]
    ref = tmp_path / "ref"
    # The uninterrupted local run goes alongside (most of either run is starting processes).
    ref_log = tmp_path / "ref.log"
    with open(ref_log, "w") as log:
        reference = subprocess.Popen([sys.executable, "-m", "slipstream", "run", "-n", "2", SCRIPT, "--out", str(ref), *common],
                                     cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        out = tmp_path / "s3run"
        proc = launch("-n", "2", "--no-heal", "--max-restarts", "1", SCRIPT, "--out", str(out), "--ckpt", f"{url}/run",
                      "--every", "3", *common, "--mode", "kill-in-save", "--fail-step", "5", env=env)
        reference.wait(timeout=240)
    finally:
        if reference.poll() is None:
            kill_tree(reference.pid)
            reference.wait()
    assert reference.returncode == 0, ref_log.read_text()[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(out / "resumed_1.pt", weights_only=False)["step"] == 3  # step 6 was never committed
    assert_state_equal(final(ref), final(out), exact=True)
    assert consumed(out, 2)[0] == consumed(ref, 2)[0]
    prefixes = {k.split("/")[1] for k in keys(client, bucket) if k.startswith("run/step_")}
    assert prefixes == {"step_00000003", "step_00000006", "step_00000008"}, prefixes
    assert all(f"run/{p}/COMMITTED" in keys(client, bucket) for p in prefixes)
    assert not os.path.exists(REPO / "s3:")  # the old bug: per-rank files in a local folder "s3:" (cwd)
