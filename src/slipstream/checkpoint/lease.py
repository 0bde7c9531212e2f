"""One live writer per checkpoint directory: a lease kept in ``<dir>/.lease.json``.

Two jobs writing one checkpoint directory destroy each other's checkpoints
(each prunes the other's steps, and a resume picks up the other run's state).
Rank 0 of a job holds the lease while it may write. The record names the
holder: its run id, host, pid, attempt and a heartbeat time, refreshed every
``interval_s`` by a daemon thread. Who may take the lease:

* nobody holds it, or the holder is this run (same run id: a restart of the
  job, whatever its pid or host);
* the holder is provably gone: same host as us and its pid is no longer alive
  (or now belongs to another process): taken over at once, so an
  orchestrator's relaunch a second later just works;
* the holder has not beaten for ``stale_after_s`` (default 6 x ``interval_s``):
  taken over, whichever host it is on.

Otherwise :meth:`Lease.acquire` raises :class:`CheckpointDirInUse` (exit 2: the
launcher does not restart a configuration error) in one line naming the holder.
Every takeover is logged as a warning naming the old holder. To take a
directory over by hand, delete its ``.lease.json``.

Identity. The run id is ``TORCHELASTIC_RUN_ID`` when set to a real id. torchrun's
default ``"none"`` (and an empty value) is shared by unrelated jobs, so it is not
taken as a run id: the identity is then host, pid and start time of the process
that lives across restarts. Under the elastic agent that is the agent
(``SLIPSTREAM_AGENT_PID`` when the launcher exports it, else the worker's parent:
torch's agent starts each worker with ``subprocess.Popen``, a direct child), so
a restarted worker keeps its lease; outside it, this process.

Writes are atomic: on a local file system a temporary file, fsync, then a
hard link (first holder: fails if another job got there first) or
``os.replace`` (takeover, heartbeat); on an fsspec URL (``s3://...``) one put of
the whole object, atomic on object stores.

Example::

    lease = Lease("ckpt", interval_s=10.0)
    lease.acquire()          # raises CheckpointDirInUse when another job writes there
    ...                      # save checkpoints
    lease.release()          # stops the heartbeat, deletes the record if still ours
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from ..extras import pip_install_hint
from ..resilience.pids import alive, start_time

log = logging.getLogger("slipstream.checkpoint")

LEASE_FILE = ".lease.json"
DEFAULT_INTERVAL_S = 10.0
STALE_INTERVALS = 6  # missed heartbeats before a holder on another host counts as gone
NOT_A_RUN_ID = ("", "none")  # torchrun's default id: shared by unrelated jobs


class CheckpointDirInUse(ConfigError):
    """Another live job holds the checkpoint directory's writer lease (exit 2)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease (the record's content, less the times)."""

    run_id: str
    host: str
    pid: int
    attempt: int = 0
    pid_start: str | None = None
    heartbeat_unix_s: float = field(default=0.0, compare=False)

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (time.time() if now is None else now) - self.heartbeat_unix_s)
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, attempt {self.attempt}, last heartbeat {age:.1f} s ago)"

    def record(self, now: float) -> bytes:
        return json.dumps({**asdict(self), "heartbeat_unix_s": now}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder:
        raw = json.loads(data)
        return cls(
            run_id=str(raw["run_id"]), host=str(raw["host"]), pid=int(raw["pid"]), attempt=int(raw.get("attempt", 0)),
            pid_start=raw.get("pid_start"), heartbeat_unix_s=float(raw.get("heartbeat_unix_s", 0.0)),
        )


def this_holder(env: Mapping[str, str] | None = None) -> Holder:
    """This process's identity as a lease holder (see the module's "Identity").

    Example::

        this_holder({"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "2"}).run_id   # "job-7"
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    elastic_id = env.get("TORCHELASTIC_RUN_ID")
    if env.get("SLIPSTREAM_AGENT_PID", "").strip().isdigit():
        pid = int(env["SLIPSTREAM_AGENT_PID"])
    elif elastic_id is not None:
        pid = os.getppid()  # the elastic agent: workers are its direct children
    else:
        pid = os.getpid()
    start = start_time(pid)
    if elastic_id is not None and elastic_id.strip().lower() not in NOT_A_RUN_ID:
        run_id = elastic_id
    else:
        run_id = f"{host}-{pid}-{start}" if start else f"{host}-{pid}"
    try:
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        attempt = 0
    return Holder(run_id=run_id, host=host, pid=pid, attempt=attempt, pid_start=start)


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class Lease:
    """The writer lease of one checkpoint directory (see the module's docstring).

    ``interval_s``: seconds between heartbeats; ``stale_after_s``: a holder
    silent this long is taken over (default ``6 * interval_s``);
    ``storage_options``: passed to fsspec for a URL directory; ``holder``: this
    job's identity (default :func:`this_holder`).
    """

    def __init__(
        self,
        directory: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        stale_after_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ConfigError(f"checkpoint_lease_interval_s must be > 0, got {interval_s}")
        self.stale_after_s = STALE_INTERVALS * interval_s if stale_after_s is None else stale_after_s
        if self.stale_after_s <= interval_s:
            raise ConfigError(f"checkpoint_lease_stale_after_s must exceed the interval ({interval_s} s), got {self.stale_after_s}")
        self.directory = directory
        self.interval_s = interval_s
        self.holder = holder or this_holder()
        self.lost = False  # the heartbeat found another job's record: this job no longer holds the lease
        self._fs = None
        if _is_url(directory):
            try:
                import fsspec  # the optional 'data' extra
            except ImportError:
                raise ConfigError(
                    f"checkpoint_dir {directory} is a URL, which needs fsspec: {pip_install_hint('data')}"
                ) from None
            self._fs, root = fsspec.core.url_to_fs(directory, **dict(storage_options or {}))
            self.path = root.rstrip("/") + "/" + LEASE_FILE
        else:
            self.path = os.path.join(directory, LEASE_FILE)
        self._unreadable = False  # the last read found a record it could not parse
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- storage ---------------------------------------------------------------------
    def read(self) -> Holder | None:
        """The current record, or None when there is none (or it is unreadable: logged)."""
        self._unreadable = False
        try:
            if self._fs is not None:
                data = self._fs.cat_file(self.path)
            else:
                with open(self.path, "rb") as f:
                    data = f.read()
        except FileNotFoundError:
            return None
        try:
            return Holder.parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            self._unreadable = True
            log.warning("checkpoint_dir %s: lease record %s is unreadable (%s); treating the directory as free", self.directory, self.path, exc)
            return None

    def _write(self, exclusive: bool) -> bool:
        """Write our record atomically; with ``exclusive``, only if there is none (False: there was one)."""
        data = self.holder.record(time.time())
        if self._fs is not None:
            self._fs.pipe_file(self.path, data)  # one put of the whole object
            return True
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, self.path)  # atomic, and fails when another job wrote first
                    return True
                except FileExistsError:
                    return False
                except OSError:
                    pass  # no hard links on this file system (some FUSE mounts): replace below
            os.replace(tmp, self.path)
            return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _delete(self) -> None:
        try:
            if self._fs is not None:
                self._fs.rm_file(self.path)
            else:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    # --- the rules -------------------------------------------------------------------
    def _mine(self, other: Holder) -> bool:
        return other.run_id == self.holder.run_id

    def _gone(self, other: Holder, now: float) -> str | None:
        """Why ``other`` may be taken over, or None when it holds the directory."""
        if other.host == self.holder.host and not alive(other.pid, other.pid_start):
            return "its process is gone (same host)"
        silent = now - other.heartbeat_unix_s
        if silent > self.stale_after_s:
            return f"no heartbeat for {silent:.0f} s (stale after {self.stale_after_s:g} s)"
        return None

    def acquire(self) -> None:
        """Take the lease (see the rules) and start the heartbeat; raises :class:`CheckpointDirInUse`."""
        for _ in range(3):  # a job that wrote between our read and our exclusive write: decide again
            current = self.read()
            if current is None:
                if not self._write(exclusive=not self._unreadable):
                    continue
            elif self._mine(current):
                self._write(exclusive=False)
            else:
                now = time.time()
                reason = self._gone(current, now)
                if reason is None:
                    raise self._refusal(current, now)
                log.warning("checkpoint_dir %s: taking over the writer lease of %s: %s", self.directory, current.describe(now), reason)
                self._write(exclusive=False)
            after = self.read()  # two takers at once: the last write wins, the other refuses
            if after is not None and not self._mine(after):
                raise self._refusal(after, time.time())
            break
        else:
            raise self._refusal(self.read() or self.holder, time.time())
        self.lost = False
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_loop, name="slipstream-ckpt-lease", daemon=True)
        self._thread.start()

    def _refusal(self, other: Holder, now: float) -> CheckpointDirInUse:
        return CheckpointDirInUse(
            f"checkpoint_dir {self.directory} is in use by {other.describe(now)}; one live writer per directory: "
            f"stop that job, or delete {self.path} if it is gone"
        )

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.beat():
                    return
            except Exception as exc:  # noqa: BLE001 - a storage hiccup: the next beat retries
                log.warning("checkpoint_dir %s: lease heartbeat failed: %s", self.directory, exc)

    def beat(self) -> bool:
        """Refresh the heartbeat; False (and :attr:`lost`) when another job holds the record now."""
        if self._fs is None and not os.path.isdir(self.directory):
            log.warning("checkpoint_dir %s is gone; its lease heartbeat stops", self.directory)
            return False
        current = self.read()
        if current is not None and not self._mine(current):
            self.lost = True
            log.error(
                "checkpoint_dir %s: the writer lease was taken over by %s; this job (run %s) no longer holds it",
                self.directory, current.describe(), self.holder.run_id,
            )
            return False
        self._write(exclusive=False)
        return True

    def release(self) -> None:
        """Stop the heartbeat and delete the record if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.interval_s))
            self._thread = None
        try:
            current = self.read()
            if current is not None and self._mine(current):
                self._delete()
        except Exception as exc:  # noqa: BLE001 - a release must not fail a clean exit
            log.warning("checkpoint_dir %s: lease not released: %s", self.directory, exc)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take_for_job(directory: str, *, rank: int, world_size: int, group: Any, interval_s: float,
                 stale_after_s: float | None = None, storage_options: Mapping[str, Any] | None = None) -> Lease | None:
    """Rank 0 takes the lease of ``directory``; every rank learns the outcome.

    Returns the lease on rank 0 (None elsewhere). A refusal, or a lease that
    cannot be written, is raised on every rank alike (one broadcast on
    ``group``, the caller's control group; none in a single process), so no rank
    is left waiting in the next collective.
    """
    outcome: list = [None]
    lease = None
    if rank == 0:
        try:
            lease = Lease(directory, interval_s=interval_s, stale_after_s=stale_after_s, storage_options=storage_options)
            lease.acquire()
        except CheckpointDirInUse as exc:
            outcome[0] = ("in use", str(exc))
        except ConfigError as exc:
            outcome[0] = ("config", str(exc))
        except Exception as exc:  # noqa: BLE001 - told to every rank below, not raised here alone (a hang)
            outcome[0] = ("config", f"checkpoint_dir {directory}: cannot write its writer lease: {type(exc).__name__}: {exc}")
    if group is not None and world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        kind, message = outcome[0]
        raise CheckpointDirInUse(message) if kind == "in use" else ConfigError(message)
    return lease
