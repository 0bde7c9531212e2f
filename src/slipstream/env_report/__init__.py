"""``slipstream env``: what a bug report needs to know about this machine, in one paste.

Versions (Slipstream, Python, torch and the CUDA and NCCL it was built with), the
devices (GPUs with their memory, or none), the network interfaces and their
addresses (what gloo and NCCL choose from), the extras installed and what each
lacks, and the configuration the environment gives a run (``SLIPSTREAM_*``
variables read as ``TrainConfig.from_env`` reads them, and the torch/NCCL/gloo
variables that change how ranks meet and talk). The same facts as
``accelerate env`` gives, plus what is Slipstream's own.

Tooling layer: it imports the core (config, extras), never the reverse.

Example::

    from slipstream.env_report import collect_env, render_env

    print(render_env(collect_env()))   # "- Slipstream: 0.1.0\\n- Python: 3.11.2 ..."
"""

from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

# The variables, besides SLIPSTREAM_*, that change how a distributed run starts or talks.
_DIST_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_", "CUDA_", "OMP_")
_DIST_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "HF_HOME", "HF_HUB_OFFLINE")
# A value that may hold a secret is shown as set, never pasted into an issue.
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.I)


@dataclass(frozen=True)
class EnvReport:
    """The facts ``slipstream env`` prints; every field has a value (``"none"``/empty where absent)."""

    slipstream: str
    python: str
    platform: str
    torch: str
    cuda: str  # the CUDA torch was built with, or "none (CPU build)"
    nccl: str  # the NCCL torch was built with, or "none"
    backends: tuple[str, ...]  # torch.distributed backends this torch has
    cpus: int
    gpus: tuple[str, ...]  # "0: NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90" per visible GPU
    interfaces: dict[str, tuple[str, ...]]  # name -> addresses
    extras: dict[str, dict[str, str | None]]  # extra -> requirement -> installed version (None: missing)
    config_from_env: dict[str, str]  # SLIPSTREAM_* of TrainConfig fields set here
    config_error: str | None  # why TrainConfig.from_env refused them, where it did
    other_env: dict[str, str] = field(default_factory=dict)  # other SLIPSTREAM_*, torch, NCCL, gloo variables

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def torch_build() -> tuple[str | None, str | None]:
    """(torch's version, the CUDA it was built with) from torch/version.py, without importing torch
    (a CPU ``--version`` costs no torch import); (None, None) where torch is not installed.

    Example::

        torch_build()   # ("2.13.0+cpu", None), or ("2.9.1+cu128", "12.8")
    """
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None, None
    facts: dict[str, Any] = {}
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as fh:
            exec(compile(fh.read(), "torch/version.py", "exec"), facts)  # noqa: S102 - torch's own constants file
    except (OSError, SyntaxError, NameError, ImportError):
        return None, None
    return facts.get("__version__"), facts.get("cuda")


def nccl_version() -> str | None:
    """The NCCL torch was built with (imports torch; None on a CPU build or where it cannot say)."""
    try:
        import torch

        if torch.version.cuda is None:
            return None
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a report must not fail on a broken CUDA install
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def version_line() -> str:
    """``slipstream --version``: one line, Slipstream's, torch's and Python's versions, and CUDA's
    and NCCL's where torch was built with them.

    Example::

        version_line()   # "slipstream 0.1.0, torch 2.13.0+cpu (CPU build), Python 3.11.2"
    """
    from .. import __version__

    version, cuda = torch_build()
    torch_part = "torch not installed" if version is None else f"torch {version}" + (
        " (CPU build)" if cuda is None else f", CUDA {cuda}")
    nccl = nccl_version() if cuda is not None else None
    return (f"slipstream {__version__}, {torch_part}" + (f", NCCL {nccl}" if nccl else "")
            + f", Python {platform.python_version()}")


def _gpus() -> tuple[str, ...]:
    import torch

    try:
        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
        return tuple(out)
    except Exception as exc:  # noqa: BLE001 - a driver problem is a fact to report
        return (f"CUDA present but not usable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",)


def _backends() -> tuple[str, ...]:
    import torch.distributed as dist

    checks = {"gloo": "is_gloo_available", "nccl": "is_nccl_available", "mpi": "is_mpi_available",
              "ucc": "is_ucc_available", "xccl": "is_xccl_available"}
    return tuple(name for name, check in checks.items() if getattr(dist, check, lambda: False)())


def _shown(name: str, value: str) -> str:
    return "(set, not shown)" if _SECRET.search(name) else value


