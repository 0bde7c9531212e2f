"""Hang diagnosis: which errors count as a stalled peer, and the flight-recorder analysis
that names the stalled rank when NCCL's watchdog kills the process before Python sees an error."""

from __future__ import annotations

import os
import pickle

import pytest
import torch.distributed as dist

from slipstream.fault import progress
from slipstream.fault.progress import is_collective_failure



# --- which errors are a hang --------------------------------------------------------------

# Messages seen here from torch 2.13's gloo, and NCCL's as written in ProcessGroupNCCL.cpp.
STALLS = [
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                 "Timed out waiting 3000ms for recv operation to complete"),
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10915: "
                 "Connection reset by peer. This is typically caused by a remote worker hanging"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4312"),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
                          "OpType=ALLREDUCE, NumelIn=8388608, NumelOut=8388608, Timeout(ms)=600000) ran for "
                          "600012 milliseconds before timing out."),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
                          "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error "
                          "or a remote process exiting prematurely."),
    dist.DistNetworkError("failed to recv, got 0 bytes"),
    dist.DistStoreError("wait timeout after 30000ms, keys: /slipstream/x"),
]

NOT_STALLS = [
    # A user's own error that mentions a backend.
    ValueError("NCCL needs CUDA tensors; move the batch to the GPU first"),
    RuntimeError("Gloo backend selected but tensors are on cuda:0"),
    # NCCL errors that are bugs, not a peer that hung.
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3105, invalid usage (run with NCCL_DEBUG=WARN for "
                          "details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of "
                          "NCCL library."),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                          "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed."),
    # A data loader's own timeout is not a collective.
    RuntimeError("DataLoader worker (pid(s) 1234) exited unexpectedly; DataLoader timed out after 60 seconds"),
    dist.QueueEmptyError("queue is empty"),
]


