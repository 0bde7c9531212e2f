"""Built-in hardware and model descriptions the cost model works from.

GPU figures are the vendors' datasheet peaks (dense, no sparsity); the model
multiplies them by an achievable fraction (the model's MFU), never uses them raw.
Intra-node bandwidth is per GPU, per direction. Prices are rough on-demand
cloud list prices per GPU-hour at the time of writing, for ranking only: pass
``--price`` for real figures.

Model figures: parameters and forward FLOPs per sample (FLOPs = 2 x multiply-
adds), activation memory per sample. Sources and derivations are beside each
entry. Training FLOPs per sample = 3 x forward (backward = 2 x forward), plus one
more forward with activation checkpointing.

Example::

    gpu = get_gpu("H100"); gpu.peak_flops("bf16")       # 989e12
    m = get_model("gpt-7b"); m.params, m.layers           # (6.7e9..., 32)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from ..errors import ConfigError, did_you_mean

GIB = 1024**3
TERA = 1e12


@dataclass(frozen=True)
class GpuSpec:
    name: str
    fp32_flops: float
    fp16_flops: float  # tensor cores, dense
    bf16_flops: float | None  # None: no bf16 support
    memory_bytes: float
    memory_bytes_per_s: float  # HBM bandwidth
    intra_bytes_per_s: float  # NVLink (or PCIe) per GPU, per direction
    intra_latency_s: float = 3e-6
    gpus_per_node: int = 8
    price_per_hour: float = 2.0
    source: str = ""

    def peak_flops(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_flops
        if precision == "fp16":
            return self.fp16_flops
        if precision == "bf16":
            if self.bf16_flops is None:
                raise ConfigError(f"--precision: {self.name} has no bf16 support; use fp16 or fp32")
            return self.bf16_flops
        raise ConfigError(f"--precision: must be fp32, bf16 or fp16, got {precision!r}")

    def supports(self, precision: str) -> bool:
        return precision != "bf16" or self.bf16_flops is not None


GPUS: dict[str, GpuSpec] = {
    # Tesla P100 PCIe 16 GB datasheet: 9.3 TFLOPS fp32, 18.7 TFLOPS fp16, 732 GB/s HBM2,
    # PCIe gen3 x16 (15.75 GB/s per direction theoretical; ~12 GB/s achieved). Pascal: no bf16.
    # (The Horovod paper's 512-GPU runs: 128 servers of 4 Pascal GPUs.)
    "P100": GpuSpec("P100", 9.3 * TERA, 18.7 * TERA, None, 16 * GIB, 732e9, 12e9, 5e-6, 4, 1.46,
                    "NVIDIA Tesla P100 PCIe datasheet"),
    # Tesla P100 SXM2 16 GB datasheet: 10.6 TFLOPS fp32, 21.2 TFLOPS fp16, 732 GB/s HBM2, NVLink 4 links x
    # 20 GB/s per direction (DGX-1 / Big Basin hybrid cube mesh; IBM S822LC "Minsky"): a ring over them is
    # taken at 40 GB/s per direction (two links' worth). Pascal: no bf16.
    "P100-SXM2": GpuSpec("P100-SXM2", 10.6 * TERA, 21.2 * TERA, None, 16 * GIB, 732e9, 40e9, 3e-6, 8, 1.46,
                         "NVIDIA Tesla P100 SXM2 datasheet"),
    # Tesla V100 SXM2 32 GB datasheet: 15.7 TFLOPS fp32, 125 TFLOPS tensor (fp16), 900 GB/s HBM2,
    # NVLink 300 GB/s total (6 links x 25 GB/s each direction) -> 150 GB/s per direction. No bf16.
    "V100": GpuSpec("V100", 15.7 * TERA, 125 * TERA, None, 32 * GIB, 900e9, 150e9, 3e-6, 8, 3.06,
                    "NVIDIA V100 datasheet (SXM2)"),
    # A100 SXM4 80 GB datasheet: 19.5 TFLOPS fp32, 312 TFLOPS bf16/fp16 dense, 2039 GB/s HBM2e,
    # NVLink 600 GB/s total -> 300 GB/s per direction.
    "A100": GpuSpec("A100", 19.5 * TERA, 312 * TERA, 312 * TERA, 80 * GIB, 2039e9, 300e9, 3e-6, 8, 4.10,
                    "NVIDIA A100 datasheet (SXM4 80GB)"),
    # H100 SXM5 80 GB datasheet: 67 TFLOPS fp32, 989 TFLOPS bf16/fp16 dense (1979 with sparsity),
    # 3.35 TB/s HBM3, NVLink 900 GB/s total -> 450 GB/s per direction.
    "H100": GpuSpec("H100", 67 * TERA, 989 * TERA, 989 * TERA, 80 * GIB, 3.35e12, 450e9, 3e-6, 8, 6.98,
                    "NVIDIA H100 datasheet (SXM5)"),
    # H200 SXM datasheet: same compute as H100 SXM (989 TFLOPS bf16 dense), 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s total -> 450 GB/s per direction.
    "H200": GpuSpec("H200", 67 * TERA, 989 * TERA, 989 * TERA, 141e9, 4.8e12, 450e9, 3e-6, 8, 8.00,
                    "NVIDIA H200 datasheet (SXM)"),
}


# The memory variants, by the names clouds and schedulers use (A100-40GB, H100-80GB, ...):
# `--gpu-type A100-40GB` was refused. A variant that is the datasheet above is the same spec
# under its longer name; the others differ in memory (and the A100 40 GB in bandwidth).
GPUS.update({
    # A100 SXM4 40 GB datasheet: the 80 GB part's compute and NVLink, 1555 GB/s HBM2. Priced
    # as the A100 above (4.10: AWS p4d, 8 x A100 40 GB, on demand, per GPU-hour).
    "A100-40GB": replace(GPUS["A100"], name="A100-40GB", memory_bytes=40 * GIB, memory_bytes_per_s=1555e9,
                         source="NVIDIA A100 datasheet (SXM4 40GB)"),
    "A100-80GB": replace(GPUS["A100"], name="A100-80GB"),
    "H100-80GB": replace(GPUS["H100"], name="H100-80GB"),
    "H200-141GB": replace(GPUS["H200"], name="H200-141GB"),
    # V100 SXM2 16 GB datasheet: the 32 GB part's compute, bandwidth and NVLink.
    "V100-16GB": replace(GPUS["V100"], name="V100-16GB", memory_bytes=16 * GIB,
                         source="NVIDIA V100 datasheet (SXM2 16GB)"),
    "V100-32GB": replace(GPUS["V100"], name="V100-32GB"),
    "P100-16GB": replace(GPUS["P100"], name="P100-16GB"),
})


def gpu_key(name: str) -> str:
    """The key of ``GPUS`` a user's spelling of a GPU means: case, a leading "NVIDIA", spaces or
    underscores for dashes and "G"/"GiB" for "GB" do not matter.

    Example::

        gpu_key("nvidia a100 40g")   # "A100-40GB"
        gpu_key("H100_80GiB")        # "H100-80GB"
    """
    key = re.sub(r"^NVIDIA[\s_-]*", "", str(name).strip().upper())
    key = re.sub(r"[\s_-]+", "-", key)
    return re.sub(r"-?(\d+)\s*(GB|GIB|G)$", r"-\1GB", key)


def local_cpu_spec(threads: int = 1) -> GpuSpec:
    """This machine's CPU as a device: matmul FLOP/s measured now at ``threads`` threads (calibrate),
    memory from /proc/meminfo, one device per node. Memory bandwidth and loopback figures are
    rough (20 GB/s, 5 GB/s): the planner uses them for the optimizer and codec passes only."""
    import os

    from .calibrate import matmul_flops_per_s

    flops = matmul_flops_per_s(threads=threads)
    mem = 8 * GIB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    # 20 GB/s: the benchmark MLP's SGD step (read param + grad, write param: 3 x 33.6 MB) took 5-6 ms here.
    return GpuSpec("CPU", flops, flops, flops, mem, 20e9, 5e9, 50e-6, 1, 0.05,
                   f"measured: fp32 matmul at {threads} thread(s) on {os.cpu_count()} cores")


def get_gpu(name: str) -> GpuSpec:
    """The spec of GPU ``name`` (:func:`gpu_key` spellings), or this machine's CPU for "cpu".

    Example::

        get_gpu("A100-40GB").memory_bytes / GIB   # 40.0
    """
    key = gpu_key(name)
    if key == "CPU":
        return local_cpu_spec()
    if key not in GPUS:
        raise ConfigError(f"--gpu-type: must be one of {', '.join(GPUS)} or cpu (this machine, measured), "
                          f"got {name!r}" + did_you_mean(key, list(GPUS), quote=True))
    return GPUS[key]


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost model sees it: uniform layers, each with a matrix layout."""

    name: str
    kind: str  # "cnn" | "transformer" | "mlp"
    params: float
    fwd_flops_per_sample: float
    layers: int
    act_bytes_per_sample_16: float  # all layers' saved activations, 16-bit; x2 at fp32
    ckpt_bytes_per_sample_16: float  # with activation checkpointing: layer inputs only
    optimizer: str = "adam"  # "adam" | "sgd" (momentum)
    mfu_fp32: float = 0.55
    mfu_16: float = 0.40
    half_batch: float = 2.0  # micro-batch at which the MFU is half its large-batch value
    matrix_aspect: float = 9.0  # per-layer gradient viewed as rows x (aspect*rows), for PowerSGD
    default_batch_per_gpu: int = 64
    seq_len: int = 0  # transformers: tokens per sample
    d_model: int = 0
    heads: int = 0
    vocab: int = 0
    source: str = ""
    default_global_batch: int | None = None  # transformers: a fixed global batch (samples)
    block_class: str = ""  # the repeated block's class name (activation checkpointing wraps it)
    measured: bool = False  # params, FLOPs and activations measured from the model (usermodel.py)
    mfu_source: str = ""  # where the MFU comes from when a measured throughput replaced the assumed one (rates.py)

    @property
    def params_per_layer(self) -> float:
        return self.params / self.layers

    def act_bytes_per_sample(self, precision: str, tp: int = 1, checkpointing: bool = False) -> float:
        """Saved activations of all layers for one sample (Korthikanti et al. 2022 for transformers)."""
        scale = 2.0 if precision == "fp32" else 1.0
        if self.measured:  # saved tensors measured at fp32 (usermodel.py); a tp shard holds ~1/tp
            full = self.act_bytes_per_sample_16 / tp
            if checkpointing:
                return scale * (self.ckpt_bytes_per_sample_16 * self.layers / tp + full / self.layers)
            return scale * full
        if self.kind == "transformer":
            s, h, a, L = self.seq_len, self.d_model, self.heads, self.layers
            if checkpointing:
                per_layer = 2 * s * h  # the layer input only
                full_one = s * h * (10 + 24 / tp + 5 * a * s / (h * tp))  # one layer recomputed at a time
                return scale * (L * per_layer + full_one)
            return scale * L * s * h * (10 + 24 / tp + 5 * a * s / (h * tp))
        if checkpointing:
            return scale * (self.ckpt_bytes_per_sample_16 + self.act_bytes_per_sample_16 / self.layers)
        return scale * self.act_bytes_per_sample_16

    def logits_bytes_per_sample(self, tp: int = 1) -> float:
        """Transformers: logits in 16-bit plus the fp32 copy the loss makes (vocab split over tp)."""
        if self.kind != "transformer":
            return 0.0
        return self.seq_len * self.vocab * (2 + 4) / tp


