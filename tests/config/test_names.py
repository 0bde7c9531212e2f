"""One name per setting: flags, run config keys, job spec keys and TrainConfig fields agree, and every
old spelling in slipstream.names.DEPRECATED still works, with one warning line naming the new one.

The settings are collected from the code itself (argparse introspection of every sub-command, the
job spec's rules, TrainConfig's sections), so a flag or key added with a second name fails here.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from slipstream import names
from slipstream.cli import build_parser, main
from slipstream.config import FLAT_NAMES, SECTIONS, TrainConfig
from slipstream.errors import ConfigError
from slipstream.job.fields import rules
from slipstream.job.model import JobSpec
from slipstream.job.spec import parse_spec
from slipstream.launch import run_config
from slipstream.launch.cli import launcher_settings, launch_options_from_args, training_options

REPO = Path(__file__).resolve().parents[2]
SPEC = {"name": "t", "image": "img:1", "command": ["python", "train.py"]}


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees the once-per-process warnings afresh."""
    names._WARNED.clear()
    yield
    names._WARNED.clear()


# ---------------------------------------------------------------------------- flags of every sub-command


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix}{name}"] = sub
                out.update(_commands(sub, f"{prefix}{name} "))
    return out


def _refused(command: str, flag: str, action: argparse.Action) -> bool:
    """A flag of slipstream.names.REFUSED, declared as refused there (hidden, an action of its own)."""
    listed = any(r.old == flag and command.split()[-1] in r.commands for r in names.REFUSED)
    return listed and action.help == argparse.SUPPRESS and action.option_strings == [flag]


def _setting(action: argparse.Action) -> str:
    """The setting a flag sets: its dest, a TrainConfig flat name for ``slipstream run``'s training flags;
    a switch ``--no-X`` (dest no_X) turns setting X off, as ``--X/--no-X`` does."""
    dest = action.dest.removeprefix("train_")
    if action.nargs == 0 and dest.startswith("no_") and f"--{dest[3:].replace('_', '-')}" not in action.option_strings:
        return dest[3:]
    return dest


def flag_table() -> list[tuple[str, str, str, bool, bool]]:
    """(command, option string, setting, is a long option, is a switch) for every live flag of every sub-command."""
    rows = []
    for command, parser in _commands(build_parser()).items():
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            for flag in action.option_strings:
                if _refused(command, flag, action):
                    continue
                rows.append((command, flag, _setting(action), flag.startswith("--"), action.nargs == 0))
    return rows


def _spelling(flag: str) -> str:
    """torchrun's two spellings of one flag (--nproc-per-node, --nproc_per_node) are one name, and so
    are a switch and its negation (--profile, --no-profile)."""
    flag = flag.replace("_", "-")
    return "--" + flag[5:] if flag.startswith("--no-") else flag


def test_a_flag_means_one_thing_in_every_sub_command():
    """-n, --json, --target, --out, ...: one option string, one setting, across all sub-commands."""
    meanings: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for command, flag, setting, _, switch in flag_table():
        meaning = f"{setting} ({'a switch' if switch else 'takes a value'})"  # --json PATH is not --json
        meanings[_spelling(flag)].add(meaning)
        where[(_spelling(flag), meaning)].append(command)
    two = {flag: {s: where[(flag, s)] for s in settings} for flag, settings in meanings.items() if len(settings) > 1}
    assert two == {}, f"a flag with two meanings (flag: {{setting: commands}}): {two}"


def test_a_setting_has_one_flag_in_every_sub_command():
    spellings: dict[str, set[str]] = defaultdict(set)
    for _, flag, setting, long, _ in flag_table():
        if long:
            spellings[setting].add(_spelling(flag))
    two = {setting: sorted(flags) for setting, flags in spellings.items() if len(flags) > 1}
    assert two == {}, f"a setting with two live flags: {two}"


