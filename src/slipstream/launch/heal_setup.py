"""The launcher's side of healing in place (:mod:`slipstream.resilience.heal`): the workers' variables and the store.

Torch's agent copies the launcher's own environment into every worker, so the launcher sets the
``SLIPSTREAM_HEAL*`` variables (:mod:`slipstream.resilience.heal_env`) in ``os.environ`` for the length of one
launch, and puts back what was there when it ends: a launch from Python (or a test) must not leave
``SLIPSTREAM_HEAL=1`` in its process, where any later worker entry started from it would run as a
supervisor.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable, Iterator, Protocol

from ..resilience import heal_env


class LaunchOptions(Protocol):
    """What of :class:`slipstream.launch.api.LaunchOptions` healing reads (typed here: api imports this)."""

    heals: bool
    spares_per_rank: int
    max_nodes: int
    is_rdzv_host: bool | None
    node_rank: int | None

NAMES = (heal_env.HEAL, heal_env.SPARES, heal_env.STORE)
"""The variables a launch sets for its workers, and puts back when it ends."""


def set_heal_env(opts: LaunchOptions) -> None:
    """The workers' healing variables, from :attr:`LaunchOptions.heals` alone: a ``SLIPSTREAM_HEAL``
    the launcher's own environment (or ``worker_env``) carries would otherwise put the supervisor
    under a ``--no-heal`` run, or leave it without its store."""
    for name in NAMES:
        os.environ.pop(name, None)
    if opts.heals:
        os.environ[heal_env.HEAL] = "1"
        os.environ[heal_env.SPARES] = str(opts.spares_per_rank)


def heal_store(opts: LaunchOptions, host: str, port: int, check_port_free: Callable[[str, int], None]) -> object | None:
    """When healing is on: the store the ranks agree on generations through, its address in
    ``SLIPSTREAM_HEAL_STORE`` for the workers. One node: a free local port; more: the rendezvous
    port + 1 on the rendezvous host, hosted by the launcher there (``None`` on the other nodes)."""
    if not opts.heals:
        return None
    import torch.distributed as dist

    if opts.max_nodes == 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        os.environ[heal_env.STORE] = f"127.0.0.1:{store.port}"
        return store
    os.environ[heal_env.STORE] = f"{host}:{port + 1}"
    if not (opts.is_rdzv_host or (opts.is_rdzv_host is None and opts.node_rank in (None, 0))):
        return None
    check_port_free(host, port + 1)
    return dist.TCPStore(host, port + 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


@contextlib.contextmanager
def healing(opts: LaunchOptions, host: str, port: int, check_port_free: Callable[[str, int], None]) -> Iterator[None]:
    """Within: the workers' variables set and the store (if any) held; after: the variables as they were."""
    before = {name: os.environ.get(name) for name in NAMES}
    try:
        set_heal_env(opts)
        store = heal_store(opts, host, port, check_port_free)  # noqa: F841 - held: it lives while the agent runs
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
