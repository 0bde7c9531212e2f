"""Process-group start-up: who am I, which device, which backend.

``init()`` recognises how the process was started, from its environment:

* ``slipstream run`` / ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
* Slurm's ``srun`` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...);
* ``mpirun`` of Open MPI (OMPI_COMM_WORLD_*) or MPICH/Intel MPI (PMI_RANK, PMI_SIZE);
* nothing: a single process, which still gets a one-member process group so the
  same script runs unchanged.

Example::

    import slipstream
    rt = slipstream.init()
    print(rt.rank, rt.world_size, rt.device, rt.backend)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping, NoReturn

import torch
import torch.distributed as dist

from ..errors import ConfigError, SlipstreamError, TrainingFailed
from ..resilience import heal
from ..resilience.snapshot_dirs import restart_count
from . import gloo_exit, gloo_interface
from .gpu_binding import GpuClaim, agree_gpu_binding, refuse_shared_gpus, visible_gpus  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from its environment."""

    launcher: str  # "torchrun", "slurm", "mpi" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def node_rank(self) -> int:
        return self.rank // max(1, self.local_world_size)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(1, self.local_world_size)))


def _int(env: Mapping[str, str], key: str) -> int:
    raw = env[key]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key} must be an integer, got {raw!r}") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as ``gpu[003-005,009],cpu01`` -> ``gpu003``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        return "127.0.0.1"
    prefix, ranges = match.group(1), match.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def slurm_tasks_per_node(text: str) -> tuple[int, ...]:
    """Expand Slurm's per-node task counts (SLURM_TASKS_PER_NODE), node by node.

    Slurm writes them in the order of SLURM_JOB_NODELIST, a count repeated on
    consecutive nodes as ``count(xN)``. Raises :class:`ConfigError` on any other text.

    Example::

        slurm_tasks_per_node("2(x3),1")   # (2, 2, 2, 1)
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE must be counts such as '2(x3),1', got {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return tuple(counts)


def _slurm_local_world(env: Mapping[str, str], world: int) -> int:
    """Tasks on this node: --ntasks-per-node if given, else this node's entry (SLURM_NODEID)
    of the step's (or the job's) per-node counts, else the whole world."""
    node = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
    for key in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key, "").strip():
            counts = slurm_tasks_per_node(env[key])
            # --ntasks-per-node is one number for every node; the others are per node.
            return counts[0] if len(counts) == 1 else counts[min(node, len(counts) - 1)]
    return world


def detect_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from the environment.

    The one parser of the launch environment: :func:`init` and
    :func:`slipstream.sync.topology.detect` both read it. A missing local rank
    is ``rank % local_world_size`` (ranks placed consecutively on nodes, as
    torchrun, srun and mpirun do by default).

    Example::

        detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]"}).rank  # 1
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        return LaunchEnv(
            launcher="torchrun",
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % max(1, local_world),
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT,
        )
    # Open MPI before Slurm: mpirun inside an allocation starts its daemons with srun,
    # and the ranks inherit the daemon's SLURM_PROCID (the node index), not their own.
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _mpi_env(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        local_world = _slurm_local_world(env, world)
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        rank = _int(env, "SLURM_PROCID")
        return LaunchEnv(
            launcher="slurm",
            rank=rank,
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank % max(1, local_world),
            local_world_size=local_world,
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else port_for_job(env.get("SLURM_JOB_ID", "0")),
        )
    # After Slurm: srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too, and the Slurm branch knows the nodes.
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpi_env(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    return LaunchEnv("single", 0, 1, 0, 1, "127.0.0.1", 0)


# Where an MPI launcher names its job: Open MPI 4 (ORTE), PMIx (Open MPI 5, MPICH with PMIx),
# and the Slurm job an mpirun may run inside. The same value on every rank of one launch.
_MPI_JOB_KEYS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID", "SLURM_JOB_ID")


def port_for_job(job_id: str) -> int:
    """A rendezvous port in [20000, 40000) derived from a launcher's job id, the same on every rank.

    Launchers that set no MASTER_PORT (srun, mpirun) need one port all ranks agree on
    without talking; a fixed one (29500) makes two jobs on one node collide.

    Example::

        port_for_job("4242")   # the same number on every rank of Slurm job 4242
    """
    return 20000 + int(hashlib.sha1(job_id.encode()).hexdigest(), 16) % 20000


def _mpi_env(env: Mapping[str, str], rank_key: str, size_key: str, lrank_key: str, lsize_key: str) -> LaunchEnv:
    """Rank and world from mpirun's variables; the rendezvous from MASTER_ADDR/PORT, else derived.

    mpirun sets no MASTER_ADDR/PORT. On one node rank 0 is on 127.0.0.1; across nodes
    MASTER_ADDR must be given (mpirun -x MASTER_ADDR=host), unless the launch runs in a
    Slurm allocation, whose first node holds rank 0 under mpirun's default mapping. The
    port is derived from the MPI job id, so concurrent launches on a node do not collide.
    """
    world = _int(env, size_key)
    local_world = _int(env, lsize_key) if lsize_key in env else world
    addr = env.get("MASTER_ADDR")
    if addr is None and local_world != world:
        nodelist = env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ConfigError(
                f"started by mpirun across nodes ({world} ranks, {local_world} per node): "
                "set MASTER_ADDR to the address of rank 0's node (mpirun -x MASTER_ADDR=HOST)"
            )
        addr = _first_slurm_host(nodelist)
    rank = _int(env, rank_key)
    job_key = next((env[k] for k in _MPI_JOB_KEYS if env.get(k)), None)
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        port = port_for_job(job_key) if job_key is not None else DEFAULT_PORT
    return LaunchEnv(
        launcher="mpi",
        rank=rank,
        world_size=world,
        local_rank=_int(env, lrank_key) if lrank_key in env else rank % max(1, local_world),
        local_world_size=local_world,
        master_addr=addr or "127.0.0.1",
        master_port=port,
    )


@dataclass(frozen=True)
class Runtime:
    """The initialised process: rank, world, device and backend.

    ``node_rank``/``num_nodes`` assume the launcher places ``local_world_size``
    consecutive ranks on each node, as torchrun, srun and mpirun do by default.
    """

    launch: LaunchEnv
    backend: str
    device: torch.device
    timeout_s: float = 600.0
    healer: heal.Healer | None = None
    """This rank's side of healing in place (:mod:`slipstream.resilience.heal`) when the launcher supervises it
    (``slipstream run``, on by default): ``accelerate()`` hands it to what must take part in a
    heal. None when the run cannot heal (one rank, another launcher, ``--no-heal``)."""

    rank = property(lambda self: self.launch.rank)
    world_size = property(lambda self: self.launch.world_size)
    local_rank = property(lambda self: self.launch.local_rank)
    local_world_size = property(lambda self: self.launch.local_world_size)
    node_rank = property(lambda self: self.launch.node_rank)
    num_nodes = property(lambda self: self.launch.num_nodes)
    is_main = property(lambda self: self.launch.rank == 0)


_RUNTIME: Runtime | None = None


BACKENDS = ("nccl", "gloo")
DEVICES = ("cuda", "cpu")


def choose_backend(requested: str | None, device: str | None, cuda_available: bool) -> str:
    """The process-group backend: ``requested`` if given, else NCCL when CUDA is
    available and the device is not the CPU, else gloo.

    Example::

        choose_backend(None, None, cuda_available=True)    # "nccl"
        choose_backend(None, "cpu", cuda_available=True)   # "gloo": NCCL carries CUDA tensors only
    """
    if requested is None:
        return "nccl" if cuda_available and device != "cpu" else "gloo"
    if requested not in BACKENDS:
        raise ConfigError(f"backend must be 'nccl' or 'gloo', got {requested!r}")
    if requested == "nccl" and not cuda_available:
        raise ConfigError("backend 'nccl' needs CUDA, and no CUDA device is visible; use 'gloo'")
    return requested


def choose_device(
    backend: str, requested: str | None, local_rank: int, local_world_size: int, device_count: int,
    visible: str | None = None,
) -> torch.device:
    """This rank's device, from the backend, the device asked for and the GPUs this process sees.

    * NCCL: a rank that sees one GPU uses it (``srun --gpus-per-task=1``, an MPI
      wrapper setting CUDA_VISIBLE_DEVICES per rank); one that sees at least as
      many GPUs as the node has ranks takes ``cuda:local_rank``. Between the
      two (4 ranks, 2 GPUs each) is refused on every rank of the node. Whether
      ranks that each see one GPU see the same one is only known across ranks:
      :func:`init` checks the GPUs' identities once the group has started
      (:func:`agree_gpu_binding`), since NCCL fails obscurely on a shared GPU.
    * gloo with ``requested="cuda"``: ``cuda:(local_rank % device_count)``. Ranks
      may share a GPU on purpose (two ranks on one GPU for a test).
    * gloo otherwise: the CPU (also on a CUDA machine).

    ``visible`` is the CUDA_VISIBLE_DEVICES text, quoted in the error. Raises
    :class:`ConfigError`.

    Example::

        choose_device("nccl", None, local_rank=1, local_world_size=2, device_count=2)   # cuda:1
        choose_device("gloo", "cuda", local_rank=1, local_world_size=2, device_count=1) # cuda:0 (shared)
        choose_device("nccl", None, local_rank=5, local_world_size=8, device_count=1)   # cuda:0 (per-task binding)
        choose_device("nccl", None, local_rank=2, local_world_size=4, device_count=2)   # ConfigError
    """
    if requested is not None and requested not in DEVICES:
        raise ConfigError(f"device must be 'cuda' or 'cpu', got {requested!r}")
    if backend == "nccl" and requested == "cpu":
        raise ConfigError("device 'cpu' cannot be used with backend 'nccl' (NCCL carries CUDA tensors only); "
                          "use backend 'gloo' for the CPU")
    device = requested or ("cuda" if backend == "nccl" else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device_count < 1:
        raise ConfigError(f"device 'cuda' with backend {backend!r} needs a GPU, and none is visible "
                          f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}); use device 'cpu'")
    if backend == "nccl" and device_count == 1:
        return torch.device("cuda", 0)  # one GPU per task; a shared one is refused after the group starts
    if backend == "nccl" and (local_world_size > device_count or local_rank >= device_count):
        raise ConfigError(
            f"local rank {local_rank} of {local_world_size} on this node but only {device_count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}): NCCL needs one GPU per rank; "
            f"start fewer processes per node (--nproc-per-node {device_count}) or pass backend='gloo', "
            "device='cuda' (slipstream run --backend gloo --device cuda) to share GPUs on purpose"
        )
    return torch.device("cuda", local_rank % device_count)


def requested_placement(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(backend, device) asked for in SLIPSTREAM_BACKEND / SLIPSTREAM_DEVICE (None: not set).

    ``slipstream run --backend/--device`` and a job spec's ``env`` set them;
    :func:`init` takes them as defaults and the job runner plans GPUs by them.

    Example::

        requested_placement({"SLIPSTREAM_BACKEND": "gloo"})   # ("gloo", None)
    """
    env = os.environ if env is None else env
    out: list[str | None] = []
    for key, allowed in (("SLIPSTREAM_BACKEND", BACKENDS), ("SLIPSTREAM_DEVICE", DEVICES)):
        raw = env.get(key, "").strip()
        if raw and raw not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {raw!r}")
        out.append(raw or None)
    return out[0], out[1]


