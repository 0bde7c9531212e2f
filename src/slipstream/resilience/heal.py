"""Healing in place: when a rank dies, the others keep their processes and re-form the group.

Under ``slipstream run --heal`` each rank's worker is a small supervisor
(:mod:`slipstream.launch.supervisor`) over the training process. When the
training process of one rank dies (SIGKILL, a segfault, the OOM killer), its
supervisor starts a replacement in place (a warm spare: Python and torch
already imported) and torch's elastic agent sees nothing fail. The survivors'
next collective fails; :class:`Accelerated` catches that, and every rank, the
replacement included, goes through this module:

1. the broken default group is destroyed (aborted on NCCL);
2. the ranks agree on a new *generation* through the launcher's store (a TCPStore
   the launcher that hosts the rendezvous starts for this, at ``SLIPSTREAM_HEAL_STORE``,
   so it outlives any worker): the first rank to fail moves the counter
   from ``g`` to ``g + 1`` with ``compare_set``, the others find it moved;
3. each rank counts itself into the generation and, once all ``world_size`` have,
   creates the default group from a store prefix of that generation;
4. the training state is restored from the in-memory snapshot every rank holds
   (:mod:`slipstream.checkpoint.snapshots`), so the survivors go back at most to
   the last completed step and the replacement to the same one.

A replacement runs the training script from its start. Until it reaches the
restore point inside :func:`slipstream.accelerate`, its default group is a
*fake* one (torch's ``FakeProcessGroup``: every collective returns at once,
moving no data): a ``barrier()`` the script makes before ``accelerate()`` does
not wait for survivors that are not making it, and DDP's first broadcast is a
no-op (the snapshot overwrites those parameters). Then it joins the survivors'
generation like they do. Consequence, documented for users: a value a script
*receives* from a collective before ``accelerate()`` is its own in a
replacement (``rank 0``'s broadcast does not reach it); state that matters
belongs in the checkpoint, as it does for every resume.

torch offers no API for this (``torch.distributed.elastic`` restarts every
worker on any failure; torchft re-forms groups only inside its own manager), so
it is written here; it uses only public store and group calls, plus
``FakeProcessGroup`` from torch's C extension (the same class torch's own fake
backend registers).

Example::

    healer = heal.from_env(rank=1, world_size=2, backend="gloo", timeout=timedelta(seconds=60), attempt=0)
    healer.form()                 # the first group (a replacement: the fake one)
    ...
    healer.rejoin()               # after a failed collective: the next generation's group
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..errors import ConfigError, TrainingFailed
from ..log import CONSOLE
from . import heal_env
from .snapshot_dirs import restart_count

ENV_HEAL = heal_env.HEAL
ENV_REPLACEMENT = heal_env.REPLACEMENT
ENV_ARMED_FILE = heal_env.ARMED_FILE
ENV_JOIN_TIMEOUT = heal_env.JOIN_TIMEOUT
DEFAULT_JOIN_TIMEOUT_S = 120.0
_FAKE_BACKEND = "slipstream_replay"
_POLL_S = 0.005
_EVICT_LOOK_S = 0.5  # how often a waiting rank looks for a hung one (a few store reads per rank)
_WATCH_POLL_S = 0.2  # how often a warm spare looks for an eviction of its rank
_WATCH_CONNECT_S = 10  # how long a warm spare waits for the heal store before it watches nothing

log = logging.getLogger(__name__)


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process trains under a supervisor of ``slipstream run --heal`` (which replaces
    it in place when it dies): only then can the group heal."""
    env = os.environ if environ is None else environ
    return env.get(ENV_HEAL) == "1" and env.get(heal_env.CHILD) == "1"


def on_fake_group() -> bool:
    """Whether this process's default group is the fake one: a replacement that has not joined
    the survivors yet (or a survivor between :meth:`Healer.leave` and :meth:`Healer.rejoin`).
    Read from torch's own state, so code that makes side groups asks the group itself, not a
    global: a gloo group made now would wait for peers that are not making it."""
    world = dist.group.WORLD  # None without a default group (never raises, unlike get_backend())
    return world is not None and dist.get_backend(world) == _FAKE_BACKEND


def side_group_backend() -> str | None:
    """The backend for a CPU side group made now: None (the default group's, the fake one) while
    :func:`on_fake_group`, else "gloo"."""
    return None if on_fake_group() else "gloo"


