"""A sync strategy brought by the user (issue #44): a codec defined in this file, registered with
``sync.register_codec``, trains through ``accelerate()``, ``slipstream run --sync NAME`` and a job
spec, with nothing changed outside sync/. Other processes find it through an entry point of group
``slipstream.sync_strategies`` (a real dist-info on PYTHONPATH), loaded lazily, once; a broken
entry point costs one line naming its package."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from slipstream import sync
from slipstream.errors import ConfigError
from slipstream.sync import StrategyInfo, SyncKind, UnknownStrategy
from slipstream.sync.compress import Cast, Codec
from tests.job.conftest import run_cli, write_spec

REPO = Path(__file__).resolve().parents[2]
NAME = "test_bf16_round"
REGISTERED = []  # one entry per call of register_strategy in this process (discovery calls it once)


class RoundToBf16(Codec):
    """bf16 on the wire through the existing cast codec, each bucket multiplied by ``scale`` before
    and divided after (1.0: the cast alone); counts its calls, which its state carries."""

    name = NAME

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.cast, self.scale, self.calls = Cast(torch.bfloat16), float(scale), 0

    def reduce(self, flat, wire, key, layout=None):
        self.calls += 1
        return self.cast.reduce(flat.mul_(self.scale), wire, key, layout).div_(self.scale)

    def wire_bytes(self, numel, n, layout=None, itemsize=4):
        return self.cast.wire_bytes(numel, n, layout, itemsize)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = int(state.get("calls", 0))


def register_strategy() -> None:
    """What the entry point names: registers the strategy (its package's function)."""
    REGISTERED.append(NAME)
    sync.register_codec(NAME, RoundToBf16, StrategyInfo(NAME, SyncKind.HOOK))


@pytest.fixture
def registry(monkeypatch):
    """The registry as built in, discovery not run yet; put back after the test."""
    monkeypatch.setattr(sync, "_REGISTRY", dict(sync._REGISTRY))
    monkeypatch.setattr(sync, "_INFO", dict(sync._INFO))
    monkeypatch.setattr(sync, "_BROKEN", {})
    monkeypatch.setattr(sync, "_DISCOVERED", False)
    REGISTERED.clear()


def _installed(where: Path, entry_points: dict[str, str], package: str = "slipstream-test-strategy") -> Path:
    """A package installed in ``where`` with ``entry_points`` (name -> module:function) in the group."""
    info = where / f"{package.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[slipstream.sync_strategies]\n{lines}")
    return where


def test_registered_in_the_script_it_trains_through_accelerate(registry, one_rank_group):
    """In this process (one rank): accelerate() finds the strategy and hands it its options; the
    codec itself runs at two ranks below (one rank leaves DDP's reducer as it is, as for bf16)."""
    import slipstream

    register_strategy()
    model = torch.nn.Linear(16, 1)
    run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.05), progress=False, run_dir=None,
                                sync=NAME, sync_options={"scale": 2.0, "warmup_steps": 1})
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        run.backward(torch.nn.functional.mse_loss(run.model(x), x.sum(1, keepdim=True)))
        run.step()
    assert run.sync_state.stats()["sync_strategy"] == NAME and run.step_count == 2
    run.finish()
    with pytest.raises(ConfigError, match=f"sync_options for '{NAME}': .*unexpected keyword argument 'scal'"):
        slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.05), progress=False, run_dir=None,
                              sync=NAME, sync_options={"scal": 2.0})


SCRIPT = """
import json, sys, torch, slipstream
rt = slipstream.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.05), progress=False, run_dir=None)
x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
for step in range(3):
    i = (step * 8 + run.dp_rank * 32) % 64
    run.backward(torch.nn.functional.mse_loss(run.model(x[i:i + 8]), x[i:i + 8].sum(1, keepdim=True)))
    run.step()
h = run.sync_state
with open(f"{sys.argv[1]}.{run.dp_rank}", "w") as f:
    json.dump({"strategy": h.stats()["sync_strategy"], "ratio": h.stats()["sync_compression_ratio"],
               "calls": h.codecs["STRATEGY"].calls, "scale": h.codecs["STRATEGY"].scale}, f)
run.finish()
slipstream.shutdown()
""".replace("STRATEGY", NAME)