def test_n_json_and_target_mean_what_the_table_says():
    meaning = {(c, f): s for c, f, s, _, _ in flag_table()}
    assert {s for (c, f), s in meaning.items() if f == "-n"} == {"nproc_per_node"}
    assert {s for (c, f), s in meaning.items() if f == "--json"} == {"json"}  # a switch: print JSON
    assert {s for (c, f), s in meaning.items() if f == "--target"} == {"target"}
    commands = _commands(build_parser())
    for c in ("plan", "bench"):
        action = next(a for a in commands[c]._actions if "--json" in a.option_strings)
        assert action.nargs == 0, f"{c} --json takes a value"


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_n_for_a_namespace_is_refused_with_the_flag_to_use(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "gpt", "--target", "slurm", "-n", "ml"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "write --namespace ml" in err and "processes per node" in err, err


# ---------------------------------------------------------------------------- training settings everywhere


def test_every_training_setting_has_one_flat_name_and_one_nested_path():
    """Flag, environment variable, keyword and flat run config key are the flat name; TrainConfig's
    section.field is the nested path, the run config's and the job spec's alike."""
    run = _commands(build_parser())["run"]
    flags = {a.dest.removeprefix("train_"): a.option_strings for a in run._actions if a.dest.startswith("train_")}
    assert set(flags) == set(FLAT_NAMES)
    for flat, (section, leaf) in FLAT_NAMES.items():
        assert {_spelling(f) for f in flags[flat]} == {"--" + flat.replace("_", "-")}, flat
        nested = {section: {leaf: getattr(getattr(TrainConfig(), section), leaf)}}
        assert run_config.parse(yaml.safe_dump(nested)) == run_config.parse(yaml.safe_dump({flat: nested[section][leaf]}))


def _job_spec_keys() -> dict[str, str]:
    """Job spec key path -> the TrainConfig flat name it sets (keys declared with config=)."""
    out = {}
    for name, rule in rules(JobSpec).items():
        if rule.kind == "section":
            for key, inner in rules(rule.section).items():
                if inner.config:
                    out[f"{name}.{key}"] = inner.config
    return out


def test_job_spec_keys_are_trainconfigs_nested_paths():
    """checkpoint.interval_steps (job spec) against checkpoint.every_steps (TrainConfig): one setting,
    two names. Every job spec key that sets a training option is TrainConfig's section.field."""
    wrong = {path: ".".join(FLAT_NAMES[flat]) for path, flat in _job_spec_keys().items()
             if path != ".".join(FLAT_NAMES[flat])}
    assert wrong == {}, f"job spec key -> TrainConfig's path for the same setting: {wrong}"


def test_a_job_spec_section_pasted_into_a_run_config_reads_the_same(tmp_path):
    doc = {"sync": {"strategy": "bf16", "bucket_cap_mb": 10.0}, "numerics": {"precision": "bf16", "accumulate_steps": 4},
           "checkpoint": {"dir": "/ck", "every_steps": 50, "every_s": 60.0, "keep_last": 2, "verify": "size",
                          "max_failures": 2},
           "parallel": {"dp_replicate": 2}}
    spec = parse_spec({**SPEC, "replicas": 2, **doc})
    values = run_config.parse(yaml.safe_dump(doc), "run.yaml")
    assert TrainConfig(**values).to_env() == {k: v for k, v in spec.worker_env().items() if k != "SLIPSTREAM_JOB_NAME"}
    keys = _job_spec_keys()
    assert set(values) == {keys[f"{section}.{key}"] for section, part in doc.items() for key in part}


# ---------------------------------------------------------------------------- deprecated spellings


NESTED = [d for d in names.DEPRECATED if d.surfaces != (names.EXAMPLE,) and not d.old.startswith("-")]


def _doc(path: str, value: object) -> dict:
    section, key = path.split(".")
    return {section: {key: value}}


def _value(path: str) -> object:
    return {"precision": "bf16", "accumulate_steps": 3, "every_steps": 7, "every_s": 30.0}[path.split(".")[1]]


def _with_dir(doc: dict) -> dict:
    if "checkpoint" in doc:
        doc["checkpoint"]["dir"] = "/ck"
    return doc


@pytest.mark.parametrize("entry", [d for d in NESTED if names.JOB_SPEC in d.surfaces], ids=lambda d: d.old)
def test_an_old_job_spec_key_warns_once_and_sets_the_same(entry, capsys):
    value = _value(entry.new)
    new = parse_spec({**SPEC, **_with_dir(_doc(entry.new, value))})
    assert capsys.readouterr().err == ""
    old = parse_spec({**SPEC, **_with_dir(_doc(entry.old, value))})
    parse_spec({**SPEC, **_with_dir(_doc(entry.old, value))})
    assert old == new and old.worker_env() == new.worker_env()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and entry.old in err[0] and f"write {entry.new}" in err[0], err
    with pytest.raises(ConfigError, match="same setting"):
        parse_spec({**SPEC, **_with_dir(_doc(entry.old, value)), **_doc(entry.new, value)}
                   if entry.old.split(".")[0] != entry.new.split(".")[0]
                   else {**SPEC, entry.new.split(".")[0]: {**_with_dir(_doc(entry.old, value))[entry.old.split(".")[0]],
                                                           entry.new.split(".")[1]: value}})


@pytest.mark.parametrize("entry", [d for d in NESTED if names.RUN_CONFIG in d.surfaces], ids=lambda d: d.old)
def test_an_old_run_config_key_warns_once_and_sets_the_same(entry, capsys):
    value = _value(entry.new)
    new = run_config.parse(yaml.safe_dump(_doc(entry.new, value)), "run.yaml")
    assert capsys.readouterr().err == ""
    old = run_config.parse(yaml.safe_dump(_doc(entry.old, value)), "run.yaml")
    assert run_config.parse(yaml.safe_dump(_doc(entry.old, value)), "run.yaml") == old == new
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and entry.old in err[0] and f"write {entry.new}" in err[0], err


def test_old_keys_are_not_live_keys():
    """An old spelling is only an alias: the job spec's rules and the run config's sections lack it."""
    spec_keys = {f"{n}.{k}" for n, r in rules(JobSpec).items() if r.kind == "section" for k in rules(r.section)}
    config_keys = {f"{s}.{leaf}" for s, cls in SECTIONS.items() for leaf in cls.FLAT}
    for d in NESTED:
        assert d.old not in spec_keys | config_keys and d.new in config_keys, d


def test_the_old_example_flag_warns_once_and_sets_the_same(capsys):
    assert names.renamed_flag(5, None, "--checkpoint-every") == 5
    assert capsys.readouterr().err == ""
    assert names.renamed_flag(None, 5, "--checkpoint-every") == 5
    assert names.renamed_flag(None, 5, "--checkpoint-every") == 5
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "write --checkpoint-every-steps" in err[0], err
    for path in sorted((REPO / "examples").glob("train_*.py")):
        text = path.read_text()
        assert '"--checkpoint-every-steps"' in text and 'renamed_flag(args.checkpoint_every_steps' in text, path


def test_the_old_bench_json_path_warns_and_writes_the_file(capsys):
    from slipstream.bench.cli import split_own_options, take_old_json_spelling

    args = build_parser().parse_args(["bench", "--json", "out.json", "train.py", "--steps", "2"])
    take_old_json_spelling(args)
    assert (args.json, args.json_out, args.script, args.script_args) == (False, "out.json", "train.py", ["--steps", "2"])
    args = build_parser().parse_args(["bench", "train.py", "--steps", "2", "--json", "r.json"])
    assert split_own_options(list(args.script_args), args) == ["--steps", "2"] and args.json_out == "r.json"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "write --json-out PATH" in err[0], err
    args = build_parser().parse_args(["bench", "--json", "train.py"])
    take_old_json_spelling(args)
    assert args.json is True and args.script == "train.py" and args.json_out is None


# ---------------------------------------------------------------------------- launcher settings in the run config


def _run_args(tmp_path, text: str, *flags: str) -> argparse.Namespace:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return build_parser().parse_args(["run", "--config", str(path), *flags, "train.py"])


def test_the_run_config_holds_launcher_settings_and_flags_override_them(tmp_path):
    args = _run_args(tmp_path, "nproc_per_node: 3\nmax_restarts: 2\nprecision: bf16\n"
                     "launch: {rdzv_conf: {join_timeout: 5}, monitor_interval: 0.5}\n")
    opts = launch_options_from_args(args)
    assert (opts.nproc_per_node, opts.max_restarts, opts.rdzv_conf, opts.monitor_interval_s) == (3, 2, {"join_timeout": "5"}, 0.5)
    assert training_options(args) == {"precision": "bf16"}
    # a flag wins, even one that repeats the default
    opts = launch_options_from_args(_run_args(tmp_path, "nproc_per_node: 3\nmax_restarts: 2\n", "--max-restarts", "0", "-n", "1"))
    assert (opts.nproc_per_node, opts.max_restarts) == (1, 0)


def test_every_launcher_setting_is_its_flags_name():
    run = _commands(build_parser())["run"]
    for key, action in launcher_settings().items():
        assert any(f.lstrip("-").replace("-", "_") == key for f in action.option_strings if f.startswith("--")), key
        assert key not in FLAT_NAMES, key
    assert {"nproc_per_node", "nnodes", "max_restarts", "rdzv_endpoint", "rdzv_conf", "rdzv_backend"} <= set(launcher_settings())
    assert all(a.dest in launcher_settings() or a.dest.startswith("train_") or a.dest in ("help", "config")
               for a in run._actions if a.option_strings)


@pytest.mark.parametrize("text,message", [
    ("nproc_per_nod: 2", "unknown key 'nproc_per_nod' (did you mean nproc_per_node?)"),
    ("max_restarts: many", "max_restarts must be K, got 'many'"),
    ("standalone: 1", "standalone must be true or false, got 1"),
    ("launch: {nnode: 2}", "unknown key launch.nnode (did you mean nnodes?)"),
    ("nnodes: 2\nlaunch: {nnodes: 2}", "nnodes is given twice"),
])
def test_a_bad_launcher_setting_is_one_line_naming_the_file(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        launch_options_from_args(_run_args(tmp_path, text))
    assert message in str(info.value) and "run.yaml" in str(info.value) and "\n" not in str(info.value)


def test_docs_name_no_deprecated_spelling():
    """README and docs/ write the live names (an old one only on a line that says it is the old one)."""
    patterns = {
        "checkpoint.interval_steps": r"\binterval_steps\b", "checkpoint.interval_s": r"\binterval_s\b",
        "sync.precision": r"sync(\.|: \{[^}]*)precision", "sync.accumulate_steps": r"sync(\.|: \{[^}]*)accumulate_steps",
        "--checkpoint-every": r"--checkpoint-every(?![\w-])", "--json PATH": r"bench\b.*--json [^-]",
    }
    assert set(patterns) == {d.old for d in names.DEPRECATED}, "a new deprecated spelling: add its pattern here"
    found = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if md.name == "names.md":  # the page that lists the old spellings
            continue
        for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            for old, pattern in patterns.items():
                if re.search(pattern, line) and not re.search(r"\bold\b|\b[Ww]as\b|deprecated", line):
                    found.append(f"{md.name}:{n}: {old}: {line.strip()[:100]}")
    assert found == [], "\n".join(found)


def test_a_run_configs_topology_with_a_job_spec_is_one_line_naming_the_file(tmp_path):
    from slipstream.errors import UsageError
    from slipstream.job.cli import job_run_from_args

    path = tmp_path / "run.yaml"
    path.write_text("nproc_per_node: 2\n")
    args = build_parser().parse_args(["run", "--config", str(path), str(REPO / "examples" / "jobs" / "local-2x1.yaml")])
    with pytest.raises(UsageError, match=r"run.yaml: nproc_per_node cannot be combined with a job spec"):
        job_run_from_args(args)
    path.write_text("max_restarts: 2\n")
    assert job_run_from_args(args.__class__(**{**vars(args), "run_file": None})).max_restarts == 2
