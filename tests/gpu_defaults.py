"""Make the CPU take the GPU's defaults where torch's differ by device.

torch's optimizers resolve ``foreach=None`` (the default) to their foreach
implementation on CUDA and to the per-tensor loop on the CPU
(``torch.optim.optimizer._default_to_fused_or_foreach``). The first GPU run
crashed at tensor parallelism's first optimizer step on that branch alone
(foreach refuses a list mixing DTensors and plain tensors), which the CPU suite
had never taken. Every process of the suite (pytest itself, and each rank the
harness starts: tests/harness.py) calls :func:`take_gpu_optimizer_defaults`, so
an optimizer built with torch's defaults runs as it would on a GPU. Tests that
want the per-tensor loop ask for it (``foreach=False``), as a user would.

Example::

    take_gpu_optimizer_defaults()
    torch.optim.AdamW(model.parameters())   # foreach on the CPU too
"""

from __future__ import annotations


def take_gpu_optimizer_defaults() -> None:
    """Let ``foreach=None`` pick the foreach implementation for CPU tensors, as for CUDA ones.
    Idempotent. Fails loudly if torch moved the function it patches (the suite would
    otherwise silently go back to the CPU's branch)."""
    import torch.optim.optimizer as optimizer_module

    current = optimizer_module._get_foreach_kernels_supported_devices
    if getattr(current, "gpu_defaults", False):
        return

    def with_cpu() -> list[str]:
        return [*current(), "cpu"]

    with_cpu.gpu_defaults = True  # type: ignore[attr-defined]
    optimizer_module._get_foreach_kernels_supported_devices = with_cpu
