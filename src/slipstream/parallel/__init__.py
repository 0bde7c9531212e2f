"""Parallel layouts on a DeviceMesh: pipeline, tensor, sharded and replicated data parallelism.

Each parallelism is one function over an ``nn.Module``, composed from
PyTorch's own implementations (``torch.distributed.pipelining``, DTensor's
``parallelize_module``, FSDP2's ``fully_shard``) and applied by
:func:`parallelize` in one documented order. ``slipstream.accelerate`` uses
them when the config's degrees ask for more than plain data parallelism; see
docs/parallel.md.
"""

from .apply import Parallelized, parallelize
from .fully_shard import apply_fully_shard
from .mesh import ParallelDims
from .pipeline import build_schedule, default_split_points, pipeline_units, split_stage
from .tensor_parallel import apply_tensor_parallel

__all__ = [
    "ParallelDims",
    "Parallelized",
    "apply_fully_shard",
    "apply_tensor_parallel",
    "build_schedule",
    "default_split_points",
    "parallelize",
    "pipeline_units",
    "split_stage",
]
