"""``slipstream export`` of a checkpoint in an object store (issue #34 item 5), against moto's S3 server.

The checkpoints are written by the CheckpointManager as training writes them
(``model_optimizer`` through torch's state-dict API), in one process without a
process group. The command runs in this process (``main(argv)``), its endpoint
and credentials from the environment as a user's would be (``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import importlib
import re
import socket
import sys
import threading
import time

import pytest
import torch
from torch import nn

from slipstream.checkpoint import CheckpointManager, layout
from slipstream.checkpoint.export import ExportError, ExportRequest, export_checkpoint
from slipstream.checkpoint.states import ModelOptimizerState
from slipstream.cli import main
from slipstream.extras import pip_install_hint

from ..data.conftest import s3, s3_endpoint  # noqa: F401 - the moto S3 server fixtures


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the manager catches it, nothing after it runs."""


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(5, 8)).square().mean().backward()
        opt.step()


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def export(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["export", *argv])
    return code, capsys.readouterr().err


@pytest.fixture
def env(s3_endpoint, monkeypatch):  # noqa: F811
    """The store as a user names it: the endpoint in the environment, no storage options."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return s3_endpoint


def test_export_from_s3_equals_the_same_checkpoint_on_disk_and_skips_an_unmarked_newer_one(
        s3, env, tmp_path, monkeypatch, capsys):  # noqa: F811
    url, opts, client = s3
    bucket = url[len("s3://"):]
    net, opt = trained(0)
    train(net, opt, 2)
    mgr = CheckpointManager(f"{url}/run", handle_sigterm=False, storage_options=opts)
    mgr.register("model_optimizer", ModelOptimizerState(net, opt))
    assert mgr.save(2)
    at_2 = weights(net)
    train(net, opt, 2)

    def killed(*args, **kwargs):  # every object of step 4 is uploaded; the process dies before the marker
        raise Killed()

    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(layout, "commit_marker", killed)
        mgr.save(4)
    mgr.close()
    stored = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert "run/step_00000004/__0_0.distcp" in stored and "run/step_00000004/COMMITTED" not in stored, stored
    assert not all(torch.equal(at_2[k], v) for k, v in weights(net).items())  # step 4 differs from step 2

    # The same checkpoint's objects, copied to a local directory as they are.
    local = tmp_path / "local"
    for key in stored:
        if key.startswith("run/step_00000002/"):
            path = local / key[len("run/"):]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    code, err = export([f"{url}/run", "--format", "torch", "--out", str(tmp_path / "s3.pt")], capsys)
    assert code == 0, err
    assert export([str(local), "--format", "torch", "--out", str(tmp_path / "disk.pt")], capsys)[0] == 0
    from_s3 = torch.load(tmp_path / "s3.pt", weights_only=True)
    from_disk = torch.load(tmp_path / "disk.pt", weights_only=True)
    assert list(from_s3) == list(from_disk) == list(at_2)
    for name, tensor in from_s3.items():
        assert tensor.dtype == from_disk[name].dtype and torch.equal(tensor, from_disk[name]), name
        assert torch.equal(tensor, at_2[name]), name  # step 2's weights, not the unmarked step 4's

    # safetensors, through the Python API with storage options instead of the environment
    # (a step prefix named directly), loads strictly into the plain model.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    from safetensors.torch import load_file

    result = export_checkpoint(ExportRequest(f"{url}/run/step_00000002", str(tmp_path / "s3.safetensors"),
                                             storage_options=opts))
    assert result.step == 2 and result.source == f"{url}/run/step_00000002"
    plain, _ = trained(1)
    plain.load_state_dict(load_file(str(tmp_path / "s3.safetensors")), strict=True)
    assert all(torch.equal(v, at_2[k]) for k, v in plain.state_dict().items())

    # The unmarked prefix named directly is refused, as a .partial directory is on disk.
    with pytest.raises(ExportError, match="no COMMITTED marker: an upload cut short"):
        export_checkpoint(ExportRequest(f"{url}/run/step_00000004", str(tmp_path / "x.pt"), "torch",
                                        storage_options=opts))


def _one_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in lines[0], (needle, err)


def test_a_missing_bucket_an_empty_prefix_and_only_unmarked_steps_are_one_line(s3, env, tmp_path, capsys):  # noqa: F811
    url, _, client = s3
    bucket = url[len("s3://"):]
    client.put_object(Bucket=bucket, Key="cut/step_00000007/.metadata", Body=b"x")
    out = ["--out", str(tmp_path / "w.safetensors")]
    _one_line(*export(["s3://no-such-bucket-3f9a/run", *out], capsys), "bucket 'no-such-bucket-3f9a' does not exist")
    _one_line(*export([f"{url}/nothing-here", *out], capsys), f"no checkpoint at {url}/nothing-here: nothing is stored")
    _one_line(*export([f"{url}/cut", *out], capsys),
              f"no complete checkpoint at {url}/cut: step_00000007 has no COMMITTED marker")
    assert not (tmp_path / "w.safetensors").exists()


def test_missing_credentials_and_a_refusing_endpoint_are_one_line(s3, env, tmp_path, monkeypatch, capsys):  # noqa: F811
    url, _, _ = s3
    out = ["--out", str(tmp_path / "w.pt")]
    with monkeypatch.context() as m:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                     "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                     "AWS_WEB_IDENTITY_TOKEN_FILE"):
            m.delenv(name, raising=False)
        m.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        m.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        m.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup off this machine
        _one_line(*export([f"{url}/run", *out], capsys), f"cannot read {url}/run: NoCredentialsError", "give credentials")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    _one_line(*export([f"{url}/run", *out], capsys), "EndpointConnectionError", "is the endpoint right")


def test_an_endpoint_that_never_answers_fails_in_bounded_time(s3, tmp_path):  # noqa: F811
    """A server that accepts connections and never answers: with s3fs's and botocore's defaults
    the listing would take 5 tries x 5 attempts x 15 s (420 s measured). Here with a 0.5 s read
    timeout (storage options take precedence over the export's 10 s): 2 tries x 2 attempts."""
    url, _, _ = s3
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}", "key": "testing", "secret": "testing",
            "config_kwargs": {"read_timeout": 0.5}}
    began = time.monotonic()
    try:
        with pytest.raises(ExportError, match=f"^cannot read {re.escape(url)}/run: ReadTimeoutError"):
            export_checkpoint(ExportRequest(f"{url}/run", str(tmp_path / "w.pt"), "torch", storage_options=opts))
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        silent.close()
    elapsed = time.monotonic() - began
    assert len(accepted) == 4, accepted  # 2 s3fs tries x 2 botocore attempts, each on a new connection
    assert elapsed < 20, elapsed  # 4 reads of 0.5 s and back-offs of up to 1 s; s3fs's defaults: 25 attempts


def test_unknown_protocol_and_missing_backends_are_one_line(tmp_path, monkeypatch, capsys):
    registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is its mapping)
    out = ["--out", str(tmp_path / "w.pt")]
    _one_line(*export(["foo://x/run", *out], capsys), "CHECKPOINT foo://x/run is not a usable fsspec URL",
              "Protocol not known: foo")
    for module, protocols in (("s3fs", ("s3",)), ("gcsfs", ("gs", "gcs"))):
        monkeypatch.setitem(sys.modules, module, None)  # `import s3fs` raises ImportError, installed or not
        for protocol in protocols:  # fsspec keeps a backend once imported (by an earlier test)
            monkeypatch.delitem(registry._registry, protocol, raising=False)
    # s3fs is in the 'data' extra: that extra is named; gcsfs is in none: the package is.
    _one_line(*export(["s3://bucket/run", *out], capsys), "CHECKPOINT s3://bucket/run: Install s3fs to access S3",
              pip_install_hint("data"))
    _one_line(*export(["gs://bucket/run", *out], capsys), "CHECKPOINT gs://bucket/run: Please install gcsfs",
              ": pip install gcsfs")
