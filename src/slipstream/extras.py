"""The pip line that installs an optional part of Slipstream (an extra) and keeps the installed torch.

A bare ``pip install 'slipstream[job]'`` lets pip re-resolve ``torch>=2.8`` and can
replace a CPU or CUDA build the user chose with another (docs/install.md): every
message that asks for an extra prints this line instead, with the installed
torch pinned in the same call.

Example::

    raise ConfigError(f"manifest validation needs jsonschema: {pip_install_hint('job')}")
    # ... needs jsonschema: pip install 'slipstream[job]' 'torch==2.13.0'
"""

from __future__ import annotations

from importlib import metadata


def pip_install_hint(extra: str) -> str:
    """``pip install 'slipstream[EXTRA]' 'torch==<installed>'`` (no pin when torch is not installed).

    Example::

        pip_install_hint("metrics")   # "pip install 'slipstream[metrics]' 'torch==2.13.0'"
    """
    try:
        pin = f" 'torch=={metadata.version('torch')}'"
    except metadata.PackageNotFoundError:
        pin = ""
    return f"pip install 'slipstream[{extra}]'{pin}"
