"""``slipstream run`` on a script that needs an extra which is missing here (transformers'
Trainer without accelerate, issue #46 item 9): one line naming the extra, exit 2, before any
worker starts; and the extras themselves, as pyproject.toml declares them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slipstream import extras
from slipstream.cli import main

REPO = Path(__file__).resolve().parents[2]
TRAINER = "import os\nfrom transformers import Trainer, TrainingArguments\n\ntrainer = Trainer(model=None)\n"


@pytest.fixture
def no_workers(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    import torch.distributed.launcher.api as launcher_api

    def tripwire(*args, **kwargs):
        raise AssertionError("a worker would start")

    monkeypatch.setattr(launcher_api, "elastic_launch", tripwire)
    return tmp_path


def test_a_trainer_script_without_accelerate_names_the_extra_before_launch(no_workers, monkeypatch, capsys):
    (no_workers / "train.py").write_text(TRAINER)
    versions = {"transformers": "5.0.0", "accelerate": None}
    monkeypatch.setattr(extras, "installed_version", versions.get)
    assert main(["run", "-n", "2", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("slipstream run: error: train.py uses transformers' Trainer, which needs "
                             "accelerate>=1.1 (not installed): pip install 'slipstream[hf]'"), err


@pytest.mark.parametrize("source, have, extra", [
    (TRAINER, {"transformers": "4.39.0", "accelerate": "1.2.0"}, "hf"),
    ("from accelerate import Accelerator\n", {}, "accelerate"),
    ("import lightning as L\n", {"lightning": "1.9.5"}, "lightning"),
])
def test_each_path_names_its_extra(source, have, extra):
    line = extras.script_missing_extra(source, "x.py", have.get)
    assert line is not None and f"'slipstream[{extra}]'" in line, line


def test_nothing_is_said_where_everything_is_installed_or_nothing_is_used():
    new = {"transformers": "5.0.0", "accelerate": "1.16.0", "lightning": "2.6.0"}.get
    assert extras.script_missing_extra(TRAINER, "x.py", new) is None
    assert extras.script_missing_extra("import torch\n# Trainer is a word in a comment\n", "x.py", lambda d: None) is None
    # transformers for a model alone needs no accelerate
    model_only = "from transformers import AutoModel  # no Trainer here\nmodel = AutoModel.from_config(c)\n"
    assert extras.script_missing_extra(model_only, "x.py", {"transformers": "5.0.0"}.get) is None


def test_the_extras_cover_the_trainer_accelerate_and_lightning_paths():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("accelerate>=1.1.0") for r in declared["hf"])  # Trainer refuses older
    assert any(r.startswith("transformers") for r in declared["hf"])
    assert any(r.startswith("accelerate") for r in declared["accelerate"])
    assert any(r.startswith("lightning") for r in declared["lightning"])
