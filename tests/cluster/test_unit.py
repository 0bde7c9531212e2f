"""Pure parts of the emulated cluster, the benchmark report and `slipstream bench` (no root, milliseconds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import report
from slipstream.bench import cli as bench_cli
from slipstream.errors import UsageError
from slipstream.launch import emulate


def test_parse_shape():
    assert emulate.parse_shape("2x2") == (2, 2)
    assert emulate.parse_shape(" 4X1 ") == (4, 1)
    for bad in ("2", "0x1", "2x0", "axb", "", "2x2x2"):
        with pytest.raises(UsageError):
            emulate.parse_shape(bad)


def test_parse_and_format_rate():
    assert emulate.parse_rate("1gbit") == 10**9
    assert emulate.parse_rate("200mbit") == 200 * 10**6
    assert emulate.parse_rate("5G") == 5 * 10**9
    assert emulate.parse_rate("2.5gbit") == 2_500_000_000
    assert emulate.parse_rate("unshaped") is None and emulate.parse_rate(None) is None
    for bad in ("fast", "1gbyte", "5bit", "-1gbit"):
        with pytest.raises(UsageError):
            emulate.parse_rate(bad)
    for text in ("1gbit", "200mbit", "5gbit", "unshaped", "1500kbit"):
        assert emulate.format_rate(emulate.parse_rate(text)) == text


def test_parse_link_with_round_trip_and_loss():
    spec = emulate.parse_link("100mbit,40ms,0.1%")
    assert (spec.bits_per_s, spec.rtt_s, spec.loss) == (10**8, 0.04, 0.001) and spec.needs_forwarder
    assert emulate.parse_link("1gbit") == emulate.LinkSpec(10**9) and not emulate.parse_link("1gbit").needs_forwarder
    assert emulate.parse_link("100mbit,1%") == emulate.LinkSpec(10**8, 0.0, 0.01)  # told apart by unit
    assert emulate.parse_link("unshaped, 800us").rtt_s == pytest.approx(0.0008)
    assert emulate.parse_link("1gbit,0ms,0%").needs_forwarder is False  # the bridge, as before
    for text in ("100mbit,40ms,0.1%", "unshaped,2000ms", "1gbit,1.5ms", "200mbit,0.5%"):
        assert str(emulate.parse_link(text)) == text
    errors = {
        "1gbit,-5ms": "round trip", "1gbit,2.5s": "0 to 2s", "1gbit,40": "unit", "1gbit,40 parsecs": "round trip",
        "1gbit,100%": "below 100%", "1gbit,-1%": "at least 0%", "1gbit,0.1": "unit", "1gbit,x%": "percentage",
        "1gbit,1ms,2ms": "once", "1gbit,1%,1%": "once", "1gbit,1ms,1%,1%": "at most three", "40ms": "a rate",
    }
    for text, words in errors.items():
        with pytest.raises(UsageError, match=words) as exc:
            emulate.parse_link(text)
        assert "\n" not in str(exc.value) and repr(text) in str(exc.value)


def test_link_lists_keep_a_link_with_commas_whole():
    assert emulate.split_link_list("unshaped,1gbit,100mbit,40ms,0.1%,5gbit") == [
        "unshaped", "1gbit", "100mbit,40ms,0.1%", "5gbit"]
    assert emulate.split_link_list("2x2@1gbit,4ms:64M,2x1@200mbit") == ["2x2@1gbit,4ms:64M", "2x1@200mbit"]


def test_tbf_burst_holds_a_gso_segment_and_scales_with_rate():
    slow = emulate.tbf_args(10**7)
    fast = emulate.tbf_args(10**10)
    assert slow[:2] == ["rate", "10000000bit"] and int(slow[3]) >= 64 * 1024
    assert int(fast[3]) == 10**10 // 8 * 4 // 1000  # 4 ms of traffic


def test_names_are_unique_and_fit_interface_limits():
    a, b = emulate.EmulatedCluster(3, "1gbit"), emulate.EmulatedCluster(3, "1gbit")
    assert set(a.namespaces).isdisjoint(b.namespaces)
    assert all(ns.startswith(emulate.NS_PREFIX) for ns in a.namespaces)
    assert all(len(n.ifname) <= 15 and len(n.port) <= 15 for n in a.node_list)
    assert len({n.addr for n in a.node_list}) == 3
    assert all(n.addr.startswith("198.18.") for n in a.node_list)


def test_agent_command_line():
    from slipstream.launch import LaunchOptions

    c = emulate.EmulatedCluster(2, "1gbit", run_id="abc123")
    argv = c.agent_argv(1, LaunchOptions("train.py", ["--steps", "3"], max_restarts=2), procs_per_node=2)
    joined = " ".join(argv)
    assert "--nnodes 2 --node-rank 1" in joined and "-n 2" in joined and "--max-restarts 2" in joined
    assert f"--rdzv-endpoint {c.node_list[0].addr}:{emulate.RDZV_PORT}" in joined
    assert f"--local-addr {c.node_list[1].addr}" in joined
    assert argv[-4:] == ["train.py", "--", "--steps", "3"]
    assert c.exec_argv(1, ["x"]) == ["ip", "netns", "exec", "ss-abc123-n1", "x"]
    assert c.node_env(1, {})["GLOO_SOCKET_IFNAME"] == "ssn1"


def test_a_healing_job_runs_its_agents_healing_and_has_them_write_down_their_workers():
    from slipstream.launch import LaunchOptions
    from slipstream.launch.agent import ENV_WORKERS_FILE

    c = emulate.EmulatedCluster(2, "1gbit", run_id="abc124")
    assert " --heal --spares 0 " in " ".join(c.agent_argv(1, LaunchOptions("train.py", [], heal=True, spares=0),
                                                          procs_per_node=1))
    assert " --no-heal " in " ".join(c.agent_argv(1, LaunchOptions("train.py", [], heal=False), procs_per_node=1))
    # No setting: as on real nodes, off across nodes (said to every agent); on within one node.
    assert " --no-heal " in " ".join(c.agent_argv(1, LaunchOptions("train.py", []), procs_per_node=1))
    assert not emulate._heals(LaunchOptions("train.py", []), 2, 1) and emulate._heals(LaunchOptions("train.py", []), 1, 2)
    assert c.node_env(1, {})[ENV_WORKERS_FILE] == c.workers_file(1) != c.workers_file(0)


def test_cli_refuses_without_privileges(monkeypatch, tmp_path, capsys):
    from slipstream.cli import main

    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    monkeypatch.setattr(emulate, "missing_privileges", lambda: "it needs root, or CAP_NET_ADMIN")
    code = main(["run", "--emulate", "2x1", "--link", "1gbit", str(script)])
    err = capsys.readouterr().err
    assert code == 2
    assert "--emulate cannot build a cluster here: it needs root" in err and "Traceback" not in err


def test_cli_rejects_bad_shape_and_rate(tmp_path, capsys):
    from slipstream.cli import main

    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    assert main(["run", "--emulate", "2by2", str(script)]) == 2
    assert "--emulate must be NODESxPROCS" in capsys.readouterr().err
    assert main(["run", "--emulate", "2x1", "--link", "quick", str(script)]) == 2
    assert "--link must be a rate" in capsys.readouterr().err
    # with a job spec too (the spec's emulated run takes --link from the same flag)
    spec = str(Path(__file__).resolve().parents[2] / "examples" / "jobs" / "local-2x1.yaml")
    assert main(["run", "--emulate", "2x1", "--link", "1gbit,-5ms", spec]) == 2
    err = capsys.readouterr().err
    assert "--link delay is the round trip" in err and "'-5ms'" in err and "Traceback" not in err


# --- benchmark report ---------------------------------------------------------


def _run(system, step_s, losses, wire=None, rep=0):
    return {
        "system": system, "repeat": rep, "steps": len(losses), "warmup_steps": 1, "losses": losses,
        "step_times_s": [step_s] * len(losses), "step_times_max_s": [step_s] * len(losses),
        "median_step_s": step_s, "wire_bytes_per_step_per_node": {"0": wire, "1": wire},
        "loopback_bytes_per_step_per_node": {"0": 0, "1": 0}, "sync_stats": None,
    }


def test_summary_ratios_and_time_to_target():
    losses_ddp = [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.9, 0.8]
    doc = {
        "kind": "train", "workload": "mlp", "topology": "2x1", "link": "1gbit", "samples_per_step": 128,
        "runs": [
            _run("floor", 0.1, [2.0] * 8, 0),
            *[_run("ddp", 0.4, losses_ddp, 3.0e7, rep) for rep in range(3)],
            *[_run("fast", 0.2, [l + 0.05 for l in losses_ddp], 1.0e7, rep) for rep in range(3)],
            *[_run("never", 0.1, [2.0] * 8, 1.0e6, rep) for rep in range(3)],
        ],
    }
    rows = {r["system"]: r for r in report.summarize_train(doc)}
    assert rows["ddp"]["x_ddp"] == pytest.approx(1.0)
    assert rows["fast"]["x_ddp"] == pytest.approx(0.5) and rows["fast"]["x_floor"] == pytest.approx(2.0)
    assert rows["ddp"]["samples_per_s"] == pytest.approx(320)
    assert rows["fast"]["wire_MB_per_step_node"] == pytest.approx(10.0)
    w = 2  # min(5, 8 // 4)
    final = sum(losses_ddp[-w:]) / w  # 0.85
    target = final + 0.1 * (2.0 - final)  # 90% of DDP's loss reduction: 0.965
    assert rows["ddp"]["target_loss"] == pytest.approx(target)
    # DDP's 2-step mean first drops to <= 0.965 at step 7 (mean of 1.0 and 0.9 = 0.95): 7 x 0.4 s
    assert rows["ddp"]["time_to_target_s"] == pytest.approx(2.8)
    # "fast" is 0.05 worse throughout: its mean reaches 0.90 + 0.05 = 0.95 at step 8: 8 x 0.2 s
    assert rows["fast"]["time_to_target_s"] == pytest.approx(1.6)
    assert rows["never"]["time_to_target_s"] is None and rows["never"]["reached"] == "0/3"
    table = report.train_table(doc)
    assert "| never |" in table and "not reached" in table


def test_update_markdown_keeps_hand_written_text(tmp_path):
    md = tmp_path / "B.md"
    md.write_text(f"# T\n\nmine above\n\n{report.MARK_BEGIN}\nold\n{report.MARK_END}\n\nmine below\n")
    report.update_benchmarks_md("new table", md)
    text = md.read_text()
    assert "mine above" in text and "mine below" in text and "new table" in text and "old" not in text
    report.update_benchmarks_md("newer", md)
    assert md.read_text().count(report.MARK_BEGIN) == 1 and "new table" not in md.read_text()


# --- slipstream bench -----------------------------------------------------------


def test_bench_options_after_script_args_are_taken():
    ns = argparse.Namespace(sync="allreduce", emulate=None, link="unshaped", nproc_per_node=2, repeats=1,
                            timeout_s=10.0, json=None, module=False)
    rest = bench_cli.split_own_options(["--steps", "5", "--sync=a,b", "-n", "3", "--", "--sync", "x"], ns)
    assert rest == ["--steps", "5", "--sync", "x"]
    assert ns.sync == "a,b" and ns.nproc_per_node == "3"


def test_bench_parses_jsonl_metrics(tmp_path):
    (tmp_path / "metrics").mkdir()
    recs = [{"step": 10, "samples_per_s": 5.0, "loss": 2.0}, {"step": 20, "samples_per_s": 100.0, "loss": 1.5},
            {"step": 30, "samples_per_s": 120.0, "loss": 1.2}, {"step": 40, "samples_per_s": 110.0, "loss": 1.1}]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    rate, loss = bench_cli.parse_metrics(tmp_path)
    assert rate == 110.0 and loss == 1.1  # first window dropped, median of the rest
    assert bench_cli.parse_metrics(tmp_path / "missing") == (None, None)


def test_bench_table_ratios():
    a = bench_cli.BenchResult("allreduce", wall_s=[20.0], samples_per_s=[100.0], final_loss=[1.0], exit_codes=[0])
    b = bench_cli.BenchResult("auto", wall_s=[10.0], samples_per_s=[250.0], final_loss=[1.1], exit_codes=[0])
    c = bench_cli.BenchResult("topk", exit_codes=[1])
    table = bench_cli.format_table([a, b, c], "1 node x 2")
    line = next(l for l in table.splitlines() if l.startswith("auto"))
    assert "250.0" in line and "2.50" in line and "2.00" in line
    assert "failed (exit 1)" in table


def test_bench_timeout_stops_the_trial_gently(tmp_path):
    # SIGTERM first, so an emulated run can delete its namespaces; SIGKILL would leave them behind.
    marker = tmp_path / "got-sigterm"
    child = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    import sys
    import time

    t0 = time.monotonic()
    code = bench_cli.run_one([sys.executable, "-c", child], timeout_s=2.0, grace_s=10.0)
    assert code == 124
    assert marker.exists()
    assert time.monotonic() - t0 < 15


def test_a_bench_told_to_stop_stops_its_trial_and_exits_130(tmp_path):
    """SIGTERM to `slipstream bench` mid-trial: the trial gets SIGINT (an emulated run deletes
    its namespaces), the bench returns 130. In a child interpreter: signals are per process."""
    import subprocess
    import sys
    import textwrap

    marker = tmp_path / "trial-got-sigint"
    trial = (f"import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: (open({str(marker)!r}, 'w').close(), "
             "sys.exit(3))); time.sleep(60)")
    code = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        from slipstream.bench import cli
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        began = time.monotonic()
        print(cli.run_one([sys.executable, "-c", {trial!r}], timeout_s=60, grace_s=10), round(time.monotonic() - began, 1))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    returned, after = proc.stdout.split()
    assert returned == "130" and float(after) < 10, proc.stdout
    assert marker.exists()


class _Exited:
    """A finished agent process, as `subprocess.Popen.poll` sees it."""

    def __init__(self, code: int):
        self.code = code

    def poll(self) -> int:
        return self.code


@pytest.mark.parametrize("codes, expected", [
    ([0, 0], 0),
    ([0, 3], 3),   # both agents exited between two polls, one failing: not a success
    ([1, 3], 1),
    ([0, -9], 1),  # killed by a signal: a training failure
])
def test_wait_reports_a_failure_even_when_every_agent_exited_before_the_first_poll(codes, expected):
    cluster = emulate.EmulatedCluster(len(codes), "1gbit")
    assert cluster._wait([_Exited(c) for c in codes], timeout_s=5, grace_s=5) == expected


class _Agent:
    """An agent process: running (None) until its code is set, or for ``polls`` polls."""

    def __init__(self, code: int | None = None, polls: int = 0):
        self.code, self.polls = code, polls

    def poll(self) -> int | None:
        self.polls -= 1
        return self.code if self.polls < 0 else None


def test_a_node_killed_by_a_signal_is_started_again_up_to_the_restart_budget(monkeypatch):
    """Issue #34: a lost node (its agent killed by a signal) is restarted, as a scheduler restarts
    a pod, its memory deleted first; past --max-restarts node restarts the job fails. An agent that
    exits with a code is the job's own outcome, never restarted."""
    cluster = emulate.EmulatedCluster(2, "1gbit")
    monkeypatch.setattr(cluster, "lose_node", lambda node: [])
    monkeypatch.setattr(cluster, "_wait_netns_empty", lambda node: None)
    forgotten, started = [], []
    monkeypatch.setattr(cluster, "forget_memory", forgotten.append)
    survivor = _Agent()

    def restart(node: int) -> _Agent:
        started.append(node)
        # the first restarted node dies again; the second one finishes with the survivor
        if len(started) == 1:
            return _Agent(-9, polls=3)
        survivor.code = 0
        return _Agent(0, polls=3)

    assert cluster._wait([survivor, _Agent(-9)], timeout_s=5, grace_s=5, restart=restart, node_restarts=2) == 0
    assert started == [1, 1] and forgotten == [1, 1]

    started.clear()
    assert cluster._wait([_Agent(), _Agent(-9)], timeout_s=5, grace_s=0.2, restart=restart, node_restarts=1) == 1
    assert started == [1]  # the second death: no node restart left
    started.clear()
    assert cluster._wait([_Agent(), _Agent(1)], timeout_s=5, grace_s=0.2, restart=restart, node_restarts=3) == 1
    assert started == []  # exit 1 (its own restarts spent): the job's failure, not a lost node


