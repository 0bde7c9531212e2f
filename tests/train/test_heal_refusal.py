"""Which runs heal in place: every built-in sync strategy does; one registered without
``heals_in_place`` is refused in one line that says why (healing.heal_refusal)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slipstream import sync
from slipstream.train import facade, healing
from slipstream.train.layout_dp import DataParallelLayout


def _run(strategy: str) -> SimpleNamespace:
    """What _heal_refusal reads of a run: a data-parallel layout, the strategy, snapshots on."""
    return SimpleNamespace(
        layout=object.__new__(DataParallelLayout), describe_layout=lambda: "pp(1) x dp_replicate(2)",
        config=SimpleNamespace(sync=SimpleNamespace(strategy=strategy)),
        checkpoints=SimpleNamespace(snapshots=SimpleNamespace(enabled=True, peer=None)),
    )


@pytest.mark.parametrize("strategy", sync.available())
def test_every_built_in_strategy_heals_in_place(strategy):
    assert healing.heal_refusal(_run(strategy)) is None


def test_a_strategy_registered_without_heals_in_place_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(sync, "_REGISTRY", dict(sync._REGISTRY))
    monkeypatch.setattr(sync, "_INFO", dict(sync._INFO))
    sync.register("mine")(lambda ddp_model, **options: None)
    why = healing.heal_refusal(_run("mine"))
    assert why is not None and "\n" not in why
    assert why.startswith("sync 'mine' is registered without heals_in_place: ")


def test_extra_state_goes_into_the_heals_snapshots_without_a_checkpoint_dir():
    """A healing run with no checkpoint_dir keeps in-memory snapshots, and extra_state (a data
    position, say) belongs in them: without it a heal would put the model back but read other
    batches. Without healing and without a checkpoint_dir it still has nowhere to go (one line)."""
    import torch

    from slipstream.config import TrainConfig
    from slipstream.errors import ConfigError

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = TrainConfig()
    facade._check_inputs(model, opt, None, {"data": object()}, config, True, healing=True)
    with pytest.raises(ConfigError, match="set checkpoint_dir too"):
        facade._check_inputs(model, opt, None, {"data": object()}, config, True, healing=False)
