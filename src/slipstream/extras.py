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

from collections.abc import Callable
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


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name), or None where it is not installed.

    Example::

        installed_version("torch")        # "2.13.0"
        installed_version("no-such-pkg")  # None
    """
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def extras_installed() -> dict[str, dict[str, str | None]]:
    """Per extra of the installed slipstream (``all`` aside), each of its requirements' installed
    version (None: missing), from the package's own metadata; empty where slipstream itself is
    not installed (run from a source tree). What ``slipstream env`` reports.

    Example::

        extras_installed()["hf"]   # {"transformers": "5.25.0", "accelerate": None}
    """
    import re

    try:
        requires = metadata.distribution("slipstream").requires or []
    except metadata.PackageNotFoundError:
        return {}
    out: dict[str, dict[str, str | None]] = {}
    for requirement in requires:
        found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if found and found.group(1) != "slipstream":  # all = slipstream[...]: the others, gathered
            out.setdefault(found.group(2), {})[found.group(1)] = installed_version(found.group(1))
    return out


# What a script imports that needs an extra, and the distribution that must be installed for it:
# (a pattern over the script's text, the distribution, its least version, the extra, what the script uses).
# Trainer: transformers refuses to build one (or its TrainingArguments) without accelerate >= 1.1.0,
# in every rank, after start-up. Only a call counts (Trainer(, Seq2SeqTrainer(, TrainingArguments():
# a script that imports transformers for a model alone runs without accelerate.
_TRAINER = r"^\s*(?:from|import)\s+transformers\b(?s:.*)(?:Trainer|TrainingArguments)\s*\("
_SCRIPT_NEEDS = (
    (_TRAINER, "transformers", (4, 40), "hf", "transformers' Trainer"),
    (_TRAINER, "accelerate", (1, 1), "hf", "transformers' Trainer"),
    (r"^\s*(?:from|import)\s+accelerate\b", "accelerate", (1, 1), "accelerate", "Accelerate"),
    (r"^\s*(?:from|import)\s+lightning\b", "lightning", (2, 0), "lightning", "Lightning"),
)


def _release(version: str) -> tuple[int, ...]:
    import re

    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def script_missing_extra(source: str, script: str = "the script",
                         version: Callable[[str], str | None] | None = None) -> str | None:
    """One line naming the extra to install where ``source`` (a script's text) imports a library
    the extra provides and it is missing or too old here; None where nothing is missing. A text
    search, no import: cheap enough to run before any worker starts.

    Example::

        script_missing_extra("from transformers import Trainer\\n", "train.py")
        # "train.py uses transformers' Trainer, which needs accelerate>=1.1 (not installed):
        #  pip install 'slipstream[hf]' 'torch==2.13.0'"   (where accelerate is missing)
    """
    import re

    version = version or installed_version  # looked up when called (a test's stand-in applies)
    for pattern, distribution, least, extra, what in _SCRIPT_NEEDS:
        if not re.search(pattern, source, re.M):
            continue
        have = version(distribution)
        if have is not None and _release(have) >= least:
            continue
        state = "not installed" if have is None else f"{have} is installed"
        return (f"{script} uses {what}, which needs {distribution}>={'.'.join(map(str, least))} ({state}): "
                f"{pip_install_hint(extra)}")
    return None