def gpt_model(name: str, layers: int, d: int, heads: int, global_batch: int, seq: int = 2048,
              vocab: int = 50257) -> ModelSpec:
    """A GPT-shaped decoder's spec from its shape (the built-ins and the published record's Megatron runs)."""
    # Parameters: 12 L d^2 (attention 4d^2 + MLP 8d^2) + embeddings (V + s) d (GPT-3 paper, Table 2.1
    # sizes; Kaplan et al. 2020 eq. 2.1). Forward FLOPs per token: 2 N + 2 L s d (attention scores and
    # their use, Kaplan et al. Table 1), so per sequence: s (2N + 2 L s d).
    n = 12 * layers * d * d + (vocab + seq) * d
    flops = seq * (2 * n + 2 * layers * seq * d)
    return ModelSpec(
        name=name, kind="transformer", params=float(n), fwd_flops_per_sample=float(flops), layers=layers,
        act_bytes_per_sample_16=0.0, ckpt_bytes_per_sample_16=0.0, optimizer="adam",
        mfu_fp32=0.55, mfu_16=0.45, half_batch=0.25, matrix_aspect=4.0, default_batch_per_gpu=1,
        seq_len=seq, d_model=d, heads=heads, vocab=vocab,
        default_global_batch=global_batch,
        source="GPT-3 (Brown et al. 2020) Table 2.1 shapes; 12Ld^2+(V+s)d params; Kaplan et al. 2020 FLOPs",
    )


