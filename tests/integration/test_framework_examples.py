"""Scripts written for a framework (torchrun DDP, Hugging Face Trainer, Lightning, Accelerate), unchanged under `slipstream run`.

Each example in examples/ that imports no Slipstream (ddp_torchrun.py, hf_trainer.py, lightning_ddp.py,
accelerate_ddp.py) trains at 2 ranks on CPU under plain ``torchrun --standalone`` and under
``slipstream run -n 2``: the two end with bitwise the same weights and the same finite loss.
:func:`run_example` runs one example under one launcher, with extra launcher flags if asked
(``--sync ...`` cases compare against a plain run the same way).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slipstream.launch.proc import kill_tree
from tests.conftest import need_module
from tests.integration.test_launcher import REPO, _torchrun, slipstream_run


@dataclass(frozen=True)
class Example:
    script: str
    module: str  # the framework it needs
    hint: str
    steps: int
    untrained_loss: float  # the loss of a model that learned nothing: the final one must be below


EXAMPLES = {
    "ddp_torchrun": Example("examples/ddp_torchrun.py", "torch", "pip install torch", 20,
                            math.log(10)),  # uniform over the 10 classes
    "hf_trainer": Example("examples/hf_trainer.py", "transformers", "pip install 'slipstream[hf]'", 10,
                          math.log(256)),  # uniform over the 256 tokens
    "lightning_ddp": Example("examples/lightning_ddp.py", "lightning", "bash scripts/install.sh test", 10,
                             math.log(10)),  # uniform over the 10 classes
    "accelerate_ddp": Example("examples/accelerate_ddp.py", "accelerate", "bash scripts/install.sh test", 20,
                              0.5),  # the target's variance (0.50): predicting its mean
}

LAUNCHERS = ("torchrun", "slipstream")
NPROC = 2
# The launchers' OMP_NUM_THREADS defaults differ on purpose (torchrun 1, slipstream cores / workers);
# nothing is downloaded (the models are built from configs): a hub access would fail here.
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@dataclass
class Run:
    weights: dict[str, torch.Tensor]  # rank 0's final state_dict
    result: dict  # rank 0's result.json: loss, steps, world_size
    output: str  # the launcher's stdout and stderr


def run_example(launcher: str, example: str, tmp_path: Path, extra_flags: tuple[str, ...] = (),
                nproc: int = NPROC, env: dict | None = None) -> Run:
    """Run ``EXAMPLES[example]`` under ``launcher`` ("torchrun" or "slipstream": ``slipstream run``)
    at ``nproc`` ranks, ``extra_flags`` after the launcher's own (e.g. ``("--sync", "powersgd")``);
    its output goes to a folder of ``tmp_path`` named after both and the flags. Fails the test
    unless it exits 0; torchrun is run again (up to 3 times) when torch's gloo abort at exit
    killed a rank after training (see ``_torchrun``)."""
    ex = EXAMPLES[example]
    out = tmp_path / "-".join([example, launcher, *(re.sub(r"[^\w.]+", "", f) for f in extra_flags)])
    script = [ex.script, "--steps", str(ex.steps), "--out", str(out)]
    env = {**ENV, **(env or {})}
    if launcher == "torchrun":
        proc = _torchrun(["--standalone", "--nproc_per_node", str(nproc), *extra_flags, *script], env=env)
    elif launcher == "slipstream":
        proc = slipstream_run("-n", str(nproc), *extra_flags, *script, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    else:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    output = proc.stdout + proc.stderr
    assert (out / "model.pt").exists() and (out / "result.json").exists(), output[-3000:]
    return Run(torch.load(out / "model.pt"), json.loads((out / "result.json").read_text()), output)


class PlainRuns:
    """The runs without extra flags (``run_example(launcher, example, ...)``), each made once per
    module and shared by the tests that compare against it: the same command gives the same run,
    so a second one would only cost time (a 2-rank Lightning run is ~10 s on 2 cores)."""

    def __init__(self, tmp_path_factory) -> None:
        self._factory = tmp_path_factory
        self._runs: dict[tuple[str, str], Run] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, launcher: str, example: str) -> Run:
        key = (launcher, example)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._runs:
                self._runs[key] = run_example(launcher, example, self._factory.mktemp(f"plain-{launcher}-{example}"))
            return self._runs[key]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> PlainRuns:
    return PlainRuns(tmp_path_factory)


def run_both(example: str, tmp_path: Path, plain: PlainRuns, extra_flags: tuple[str, ...] = ()) -> tuple[Run, Run]:
    """(plain torchrun's run, ``slipstream run [extra_flags]``'s run) of ``example``, side by side
    (each launcher picks its own free port); a plain run another test made already is reused."""
    with ThreadPoolExecutor(2) as pool:
        theirs = pool.submit(plain.get, "torchrun", example)
        ours = (pool.submit(plain.get, "slipstream", example) if not extra_flags
                else pool.submit(run_example, "slipstream", example, tmp_path, extra_flags))
        return theirs.result(), ours.result()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)}/{len(a)} tensors differ: {differ[:5]}"


@pytest.mark.distributed
@pytest.mark.parametrize("example", EXAMPLES)
def test_a_framework_script_trains_under_slipstream_run_as_under_torchrun(tmp_path, plain_runs, example):
    """The same command words after `slipstream run -n 2` as after `torchrun --standalone
    --nproc_per_node 2`: a 2-rank run (not two 1-rank runs) that trained, bitwise torchrun's."""
    ex = EXAMPLES[example]
    need_module(ex.module, ex.hint)
    theirs, ours = run_both(example, tmp_path, plain_runs)
    for run in (theirs, ours):
        assert run.result["world_size"] == NPROC and run.result["steps"] == ex.steps, run.result
        assert math.isfinite(run.result["loss"]) and run.result["loss"] < ex.untrained_loss, run.result
    assert_same_weights(ours.weights, theirs.weights)
    assert ours.result["loss"] == theirs.result["loss"]
    if example == "lightning_ddp":
        # Lightning joined the launched processes (its TorchElasticEnvironment: TORCHELASTIC_RUN_ID
        # is set) instead of starting processes of its own: one process group member per rank.
        for run in (theirs, ours):
            members = re.findall(r"Initializing distributed: GLOBAL_RANK: (\d+), MEMBER: (\d+)/(\d+)", run.output)
            assert sorted(members) == [(str(r), str(r + 1), str(NPROC)) for r in range(NPROC)], members


