"""docs/migration.md's converted scripts resume without reading a sample twice or skipping one.

Each conversion is taken from the page as printed (the Accelerate diff's new side, the
Lightning Trainer's block), completed by a prelude that defines what the page assumes
(the model, the optimizer, the dataset, the loop's bound) and records every sample the
model sees in a ledger. The script is interrupted by SIGTERM (exit 143, the emergency
checkpoint written), run again to the end, and run a third time: the ledger must hold each
epoch of the plan exactly once, and the third run must say there was nothing to train.
One process per run (``python train.py``): the loader's split across ranks is the data
tests' (tests/data); here it is the position that must come back with the checkpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.errors import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "migration.md"
SAMPLES = 96  # the dataset; 12 batches of 8 (Accelerate) or 3 of 32 (Lightning) per epoch

_PRELUDE = '''
import os, signal
import torch
import torch.nn.functional as F

SAMPLES = {samples}
STOP_AT = int(os.environ.get("STOP_AT_FORWARD", "0"))  # SIGTERM to this process at this forward (0: never)
_forwards = 0


def _record(ids):
    """The ledger: one line of sample ids per forward; SIGTERM when told to (what the kubelet sends)."""
    global _forwards
    _forwards += 1
    with open("ledger.txt", "a") as fh:
        fh.write(" ".join(str(int(i)) for i in ids.tolist()) + "\\n")
    if _forwards == STOP_AT:
        os.kill(os.getpid(), signal.SIGTERM)


class Output(dict):
    """A model output with a .loss, as Hugging Face's ModelOutput."""
    __getattr__ = dict.__getitem__
'''

_ACCELERATE = _PRELUDE + '''

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, idx, x, labels):
        _record(idx)
        return Output(loss=F.mse_loss(self.net(x), labels))


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x = torch.full((4,), float(i) / SAMPLES)
        return {{"idx": torch.tensor(i), "x": x, "labels": x.sum(0, keepdim=True)}}


torch.manual_seed(0)
model, dataset, epochs = Model(), Samples(), 3
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
'''

_LIGHTNING = _PRELUDE + '''

class Module(torch.nn.Module):
    """The LightningModule's parts that the conversion uses (no lightning import needed)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 3)

    def forward(self, x):
        _record(x[:, 0])  # column 0 carries the sample's id
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.tensor([float(i), 1.0, -1.0, 0.5]), torch.tensor(i % 3)


torch.manual_seed(0)
module, dataset, max_steps = Module(), Samples(), 5  # 2 micro-steps of 32 per step: 5 steps = 10 batches
'''


def _blocks(kind: str) -> list[tuple[str, str]]:
    """(section heading, code) of every ``kind`` code block in the page."""
    found, heading = [], ""
    for part in re.split(r"^(## .*)$", PAGE.read_text(), flags=re.M):
        if part.startswith("## "):
            heading = part[3:].strip()
            continue
        found += [(heading, code) for code in re.findall(rf"^```{kind}\n(.*?)^```", part, flags=re.S | re.M)]
    return found


def accelerate_script() -> str:
    """The Accelerate conversion: the diff's context and added lines, as the converted file holds them."""
    (code,) = [code for heading, code in _blocks("diff") if heading == "From Hugging Face Accelerate"]
    return "".join(line[1:] + "\n" for line in code.splitlines() if line[:1] in ("+", " "))


def lightning_script() -> str:
    (code,) = [code for heading, code in _blocks("python") if heading == "From the Lightning Trainer"]
    return code


def _run(workdir: Path, stop_at: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "STOP_AT_FORWARD": str(stop_at), "SLIPSTREAM_RUN_DIR": str(workdir / "run")}
    return subprocess.run([sys.executable, "train.py"], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=240)


def _epochs(ledger: list[int], per_epoch: int) -> list[list[int]]:
    return [ledger[i:i + per_epoch] for i in range(0, len(ledger), per_epoch)]


@pytest.mark.parametrize("name, prelude, script, stop_at, seen", [
    # 12 batches an epoch, 4 micro-steps a step: SIGTERM in forward 14 (epoch 1), checkpoint at step 4 (batch 16).
    ("accelerate", _ACCELERATE, accelerate_script, 14, 3 * SAMPLES),
    # 3 batches an epoch, 2 micro-steps a step: SIGTERM in forward 3 (epoch 0), checkpoint at step 2 (batch 4).
    ("lightning", _LIGHTNING, lightning_script, 3, 10 * 32),
], ids=["accelerate", "lightning"])
def test_a_converted_script_resumes_without_repeating_or_skipping_data(tmp_path, name, prelude, script, stop_at,
                                                                      seen):
    (tmp_path / "train.py").write_text(prelude.format(samples=SAMPLES) + script())

    cut = _run(tmp_path, stop_at=stop_at)
    assert cut.returncode == EXIT_PREEMPTED, cut.stdout[-2000:] + cut.stderr[-2000:]
    assert "preempted (SIGTERM)" in cut.stdout
    before = len((tmp_path / "ledger.txt").read_text().splitlines())

    again = _run(tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert re.search(r"resumed from \S*ckpt at step \d+\n", again.stdout), again.stdout  # nothing changed: no list

    lines = (tmp_path / "ledger.txt").read_text().splitlines()
    assert before < len(lines)
    ledger = [int(i) for line in lines for i in line.split()]
    assert len(ledger) == seen, (len(ledger), seen)
    for epoch, ids in enumerate(_epochs(ledger, SAMPLES)):
        full = len(ids) == SAMPLES
        assert len(set(ids)) == len(ids), f"epoch {epoch}: a sample read twice"
        assert not full or sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: a sample skipped"

    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "nothing to train: the run in ckpt is already complete" in done.stdout, done.stdout
    assert len((tmp_path / "ledger.txt").read_text().splitlines()) == len(lines)  # no forward at all