MODELS: dict[str, ModelSpec] = {
    # CNNs at 224x224 (Inception V3 at 299x299). Params and multiply-adds from the torchvision model
    # table (FLOPs = 2 x MACs). Activation memory: rough estimates of the tensors autograd keeps
    # (order of 100 MB per sample in fp32, halved for the 16-bit column; not measured here: no
    # torchvision on this machine), so the memory check for CNNs is approximate.
    # ResNet-50: 25.6 M params, 4.09 GMACs; activations ~ 92 MB/sample fp32 (He et al. 2016).
    "resnet50": ModelSpec("resnet50", "cnn", 25.557e6, 2 * 4.09e9, 50, 46e6, 5e6, "sgd",
                          mfu_fp32=0.55, mfu_16=0.30, half_batch=4, default_batch_per_gpu=64,
                          source="torchvision resnet50: 25.6M params, 4.09 GMACs (He et al. 2016)"),
    # ResNet-101: 44.5 M params, 7.80 GMACs; activations ~ 140 MB/sample fp32.
    "resnet101": ModelSpec("resnet101", "cnn", 44.549e6, 2 * 7.80e9, 101, 70e6, 7e6, "sgd",
                           mfu_fp32=0.55, mfu_16=0.30, half_batch=4, default_batch_per_gpu=64,
                           source="torchvision resnet101: 44.5M params, 7.80 GMACs"),
    # Inception V3 at 299x299: 23.8 M params without the auxiliary head (27.2 M with), 5.71 GMACs;
    # activations ~ 120 MB/sample fp32. Layer count: 48 conv layers on the main path (Szegedy 2016).
    "inception_v3": ModelSpec("inception_v3", "cnn", 23.83e6, 2 * 5.71e9, 48, 60e6, 6e6, "sgd",
                              mfu_fp32=0.55, mfu_16=0.30, half_batch=4, default_batch_per_gpu=64,
                              source="torchvision inception_v3: 27.2M params incl. aux, 5.71 GMACs"),
    # VGG-16: 138.4 M params (123.6 M in the three fully connected layers), 15.47 GMACs;
    # activations ~ 110 MB/sample fp32 (Simonyan & Zisserman 2015).
    "vgg16": ModelSpec("vgg16", "cnn", 138.36e6, 2 * 15.47e9, 16, 55e6, 6e6, "sgd",
                       mfu_fp32=0.55, mfu_16=0.30, half_batch=4, default_batch_per_gpu=64, matrix_aspect=6.0,
                       source="torchvision vgg16: 138.4M params, 15.47 GMACs"),
    # The benchmark MLP (docs/measuring.md): 8 x Linear(1024,1024) + Linear(1024,10), batch 64.
    # MFU 0.5: its floor here (forward + backward ~ 40 ms for 3.2 GFLOP) against the 1-thread matmul
    # rate (~155 GFLOP/s), measured by benchmarks/plan_validation.py.
    "mlp": ModelSpec("mlp", "mlp", 8 * (1024 * 1024 + 1024) + 10 * 1024 + 10, 2 * (8 * 1024 * 1024 + 10240),
                     9, 2 * 17 * 1024, 2 * 1024, "sgd", mfu_fp32=0.5, mfu_16=0.5, half_batch=1.0,
                     matrix_aspect=1.0, default_batch_per_gpu=64, source="docs/measuring.md, the benchmark MLP"),
    # Global batch in sequences of 2048: GPT-3's 0.5M / 1M / 2M tokens, rounded to powers of two.
    "gpt-125m": gpt_model("gpt-125m", 12, 768, 12, 256),
    "gpt-350m": gpt_model("gpt-350m", 24, 1024, 16, 256),
    "gpt-1.3b": gpt_model("gpt-1.3b", 24, 2048, 16, 512),
    "gpt-2.7b": gpt_model("gpt-2.7b", 32, 2560, 32, 512),
    "gpt-7b": gpt_model("gpt-7b", 32, 4096, 32, 1024),
    "gpt-13b": gpt_model("gpt-13b", 40, 5120, 40, 1024),
}


