"""Launch workers through torch's elastic agent (``torch.distributed.launcher.api``).

Workers get the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID, ...), so an unmodified
torchrun script runs unchanged, restarts included.

What differs from torchrun, and why:

* Every attempt bootstraps from a fresh TCP store. torchrun shares the agent's
  rendezvous store with the workers across restarts; under gloo a restarted
  rank can then read the address its peer published in the previous attempt
  and fail with "Connection refused" in connectFullMesh (seen in 4 of 10
  trials on our CI machine). We opt out of that sharing
  (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): each rendezvous round then picks a
  new port and rank 0 of the attempt hosts a new store, so no key survives
  from an earlier attempt.
* Clear errors before anything starts (missing script, bad counts, busy port)
  and exit codes that tell success (0), training failure (1) and usage
  errors (2) apart. A worker's usage error (exit 2, e.g. a ConfigError) is
  reported with its message, exits 2 and is not restarted: it would recur.
* OMP_NUM_THREADS defaults to cores / local workers rather than 1.
* Every run ends with a one-line summary and the run directory, printed by the launcher
  (:mod:`slipstream.launch.summary`), whatever the script prints; and a successful run ends
  quietly: the rendezvous store's host leaves last (:mod:`slipstream.launch.agent`).
* Workers run ``python -u -m slipstream.launch.worker SCRIPT`` (the script as
  ``__main__``, as Python runs it, plus a safe exit under gloo), not ``python -u
  SCRIPT``; ``--no-python`` runs the program itself, as torchrun does.
* A stop signal (SIGTERM, ...) raises torch's ``SignalException`` only outside
  standard-library code, so it cannot leave a worker's Popen lock held and the
  agent blind to that worker's exit (:mod:`slipstream.launch.agent_signals`).
* Workers die with the agent: a launcher killed with SIGKILL takes its workers
  with it (SIGKILL from the kernel, see :mod:`slipstream.launch.parent_death`)
  instead of leaving them training beside the relaunch. Not under
  ``--no-python``, whose program does not run the worker entry.

Every other torchrun option (``torch.distributed.run``) maps onto torch's
``LaunchConfig`` as torchrun maps it: see :func:`agent_config`.

Example::

    from slipstream.launch import LaunchOptions, launch
    code = launch(LaunchOptions("train.py", ["--steps", "10"], nproc_per_node=2, max_restarts=1))
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_TRAINING_FAILED,
    EXIT_USAGE,
    UsageError,
    did_you_mean,
)
from ..log import CONSOLE, ENV_LOG_LEVEL, LOG_LEVELS, set_level
from ..resilience.snapshot_dirs import ENV_REJOINS
from . import agent_signals
from .agent import patched_agent
from .heal_setup import healing
from .parent_death import ENV_AGENT_PID
from .summary import read_totals, summary_lines

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # torch is imported late (see launch)
    from torch.distributed.launcher.api import LaunchConfig

START_METHODS = ("spawn", "fork", "forkserver")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
"""torch.numa.binding.AffinityMode's values (torchrun --numa-binding)."""
_STD_PATTERN = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")