def _register_fake_backend() -> None:
    if _FAKE_BACKEND in dist.Backend.backend_list:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: object, backend_options: object) -> object:
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, backend_options)  # type: ignore[attr-defined]

    dist.Backend.register_backend(_FAKE_BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


class Healer:
    """One process's side of healing in place (see the module docstring).

    ``store``: a client of the launcher's store; ``prefix``: this launch attempt's
    keys (a full restart starts a new attempt, and so new generations).
    """

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int, backend: str,
                 timeout: datetime.timedelta, device: torch.device | None = None,
                 replacement: bool = False, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
                 armed_file: str | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self.replacement = replacement
        self.join_timeout_s = join_timeout_s
        self.armed_file = armed_file
        self.generation: int | None = None  # the generation of the real group this process is in
        self._left: int | None = None  # the generation whose group failed (None: a replacement's first join)
        self.heals = 0  # groups re-formed after a failure, in this process
        self.last_heal_s: float | None = None
        self.armed = False

    # --- the group ---------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """True in a replacement until it joined the survivors (its default group is the fake one)."""
        return self.generation is None

    def side_group_backend(self) -> str | None:
        """The backend for a gloo side group made now: None while the default group is the fake
        one (a gloo group would wait for peers that are not making it), else "gloo"."""
        return None if self.pending else "gloo"

    def form(self) -> None:
        """The first default group: generation 0 for a rank of the first start, the fake group
        for a replacement (which joins the survivors later, in :meth:`rejoin`)."""
        # Which process is this rank's now: a hung one is killed by that pid (see _evict_hung).
        self.store.set(self._key(f"rank{self.rank}/pid"), str(os.getpid()))
        if self.replacement:
            self._note("a replacement, running the script up to accelerate()")
            self._init_fake_group()
        else:
            self._join(0)

    def leave(self) -> None:
        """After a failed collective: destroy the broken default group (every group with it) and put
        the fake one in its place. The caller then hands the fake group to whatever held the broken
        one (DDP), so the broken group's last reference goes and its sockets close: a peer still
        blocked in the failed collective on one of them (the ring's next rank) fails at once too,
        instead of waiting out the collective timeout."""
        if self.pending:
            return
        self._left = self.generation
        self._note(f"left generation {self.generation}")
        if self.backend == "nccl":
            # A NCCL collective that lost its peer never returns: abort it (and every group) first.
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        self.generation = None
        self._init_fake_group()

    def rejoin(self) -> float:
        """Leave the fake default group (after :meth:`leave`, or a replacement's first one) and join
        the next generation's; returns the seconds it took. Raises :class:`TrainingFailed` when the
        group does not form in time (another failure meanwhile, a peer that never comes back): the
        caller's failure then ends the process, and the launcher's full restart takes over."""
        started = time.monotonic()
        self.leave()
        was = self._left
        self._drop_fake_group(collect=was is not None)
        self.store.add(self._key("gen"), 0)  # exists from here on
        if was is not None:
            # A survivor: move the counter past the generation that failed (the first one wins).
            target = int(self.store.compare_set(self._key("gen"), str(was), str(was + 1)))
        else:
            # A replacement: the generation its predecessor was in is complete (formed by every rank);
            # move past it, unless the survivors already did and are forming the next one.
            target = self._read_gen()
            if self.store.add(self._key(f"{target}/formed"), 0) >= self.world_size:
                target = int(self.store.compare_set(self._key("gen"), str(target), str(target + 1)))
        self._join(target)
        if was is not None:
            self.heals += 1
        self.last_heal_s = time.monotonic() - started
        return self.last_heal_s

    def arm(self) -> None:
        """Tell the supervisor this process can heal: when it dies, replace it in place."""
        self.armed = True
        if self.armed_file:
            with open(self.armed_file, "w") as fh:
                fh.write(str(os.getpid()))

    def disarm(self) -> None:
        """Back to the full restart: the supervisor passes this process's death on to the agent."""
        self.armed = False
        if self.armed_file:
            try:
                os.unlink(self.armed_file)
            except FileNotFoundError:
                pass

    # --- the protocol ------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _read_gen(self) -> int:
        return int(self.store.add(self._key("gen"), 0))

    def _drop_fake_group(self, collect: bool) -> None:
        dist.destroy_process_group()
        if collect:  # a survivor: the broken group's sockets close when its last reference goes
            gc.collect()

    def _init_fake_group(self) -> None:
        _register_fake_backend()
        dist.init_process_group(_FAKE_BACKEND, store=dist.HashStore(), rank=self.rank, world_size=self.world_size)

    def _note(self, what: str) -> None:
        """Where this rank is in the protocol, for a peer's timeout message (wall-clock stamped:
        the ranks share no monotonic clock)."""
        self.store.set(self._key(f"rank{self.rank}/state"), f"{time.time():.3f} {what}")

    def _join(self, generation: int) -> None:
        """Count this rank into ``generation`` and form its group once every rank has; follow the
        counter when another failure moves it meanwhile. The wait has a deadline only while nothing
        moves: each rank that joins (or a newer generation) starts ``join_timeout_s`` again, so a
        join that is slow but progressing (ranks busy beside CPU-bound neighbours, a replacement
        that imports slowly) is never taken for a lost rank."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            waiting_since = next_look = time.monotonic()
            self.store.add(self._key(f"{generation}/joined"), 1)
            self.store.set(self._key(f"{generation}/rank{self.rank}"), "joined")
            self._note(f"joined generation {generation}")
            seen, moved = 0, False
            while not moved:
                joined = self.store.add(self._key(f"{generation}/joined"), 0)
                if joined >= self.world_size:
                    self._init_group(generation)
                    self.store.add(self._key(f"{generation}/formed"), 1)
                    self.generation = generation
                    return
                newer = self._read_gen()
                if newer > generation:  # another rank failed meanwhile: that generation is the one
                    generation, moved = newer, True
                    deadline = time.monotonic() + self.join_timeout_s
                elif joined > seen:  # progress: someone else came
                    seen, deadline = joined, time.monotonic() + self.join_timeout_s
                elif time.monotonic() > deadline:
                    raise TrainingFailed(self._timeout_message(generation, joined))
                else:
                    now = time.monotonic()
                    if now >= next_look and now - waiting_since > self.timeout.total_seconds():
                        self._evict_hung(generation)
                        next_look = now + _EVICT_LOOK_S
                    time.sleep(_POLL_S)

    def _evict_hung(self, generation: int) -> None:
        """Kill the ranks that hang: still in an older generation (they neither left its group nor
        died) one collective timeout after this rank began waiting for ``generation``. A hung rank
        (SIGSTOPped, deadlocked) never fails a collective itself, so it would never come, and the
        join would time out into a full restart. The others cannot form a group without it (the
        world size is fixed), so they do not evict it from the group: its own supervisor kills it
        (the pid it recorded; the supervisor's warm spare watches the store for this, see
        :func:`watch_for_eviction`), and its replacement then joins like any dead rank's."""
        for r in range(self.world_size):
            if r == self.rank or self.store.check([self._key(f"{generation}/rank{r}")]):
                continue
            state_key = self._key(f"rank{r}/state")
            if not self.store.check([state_key]):
                continue
            _stamp, _, what = self.store.get(state_key).decode().partition(" ")
            if not what.startswith("joined generation ") or int(what.rsplit(" ", 1)[1]) >= generation:
                continue  # left (it fails over to the protocol by itself), or a replacement on its way
            if self.store.add(self._key(f"{generation}/evict{r}"), 1) != 1:
                continue  # another rank asked already
            # No line here: a rank that died and whose replacement is slow looks the same from
            # the store; the spare says so when it finds the process alive and kills it.
            self.store.set(self._key(f"rank{r}/evict"), self.store.get(self._key(f"rank{r}/pid")))

    def _timeout_message(self, generation: int, joined: int) -> str:
        """Which ranks did not join ``generation`` and where each was last seen."""
        now, missing = time.time(), []
        for r in range(self.world_size):
            if self.store.check([self._key(f"{generation}/rank{r}")]):
                continue
            state_key = self._key(f"rank{r}/state")
            if self.store.check([state_key]):
                stamp, _, what = self.store.get(state_key).decode().partition(" ")
                missing.append(f"rank {r} last said '{what}' {now - float(stamp):.0f} s ago")
            else:
                missing.append(f"rank {r} never reached the protocol")
        return (f"rank {self.rank}: the process group of generation {generation} did not form: nothing moved "
                f"for {self.join_timeout_s:.0f} s ({joined} of {self.world_size} joined; {'; '.join(missing)}). "
                "A rank that died with no replacement is named in its supervisor's line; the launcher now "
                "restarts every worker")

    def _init_group(self, generation: int) -> None:
        store = dist.PrefixStore(self._key(f"{generation}/pg"), self.store)
        device_id = self.device if self.backend == "nccl" else None
        try:
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=self.timeout, device_id=device_id)
        except RuntimeError as exc:
            raise TrainingFailed(f"rank {self.rank}: the process group of generation {generation} failed to "
                                 f"form: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def watch_for_eviction(environ: Mapping[str, str], stop: threading.Event) -> threading.Thread | None:
    """In a warm spare (:mod:`slipstream.launch.spare`): a thread that kills this rank's hung
    training process when the others ask for it (:meth:`Healer._evict_hung`), until ``stop``.
    Only a process of this spare's own supervisor is killed (its parent's child: the pid came
    through the store, from another node perhaps); its supervisor then replaces it in place with
    this spare, as after any death. The spare is the watcher because it has torch (the store
    client) and is idle; the supervisor stays torch-free. None without a heal store, or when
    the store does not answer within :data:`_WATCH_CONNECT_S`.

    The store is reached here, in the caller's thread, not in the watcher: the thread then
    only makes millisecond calls, so the spare can join it (``stop``, then ``join``) before it
    runs the script. With the watcher (and its store client) still running when a short script
    ended, the process died in interpreter teardown ("terminate called without an active
    exception", SIGABRT) after a successful run: 2 of 3 runs of tests/launch/test_spare.py, and
    2 of 6 two-rank launches of a trivial script under default healing."""
    if not environ.get(heal_env.STORE) or "RANK" not in environ:
        return None
    host, _, port = environ[heal_env.STORE].rpartition(":")
    key = f"slipstream/heal/attempt{restart_count(environ)}/rank{environ['RANK']}/evict"
    supervisor = os.getppid()
    try:
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=_WATCH_CONNECT_S))
    except (OSError, RuntimeError, ValueError):  # no store to watch (the job ends): no watcher
        return None

    def watch() -> None:
        try:
            while not stop.wait(_WATCH_POLL_S):
                if not store.check([key]):
                    continue
                pid = int(store.get(key).decode())
                store.delete_key(key)
                if pid != os.getpid() and _parent_of(pid) == supervisor:
                    log.info(f"[slipstream] rank {environ['RANK']}: the training process (pid {pid}) hangs: it "
                             "never left the group whose collective timed out on the others; killing it, so it is "
                             "replaced in place", extra=CONSOLE)
                    os.kill(pid, signal.SIGKILL)
        except (OSError, RuntimeError, ValueError):  # the store went (the job ends): nothing to watch
            return

    thread = threading.Thread(target=watch, name="slipstream-evict-watch", daemon=True)
    thread.start()
    return thread


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rpartition(")")[2].split()[1])  # after "pid (comm)": state, ppid
    except (OSError, ValueError, IndexError):
        return None


def from_env(rank: int, world_size: int, backend: str, timeout: datetime.timedelta, attempt: int,
             device: torch.device | None = None, environ: Mapping[str, str] | None = None) -> Healer:
    """The healer of a worker that ``slipstream run --heal`` started: a client of the launcher's
    store (``SLIPSTREAM_HEAL_STORE``), keys under launch attempt ``attempt`` (a full restart's
    workers start a new one)."""
    env = os.environ if environ is None else environ
    host, _, port = env[heal_env.STORE].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    try:
        join_timeout = float(env.get(ENV_JOIN_TIMEOUT) or DEFAULT_JOIN_TIMEOUT_S)
    except ValueError:
        raise ConfigError(f"{ENV_JOIN_TIMEOUT} must be a number of seconds, got {env.get(ENV_JOIN_TIMEOUT)!r}") from None
    return Healer(store, f"slipstream/heal/attempt{attempt}", rank, world_size, backend, timeout,
                  device=device, replacement=env.get(ENV_REPLACEMENT) == "1", join_timeout_s=join_timeout,
                  armed_file=env.get(ENV_ARMED_FILE) or None)