def with_measured_rate(model: ModelSpec, gpu: GpuSpec, precision: str, micro_batch: int,
                       samples_per_s: float) -> ModelSpec:
    """``model`` with its assumed MFU replaced by the one a measured one-GPU training throughput
    implies (``samples_per_s`` at ``micro_batch``): what calibration does on the machine at hand,
    from a published measurement instead.

    Example::

        with_measured_rate(get_model("vgg16"), get_gpu("P100"), "fp32", 64, 132).mfu_fp32   # > 1: Winograd
    """
    import dataclasses

    achieved = samples_per_s * 3 * model.fwd_flops_per_sample / gpu.peak_flops(precision)
    base = achieved * (micro_batch + model.half_batch) / micro_batch
    field_name = "mfu_fp32" if precision == "fp32" else "mfu_16"
    return dataclasses.replace(model, **{field_name: base})


def get_model(name: str) -> ModelSpec:
    key = str(name).strip().lower().replace("_", "-")
    for k, v in MODELS.items():
        if k.replace("_", "-") == key:
            return v
    raise ConfigError(f"--model: must be one of {', '.join(MODELS)}, got {name!r}")


def layer_matrix(model: ModelSpec, numel: float | None = None) -> tuple[int, int]:
    """A (rows, cols) view of one layer's gradient (``numel`` values, default the whole layer's),
    for codecs that use matrix structure."""
    p = model.params_per_layer if numel is None else numel
    rows = max(1, int(math.sqrt(p / model.matrix_aspect)))
    return rows, max(1, int(p // rows))


__all__ = ["GIB", "GPUS", "MODELS", "GpuSpec", "ModelSpec", "field", "get_gpu", "get_model", "gpt_model", "layer_matrix",
           "with_measured_rate"]