@dataclass(frozen=True)
class LaunchOptions:
    """What to start and how: the typed request ``slipstream run SCRIPT`` builds from its
    flags (launch/cli.py) and the job runner builds from a spec; validated by :meth:`validate`."""

    entrypoint: str
    """Path of the training script, or a module name when ``module`` is true."""
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    """This node's rank; 0 hosts the rendezvous store. None: decided from the endpoint."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous store; None on one node: a free local port."""
    rdzv_id: str | None = None
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    module: bool = False
    local_addr: str | None = None
    """Address this node publishes to the others (default: its host name)."""
    join_timeout_s: float = 600.0
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra c10d rendezvous settings (last_call_timeout, keep_alive_interval, ...)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for workers (e.g. SLIPSTREAM_SYNC set by --sync)."""
    # The rest are torchrun's options (torch.distributed.run), with its defaults and meaning.
    rdzv_backend: str = "c10d"
    """c10d: one fresh store per attempt (see the module's docstring); another name (etcd, etcd-v2)
    goes to torch's rendezvous registry unchanged."""
    role: str = "default"
    start_method: str = "spawn"
    """How the agent starts workers: spawn, fork or forkserver."""
    no_python: bool = False
    """Run ``entrypoint`` as an executable (torchrun --no-python), not through Python."""
    log_dir: str | None = None
    """Base directory of the workers' log files (None: a temporary one)."""
    redirects: str = "0"
    """Streams written to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank, "0:1,1:2"."""
    tee: str = "0"
    """Streams written to log files and the console (same format as ``redirects``)."""
    local_ranks_filter: tuple[int, ...] = ()
    """Local ranks whose output reaches the console (empty: all)."""
    logs_specs: str | None = None
    """Name of a ``torchrun.logs_specs`` entry point (a LogsSpecs class); None: torch's default."""
    event_log_handler: str = "null"
    numa_binding: str | None = None
    """Bind workers to CPUs near their GPU: node, socket, exclusive or core-complex."""
    signals_to_handle: str | None = None
    """Signals the agent forwards to the workers, comma-separated; None: torch's default."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    """Every worker sees LOCAL_RANK 0 (and only its own device)."""
    shutdown_timeout_s: int | None = None
    """Seconds workers get after SIGTERM before SIGKILL; None: torch's default."""
    log_level: str | None = None
    """How much the ``slipstream`` logger says, here and in every worker: one of
    :data:`slipstream.log.LOG_LEVELS` (``--log-level``; ``-q`` is ``warning``); None: as configured."""
    summary: bool = True
    """Print the run directory and a one-line summary at the end (the node that hosts the
    rendezvous does); False for a program that wraps the launcher and prints its own."""
    heal: bool | None = None
    """Heal a rank whose process dies in place (docs/fault-tolerance.md, "Healing in place"): each
    rank runs under a supervisor that replaces its training process while the others keep theirs.
    None (the default): on wherever it applies (more than one rank, the Python worker entry, not
    ``no_python``, a fixed number of nodes, not an elastic range: see :attr:`heals`); True (``--heal``):
    on, an error with ``no_python``; False (``--no-heal``): off, a failed rank restarts every
    worker (``max_restarts``). Resolved by :attr:`heals`."""
    spares: int | None = None
    """Warm spares each rank keeps while healing is on: 0 or 1 (None: 1). 0 starts a replacement
    cold, seconds later, and costs no memory until then."""

    def validate(self) -> None:
        """Raise :class:`UsageError` with a readable message for anything unusable."""
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.min_nodes < 1:
            raise UsageError(f"--nnodes minimum must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise UsageError(f"--nnodes maximum ({self.max_nodes}) must be >= minimum ({self.min_nodes})")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.max_nodes:
            raise UsageError(f"--node-rank must be in [0, {self.max_nodes}), got {self.node_rank}")
        if self.join_timeout_s <= 0:
            raise UsageError(f"join timeout must be > 0 s, got {self.join_timeout_s}")
        if self.monitor_interval_s <= 0:
            raise UsageError(f"--monitor-interval must be > 0 s, got {self.monitor_interval_s}")
        if self.start_method not in START_METHODS:
            raise UsageError(f"--start-method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            if not _STD_PATTERN.fullmatch(value):
                raise UsageError(f"{flag} must be 0-3 or LOCAL_RANK:0-3 pairs separated by commas (e.g. 3 or 0:1,1:2), "
                                 f"got {value!r}")
        if self.numa_binding is not None and self.numa_binding not in NUMA_BINDINGS:
            raise UsageError(f"--numa-binding must be one of {', '.join(NUMA_BINDINGS)}, got {self.numa_binding!r}")
        if self.shutdown_timeout_s is not None and self.shutdown_timeout_s < 0:
            raise UsageError(f"--shutdown-timeout must be >= 0 s, got {self.shutdown_timeout_s}")
        if self.no_python:
            if self.module:
                raise UsageError("--no-python and -m/--module cannot be used together (as with torchrun)")
            if not os.path.exists(self.entrypoint) and shutil.which(self.entrypoint) is None:
                raise UsageError(f"--no-python: command not found: {self.entrypoint}")
        elif not self.module:
            if not os.path.exists(self.entrypoint):
                raise UsageError(f"training script not found: {self.entrypoint}")
            if os.path.isdir(self.entrypoint):
                raise UsageError(f"training script is a directory, not a file: {self.entrypoint}")
        elif _module_missing(self.entrypoint):
            raise UsageError(f"-m/--module: no module named {self.entrypoint.split('.')[0]!r} "
                             f"(looked in the current directory and on sys.path), got {self.entrypoint!r}")
        if self.log_dir is not None and os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise UsageError(f"--log-dir must be a directory, got a file: {self.log_dir}")
        if self.signals_to_handle is not None:
            for name in (part.strip() for part in self.signals_to_handle.split(",")):
                if not isinstance(getattr(signal, name, None), signal.Signals) or not name.startswith("SIG"):
                    known = [s.name for s in signal.Signals if not s.name.startswith("SIG_")]
                    raise UsageError(f"--signals-to-handle must name signals such as SIGTERM,SIGINT separated by "
                                     f"commas, got {name!r}" + did_you_mean(name, known, quote=True))
        if self.max_nodes > 1 and not self.rdzv_endpoint:
            raise UsageError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the store every node joins), "
                             "or --master-addr HOST [--master-port PORT]")
        if self.rdzv_endpoint:
            parse_endpoint(self.rdzv_endpoint)
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
                             + did_you_mean(self.log_level, LOG_LEVELS, quote=True))
        self.validate_heal()

    def validate_heal(self) -> None:
        """The rules of :attr:`heal` and :attr:`spares` alone (the flags' check needs no script)."""
        if self.spares is not None and self.spares not in (0, 1):
            raise UsageError(f"--spares must be 0 or 1 (warm spares per rank), got {self.spares}")
        if self.heal is False and self.spares is not None:
            raise UsageError(f"--spares {self.spares} keeps warm replacements for healing in place, "
                             "which --no-heal turns off: give one or the other")
        if self.heal and self.no_python:
            raise UsageError("--heal runs each rank under a supervisor in the Python worker entry: "
                             "it cannot go with --no-python")

    @property
    def heals(self) -> bool:
        """Whether this launch heals in place: :attr:`heal` resolved. Its default is on wherever
        it applies, and off without a word where it does not: one rank has no survivor to heal
        with; ``--no-python`` has no Python worker entry to supervise; and a launch across nodes.
        There a lost node comes back through a new agent, whose rendezvous restarts every worker
        anyway, after the survivors first waited for the lost ranks to join their heal
        (``SLIPSTREAM_HEAL_JOIN_TIMEOUT_S``): a two-container job whose second container was
        killed and started again did not finish in 180 s with healing on (tests/container).
        ``--heal`` across nodes heals a lost *process* in place, and a lost node by that slow way
        (on the emulated cluster, a lost node other than node 0 comes back healing: :mod:`.node_rejoin`)."""
        if self.heal is not None:
            return self.heal
        return not self.no_python and self.nproc_per_node > 1 and self.max_nodes == 1

    @property
    def spares_per_rank(self) -> int:
        """Warm spares each rank keeps when :attr:`heals` (the default: 1)."""
        return 1 if self.spares is None else self.spares

    @property
    def is_rdzv_host(self) -> bool | None:
        """True/False when known from --node-rank or a single-node run, None to let torch decide."""
        if self.node_rank is not None:
            return self.node_rank == 0
        if self.max_nodes == 1:
            return True
        return None