@pytest.mark.parametrize("exc", STALLS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_stall_messages_are_collective_failures(exc):
    assert is_collective_failure(exc)


@pytest.mark.parametrize("exc", NOT_STALLS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_errors_that_only_mention_a_backend_are_not(exc):
    assert not is_collective_failure(exc)


def test_a_wrapped_stall_counts_but_an_unrelated_error_raised_while_handling_one_does_not():
    try:
        try:
            raise STALLS[0]
        except RuntimeError as inner:
            raise KeyError("batch") from inner
    except KeyError as wrapped:
        assert is_collective_failure(wrapped)
    try:
        try:
            raise STALLS[0]
        except RuntimeError:
            raise KeyError("batch")  # noqa: B904 - the implicit context is the point
    except KeyError as unrelated:
        assert not is_collective_failure(unrelated)


# --- flight recorder: synthetic dumps in the format torch writes ------------------------------
# The structure is FlightRecorder::dump_dict (torch/csrc/distributed/c10d/FlightRecorderDetail.hpp),
# the same keys the real gloo dump below carries.


def _entry(record_id, pg_id, pg, seq, op, state, *, line=88, size=(8388608,), backend="nccl"):
    return {
        "record_id": record_id, "pg_id": pg_id, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
        "op_id": seq, "profiling_name": f"{backend}:{op}", "time_created_ns": 1_000_000_000 * (100 + seq) + pg_id,
        "input_sizes": [list(size)], "input_dtypes": ["Float"], "output_sizes": [list(size)],
        "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000,
        "is_p2p": False, "thread_id": "1", "thread_name": "pt_main_thread",
        "frames": [{"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 2600},
                   {"name": "train_step", "filename": "/home/u/train.py", "line": line}],
    }


def _dump(groups, first_record=0):
    """groups: [(pg_id, name, desc, ranks, [(seq, op, state), ...])] -> one rank's dump dict."""
    entries, status, config = [], {}, {}
    rid = first_record
    for pg_id, name, desc, ranks, ops in groups:
        config[name] = {"name": name, "desc": desc, "ranks": str(list(ranks))}
        for seq, op, state in ops:
            entries.append(_entry(rid, pg_id, (name, desc), seq, op, state))
            rid += 1
        done = [s for s, _, st in ops if st == "completed"]
        started = [s for s, _, st in ops if st in ("started", "completed")]
        status[str(pg_id)] = {
            "last_enqueued_collective": max((s for s, _, _ in ops), default=-1),
            "last_started_collective": max(started, default=-1),
            "last_completed_collective": max(done, default=-1),
        }
    entries.sort(key=lambda e: e["time_created_ns"])
    return {"version": "2.10", "comm_lib_version": "2.21.5", "pg_config": config, "pg_status": status,
            "entries": entries}


def _ops(last_done, pending=None, state="scheduled", op="all_reduce"):
    ops = [(s, op, "completed") for s in range(1, last_done + 1)]
    if pending is not None:
        ops.append((pending, op, state))
    return ops


def _write(tmp_path, dumps):
    from slipstream.fault.flight_recorder import TRACE_DIRNAME, TRACE_PREFIX

    d = tmp_path / TRACE_DIRNAME
    d.mkdir(exist_ok=True)
    for rank, dump in dumps.items():
        with open(d / f"{TRACE_PREFIX}{rank}", "wb") as f:
            pickle.dump(dump, f)
    return str(tmp_path)


WORLD = (0, 1, 2, 3)


def test_the_rank_that_never_entered_the_collective_is_named(tmp_path):
    from slipstream.fault.flight_recorder import diagnose_flight_recorder

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42))]) for r in (0, 2, 3)}
    dumps[1] = _dump([(0, "0", "default_pg", WORLD, _ops(41))])  # stuck in user code after #41
    run_dir = _write(tmp_path, dumps)
    verdict = diagnose_flight_recorder(run_dir, world_size=4)
    assert verdict is not None
    assert verdict.culprits == [1]
    assert verdict.seq == 42 and verdict.op == "all_reduce" and verdict.group == "0"
    assert "rank 1 never entered it" in verdict.message
    assert "#41 (all_reduce) from train.py:88 (train_step)" in verdict.message
    assert "rank(s) 0, 2, 3 wait in it" in verdict.message
    text = (tmp_path / "hang.txt").read_text()
    assert "rank 1 never entered it" in text
    # Archived: a later failure is judged on its own dumps.
    assert not any(p.is_file() for p in (tmp_path / "flight_recorder").iterdir())
    assert diagnose_flight_recorder(run_dir, world_size=4) is None


def test_a_hang_in_one_group_names_its_laggard_not_the_ranks_waiting_behind_it(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    # 2-way TP x 2-way DP. Rank 3 hangs before the DP all-reduce #7 of group "dp1" (ranks 1, 3);
    # its TP partner rank 2 then waits in TP collective #20, entered later.
    dumps = {
        0: _dump([(1, "tp0", "tp", (0, 1), _ops(20)), (2, "dp0", "dp", (0, 2), _ops(7))]),
        1: _dump([(1, "tp0", "tp", (0, 1), _ops(20)), (2, "dp1", "dp", (1, 3), _ops(6, 7))]),
        2: _dump([(1, "tp1", "tp", (2, 3), _ops(19, 20)), (2, "dp0", "dp", (0, 2), _ops(7))]),
        3: _dump([(1, "tp1", "tp", (2, 3), _ops(19)), (2, "dp1", "dp", (1, 3), _ops(6))]),
    }
    # #7 of dp1 was entered before #20 of tp1 (time_created grows with seq here; make it explicit).
    for e in dumps[1]["entries"]:
        if e["process_group"][0] == "dp1" and e["collective_seq_id"] == 7:
            e["time_created_ns"] = 1
    verdict = analyze_traces(dumps)
    assert verdict.culprits == [3]
    assert verdict.group == "dp1" and verdict.seq == 7
    assert "process group dp1 (dp)" in verdict.message


def test_every_rank_in_the_collective_means_the_collective_itself_hung(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42))]) for r in WORLD}
    verdict = analyze_traces(dumps)
    assert verdict.culprits == []
    assert "collective itself hung" in verdict.message


