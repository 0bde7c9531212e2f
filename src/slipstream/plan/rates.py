"""Measured one-GPU training throughputs: the calibration that replaces the assumed MFU.

The cost model's compute is ``FLOPs / (peak x MFU)``, with MFU a per-class assumption
(specs.py). Where a one-GPU training throughput of a model on a GPU has been measured and
published, :func:`calibrated` replaces the assumed MFU with the one that throughput implies
(:func:`slipstream.plan.specs.with_measured_rate`), at every micro-batch (the ramp
``b / (b + b_half)`` anchored at the measured batch). ``slipstream plan`` and the published
record (``python -m slipstream.plan.published``) both take the model through :func:`calibrated`,
so the figure the CLI prints for a row is the one the record validates: both predict a layout
with :func:`predict_layout`.

Example::

    m = calibrated(get_model("vgg16"), get_gpu("P100"), "fp32")
    m.mfu_fp32, m.mfu_source     # > 1 (cuDNN's Winograd convolutions), "measured: TensorFlow's ..."
"""

from __future__ import annotations

from dataclasses import dataclass

from .costmodel import FRAMEWORKS, Framework, Layout, Prediction, predict
from .network import Network
from .specs import GpuSpec, ModelSpec, with_measured_rate

# One-GPU training throughputs measured on a DGX-1's P100 (SXM2, 10.6 TFLOP/s) by the TensorFlow team;
# Horovod's servers are taken as P100 PCIe (9.3 TFLOP/s), so the rates are scaled by the peak ratio.
TF_P100 = ("TensorFlow's benchmarks page (tensorflow/docs_src/performance/benchmarks.md, 'Details for NVIDIA "
           "DGX-1 (NVIDIA Tesla P100)', training synthetic data, batch 64, 1 GPU): ")
P100_PCIE_OVER_SXM2 = 9.3 / 10.6
_R50, _R152 = 238 * 6 * 4.09e9, 95.6 * 6 * 11.56e9  # FLOP/s achieved (training = 3 x 2 x MACs)
RATE101 = (_R50 + (_R152 - _R50) * (7.80 - 4.09) / (11.56 - 4.09)) / (6 * 7.80e9) * P100_PCIE_OVER_SXM2


@dataclass(frozen=True)
class MeasuredRate:
    """A published one-GPU training throughput: ``samples_per_s`` of ``model`` on ``gpu`` at
    ``precision`` and ``micro_batch``, and where it comes from."""

    model: str
    gpu: str
    precision: str
    micro_batch: int
    samples_per_s: float
    source: str


RATES = (
    MeasuredRate("resnet101", "P100", "fp32", 64, RATE101,
                 TF_P100 + "ResNet-50 238 and ResNet-152 95.6 img/s; ResNet-101 interpolated by FLOPs between "
                 "them (6.23 TFLOP/s -> 133.2 img/s); x 9.3/10.6 for a PCIe P100"),
    MeasuredRate("inception_v3", "P100", "fp32", 64, 142 * P100_PCIE_OVER_SXM2,
                 TF_P100 + "InceptionV3 142 img/s; x 9.3/10.6 for a PCIe P100"),
    MeasuredRate("vgg16", "P100", "fp32", 64, 132 * P100_PCIE_OVER_SXM2,
                 TF_P100 + "VGG16 132 img/s (12.2 TFLOP/s of direct-convolution FLOPs: cuDNN's Winograd 3x3 "
                 "convolutions do fewer); x 9.3/10.6 for a PCIe P100"),
)


def measured_rate(model: str, gpu: str, precision: str) -> MeasuredRate | None:
    """The published one-GPU throughput of ``model`` on ``gpu`` at ``precision``, if there is one."""
    return next((r for r in RATES if (r.model, r.gpu, r.precision) == (model, gpu, precision)), None)


def calibrated(model: ModelSpec, gpu: GpuSpec, precision: str) -> ModelSpec:
    """``model`` with its assumed MFU at ``precision`` replaced by a measured one-GPU throughput's
    (:data:`RATES`), or unchanged where none is known or the model was measured by the user
    (usermodel.py: its name may shadow a built-in's)."""
    r = None if model.measured else measured_rate(model.name, gpu.name, precision)
    if r is None:
        return model
    import dataclasses

    m = with_measured_rate(model, gpu, precision, r.micro_batch, r.samples_per_s)
    return dataclasses.replace(m, mfu_source=f"{r.samples_per_s:.1f} samples/s at micro-batch {r.micro_batch}, "
                                             f"{r.source}")


def predict_layout(model: ModelSpec, gpu: GpuSpec, network: Network, layout: Layout, gpus_per_node: int,
                   framework: str | Framework = "ddp", straggler_cv: float | None = None,
                   calibrate: bool = True) -> Prediction:
    """The prediction the planner (planner.plan) ranks and ``slipstream plan`` prints for one layout: ``model``
    through :func:`slipstream.plan.rates.calibrated` (a published one-GPU throughput replaces the
    assumed MFU), then the cost model with ``framework``'s buckets (costmodel.FRAMEWORKS).
    ``python -m slipstream.plan.published`` evaluates its record through this function too
    (``calibrate=False``: the assumed MFU, for its attribution of the terms)."""
    fw = FRAMEWORKS[framework] if isinstance(framework, str) else framework
    m = calibrated(model, gpu, layout.precision) if calibrate else model
    return predict(m, gpu, network, layout, gpus_per_node=gpus_per_node,
                   framework=fw, straggler_cv=straggler_cv)


__all__ = ["MeasuredRate", "RATES", "calibrated", "measured_rate", "predict_layout"]