def _module_missing(name: str) -> bool:
    """Whether no top-level package ``name`` (``pkg`` of ``pkg.mod``) can be found from the
    current directory or sys.path, where the worker's ``python -m`` looks. Imports nothing;
    a missing submodule is left to the worker, which reports it in one line too."""
    import importlib.machinery
    import importlib.util

    top = name.split(".")[0]
    if not top.isidentifier():
        return True
    if top in sys.builtin_module_names or importlib.util.find_spec(top) is not None:
        return False
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is None


def check_torch_options(opts: LaunchOptions) -> None:
    """The options whose valid values torch decides, checked before any worker starts:
    --event-log-handler against torch's registered handlers, --numa-binding against a
    torch and machine that can bind (it places workers near their CUDA device).

    Example::

        check_torch_options(LaunchOptions("train.py", event_log_handler="bogus"))
        # UsageError: --event-log-handler must be one of console, dynamic_rendezvous, null, got 'bogus'
    """
    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic.rendezvous import registry  # registers torch's own backends

    backends = tuple(b for b in getattr(getattr(registry, "handler_registry", None), "_registry", {}) or ()
                     if b != "static")
    if backends and opts.rdzv_backend not in backends:
        raise UsageError(f"--rdzv-backend {opts.rdzv_backend}: The rendezvous backend {opts.rdzv_backend!r} is not "
                         f"registered; known: static, {', '.join(backends)}"
                         + did_you_mean(opts.rdzv_backend, ("static", *backends), quote=True))
    _logs_specs_class(opts.logs_specs, object)  # a --logs-specs no package provides

    known = tuple(getattr(handlers, "_log_handlers", {}))
    if known and opts.event_log_handler not in known:
        raise UsageError(f"--event-log-handler must be one of {', '.join(known)}, got {opts.event_log_handler!r}"
                         + did_you_mean(opts.event_log_handler, known, quote=True))
    if opts.numa_binding is not None:
        import torch

        if not torch.cuda.is_available():
            why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"--numa-binding {opts.numa_binding} binds each worker to the CPUs near its GPU and "
                             f"needs CUDA GPUs; {why} (torch {torch.__version__}): leave --numa-binding out")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:29400"`` -> ``("host", 29400)``; a clear error otherwise."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError(f"--rdzv-endpoint port must be a number, got {port_text!r} in {endpoint!r}") from None
    if not 0 <= port < 65536:
        raise UsageError(f"--rdzv-endpoint port must be in [0, 65535], got {port}")
    return host.strip("[]"), port


