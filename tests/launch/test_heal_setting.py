"""Healing in place as one launch setting (issue #43 item 4's first half, item 1's switch):
``LaunchOptions.heal``/``spares``, on by default wherever it applies, carried by the flags
(``--heal``, ``--no-heal``, ``--spares``) and the run config, and the only source of the
workers' ``SLIPSTREAM_HEAL*`` variables. Unit level: no worker starts (milliseconds)."""

from __future__ import annotations

import logging

import pytest

from slipstream.cli import build_parser
from slipstream.errors import UsageError
from slipstream.launch import api, heal_setup
from slipstream.launch.api import LaunchOptions
from slipstream.launch.cli import launch_options_from_args
from slipstream.resilience import heal_env


def options(*flags: str, config: str | None = None) -> LaunchOptions:
    argv = ["run", *flags, *(["--config", config] if config else []), "train.py"]
    return launch_options_from_args(build_parser().parse_args(argv))


def workers_heal_env(opts: LaunchOptions, monkeypatch) -> dict[str, str]:
    """The SLIPSTREAM_HEAL* variables the workers get from this launch (the launcher sets them in
    its own environment, which torch's agent copies); a stale SLIPSTREAM_HEAL=1 there must not count."""
    for name in heal_setup.NAMES:  # recorded, so that the test's end takes back what set_heal_env writes
        monkeypatch.setenv(name, "1")
    heal_setup.set_heal_env(opts)
    import os

    return {k: v for k, v in os.environ.items() if k in (heal_env.HEAL, heal_env.SPARES)}


@pytest.mark.parametrize("opts,heals", [
    (LaunchOptions("t.py", nproc_per_node=2), True),  # the default: on with more than one rank
    # Across nodes off: a lost node comes back through the rendezvous, which restarts every worker
    # anyway, after the survivors waited for its ranks (the emulated cluster keeps this default).
    (LaunchOptions("t.py", nproc_per_node=1, min_nodes=2, max_nodes=2, rdzv_endpoint="h:1"), False),
    (LaunchOptions("t.py", nproc_per_node=1, min_nodes=2, max_nodes=2, rdzv_endpoint="h:1", heal=True), True),
    (LaunchOptions("t.py", nproc_per_node=1), False),  # one rank: no survivor to heal with
    (LaunchOptions("t", nproc_per_node=2, no_python=True), False),  # no Python worker entry to supervise
    (LaunchOptions("t.py", nproc_per_node=2, min_nodes=1, max_nodes=2, rdzv_endpoint="h:1"), False),  # elastic
    (LaunchOptions("t.py", nproc_per_node=2, max_nodes=2, min_nodes=2, rdzv_backend="etcd"), False),
    (LaunchOptions("t.py", nproc_per_node=2, heal=False), False),
    (LaunchOptions("t.py", nproc_per_node=1, heal=True), True),  # asked for: as before
])
def test_heal_is_on_by_default_wherever_it_applies(opts, heals):
    assert opts.heals is heals


def test_the_flags_decide_the_workers_variables(monkeypatch):
    assert workers_heal_env(options("-n", "2"), monkeypatch) == {heal_env.HEAL: "1", heal_env.SPARES: "1"}
    assert workers_heal_env(options("-n", "2", "--spares", "0"), monkeypatch) == {heal_env.HEAL: "1",
                                                                                  heal_env.SPARES: "0"}
    # --no-heal: no supervisor, even with SLIPSTREAM_HEAL=1 left in the launcher's environment.
    assert workers_heal_env(options("-n", "2", "--no-heal"), monkeypatch) == {}
    assert workers_heal_env(options("-n", "1"), monkeypatch) == {}
    assert workers_heal_env(options("-n", "1", "--heal"), monkeypatch) == {heal_env.HEAL: "1", heal_env.SPARES: "1"}
    # The training options' variables no longer carry it: the launch setting is its only source.
    assert heal_env.HEAL not in options("-n", "2", "--heal").worker_env


def test_run_config_sets_heal_and_spares_and_the_flags_win(tmp_path, monkeypatch):
    off = tmp_path / "off.yaml"
    off.write_text("heal: false\n")
    assert options("-n", "2", config=str(off)).heal is False
    assert options("-n", "2", "--heal", config=str(off)).heal is True  # the flag over the file
    section = tmp_path / "section.yaml"
    section.write_text("launch: {spares: 0}\n")
    assert workers_heal_env(options("-n", "2", config=str(section)), monkeypatch)[heal_env.SPARES] == "0"
    assert options("-n", "2", "--spares", "1", config=str(section)).spares == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("heal: sometimes\n")
    with pytest.raises(Exception, match="heal must be true or false"):
        options("-n", "2", config=str(bad))


@pytest.mark.parametrize("flags,message", [
    (("--heal", "--no-python"), "--heal runs each rank under a supervisor in the Python worker entry"),
    (("--no-heal", "--spares", "1"), "--spares 1 keeps warm replacements for healing in place, which --no-heal"),
    (("--spares", "2"), "--spares must be 0 or 1"),
])
def test_contradictions_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message):
        options("-n", "2", *flags)


def test_no_python_without_the_flag_is_simply_off():
    opts = options("-n", "2", "--no-python")
    assert opts.heal is None and not opts.heals


def test_healing_is_announced_once_at_start_and_only_when_on(tmp_path, monkeypatch, caplog):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(api, "_run_agent", lambda opts: 0)  # no worker: the start and end lines only
    monkeypatch.setenv("SLIPSTREAM_RUN_DIR", str(tmp_path / "run"))

    def said(**kw) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slipstream"):
            assert api.launch(LaunchOptions(str(script), **kw)) == 0
        return [r.getMessage() for r in caplog.records if "healing in place" in r.getMessage()]

    assert said(nproc_per_node=2) == ["slipstream run: healing in place: on (1 warm spare per rank; "
                                      "--no-heal to turn off)"]
    assert said(nproc_per_node=2, spares=0) == ["slipstream run: healing in place: on (0 warm spares per rank; "
                                                "--no-heal to turn off)"]
    assert said(nproc_per_node=2, heal=False) == []
    assert said(nproc_per_node=1) == []
    assert said(nproc_per_node=2, summary=False) == []  # a wrapping program speaks for itself