def test_each_framework_script_also_runs_alone_as_one_process(tmp_path):
    """`python examples/X.py`, no launcher: the framework trains on one process (world size 1).
    The three side by side: each is mostly its imports."""
    for ex in EXAMPLES.values():
        need_module(ex.module, ex.hint)
    procs = {}
    for name, ex in EXAMPLES.items():
        with open(tmp_path / f"{name}.log", "w") as log:  # a file: no pipe fills while another run is awaited
            procs[name] = subprocess.Popen(
                [sys.executable, ex.script, "--steps", str(ex.steps), "--out", str(tmp_path / name)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **ENV})
    try:
        for name, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    for name, ex in EXAMPLES.items():
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert result["world_size"] == 1 and result["steps"] == ex.steps, (name, result)
        assert math.isfinite(result["loss"]) and result["loss"] < ex.untrained_loss, (name, result)
        weights = torch.load(tmp_path / name / "model.pt")
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()), name


# --- zero-change acceleration (docs/zero-change.md): `slipstream run --sync ...` on the Trainer ---

@pytest.fixture(scope="module")
def trainer_plain(plain_runs) -> Run:
    """`slipstream run -n 2 examples/hf_trainer.py`: the run the parametrized test above compares with torchrun's."""
    need_module("transformers", EXAMPLES["hf_trainer"].hint)
    return plain_runs.get("slipstream", "hf_trainer")


def metrics_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["bf16", "powersgd"])
def test_the_trainer_gets_the_strategy_unchanged(tmp_path, trainer_plain, strategy):
    """The Trainer's DDP model is adopted: the strategy is reported and ran (other weights than
    the plain run's), the loss stays within 2% of it, and the metrics hold the Trainer's loss."""
    run_dir = tmp_path / "run"
    ours = run_example("slipstream", "hf_trainer", tmp_path,
                       ("--sync", strategy, "--log-every-steps", "5", "--run-dir", str(run_dir)))
    assert f"gradient sync {strategy}" in ours.output and "adopted the script's DistributedDataParallel" in ours.output
    assert ours.result["world_size"] == NPROC
    assert abs(ours.result["loss"] - trainer_plain.result["loss"]) <= 0.02 * trainer_plain.result["loss"]
    assert any(not torch.equal(ours.weights[k], trainer_plain.weights[k]) for k in ours.weights), "the strategy ran"
    last = metrics_records(run_dir)[-1]
    assert last["step"] == 10 and last["sync_strategy"] == strategy and last["sync_compression_ratio"] > 1
    # The model's output.loss as the Trainer left it (it rescales the tensor in place by the
    # number of processes): rank 0's mean of steps 6-10 against the Trainer's mean over ranks.
    assert abs(last["loss"] - ours.result["loss"]) <= 0.1 * ours.result["loss"], (last["loss"], ours.result)
    assert last["tokens"] > 0 and last["forward_s"] > 0


@pytest.mark.distributed
def test_the_trainer_under_auto_decides_on_a_slow_link(tmp_path, trainer_plain):
    """`auto` on the emulated cluster (two network namespaces, 20 Mbit/s): it probes, decides
    to compress, and the Trainer still trains to within 2% of the plain run's loss."""
    from tests.conftest import require_root

    require_root("the emulated cluster (network namespaces, tc)")
    run_dir = tmp_path / "run"
    ours = run_example("slipstream", "hf_trainer", tmp_path,
                       ("--emulate", "2x1", "--link", "20mbit", "--sync", "auto", "--run-dir", str(run_dir)))
    assert "gradient sync auto" in ours.output
    assert abs(ours.result["loss"] - trainer_plain.result["loss"]) <= 0.02 * trainer_plain.result["loss"]
    decision = metrics_records(run_dir)[-1]["sync_decision"]
    assert decision and decision != "allreduce" and "observing" not in decision, decision
    assert any(not torch.equal(ours.weights[k], trainer_plain.weights[k]) for k in ours.weights)


@pytest.mark.distributed
@pytest.mark.parametrize("example", ["lightning_ddp", "accelerate_ddp"])
def test_lightning_and_accelerate_scripts_get_the_strategy_unchanged(tmp_path, plain_runs, example):
    """Lightning's DDP strategy and Accelerate's prepare() build the DDP model: it is adopted too."""
    ex = EXAMPLES[example]
    need_module(ex.module, ex.hint)
    theirs, ours = run_both(example, tmp_path, plain_runs, ("--sync", "powersgd"))
    assert "adopted the script's DistributedDataParallel" in ours.output and "gradient sync powersgd" in ours.output
    assert ours.result["world_size"] == NPROC and math.isfinite(ours.result["loss"])
    assert ours.result["loss"] < ex.untrained_loss
    assert any(not torch.equal(ours.weights[k], theirs.weights[k]) for k in ours.weights), "the strategy ran"