def test_a_rank_without_a_trace_is_blamed_when_all_others_entered(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42))]) for r in (0, 1, 2)}
    verdict = analyze_traces(dumps)
    assert verdict.culprits == [3]
    assert "wrote none" in verdict.message


def test_a_rank_whose_gpu_never_started_the_collective_is_blamed(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    # Start events recorded (TORCH_NCCL_ENABLE_TIMING): ranks 0-2 started #42 on the GPU, rank 3 did not.
    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42, state="started"))]) for r in (0, 1, 2)}
    dumps[3] = _dump([(0, "0", "default_pg", WORLD, _ops(41, 42, state="scheduled"))])
    verdict = analyze_traces(dumps)
    assert verdict.culprits == [3]
    assert "GPU never started it" in verdict.message


def test_no_pending_collective_is_no_verdict(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(42))]) for r in WORLD}
    assert analyze_traces(dumps) is None


def test_a_rank_whose_buffer_wrapped_is_not_blamed_for_entries_it_lost(tmp_path):
    from slipstream.fault.flight_recorder import analyze_traces

    # Rank 1's ring buffer holds only its newest records, none of group "side": unknown, not "never entered".
    side = (1, "side", "side", (0, 1), _ops(3, 4))
    dumps = {0: _dump([side, (0, "0", "default_pg", (0, 1), _ops(50))]),
             1: _dump([(0, "0", "default_pg", (0, 1), _ops(50))], first_record=5000)}
    verdict = analyze_traces(dumps)
    assert verdict.culprits == [] and "ring buffer wrapped" in verdict.message
    # The same history with its first record still in the buffer: rank 1 never entered "side".
    dumps[1] = _dump([(0, "0", "default_pg", (0, 1), _ops(50))])
    assert analyze_traces(dumps).culprits == [1]


def test_a_truncated_dump_is_reported_and_the_others_still_analysed(tmp_path):
    from slipstream.fault.flight_recorder import TRACE_PREFIX, diagnose_flight_recorder

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42))]) for r in (0, 2, 3)}
    dumps[1] = _dump([(0, "0", "default_pg", WORLD, _ops(41))])
    run_dir = _write(tmp_path, dumps)
    path = tmp_path / "flight_recorder" / f"{TRACE_PREFIX}1"
    path.write_bytes(path.read_bytes()[:40])
    verdict = diagnose_flight_recorder(run_dir, world_size=4, archive=False)
    assert "unreadable traces: rank 1" in verdict.message
    assert verdict.culprits == [1]  # no readable trace from rank 1, every other rank entered #42


def test_configure_sets_what_the_user_did_not(tmp_path):
    from slipstream.fault.flight_recorder import configure_flight_recorder, trace_prefix

    run_dir = str(tmp_path / "run")
    env = configure_flight_recorder(run_dir, environ={})
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) > 60  # above the watchdog's 60 s wait for the dumps
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == trace_prefix(run_dir)
    assert os.path.isdir(os.path.dirname(trace_prefix(run_dir)))
    # The user's choice stands, under the new name or the deprecated one.
    assert "TORCH_FR_BUFFER_SIZE" not in configure_flight_recorder(run_dir, environ={"TORCH_FR_BUFFER_SIZE": "50"})
    mine = configure_flight_recorder(run_dir, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
                                                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/t_"})
    assert "TORCH_FR_BUFFER_SIZE" not in mine and "TORCH_FR_DUMP_TEMP_FILE" not in mine
    assert "TORCH_FR_DUMP_TEMP_FILE" not in configure_flight_recorder(None, environ={})


# --- flight recorder: a real dump from torch (gloo records in the same format) ----------------


def _stall_and_dump(rank: int, world_size: int) -> str:
    """Two gloo collectives everywhere; rank 0 enters a third that rank 1 never joins; both dump."""
    import datetime
    import time

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.all_reduce(t)
    work = dist.all_reduce(torch.ones(16), async_op=True) if rank == 0 else None
    # What NCCL's watchdog does on a timeout, by hand: write the buffer to <prefix><rank>. The
    # recorder marks a gloo collective completed a moment after all_reduce returns (its own
    # bookkeeping, on another thread); a real dump comes a timeout later, so wait for both
    # finished collectives to read as completed, as they would then (under load they did not).
    deadline = time.monotonic() + 30
    trace = _dump_fr_trace()
    while time.monotonic() < deadline:
        entries = pickle.loads(trace).get("entries", [])
        if sum(1 for e in entries if e.get("state") == "completed" or e.get("retired")) >= 2:
            break
        time.sleep(0.05)
        trace = _dump_fr_trace()
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as f:
        f.write(trace)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"dumped{rank}", "1")
    store.wait([f"dumped{1 - rank}"], datetime.timedelta(seconds=60))
    if work is None:
        # Stay in the group until rank 0's wait has ended: leaving earlier closes the pair, and
        # rank 0 then fails with "connection closed" instead of gloo's timeout (under load, it did).
        store.wait(["waited0"], datetime.timedelta(seconds=60))
        return ""
    message = ""
    try:
        work.wait()
    except RuntimeError as exc:
        message = str(exc)
    store.set("waited0", "1")
    return message


