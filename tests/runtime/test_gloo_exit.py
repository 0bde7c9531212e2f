"""The exit wait for gloo worker threads: /proc parsing on a fake task folder, and the real threads."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.distributed as dist

from slipstream.process import gloo_exit
from tests.conftest import cannot_run_here

PARKED = "202 0x55d0c5a1 0x189 0x0 0x0 0x0 0xffffffff 0x7f0e 0x7f0f\n"      # cv wait for work
GIL_WAIT = "202 0x7f3a5b10 0x189 0x0 0x7ffd2a00 0x0 0xffffffff 0x7f0e 0x7f0f\n"  # timed: CPython's take_gil
MUTEX_WAIT = "202 0x7f3a5b10 0x80 0x2 0x0 0x0 0x0 0x7f0e 0x7f0f\n"        # FUTEX_WAIT: a std::mutex
RUNNING = "running\n"


def _task_dir(tmp_path, threads: dict[str, tuple[str, str]]):
    for tid, (comm, syscall) in threads.items():
        d = tmp_path / tid
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "syscall").write_text(syscall)
    return str(tmp_path)


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def test_parked_workers_and_other_threads_are_told_apart(tmp_path, x86):
    task = _task_dir(tmp_path, {
        "10": ("python", RUNNING),  # the main thread is not a gloo worker
        "11": ("gloo_tcp_loop", "232 0x11 0x7f 0x40 0xa\n"),
        "12": ("pt_gloo_runloop", PARKED),
        "13": ("pt_gloo_runloop", PARKED),
    })
    assert len(gloo_exit._gloo_worker_threads(task)) == 2
    assert gloo_exit.wait_for_gloo_workers(timeout_s=1, task_dir=task)


@pytest.mark.parametrize("state", [GIL_WAIT, MUTEX_WAIT, RUNNING])
def test_a_worker_not_parked_is_waited_for_until_the_timeout(tmp_path, x86, state):
    task = _task_dir(tmp_path, {"12": ("pt_gloo_runloop", PARKED), "13": ("pt_gloo_runloop", state)})
    assert not gloo_exit._parked(os.path.join(task, "13"), 202)
    assert not gloo_exit.wait_for_gloo_workers(timeout_s=0.05, task_dir=task)


def test_no_gloo_threads_returns_at_once(tmp_path, x86):
    task = _task_dir(tmp_path, {"10": ("python", RUNNING)})
    assert gloo_exit.wait_for_gloo_workers(timeout_s=0, task_dir=task)


def test_a_thread_that_ended_holds_nothing(tmp_path, x86):
    assert gloo_exit._parked(str(tmp_path / "gone"), 202)


def test_real_gloo_workers_are_found_and_settle_after_collectives(monkeypatch):
    if not os.path.isdir("/proc/self/task") or platform.machine() not in gloo_exit._FUTEX_SYSCALL:
        cannot_run_here("reads Linux /proc thread states, on a machine whose futex syscall gloo_exit knows")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        t = torch.ones(1 << 16)
        for _ in range(8):
            dist.all_reduce(t, async_op=True)
        dist.barrier()
        assert gloo_exit._gloo_worker_threads("/proc/self/task"), "torch renamed its gloo worker threads"
        assert gloo_exit.wait_for_gloo_workers(timeout_s=5)
    finally:
        dist.destroy_process_group()