def check_port_free(host: str, port: int) -> None:
    """Fail early, with a readable message, when the store port is taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the store binds (TCPStore sets SO_REUSEADDR): only a listener makes the port busy, not
        # the connections of a store that was killed, left in TIME_WAIT for a minute (a rendezvous
        # host's node lost and started again on the same port was refused here).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("" if family == socket.AF_INET else "::", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"rendezvous port {port} is already in use on this machine; "
                    f"choose another with --rdzv-endpoint {host}:PORT or stop the process holding it"
                ) from None
            raise


class _AttemptHistory(logging.Handler):
    """Collects the agent's one "failed (exitcode ...)" record per failed attempt,
    so the final summary can list every attempt, not just the last."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.failures: list[tuple[float, object, object, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("failed (exitcode") and isinstance(record.args, tuple) and len(record.args) >= 3:
            exitcode, local_rank, pid = record.args[:3]
            self.failures.append((record.created, exitcode, local_rank, pid))


def _default_threads(nproc_per_node: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc_per_node)


def launch(opts: LaunchOptions) -> int:
    """Run the workers to completion; returns the process exit code.

    0 when every worker succeeded, 1 when they failed with no restart left,
    2 when a worker exited 2 (a usage or configuration error: reported with
    the worker's message, not restarted), 130 when interrupted.

    The workers' environment is made in this process's ``os.environ`` (torch's agent
    copies it for each worker); it is restored on return, so a second ``launch()`` in the
    same process (a notebook, a test) does not inherit the first one's ``--sync`` or
    ``OMP_NUM_THREADS``.
    """
    saved = dict(os.environ)
    logger = logging.getLogger("slipstream")
    saved_level = logger.level
    try:
        return _launch(opts)
    finally:
        logger.setLevel(saved_level)  # --log-level is this launch's, not the calling program's
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def _launch(opts: LaunchOptions) -> int:
    """:func:`launch`, without the restoring of ``os.environ`` and the log level."""
    opts.validate()
    if opts.log_level is not None:
        set_level(opts.log_level)
        os.environ[ENV_LOG_LEVEL] = opts.log_level  # the workers' (slipstream.log reads it at import)
    opts = with_run_dir(opts)
    if opts.heals and opts.summary and opts.is_rdzv_host:
        # Said once, by the node that speaks for the run: healing is on without a flag, and
        # a user who sees a rank replaced should know why and how to turn it off.
        spares = opts.spares_per_rank
        log.info(f"slipstream run: healing in place: on ({spares} warm spare{'' if spares == 1 else 's'} per rank; "
                 "--no-heal to turn off)", extra=CONSOLE)
    started = time.monotonic()
    code = _run_agent(opts)
    run_dir = opts.worker_env.get("SLIPSTREAM_RUN_DIR") or os.environ.get("SLIPSTREAM_RUN_DIR")
    # One node speaks for the run: the rendezvous host (node rank 0), whose rank 0 wrote the
    # metrics; a node that does not know whether it hosts speaks if rank 0's metrics are here.
    if opts.summary and (opts.is_rdzv_host or (opts.is_rdzv_host is None and run_dir and read_totals(run_dir))):
        for line in summary_lines(run_dir, code, time.monotonic() - started):
            log.info(line, extra=CONSOLE)
    return code


def _run_agent(opts: LaunchOptions) -> int:
    """The elastic agent of this node, run to its end; the exit code (see :func:`launch`)."""
    endpoint = opts.rdzv_endpoint or "127.0.0.1:0"
    host, port = parse_endpoint(endpoint)
    if opts.is_rdzv_host and opts.rdzv_backend == "c10d":  # another backend's store is not ours to host
        check_port_free(host, port)
    check_torch_options(opts)

    # Imported late: importing the launcher costs a second and the checks above
    # should answer at once.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from ..resilience import snapshot_dirs as snapshots  # torch-free: not the checkpoint package

    snapshots.sweep()  # in-memory snapshots of launchers that were killed before they could delete theirs
    # A stop signal must not land inside the agent's Popen.poll (slipstream.launch.agent_signals).
    agent_signals.install()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(_default_threads(opts.nproc_per_node)))
    os.environ.setdefault("LOGLEVEL", "WARNING")
    os.environ.update(opts.worker_env)
    config, entrypoint, cmd_args = agent_config(opts)
    # The agent runs in this process: workers arm themselves to die with it
    # (slipstream.launch.parent_death) and check it is still their parent.
    os.environ[ENV_AGENT_PID] = str(os.getpid())
    started = time.monotonic()
    history = _AttemptHistory()
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addHandler(history)
    try:
        with healing(opts, host, port, check_port_free), \
                patched_agent(is_store_host=opts.is_rdzv_host if opts.rdzv_backend == "c10d" else None):
            _launch_rejoining(opts, endpoint, lambda: elastic_launch(config, entrypoint)(*cmd_args))
    except ChildFailedError as exc:
        failures = getattr(exc, "failures", {})
        if any(f.exitcode == EXIT_USAGE for f in failures.values()):
            _report_usage_error(failures, opts, len(history.failures))
            return EXIT_USAGE
        _report_failure(exc, opts, time.monotonic() - started, history.failures)
        return EXIT_TRAINING_FAILED
    except RendezvousError as exc:
        log.info(f"slipstream run: rendezvous failed at {endpoint}: {exc}", extra=CONSOLE)
        return EXIT_TRAINING_FAILED
    except ValueError as exc:
        if "rendezvous backend" in str(exc):  # a --rdzv-backend no package registered
            raise UsageError(f"--rdzv-backend {opts.rdzv_backend}: {exc}") from None
        raise
    except KeyboardInterrupt:
        log.info("slipstream run: interrupted", extra=CONSOLE)
        return EXIT_INTERRUPTED
    except SignalException as exc:
        # The agent itself was told to stop (pod eviction, preemption): its
        # workers got SIGTERM too and wrote an emergency checkpoint if they
        # checkpoint at all.
        log.info(f"slipstream run: stopped by {exc.sigval.name}; workers were told to checkpoint and exit", extra=CONSOLE)
        return EXIT_PREEMPTED if exc.sigval == signal.SIGTERM else 128 + int(exc.sigval)
    finally:
        agent_log.removeHandler(history)
        os.environ.pop(ENV_AGENT_PID, None)
        snapshots.sweep(owner=os.getpid())  # this launch's workers' in-memory snapshots: no restart comes now
    return EXIT_OK