@pytest.mark.distributed
def test_a_real_torch_dump_names_the_rank_that_skipped_the_collective(tmp_path):
    from tests.harness import run_ranks

    from slipstream.fault.flight_recorder import configure_flight_recorder, diagnose_flight_recorder

    run_dir = str(tmp_path / "run")
    env = configure_flight_recorder(run_dir, environ={})
    errors = run_ranks(_stall_and_dump, 2, env=env, timeout_s=60)
    assert is_collective_failure(RuntimeError(errors[0]))  # rank 0's wait timed out (gloo's own message)
    verdict = diagnose_flight_recorder(run_dir, world_size=2)
    assert verdict is not None, "torch's dump was not understood"
    assert verdict.culprits == [1] and verdict.seq == 3 and verdict.op == "all_reduce"
    assert "rank 1 never entered it; its last collective there was #2 (all_reduce)" in verdict.message
    assert "test_hang_diagnosis.py" in verdict.message  # the call site, from the recorded stack


def test_hang_report_files_come_from_one_writer(tmp_path):
    progress.write_hang_report(str(tmp_path), "rank 1 stalled first.", {"culprit": "rank 1 stalled first"})
    assert (tmp_path / "hang.txt").read_text() == "rank 1 stalled first.\n"
    assert '"culprit": "rank 1 stalled first"' in (tmp_path / "hang.json").read_text()


def test_progress_files_add_where_each_ranks_host_code_was(tmp_path):
    import time

    from slipstream.fault.flight_recorder import PROGRESS_DIRNAME, diagnose_flight_recorder

    # No process group here: the reporter publishes to its file only.
    reporters = [progress.ProgressReporter(r, 2, interval_s=0.05, progress_dir=str(tmp_path / PROGRESS_DIRNAME))
                 for r in (0, 1)]
    reporters[0].mark(progress.BACKWARD, step=41)
    reporters[1].mark(progress.USER, step=41)
    # Wait for each reporter's thread to publish its mark (it writes every 0.05 s), not a
    # fixed 0.3 s that a loaded machine can overrun.
    deadline = time.monotonic() + 30
    files = lambda: [p.read_text() for p in (tmp_path / PROGRESS_DIRNAME).glob("*") if p.suffix != ".tmp"]  # noqa: E731
    while not (len(files()) == 2 and all('"step": 41' in f for f in files())) and time.monotonic() < deadline:
        time.sleep(0.02)
    for rep in reporters:
        rep.close()
    dumps = {0: _dump([(0, "0", "default_pg", (0, 1), _ops(41, 42))]), 1: _dump([(0, "0", "default_pg", (0, 1), _ops(41))])}
    verdict = diagnose_flight_recorder(_write(tmp_path, dumps), world_size=2)
    assert verdict.culprits == [1]
    assert "rank 0: backward (gradient all-reduce) of step 42" in verdict.message
    assert "rank 1: user code between steps after step 41" in verdict.message