def init(backend: str | None = None, timeout_s: float | None = None, device: str | None = None) -> Runtime:
    """Start (or return the already started) process group.

    backend: "nccl" or "gloo"; default SLIPSTREAM_BACKEND from the environment
        (set by ``slipstream run --backend``), else NCCL when CUDA is available
        (and device is not "cpu"), else gloo.
    device: "cuda" or "cpu"; default SLIPSTREAM_DEVICE (``slipstream run
        --device``), else CUDA for NCCL and the CPU for gloo. gloo with "cuda"
        keeps tensors on the GPU and lets ranks share one (see :func:`choose_device`).
    timeout_s: how long a collective may wait before it fails (hang detection);
        default SLIPSTREAM_COLLECTIVE_TIMEOUT_S from the environment (set by
        ``slipstream run --collective-timeout-s``), else 600.

    Example::

        rt = slipstream.init()
        if rt.is_main:
            print(f"{rt.world_size} ranks on {rt.num_nodes} node(s), backend {rt.backend}")
        rt = slipstream.init(backend="gloo", device="cuda")   # two ranks may share a GPU
    """
    global _RUNTIME
    if _RUNTIME is not None and dist.is_initialized():
        return _RUNTIME
    _install_excepthook()  # a ConfigError below (too few GPUs, ...) prints one line, not a traceback
    if timeout_s is None:
        timeout_s = _timeout_from_env()
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    launch = detect_launch_env()
    env_backend, env_device = requested_placement()
    backend = env_backend if backend is None else backend
    device = env_device if device is None else device
    cuda_available = torch.cuda.is_available()
    backend = choose_backend(backend, device, cuda_available)
    if launch.rank < 0 or launch.rank >= launch.world_size:
        raise ConfigError(f"rank must be in [0, {launch.world_size}), got {launch.rank}")
    gpus = visible_gpus() if cuda_available else ()
    where = choose_device(
        backend, device, launch.local_rank, launch.local_world_size, len(gpus), os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if where.type == "cuda":
        # Also under gloo: side threads and CUDA RNG state (checkpoints) follow the current device.
        torch.cuda.set_device(where)

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl" and not dist.is_initialized():
        # On NCCL a hung collective ends in the watchdog's SIGABRT, never in Python:
        # torch's flight recorder dumps every rank's last collectives instead, into
        # the run directory, where the launcher names the stalled rank.
        from ..fault.flight_recorder import configure_flight_recorder

        os.environ.update(configure_flight_recorder(os.environ.get("SLIPSTREAM_RUN_DIR")))
    healer = None
    if not dist.is_initialized():
        gloo_interface.configure(launch.world_size, launch.local_rank, launch.master_addr, launch.master_port)  # before the first gloo group, NCCL runs create them too
        if heal.requested() and launch.launcher == "torchrun" and launch.world_size > 1:
            healer = _form_healing_group(launch, backend, where, timeout)
        else:
            _join_process_group(launch, backend, where, timeout)
        if backend == "nccl" and launch.world_size > 1 and (healer is None or not healer.pending):
            # Ranks that each see one GPU may see the same one: only their identities tell.
            claim = GpuClaim(launch.rank, socket.gethostname(), gpus[where.index or 0], where.index or 0,
                             os.environ.get("CUDA_VISIBLE_DEVICES"))
            try:
                agree_gpu_binding(claim, timeout)
            except RuntimeError as exc:  # the gloo group could not connect
                raise TrainingFailed(f"rank {launch.rank} could not create a gloo group: "
                                     f"{_first_line(exc)}{gloo_interface.note()}") from exc
    _install_excepthook()  # after init_process_group, which installs a hook of its own
    gloo_exit.install()  # gloo worker threads (also of CPU side groups) settle before teardown
    _RUNTIME = Runtime(launch=launch, backend=backend, device=where, timeout_s=timeout_s, healer=healer)
    return _RUNTIME


def _form_healing_group(launch: LaunchEnv, backend: str, where: torch.device,
                        timeout: datetime.timedelta) -> heal.Healer:
    """The first default group under ``slipstream run --heal`` (:mod:`slipstream.resilience.heal`): generation 0
    through the launcher's store, or, in a replacement, the fake group until ``accelerate()``."""
    try:
        healer = heal.from_env(launch.rank, launch.world_size, backend, timeout, restart_count(), device=where)
        healer.form()
    except RuntimeError as exc:  # the store or gloo could not connect
        _install_excepthook()
        raise TrainingFailed(f"rank {launch.rank} could not join the process group of {launch.world_size} ranks "
                             f"({backend}, healing in place): {_first_line(exc)}") from exc
    return healer


def _join_process_group(launch: LaunchEnv, backend: str, where: torch.device, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` for how this process was launched.

    A peer that goes away while the group forms (it failed first, say with a
    configuration error) makes gloo or the store raise a bare RuntimeError
    ("Connection reset by peer") deep inside torch; it becomes one line naming
    this rank, and exit 1 so that the launcher's restart policy applies.
    """
    # device_id binds a NCCL group to the rank's GPU under every launcher: NCCL connects
    # eagerly (a bad binding fails here, not at the first all-reduce) and subgroups can be
    # split off its communicator. It means nothing to gloo, even when gloo carries CUDA tensors.
    device_id = where if backend == "nccl" else None
    try:
        if launch.launcher == "single":
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device_id)
        elif launch.launcher == "torchrun":
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            init_method = f"tcp://{launch.master_addr}:{launch.master_port}"
            dist.init_process_group(backend, init_method=init_method, rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout, device_id=device_id)
    except RuntimeError as exc:  # DistNetworkError, DistStoreError and gloo's errors are RuntimeErrors
        _install_excepthook()  # init_process_group may have put a hook of its own before failing
        raise TrainingFailed(
            f"rank {launch.rank} could not join the process group of {launch.world_size} ranks "
            f"({backend}): {_first_line(exc)}; if another rank failed first, its error is the cause"
            + (gloo_interface.note() if backend == "gloo" else "")
        ) from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__


def _install_excepthook() -> None:
    """A SlipstreamError escaping the user's script prints one line and exits 2
    (usage error), not a traceback from inside the library."""
    previous = sys.excepthook
    if getattr(previous, "_slipstream", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, SlipstreamError):
            exit_on_error(value)
        previous(kind, value, tb)

    hook._slipstream = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def exit_on_error(exc: SlipstreamError) -> NoReturn:
    """Report ``exc`` in one line and end this process with ``exc.exit_code``.

    The exit code tells ``slipstream run`` what happened (2: a configuration
    error, not worth a restart). The line goes to stderr and, under
    ``slipstream run`` / torchrun, also into this worker's error file
    (TORCHELASTIC_ERROR_FILE), which the elastic agent reads back: that is how
    the launcher repeats it in its final report. ``os._exit``: the
    interpreter's teardown can abort a gloo rank (see
    :mod:`slipstream.process.gloo_exit`) and turn exit 2 into SIGABRT.

    Example::

        except ConfigError as exc:
            runtime.exit_on_error(exc)   # "slipstream: error (rank 0): ...", exit 2
    """
    env = os.environ
    rank = (_RUNTIME.rank if _RUNTIME is not None else None) if "RANK" not in env else env["RANK"]
    if rank is None:  # before init(), or under srun/mpirun, which set no RANK
        rank = next((env[k] for k in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK") if k in env), "0")
    line = f"slipstream: error (rank {rank}): {exc}"
    sys.stdout.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    recorded = False
    if error_file:
        try:
            # torch's error-file format with a plain-string message (ProcessFailure reads both).
            with open(error_file, "w", encoding="utf-8") as fh:
                json.dump({"message": line, "timestamp": int(time.time())}, fh)
            recorded = True
        except OSError:
            pass  # the exit code alone still tells the launcher what happened
    # Under `slipstream run` (its agent's pid in SLIPSTREAM_AGENT_PID) the launcher prints a
    # recorded configuration error (exit 2) in its report, once for all ranks: printing it here
    # too repeated it per rank. Any other error is printed here as well: the launcher's report
    # names only the rank that failed first (a SIGKILLed rank, say), and a survivor's hang
    # diagnosis ("rank 1 failed first: its heartbeat stopped ...") must still reach the user.
    once_by_launcher = recorded and os.environ.get("SLIPSTREAM_AGENT_PID") and exc.exit_code == 2
    if not once_by_launcher:
        # One write: ranks share the terminal, and print()'s separate newline interleaves their lines.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    os._exit(exc.exit_code)


def group_timeout() -> datetime.timedelta:
    """The collective timeout every process group of this run carries.

    The one configured for :func:`init` when it ran, else
    SLIPSTREAM_COLLECTIVE_TIMEOUT_S, else 600 s. Every ``dist.new_group`` in
    Slipstream passes it, so a side group hangs no longer than the default one.

    Example::

        g = dist.new_group(backend="gloo", timeout=runtime.group_timeout())
    """
    rt = started()
    return datetime.timedelta(seconds=rt.timeout_s if rt is not None else _timeout_from_env())


def _timeout_from_env() -> float:
    raw = os.environ.get("SLIPSTREAM_COLLECTIVE_TIMEOUT_S", "600")
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"SLIPSTREAM_COLLECTIVE_TIMEOUT_S must be a number of seconds, got {raw!r}") from None


def started() -> Runtime | None:
    """The runtime :func:`init` started in this process, or None (never starts one).

    The public way to read it from other modules (the module's ``_RUNTIME`` is private).

    Example::

        rt = runtime.started()
        device = rt.device if rt is not None else torch.device("cpu")
    """
    return _RUNTIME if _RUNTIME is not None and dist.is_initialized() else None


def current() -> Runtime:
    """The runtime started by :func:`init` (starting a default one if needed); :func:`started` never starts one.

    Example::

        rt = runtime.current()   # the running one, or init() with its defaults
    """
    rt = started()
    return rt if rt is not None else init()


def shutdown(exit_code: int | None = None) -> None:
    """Destroy the process group (idempotent).

    ``exit_code``: end the process right after, with that status, without the
    interpreter's teardown. A script's last line may use it; scripts that
    exit normally are covered too, by the exit wait :func:`init` installs
    for gloo (:mod:`slipstream.process.gloo_exit`, where torch 2.13 can abort a
    finished rank in teardown).

    Example::

        run.finish()
        slipstream.shutdown(exit_code=0)   # nothing after this line runs
    """
    global _RUNTIME
    if dist.is_initialized():
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            # Leave together: a rank tearing down gloo while a peer still
            # talks to it can abort at exit ("terminate called without an
            # active exception"). Bounded, so a peer that never calls
            # shutdown() costs at most 30 s.
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            except Exception:  # noqa: BLE001 - a peer already gone: nothing to wait for
                pass
        dist.destroy_process_group()
    _RUNTIME = None
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