def with_run_dir(opts: LaunchOptions, now: float | None = None) -> LaunchOptions:
    """``opts`` with SLIPSTREAM_RUN_DIR in its worker environment, chosen now when no one chose it.

    The workers' flight recorder (set up in ``slipstream.init()``, before the process
    group) writes its dumps into the run directory, and the launcher's hang verdict
    reads them there: both must know it before any worker starts. Without --run-dir
    (or SLIPSTREAM_RUN_DIR in the launcher's environment) it is ``runs/<rdzv id>`` when
    several nodes share an explicit rendezvous id (the same on every node), else
    ``runs/<local time %Y%m%d-%H%M%S>``, the training loop's own default, made absolute
    so a worker that changes directory still writes there.

    Example::

        with_run_dir(LaunchOptions("train.py")).worker_env["SLIPSTREAM_RUN_DIR"]   # "/cwd/runs/20261202-043100"
    """
    if opts.worker_env.get("SLIPSTREAM_RUN_DIR") or os.environ.get("SLIPSTREAM_RUN_DIR"):
        return opts
    if opts.max_nodes > 1 and opts.rdzv_id not in (None, "", "none"):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(opts.rdzv_id))
    else:
        name = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    run_dir = os.path.abspath(os.path.join("runs", name))
    return dataclasses.replace(opts, worker_env={**opts.worker_env, "SLIPSTREAM_RUN_DIR": run_dir})