def test_the_launchers_failure_summary_names_the_stalled_rank(tmp_path, capsys):
    """NCCL kills the ranks (watchdog SIGABRT) before Python can diagnose: the launcher
    reads their dumps in the run directory and says who never entered the collective."""
    from slipstream.launch.api import LaunchOptions, _report_failure

    dumps = {r: _dump([(0, "0", "default_pg", WORLD, _ops(41, 42))]) for r in (0, 2, 3)}
    dumps[1] = _dump([(0, "0", "default_pg", WORLD, _ops(41))])
    run_dir = _write(tmp_path, dumps)

    class Failed(Exception):
        failures: dict = {}

    _report_failure(Failed(), LaunchOptions("train.py", worker_env={"SLIPSTREAM_RUN_DIR": run_dir}), 12.0, [])
    err = capsys.readouterr().err
    assert "training failed" in err
    assert "hang (from the ranks' flight-recorder dumps)" in err and "rank 1 never entered it" in err


def test_configure_reads_the_real_process_environment(monkeypatch, tmp_path):
    """os.environ refuses non-string look-ups (a dict does not): read it as init() does."""
    from slipstream.fault.flight_recorder import configure_flight_recorder

    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    wanted = configure_flight_recorder(str(tmp_path))
    assert "TORCH_FR_BUFFER_SIZE" not in wanted  # the user's older name wins
    assert wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


# --- default options: the launcher's verdict finds the dumps (issue #32) ------------------------

_HANG_SCRIPT = '''
import datetime, os, pickle, sys, time
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
from slipstream.fault.flight_recorder import configure_flight_recorder

# What slipstream.init() does before an NCCL group starts (NCCL needs a GPU; this runs on gloo,
# whose collectives torch 2.13 records in the same format).
os.environ.update(configure_flight_recorder(os.environ.get("SLIPSTREAM_RUN_DIR")))
prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
dist.all_reduce(torch.ones(8))
dist.all_reduce(torch.ones(8))
work = dist.all_reduce(torch.ones(16), async_op=True) if rank == 0 else None
deadline = time.monotonic() + 30
trace = _dump_fr_trace()
while time.monotonic() < deadline:  # both finished collectives read as completed, as after a real timeout
    if sum(1 for e in pickle.loads(trace).get("entries", []) if e.get("state") == "completed" or e.get("retired")) >= 2:
        break
    time.sleep(0.05)
    trace = _dump_fr_trace()
if prefix:  # where NCCL's watchdog writes each rank's buffer on a timeout
    with open(prefix + str(rank), "wb") as f:
        f.write(trace)
store = dist.distributed_c10d._get_default_store()
store.set(f"dumped{rank}", "1")
store.wait([f"dumped{1 - rank}"], datetime.timedelta(seconds=60))
if work is None:
    store.wait(["waited0"], datetime.timedelta(seconds=60))
    os._exit(0)
try:
    work.wait()
except RuntimeError:
    pass
store.set("waited0", "1")
os._exit(1)
'''


@pytest.mark.distributed
def test_with_default_options_the_dumps_land_where_the_launchers_verdict_reads(tmp_path):
    """`slipstream run` without --run-dir: the workers' flight recorder writes into the run
    directory the launcher chose, and its failure summary names the rank that never entered."""
    import subprocess
    import sys

    (tmp_path / "hang.py").write_text(_HANG_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_RUN_DIR", "TORCH_FR_", "TORCH_NCCL_"))}
    r = subprocess.run([sys.executable, "-m", "slipstream", "run", "--nproc-per-node", "2", "hang.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    # Read, then archived under flight_recorder/attempt-<ns>/ by the diagnosis.
    dumps = sorted(p.name for p in tmp_path.glob("runs/*/flight_recorder/**/nccl_trace_rank_*"))
    assert dumps == ["nccl_trace_rank_0", "nccl_trace_rank_1"], r.stderr[-3000:]
    assert "hang (from the ranks' flight-recorder dumps)" in r.stderr and "rank 1 never entered it" in r.stderr
