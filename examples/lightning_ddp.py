"""Train a small classifier with PyTorch Lightning's DDP strategy: a plain Lightning script, nothing of Slipstream in it.

    python examples/lightning_ddp.py                                      # one process
    python examples/lightning_ddp.py --devices 2                          # two, started by Lightning
    torchrun --standalone --nproc_per_node 2 examples/lightning_ddp.py    # two, started by torchrun
    slipstream run -n 2 examples/lightning_ddp.py                         # the same line under Slipstream

Under torchrun (or `slipstream run`, which sets the same environment: TORCHELASTIC_RUN_ID,
RANK, LOCAL_WORLD_SIZE, ...) Lightning's TorchElasticEnvironment joins the launched processes
instead of starting its own; it asks for devices x nodes = WORLD_SIZE, hence the defaults below.
--out DIR writes rank 0's final weights (DIR/model.pt) and final loss (DIR/result.json).
"""

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F

FEATURES, CLASSES = 32, 10


def make_dataset(size: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Noisy points around one centre per class: the same on every rank and run (a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2
    labels = torch.randint(CLASSES, (size,), generator=g)
    points = centres[labels] + torch.randn(size, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(points, labels)


class Classifier(L.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, CLASSES))

    def training_step(self, batch, batch_idx):
        points, labels = batch
        loss = F.cross_entropy(self.net(points), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--out", help="directory for model.pt and result.json (rank 0)")
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    model = Classifier()
    loader = torch.utils.data.DataLoader(make_dataset(4096), batch_size=32, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=int(os.environ.get("WORLD_SIZE", args.devices)) // args.devices,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=args.steps,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)  # Lightning gives each rank its share of the data (a DistributedSampler)

    if args.out and trainer.is_global_zero:
        os.makedirs(args.out, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(args.out, "model.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"loss": trainer.callback_metrics["train_loss"].item(), "steps": trainer.global_step,
                       "world_size": trainer.world_size}, f)


if __name__ == "__main__":
    main()