REJOIN_PAUSE_S = 3.0
"""Pause between two attempts of a node cut off from the rendezvous store to join again."""
REJOIN_WINDOW_S = 180.0
"""How long such a node keeps trying (or the join timeout, if shorter): long enough for a
link that comes back, short enough that a lost rendezvous host (the c10d store dies
with it) still fails the job within minutes, for the orchestrator to restart."""


def _launch_rejoining(opts: LaunchOptions, endpoint: str, run_agent: Callable[[], object]) -> None:
    """Run the agent; a node that is not the rendezvous host and loses the store (a
    link cut, a switch failure) tries again to join, for up to :data:`REJOIN_WINDOW_S`
    (or ``join_timeout_s`` if shorter), instead of leaving the job for good.

    Torch's agent gives up at the first RendezvousConnectionError. The same retry
    serves a node that starts before the rendezvous host is up (pods start in any
    order); a wrong endpoint is named in every retry line. An elastic job
    (``--nnodes MIN:MAX``) goes on without this node meanwhile (at the smaller size,
    from its last checkpoint) and takes it back in at its next rendezvous round once
    the link is back; in a fixed-size job the other nodes wait for it in their
    rendezvous (for up to their join timeout).
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    first_error: float | None = None
    joins = 0
    while True:
        try:
            run_agent()
            return
        except RendezvousConnectionError as exc:
            if opts.is_rdzv_host is True or opts.rdzv_backend != "c10d":
                raise
            now = time.monotonic()
            first_error = first_error if first_error is not None else now
            window = min(opts.join_timeout_s, REJOIN_WINDOW_S)
            if now - first_error > window:
                raise
            log.info(
                f"slipstream run: cannot reach the rendezvous store at {endpoint} ({exc}); trying to join again "
                f"for up to {window - (now - first_error):.0f} s more (if this node never joined, check --rdzv-endpoint)",
                extra=CONSOLE,
            )
            time.sleep(REJOIN_PAUSE_S)
            # The next agent counts its restarts from 0 again: its workers learn they are not a
            # new job (their in-memory snapshots are kept, slipstream.resilience.snapshot_dirs.restart_count).
            joins += 1
            os.environ[ENV_REJOINS] = str(joins)


def agent_config(opts: LaunchOptions) -> "tuple[LaunchConfig, str, list[str]]":
    """What torch's ``elastic_launch`` gets for ``opts``: its LaunchConfig, the program and its arguments.

    The torchrun options map as ``torch.distributed.run.config_from_args`` maps them;
    the program is ``python -u -m slipstream.launch.worker SCRIPT ARGS`` (``--no-python``:
    ``SCRIPT ARGS``). Starts nothing (torch's log spec makes its log directory); raises :class:`UsageError` for a
    ``--logs-specs`` name no package provides.

    Example::

        config, program, args = agent_config(LaunchOptions("train.py", ["--steps", "5"], nproc_per_node=2))
        config.nproc_per_node, args   # 2, ["-u", "-m", "slipstream.launch.worker", "train.py", "--steps", "5"]
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    endpoint = opts.rdzv_endpoint or "127.0.0.1:0"
    rdzv_configs: dict[str, object] = {"join_timeout": int(opts.join_timeout_s)}
    if opts.rdzv_backend == "c10d" and opts.is_rdzv_host is not None:
        rdzv_configs["is_host"] = opts.is_rdzv_host
    rdzv_configs.update(opts.rdzv_conf)
    if opts.rdzv_id:
        run_id = opts.rdzv_id
    else:
        # torchrun's default id across nodes (every agent must name the same one); one node: a fresh id.
        run_id = "none" if opts.max_nodes > 1 else f"slipstream-{uuid.uuid4().hex[:12]}"
    logs_specs = _logs_specs_class(opts.logs_specs, DefaultLogsSpecs)(
        log_dir=opts.log_dir,
        redirects=Std.from_str(opts.redirects),
        tee=Std.from_str(opts.tee),
        local_ranks_filter=set(opts.local_ranks_filter) or None,
    )
    # Given only when set, so an older torch without these fields still launches.
    optional: dict[str, object] = {}
    if opts.numa_binding is not None:
        from torch.numa.binding import AffinityMode, NumaOptions

        optional["numa_options"] = NumaOptions(affinity_mode=AffinityMode(opts.numa_binding))
    if opts.signals_to_handle is not None:
        optional["signals_to_handle"] = opts.signals_to_handle
    if opts.duplicate_stdout_filters:
        optional["duplicate_stdout_filters"] = list(opts.duplicate_stdout_filters)
    if opts.duplicate_stderr_filters:
        optional["duplicate_stderr_filters"] = list(opts.duplicate_stderr_filters)
    if opts.virtual_local_rank:
        optional["virtual_local_rank"] = True
    if opts.shutdown_timeout_s is not None:
        optional["shutdown_timeout"] = opts.shutdown_timeout_s
    config = LaunchConfig(
        min_nodes=opts.min_nodes,
        max_nodes=opts.max_nodes,
        nproc_per_node=opts.nproc_per_node,
        run_id=run_id,
        role=opts.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=opts.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=opts.max_restarts,
        monitor_interval=opts.monitor_interval_s,
        start_method=opts.start_method,
        log_line_prefix_template=os.getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        local_addr=opts.local_addr,
        logs_specs=logs_specs,
        event_log_handler=opts.event_log_handler,
        **optional,
    )
    if opts.no_python:
        _note_no_python_adoption(opts.worker_env)
        return config, opts.entrypoint, list(opts.args)
    # Each worker runs the script through slipstream.launch.worker: the script as
    # Python would run it, plus a wait at exit that keeps gloo from aborting it.
    target = ["--module", opts.entrypoint] if opts.module else [opts.entrypoint]
    return config, os.getenv("PYTHON_EXEC", sys.executable), ["-u", "-m", "slipstream.launch.worker", *target, *opts.args]


def _note_no_python_adoption(worker_env: dict[str, str]) -> None:
    """--no-python runs the program itself, not the worker entry that adopts DDP models: training
    options then reach only a slipstream.accelerate() inside it. Said once, at start."""
    from ..config import options_in_env

    given = options_in_env(worker_env)
    if given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        log.info(f"slipstream run: {flags} with --no-python: training options reach only a slipstream.accelerate() "
              "call inside the program, which runs without the worker entry that adopts the DDP models a script "
              "builds (docs/zero-change.md)",
              extra=CONSOLE)


def _logs_specs_class(name: str | None, default: type) -> type:
    """The LogsSpecs class of entry point ``name`` in group ``torchrun.logs_specs``, as torchrun finds it."""
    if name is None:
        return default
    from importlib.metadata import entry_points

    found = entry_points(group="torchrun.logs_specs").select(name=name)
    if not found:
        raise UsageError(f"--logs-specs: no entry point {name!r} in group torchrun.logs_specs (is its package installed?)")
    return next(iter(found)).load()


def _report_usage_error(failures: dict, opts: LaunchOptions, attempts: int) -> None:
    """The workers' own one-line messages, from their error files, under a header
    that says why there was no restart. Ranks the agent stopped are not listed."""
    usage = sorted(rank for rank, f in failures.items() if f.exitcode == EXIT_USAGE)
    which = f"rank {usage[0]}" if len(usage) == 1 else f"ranks {', '.join(map(str, usage))}"
    when = f" in attempt {attempts}" if attempts > 1 else ""
    left = opts.max_restarts - max(0, attempts - 1)
    why = f"; not restarted ({left} restart(s) left unused), it would fail the same way" if left > 0 else ""
    lines = [f"slipstream run: configuration error in {which} (exit code {EXIT_USAGE}){when}{why}:"]
    seen: set[str] = set()
    # The ranks that exited 2 first: their messages, each once (every rank of a run with a bad
    # setting says the same); then the others, whose collectives lost those ranks.
    for rank in sorted(failures, key=lambda r: (failures[r].exitcode != EXIT_USAGE, r)):
        failure = failures[rank]
        if failure.exitcode < 0:
            continue
        text = (failure.message if isinstance(failure.message, str) else str(failure.message)).strip()
        same = re.sub(r"^slipstream: error \(rank [^)]*\): ", "", text)
        if same in seen:
            continue
        seen.add(same)
        if text.startswith("slipstream: "):
            lines.append("  " + text.replace("\n", "\n  "))
        else:
            lines.append(f"  rank {rank} (pid {failure.pid}): exit code {failure.exitcode}, "
                         "no error record; see the worker's output above")
    log.info("\n".join(lines), extra=CONSOLE)


def _report_failure(
    exc: "Exception", opts: LaunchOptions, elapsed_s: float, attempts: list[tuple[float, object, object, object]]
) -> None:
    """A short summary: one line per failed attempt on this node, then the last
    attempt's failures, root cause (the earliest real failure) first."""
    failures = getattr(exc, "failures", {})
    lines = [
        f"slipstream run: training failed after {opts.max_restarts + 1} attempt(s) in {elapsed_s:.1f} s "
        f"(--max-restarts {opts.max_restarts} spent)."
    ]
    for i, (when, exitcode, local_rank, pid) in enumerate(attempts):
        stamp = time.strftime("%H:%M:%S", time.localtime(when))
        lines.append(f"  attempt {i + 1}: local rank {local_rank} (pid {pid}) failed first, exit code {exitcode}, at {stamp}")
    lines.append("  last attempt:")
    # Ranks the agent stopped with SIGTERM after the first failure come last.
    ordered = sorted(failures.items(), key=lambda item: (item[1].exitcode == -15, item[1].timestamp, item[0]))
    for i, (global_rank, failure) in enumerate(ordered):
        text = failure.message if isinstance(failure.message, str) else str(failure.message)
        text = text.strip()
        if not text or text.startswith("To enable traceback"):
            reason = "no error record; see the worker's output above"
        else:
            reason = text.splitlines()[-1]
        role = "first failure" if i == 0 else "then"
        lines.append(
            f"    {role}: rank {global_rank} (local {failure.local_rank}, pid {failure.pid}): "
            f"exit code {failure.exitcode}: {reason}"
        )
    verdict = _flight_recorder_verdict(opts)
    if verdict is not None:
        lines.append("  hang (from the ranks' flight-recorder dumps): " + verdict.replace("\n", "\n    "))
    log.info("\n".join(lines), extra=CONSOLE)


def _flight_recorder_verdict(opts: LaunchOptions) -> str | None:
    """On NCCL a hung collective kills the workers (watchdog SIGABRT) before any Python
    diagnosis runs; their flight-recorder dumps in the run directory still say which
    rank never entered the collective (the last attempt's: dumps are per rank)."""
    from ..fault.flight_recorder import diagnose_flight_recorder

    run_dir = opts.worker_env.get("SLIPSTREAM_RUN_DIR") or os.environ.get("SLIPSTREAM_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return None
    try:
        verdict = diagnose_flight_recorder(run_dir)
    except Exception as exc:  # noqa: BLE001 - the summary above must still print
        return f"could not read the dumps in {run_dir}: {exc}"
    return verdict.message if verdict is not None else None
