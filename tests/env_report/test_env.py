"""``slipstream env`` for bug reports and ``slipstream --version`` (issue #46 item 10)."""

from __future__ import annotations

import json
import platform

import pytest
import torch

from slipstream import __version__
from slipstream.cli import main
from slipstream.env_report import environment_config


def test_env_prints_versions_devices_interfaces_extras_and_the_environments_configuration(capsys, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_PRECISION", "bf16")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("SLIPSTREAM_S3_SECRET_KEY", "hunter2")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for line in (f"- Slipstream: {__version__}", f"- Python: {platform.python_version()}",
                 f"- torch: {torch.__version__}", "- CUDA (torch's build): ", "- NCCL: ",
                 "- torch.distributed backends: gloo", "- GPUs: ", "- Network interfaces:", "  - lo: 127.0.0.1",
                 "  - SLIPSTREAM_PRECISION=bf16", "  - NCCL_DEBUG=INFO"):
        assert line in out, (line, out)
    assert "hunter2" not in out and "SLIPSTREAM_S3_SECRET_KEY=(set, not shown)" in out
    assert "  - hf: " in out and "accelerate" in out.split("  - hf: ")[1].splitlines()[0]  # the Trainer's extra


def test_env_json_is_one_object_with_every_fact(capsys):
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["slipstream"] == __version__ and doc["torch"] == torch.__version__
    assert "lo" in doc["interfaces"] and isinstance(doc["extras"], dict) and "gloo" in doc["backends"]


def test_a_refused_value_in_the_environment_is_reported_not_raised():
    config, error, _ = environment_config({"SLIPSTREAM_PRECISION": "bf17"})
    assert config == {"SLIPSTREAM_PRECISION": "bf17"}
    assert error is not None and "precision" in error and "bf17" in error


def test_version_names_slipstream_torch_and_python_on_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    assert out[0].startswith(f"slipstream {__version__}, torch {torch.__version__}"), out
    assert out[0].endswith(f"Python {platform.python_version()}"), out
    assert ("CPU build" in out[0]) == (torch.version.cuda is None)
    if torch.version.cuda is not None:
        assert f"CUDA {torch.version.cuda}" in out[0]
