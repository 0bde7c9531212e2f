"""Strategies brought by installed packages: the ``slipstream.sync_strategies`` entry points.

A package declares one entry point per strategy, named as the strategy, naming a function
that registers it (called once, with no argument)::

    # pyproject.toml of the package "mycodec"
    [project.entry-points."slipstream.sync_strategies"]
    int8 = "mycodec.strategy:register"

    # mycodec/strategy.py
    def register():
        from slipstream import sync
        sync.register_codec("int8", Int8Codec)

:func:`slipstream.sync.available` and :func:`slipstream.sync.describe` (for a name not built
in) load them, lazily and once per process; every process of a run does (the launcher, each
worker), which is why a strategy for ``slipstream run --sync NAME`` or a job spec comes from an
installed package and not from the script. An entry point that fails to load, or loads without
registering its name, costs its own strategy only: one warning line names it and its package,
and asking for that strategy raises a :class:`~slipstream.errors.ConfigError` with the same line.

Pure of torch: reading the entry points imports nothing until one is loaded.

Example::

    broken = load_strategies(lambda name: name in registry)   # {'int8': "sync strategy 'int8' ..."}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import metadata

GROUP = "slipstream.sync_strategies"
"""The entry-point group a package declares its sync strategies under."""

log = logging.getLogger("slipstream.sync")


def load_strategies(registered: Callable[[str], bool]) -> dict[str, str]:
    """Load every entry point of :data:`GROUP` whose name ``registered`` does not know yet, calling
    the function each names; returns, per strategy that did not come, the one line saying why
    (each also logged as a warning)."""
    broken: dict[str, str] = {}
    for ep in metadata.entry_points(group=GROUP):
        if registered(ep.name):
            continue  # registered in this process already (by the script, or a package's earlier call)
        where = f"sync strategy {ep.name!r} (entry point {ep.value!r} of package {_package(ep)!r})"
        try:
            register = ep.load()
            register()
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party package: one line, not a traceback
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            broken[ep.name] = f"{where} failed to load: {why}"
        else:
            if not registered(ep.name):
                broken[ep.name] = (f"{where} registered no strategy named {ep.name!r} (its function must call "
                                   f"slipstream.sync.register({ep.name!r}, ...) or register_codec)")
        if ep.name in broken:
            log.warning("%s; it is not available", broken[ep.name])
    return broken


def _package(ep: metadata.EntryPoint) -> str:
    """The distribution that declares ``ep`` (its name and version), or its module where unknown."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.module
    return f"{dist.metadata['Name']} {dist.version}"


__all__ = ["GROUP", "load_strategies"]
