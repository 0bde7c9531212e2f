"""Shared pytest fixtures and CI conventions.

**One rule for what a test needs.** A test that needs something installed or
running (a Python package, a command, root, a service, a file CI provides)
asks through :func:`need` (or :func:`need_module`, :func:`need_command`,
:func:`require_root`): outside CI a missing need skips the test; under CI
(``CI`` set to 1, true or yes, any case: :func:`in_ci`) it fails, because CI
installs everything (``bash scripts/install.sh test``) and a skip there would
hide a test that never ran. A test that cannot run on a machine for a reason
no install changes (a GPU is visible, another operating system) calls
:func:`cannot_run_here`, which skips everywhere and says so.
``tests/architecture/test_ci_strict.py`` fails on any other skip in tests/.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` is 1, true or yes (any case). Read at each call."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


IN_CI = in_ci()

# Each failed test's whole output and its workers' logs, leftover processes, a timeline;
# the fast tier (--tier fast, tests/tiers.py).
pytest_plugins = ["tests.records", "tests.tiers"]


def pytest_configure(config: pytest.Config) -> None:
    # Optimizers as on a GPU in this process too (tests/gpu_defaults.py): references
    # computed here and ranks started by tests/harness.py take the same branch.
    from tests.gpu_defaults import take_gpu_optimizer_defaults

    take_gpu_optimizer_defaults()


def need(met: bool, reason: str) -> None:
    """Skip (locally) or fail (under CI) unless ``met``; ``reason`` says what is missing.

    Usable in a test, a fixture, or at module level (the whole module skips).

    Example::

        need(shutil.which("sbatch") is not None, "sbatch is not installed")
    """
    if met:
        return
    if in_ci():
        pytest.fail(f"{reason}, and CI=true: CI provides every test's needs (bash scripts/install.sh "
                    "test, its tools, services and root), so this test must run there", pytrace=False)
    _skip(reason)


def _skip(reason: str) -> None:
    # Reported at the test (or module) that asked, as a skip mark is, not at this line.
    try:
        raise pytest.skip.Exception(reason, allow_module_level=True, _use_item_location=True)
    except TypeError:  # a pytest without the keyword
        pytest.skip(reason, allow_module_level=True)


def need_module(name: str, hint: str = "") -> ModuleType:
    """The imported module ``name``, or skip locally / fail under CI if it does not import.

    Example::

        transformers = need_module("transformers", "pip install 'slipstream[hf]'")
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        need(False, f"needs the Python package {name}{f' ({hint})' if hint else ''}: {exc}")
        raise  # not reached: need() skipped or failed


def need_command(*names: str, hint: str = "") -> list[str]:
    """The paths of commands ``names`` on PATH, or skip locally / fail under CI if one is missing."""
    paths = [shutil.which(n) for n in names]
    missing = [n for n, p in zip(names, paths, strict=True) if p is None]
    need(not missing, f"needs {', '.join(missing)} on PATH{f' ({hint})' if hint else ''}")
    return [p for p in paths if p is not None]


def require_root(reason: str = "needs root (network namespaces / tc)") -> None:
    """Call at the start of a root-only test: skip locally, fail loudly in CI."""
    need(os.geteuid() == 0, reason)


def cannot_run_here(reason: str) -> None:
    """Skip, under CI too, for a reason no install changes (a visible GPU, another OS).

    ``reason`` says what about this machine rules the test out.
    """
    _skip(f"cannot run on this machine, CI included: {reason}")


@pytest.fixture(autouse=True)
def _launch_variables_stay_in_the_test():
    """Set up before any monkeypatch (and so checked after its undo). A test (or the launch it runs in-process) leaves no SLIPSTREAM_HEAL* / SLIPSTREAM_AGENT_PID behind:
    with SLIPSTREAM_HEAL=1 left in this process, every later worker entry started from it runs as a
    healing supervisor (found by CI: tests/launch/test_parent_death.py saw the supervisor's pid)."""
    def launch_variables() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("SLIPSTREAM_HEAL") or k == "SLIPSTREAM_AGENT_PID"}

    before = launch_variables()
    yield
    after = launch_variables()
    if after != before:
        for name in after:
            os.environ.pop(name, None)
        os.environ.update(before)
        pytest.fail(f"the test left launch variables changed: {before} -> {after}", pytrace=False)


@pytest.fixture(autouse=True)
def _submission_records_stay_in_the_test(tmp_path_factory, monkeypatch):
    """`slipstream submit` records jobs under ~/.local/state; no test writes to the user's home."""
    if "SLIPSTREAM_STATE_DIR" not in os.environ:
        monkeypatch.setenv("SLIPSTREAM_STATE_DIR", str(tmp_path_factory.mktemp("submissions")))


@pytest.fixture()
def one_rank_group():
    """A one-member gloo group for tests that drive the engine in-process (the default group)."""
    import torch.distributed as dist

    from tests.harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
