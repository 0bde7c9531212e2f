"""`slipstream run` takes every torchrun option (both spellings) and gives it torchrun's meaning.

The option list comes from torch's own parser, so an option a new torch adds fails here
until the launcher takes it. Meanings are compared on what each launcher hands torch's
elastic agent: torchrun's ``config_from_args`` against our ``agent_config``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest
import torch
from torch.distributed import run as torchrun

from slipstream.cli import build_parser, main
from slipstream.errors import UsageError
from slipstream.launch.api import agent_config
from slipstream.launch.cli import launch_options_from_args, resolve_nproc


def torch_options() -> list[str]:
    return [s for a in torchrun.get_args_parser()._actions for s in a.option_strings if s not in ("-h", "--help")]


def ours(argv: list[str]):
    return launch_options_from_args(build_parser().parse_args(["run", *argv]))


def theirs(argv: list[str], monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in our environment
    return torchrun.config_from_args(torchrun.get_args_parser().parse_args(argv))


def test_every_torchrun_option_string_is_accepted():
    run = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    missing = [s for s in torch_options() if s not in run._option_string_actions]
    assert missing == [], f"torchrun options slipstream run does not take: {missing}"
    # ... and each one parses: a value-taking option with a value that fits it.
    samples = {"nnodes": "1", "nproc_per_node": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1",
               "rdzv_id": "j", "rdzv_conf": "a=1", "max_restarts": "1", "monitor_interval": "0.5",
               "start_method": "fork", "event_log_handler": "console", "role": "trainer", "log_dir": "/tmp/x",
               "redirects": "3", "tee": "1", "local_ranks_filter": "0", "duplicate_stdout_filters": "a,b",
               "duplicate_stderr_filters": "a", "node_rank": "0", "master_addr": "h", "master_port": "1",
               "local_addr": "h", "logs_specs": "x", "numa_binding": "node", "signals_to_handle": "SIGTERM",
               "shutdown_timeout": "5"}
    parser = build_parser()
    for action in torchrun.get_args_parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue
            value = [] if action.nargs == 0 else [samples[action.dest]]
            args = parser.parse_args(["run", flag, *value, "train.py"])
            assert args.script == "train.py", flag


SAME_MEANING = [
    ["--nproc_per_node", "2", "train.py", "--steps", "3"],
    ["--nproc-per-node=3", "--max_restarts", "2", "--monitor_interval", "0.5", "--role", "trainer", "train.py"],
    ["--nproc-per-node", "2", "--start-method", "fork", "--event_log_handler", "console", "-m", "pkg.train", "--lr", "1"],
    ["--log_dir", "LOGDIR", "-r", "3", "-t", "0:1,1:2", "--local_ranks_filter", "0,1", "train.py"],
    ["--redirects", "2", "--tee", "1", "--local-ranks-filter", "1", "--no_python", "/bin/echo", "hi"],
    ["--run_path", "train.py"],
    ["--nnodes", "1:3", "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:29400", "--rdzv_id", "job7",
     "--rdzv_conf", "last_call_timeout=5,keep_alive_interval=2", "--local_addr", "10.0.0.2", "train.py"],
    ["--numa_binding", "socket", "--signals_to_handle", "SIGTERM,SIGUSR1", "--shutdown_timeout", "7",
     "--virtual_local_rank", "--duplicate_stdout_filters", "loss,,x,step", "--duplicate-stderr-filters", "err",
     "train.py"],
]


@pytest.mark.parametrize("argv", SAME_MEANING, ids=[" ".join(a[:2]) for a in SAME_MEANING])
def test_a_torchrun_line_means_the_same(argv, monkeypatch, tmp_path):
    argv = [str(tmp_path) if a == "LOGDIR" else a for a in argv]
    want, want_cmd, want_args = theirs(argv, monkeypatch)
    got, got_cmd, got_args = agent_config(ours(argv))
    for name in ("min_nodes", "max_nodes", "nproc_per_node", "role", "max_restarts", "monitor_interval",
                 "start_method", "local_addr", "event_log_handler", "numa_options", "signals_to_handle",
                 "virtual_local_rank", "shutdown_timeout", "log_line_prefix_template"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        assert (getattr(got, name) or []) == (getattr(want, name) or []), name
    for name in ("_redirects", "_tee", "_local_ranks_filter"):
        assert getattr(got.logs_specs, name) == getattr(want.logs_specs, name), name
    assert type(got.logs_specs) is type(want.logs_specs)
    if "--log_dir" in argv:
        assert got.logs_specs.root_log_dir == want.logs_specs.root_log_dir == str(tmp_path)
    if "--rdzv_endpoint" in argv:
        assert (got.rdzv_backend, got.rdzv_endpoint, got.run_id) == (want.rdzv_backend, want.rdzv_endpoint, want.run_id)
        assert want.rdzv_configs.items() <= got.rdzv_configs.items()
    if "--no_python" in argv:
        assert (got_cmd, got_args) == (want_cmd, want_args)
    else:  # the same program and arguments, run through the worker entry (a safe exit under gloo)
        assert got_cmd == sys.executable
        prefix = ["-u", "-m", "slipstream.launch.worker"]
        assert got_args[:3] == prefix
        rest = got_args[3:]
        if "--run_path" in argv:  # torchrun: runpy.run_path(SCRIPT) in a process of its own; ours: the same
            assert want_cmd is torchrun.run_script_path and want_args == rest
        else:
            assert want_cmd == sys.executable
            assert want_args == ["-u", *(["-m", *rest[1:]] if rest[0] == "--module" else rest)]


def test_rendezvous_as_torchrun_settles_it():
    standalone = ours(["--standalone", "--rdzv-endpoint", "x:1", "--rdzv_id", "ignored", "-n", "2", "t.py"])
    assert (standalone.rdzv_backend, standalone.rdzv_endpoint, standalone.rdzv_id) == ("c10d", None, None)
    one_node = ours(["t.py"])  # static, no endpoint, no master port, one node: a free local port
    assert (one_node.rdzv_backend, one_node.rdzv_endpoint) == ("c10d", None)
    static = ours(["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "1234", "t.py"])
    assert (static.rdzv_backend, static.rdzv_endpoint, static.node_rank, static.is_rdzv_host) == (
        "c10d", "10.0.0.1:1234", 1, False)
    assert ours(["--nnodes", "2", "--master-addr", "h", "t.py"]).rdzv_endpoint == "h:29500"  # torchrun's port
    etcd = ours(["--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e:2379", "t.py"])
    assert (etcd.rdzv_backend, etcd.rdzv_endpoint) == ("etcd-v2", "e:2379")
    config, _, _ = agent_config(etcd)
    assert "is_host" not in config.rdzv_configs and config.run_id == "none"  # torchrun's default id across nodes


def test_pet_variables_give_the_defaults(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    opts = ours(["t.py"])
    assert (opts.nproc_per_node, opts.max_restarts, opts.rdzv_backend) == (3, 2, "c10d")
    assert ours(["-n", "1", "t.py"]).nproc_per_node == 1  # a flag still wins


def test_nproc_keywords_resolve_as_torchrun_resolves_them(monkeypatch):
    for value in ("cpu", "auto"):
        assert resolve_nproc(value) == torchrun.determine_local_world_size(value)
    assert resolve_nproc(3) == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_nproc("gpu") == 4 and ours(["--nproc_per_node", "gpu", "t.py"]).nproc_per_node == 4


@pytest.mark.parametrize("argv,message", [
    (["-n", "gpu", "t.py"], "--nproc-per-node gpu: Cuda is not available"),
    (["-n", "many", "t.py"], "--nproc-per-node must be a number or one of auto, cpu, gpu, xpu, got 'many'"),
    (["-r", "5", "t.py"], "--redirects must be 0-3 or LOCAL_RANK:0-3 pairs"),
    (["--local-ranks-filter", "a", "t.py"], "--local-ranks-filter must be local ranks"),
    (["--no-python", "-m", "pkg"], "--no-python and -m/--module cannot be used together"),
    (["--start_method", "thread", "t.py"], "--start-method must be one of spawn, fork, forkserver"),
    (["--numa-binding", "rack", "t.py"], "--numa-binding must be one of node, socket"),
    (["--nnodes", "2", "t.py"], "needs --rdzv-endpoint"),
    (["--rdzv-backend", "carrier-pigeon", "t.py"], "--rdzv-backend carrier-pigeon: The rendezvous backend"),
])
def test_bad_torchrun_values_are_one_line_exit_2(argv, message, monkeypatch, tmp_path):
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS", "LOGLEVEL"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))  # launch() sets them: restored after the test
    if argv[0] == "-n" and argv[1] == "gpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", *argv])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err.getvalue()


def test_help_lists_the_differences_and_both_spellings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    assert "--nproc-per-node" in text and "--nproc_per_node" in text and "--standalone" in text
    assert "differences from torchrun" in text and "fresh c10d store" in text and "--run-path" in text


def test_resolve_nproc_refuses_an_unknown_word():
    with pytest.raises(UsageError):
        resolve_nproc("tpu")