def environment_config(environ: Mapping[str, str]) -> tuple[dict[str, str], str | None, dict[str, str]]:
    """What ``environ`` gives a run: the ``SLIPSTREAM_*`` variables of TrainConfig fields, as
    :meth:`TrainConfig.from_env` reads them (or its error where it refuses them); and the other
    ``SLIPSTREAM_*``, torch, NCCL and gloo variables set, by name.

    Example::

        environment_config({"SLIPSTREAM_PRECISION": "bf16", "NCCL_DEBUG": "INFO"})
        # ({"SLIPSTREAM_PRECISION": "bf16"}, None, {"NCCL_DEBUG": "INFO"})
    """
    from ..config import ENV_PREFIX, FLAT_NAMES, TrainConfig
    from ..errors import ConfigError

    fields = {ENV_PREFIX + name.upper() for name in FLAT_NAMES}
    error = None
    try:
        TrainConfig.from_env(environ)  # checks every value as a run would
    except ConfigError as exc:
        error = str(exc)
    config = {k: _shown(k, v) for k, v in sorted(environ.items()) if k in fields and v != ""}
    other = {k: _shown(k, v) for k, v in sorted(environ.items())
             if k not in fields and (k.startswith(ENV_PREFIX) or k.startswith(_DIST_PREFIXES) or k in _DIST_NAMES)}
    return config, error, other


def collect_env(environ: Mapping[str, str] | None = None) -> EnvReport:
    """Gather the report (imports torch; reads the interfaces from the kernel; starts no process).

    Example::

        collect_env().torch   # "2.13.0+cpu"
    """
    from .. import __version__
    from ..extras import extras_installed
    from ..process.gloo_interface import interface_addresses

    environ = os.environ if environ is None else environ
    version, cuda = torch_build()
    config, error, other = environment_config(environ)
    try:
        interfaces = interface_addresses()
    except OSError as exc:  # a sandbox without the ioctl: say so rather than fail
        interfaces = {"(unreadable)": (str(exc),)}
    return EnvReport(
        slipstream=__version__,
        python=f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        platform=platform.platform(),
        torch=version or "not installed",
        cuda=cuda or "none (CPU build)",
        nccl=nccl_version() or "none",
        backends=_backends() if version else (),
        cpus=os.cpu_count() or 0,
        gpus=_gpus() if version else (),
        interfaces=interfaces,
        extras=extras_installed(),
        config_from_env=config,
        config_error=error,
        other_env=other,
    )


def render_env(report: EnvReport) -> str:
    """The report as a Markdown list, to paste into an issue.

    Example::

        render_env(collect_env()).splitlines()[0]   # "- Slipstream: 0.1.0"
    """
    def extra_line(name: str, requirements: dict[str, str | None]) -> str:
        parts = [f"{req} {ver}" if ver else f"{req} missing" for req, ver in requirements.items()]
        state = "installed" if all(requirements.values()) else "not installed" if not any(
            requirements.values()) else "partly installed"
        return f"  - {name}: {state} ({', '.join(parts)})"

    lines = [
        f"- Slipstream: {report.slipstream}",
        f"- Python: {report.python}",
        f"- Platform: {report.platform}",
        f"- torch: {report.torch}",
        f"- CUDA (torch's build): {report.cuda}",
        f"- NCCL: {report.nccl}",
        f"- torch.distributed backends: {', '.join(report.backends) or 'none'}",
        f"- CPUs: {report.cpus}",
        f"- GPUs: {len(report.gpus) if report.gpus else 'none visible'}",
        *(f"  - {g}" for g in report.gpus),
        "- Network interfaces:",
        *(f"  - {name}: {', '.join(addrs) or 'no address'}" for name, addrs in report.interfaces.items()),
        "- Extras:" if report.extras else "- Extras: unknown (slipstream is not installed as a package here)",
        *(extra_line(name, reqs) for name, reqs in report.extras.items()),
        "- Configuration from the environment (SLIPSTREAM_* variables of TrainConfig):"
        + ("" if report.config_from_env else " none set, the defaults apply"),
        *(f"  - {k}={v}" for k, v in report.config_from_env.items()),
        *([f"  - refused: {report.config_error}"] if report.config_error else []),
        "- Other variables (SLIPSTREAM_*, torch, NCCL, gloo, CUDA):" + ("" if report.other_env else " none set"),
        *(f"  - {k}={v}" for k, v in report.other_env.items()),
    ]
    return "\n".join(lines)


__all__ = ["EnvReport", "collect_env", "environment_config", "nccl_version", "render_env", "torch_build",
           "version_line"]