def test_from_an_installed_package_it_trains_through_slipstream_run_and_a_job_spec_run(tmp_path, registry, monkeypatch,
                                                                                 capsys):
    site = _installed(tmp_path / "site", {NAME: "tests.sync.test_user_strategy:register_strategy"})
    spec = write_spec({"name": "mine", "image": "i:1", "command": ["python", "train.py"], "processes_per_replica": 2,
                       "sync": {"strategy": NAME}}, str(tmp_path))
    # Not installed: the spec is refused, naming what it takes.
    code, _, err = run_cli(["job", "validate", spec], capsys)
    assert code == 2 and "sync.strategy: must be one of" in err and f"got {NAME!r}" in err, err

    # Installed: the spec validates and renders with it (loaded once, by its entry point).
    monkeypatch.setattr(sync, "_DISCOVERED", False)
    monkeypatch.syspath_prepend(str(site))
    code, out, err = run_cli(["job", "validate", spec], capsys)
    assert code == 0, err
    code, out, err = run_cli(["job", "render", spec], capsys)
    assert code == 0, err
    env = [e for doc in yaml.safe_load_all(out) if doc and doc["kind"] == "Job"
           for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert {"name": "SLIPSTREAM_SYNC", "value": NAME} in env, env
    assert REGISTERED == [NAME] and sync.describe(NAME).kind is SyncKind.HOOK

    # `slipstream run --sync NAME`: the launcher and both workers load it the same way.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out_prefix = tmp_path / "result"
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "--no-heal", "--no-summary", "--sync", NAME,
         "--sync-options", '{"scale": 1.0}', str(script), str(out_prefix)],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads(Path(f"{out_prefix}.{rank}").read_text())
        assert got["strategy"] == NAME and got["ratio"] == pytest.approx(2.0) and got["scale"] == 1.0, got
        assert got["calls"] >= 3, got

    # The job spec, run: its sync.strategy reaches both workers the same way.
    proc = subprocess.run([sys.executable, "-m", "slipstream", "run", "--no-heal", "--no-summary", spec, "--",
                           str(tmp_path / "from-spec")], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads(Path(f"{tmp_path / 'from-spec'}.{rank}").read_text())
        assert got["strategy"] == NAME and got["ratio"] == pytest.approx(2.0) and got["calls"] >= 3, got


def test_discovery_loads_each_entry_point_once(tmp_path, registry, monkeypatch):
    monkeypatch.syspath_prepend(str(_installed(tmp_path, {NAME: "tests.sync.test_user_strategy:register_strategy"})))
    assert sync.describe("bf16").codec == "bf16" and REGISTERED == []  # a built-in name loads nothing
    assert NAME in sync.available() and sync.is_valid(NAME) and NAME in sync.matching(lambda i: not i.heals_in_place)
    sync.describe(NAME)
    assert REGISTERED == [NAME]


def test_a_broken_entry_point_is_one_line_naming_its_package(tmp_path, registry, monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(_installed(tmp_path, {"gone": "no_such_module_here:register",
                                                          "silent": "os:getcwd"}, package="broken-codecs")))
    with caplog.at_level(logging.WARNING, logger="slipstream.sync"):
        assert "gone" not in sync.available() and "bf16" in sync.available()  # the others stay usable
    with pytest.raises(UnknownStrategy) as failed:
        sync.describe("gone")
    line = str(failed.value)
    assert "\n" not in line and "'broken-codecs 0.1'" in line and "ModuleNotFoundError" in line, line
    assert line.startswith("sync strategy 'gone' (entry point 'no_such_module_here:register'"), line
    with pytest.raises(UnknownStrategy, match=r"'silent' .* registered no strategy named 'silent'"):
        sync.describe("silent")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("broken-codecs 0.1" in w and "\n" not in w for w in warned), warned
