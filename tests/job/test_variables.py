"""One spec, one meaning on every target: ``$(VAR)`` references by Kubernetes' rule, every other
byte unchanged (the local runner, the sbatch script, the Kubernetes manifests)."""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.job import parse_spec
from slipstream.job.commands import entry_argv
from slipstream.job.slurm import render_sbatch
from slipstream.job.variables import expand, expand_env, shell_word

from .sbatch_shim import agent_call, run_sbatch_script


def spec_of(**more):
    return parse_spec({"name": "v", "image": "img:1", "command": ["python3", "train.py"], **more})


# ---------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("text, want", [
    ("$(A)", "1"),                       # a defined variable
    ("$(NOPE)", "$(NOPE)"),              # undefined: the text as written
    ("$$(A)", "$(A)"),                   # $$ escapes
    ("$$$(A)", "$1"),
    ("x$(A)y$(A)", "x1y1"),
    ("${A} $A `A`", "${A} $A `A`"),      # nothing else is special
    ("$(touch /tmp/x)", "$(touch /tmp/x)"),
    ("$(A", "$(A"), ("$", "$"), ("a$", "a$"), ("$$", "$"), ("$x", "$x"),
    ("$(a$(A)", "$(a$(A)"),              # the name runs to the first ")"
    ("$()", "$()"),
])
def test_expand_is_kubernetes_rule(text, want):
    assert expand(text, {"A": "1"}) == want


def test_env_values_see_only_earlier_entries():
    assert expand_env([("A", "a"), ("B", "$(A)/$(C)"), ("C", "c")]) == {"A": "a", "B": "a/$(C)", "C": "c"}


def test_shell_word_quotes_all_but_references():
    assert shell_word("$(A)'$(B)", {"A"}) == "\"${A}\"''\"'\"'$(B)'"
    assert shell_word("", {"A"}) == "''"


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("more, needle", [
    ({"args": ["$(JOB_COMPLETION_INDEX)"]}, "args[0]: references $(JOB_COMPLETION_INDEX), which is not set by the spec"),
    ({"env": {"A": "$(B)", "B": "x"}}, "env.A: references $(B), which is set after it"),
    ({"args": ["a\0b"]}, "args[0]: must not contain a NUL character"),
    ({"command": ["python3", "train.py", "$é"]}, "command[2]: must not put '$' right before a non-ASCII character"),
    ({"data": {"source": "s3://b/$(X)"}}, "data.source: references $(X)"),
    ({"env": {"X": "1"}, "checkpoint": {"dir": "/ck/$(X)", "volume_claim": "c"}},
     "checkpoint.dir: must not reference $(X)"),
])
def test_references_that_would_differ_are_refused(more, needle):
    with pytest.raises(ConfigError) as err:
        spec_of(**more)
    assert needle in str(err.value) and "got " in str(err.value)


# ---------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("word", ["$(touch {marker})", "${{HOME}}`touch {marker}`"])
def test_shell_code_in_an_argument_does_not_run_on_slurm(tmp_path, word):
    """Issue #32: ``$(touch ...)`` and ``${HOME}`touch ...``` in a command ran on the node."""
    marker = tmp_path / "x"
    word = word.format(marker=marker)
    spec = spec_of(command=["python3", "train.py", word], args=[word])
    calls = run_sbatch_script(render_sbatch(spec), tmp_path)
    assert not marker.exists(), "the shell ran code from the spec"
    assert agent_call(calls)["argv"][-3:] == ["train.py", word, word]


def test_references_reach_the_program_expanded_on_slurm(tmp_path):
    spec = spec_of(env={"OUT": "/data dir", "LOG": "$(OUT)/log"},
                   args=["--out=$(OUT)/x", "$$(OUT)", "$(LOG)", "$(OUT"])
    call = agent_call(run_sbatch_script(render_sbatch(spec), tmp_path))
    assert call["argv"][-4:] == ["--out=/data dir/x", "$(OUT)", "/data dir/log", "$(OUT"]
    assert call["env"]["LOG"] == "/data dir/log"


def test_the_local_runner_expands_as_kubernetes_does():
    from slipstream.job.commands import resolved_entry_argv, resolved_env

    spec = spec_of(env={"OUT": "/o", "LOG": "$(OUT)/log"}, args=["$(OUT)", "$$(OUT)", "${HOME}"])
    env = resolved_env(spec)
    assert env["LOG"] == "/o/log"
    assert resolved_entry_argv(spec, env, ["$(OUT)"]) == ["train.py", "/o", "$(OUT)", "${HOME}", "$(OUT)"]
    assert entry_argv(spec) == ["train.py", "$(OUT)", "$$(OUT)", "${HOME}"]  # the manifests' words, for the kubelet
