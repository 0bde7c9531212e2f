"""TensorBoard sink: every numeric field of a record as a scalar, one event dir per rank.

Tags are grouped so TensorBoard's sections read well: ``train/loss``,
``throughput/samples_per_s``, ``time/forward_s``, ``comm/sync_bytes_sent``,
``memory/mem_rss_bytes``, ``straggler/...``. Open with
``tensorboard --logdir RUN_DIR/tensorboard`` (each rank is a run).

Example::

    sink = TensorBoardSink("runs/x/tensorboard/rank0")
    sink.write({"step": 10, "loss": 2.3}); sink.close()
"""

from __future__ import annotations

from typing import Any

_SKIP = {"step", "rank", "time_s"}


def tag_for(key: str) -> str:
    """The TensorBoard tag of a record field."""
    if key in ("loss", "lr", "grad_norm"):
        return f"train/{key}"
    if key.endswith("_per_s") or key in ("mfu", "samples", "tokens"):
        return f"throughput/{key}"
    if key.startswith("sync_"):
        return f"comm/{key}"
    if key.startswith(("mem_", "cuda_")):
        return f"memory/{key}"
    if key.startswith("straggler"):
        return f"straggler/{key}"
    if key.endswith("_s"):
        return f"time/{key}"
    return f"other/{key}"


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(tag_for(key), value, global_step=step, walltime=None)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


__all__ = ["TensorBoardSink", "tag_for"]