def test_a_lost_node_comes_back_healing_and_node_0_by_a_restart(monkeypatch):
    """Issue #43 item 3: under healing a lost node other than node 0 comes back as its ranks'
    replacements (no agent: a new one would rejoin the rendezvous and the survivors' agents would
    restart their workers), with no --max-restarts needed; node 0 hosts both stores and is
    restarted as before, within the budget."""
    cluster = emulate.EmulatedCluster(2, "1gbit")
    monkeypatch.setattr(cluster, "lose_node", lambda node: [])
    monkeypatch.setattr(cluster, "_wait_netns_empty", lambda node: None)
    forgotten, restarted, rejoined = [], [], []
    monkeypatch.setattr(cluster, "forget_memory", forgotten.append)
    survivor = _Agent()

    def restart(node: int) -> _Agent:
        restarted.append(node)
        return _Agent(0, polls=2)

    def rejoin(node: int) -> _Agent | None:
        rejoined.append(node)
        if node == 0:
            return None
        survivor.code = 0
        return _Agent(0, polls=2)

    assert cluster._wait([survivor, _Agent(-9)], timeout_s=5, grace_s=5, restart=restart, node_restarts=0,
                         rejoin=rejoin) == 0
    assert rejoined == [1] and restarted == [] and forgotten == [1]
    rejoined.clear()
    assert cluster._wait([_Agent(-9), _Agent(0, polls=3)], timeout_s=5, grace_s=5, restart=restart, node_restarts=1,
                         rejoin=rejoin) == 0
    assert rejoined == [0] and restarted == [0]
    rejoined.clear()
    restarted.clear()
    # node 0 again, no restart left: the job fails (no busy loop over a node nothing can start)
    assert cluster._wait([_Agent(-9), _Agent()], timeout_s=5, grace_s=0.2, restart=restart, node_restarts=0,
                         rejoin=rejoin) == 1
    assert restarted == []


def test_the_cluster_leaves_its_network_to_a_collaborator():
    """Issue #44 item 3: EmulatedCluster was 529 lines, network set-up and node processes in one
    class. The network (namespaces, links, shaping, partitions) is emulate_net.ClusterNetwork;
    the cluster's names are the network's (its size: tests/architecture)."""
    c = emulate.EmulatedCluster(2, "100mbit,40ms", run_id="abc125")
    assert c.network.node_list is c.node_list and c.network.switch_ns == c.switch_ns
    prefix = emulate.NS_PREFIX
    assert c.namespaces == [f"{prefix}abc125-sw", f"{prefix}abc125-n0", f"{prefix}abc125-n1"]
    assert (c.link_spec.rtt_s, c.link_bits_per_s) == (0.04, 10**8)


def test_wait_stops_the_nodes_when_the_link_forwarder_exits(monkeypatch):
    """The forwarder carries every packet between nodes: once it is gone the job cannot go on."""
    cluster = emulate.EmulatedCluster(2, "1gbit")
    monkeypatch.setattr(cluster.network, "forwarder_exit_code", lambda: 1)
    assert cluster._wait([_Agent(), _Agent()], timeout_s=5, grace_s=5) == 1
