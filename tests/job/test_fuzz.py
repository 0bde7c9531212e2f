"""Property-based fuzzing of job specs through the CLI (in-process).

* every valid spec: `slipstream validate` exits 0, and each target's manifests
  pass kubernetes-validate --strict / strict CRD schemas / our checks;
* every invalid spec: exit code 2, one "slipstream validate: error:" message that
  names the field and the offending value, never a traceback;
* arbitrary text: exit 0 or 2, never a traceback.
"""

from __future__ import annotations

import os
import re

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slipstream.job import TARGETS, render
from slipstream.job.slurm import check_syntax, render_sbatch
from slipstream.job.render import TargetUnsupported
from slipstream.job.spec import parse_spec

from .conftest import run_cli, write_spec

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

dns_label = st.from_regex(r"\A[a-z]([a-z0-9-]{0,20}[a-z0-9])?\Z")
quantity_mem = st.builds(lambda n, u: f"{n}{u}", st.integers(128, 4096), st.sampled_from(["Mi", "Gi"]))
quantity_cpu = st.one_of(st.integers(1, 64), st.sampled_from(["500m", "250m", "1.5", "2"]))
env_name = st.from_regex(r"\A[A-Z][A-Z0-9_]{0,10}\Z").filter(lambda s: not s.startswith("SLIPSTREAM_"))
env_value = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20), st.integers(), st.booleans())


@st.composite
def valid_specs(draw):
    kind = draw(st.sampled_from(["training", "training", "inference"]))
    gpu_count = draw(st.integers(0, 8))
    replicas = draw(st.integers(1, 6))
    spec = {"name": draw(dns_label), "image": draw(st.sampled_from(["img:1", "ghcr.io/a/b:0.1", "reg:5000/x/y@sha256:" + "a" * 64]))}
    if kind == "inference":
        spec["kind"] = "inference"
        spec["command"] = draw(st.sampled_from([["vllm", "serve", "m"], ["python", "-m", "http.server"], ["/bin/server"]]))
        if draw(st.booleans()):
            spec["serve"] = {"port": draw(st.integers(1024, 29399)), "health_path": "/healthz"}
    else:
        spec["command"] = draw(st.sampled_from([["python", "train.py"], ["python3", "-u", "-m", "pkg.train"], ["train.py"]]))
    if draw(st.booleans()):
        spec["args"] = draw(st.lists(st.sampled_from(["--lr", "0.1", "--steps", "10", "-x"]), max_size=4))
    spec["replicas"] = replicas
    spec["gpu_count"] = gpu_count
    if draw(st.booleans()):
        spec["cpu"] = draw(quantity_cpu)
    if draw(st.booleans()):
        spec["memory"] = draw(quantity_mem)
        if draw(st.booleans()):
            spec["shm_size"] = "64Mi"
    elif draw(st.booleans()):
        spec["shm_size"] = draw(quantity_mem)
    if draw(st.booleans()):
        spec["env"] = draw(st.dictionaries(env_name, env_value, max_size=3))
    if gpu_count:
        choice = draw(st.sampled_from(["none", "mig", "time", "fraction"]))
        if choice == "mig":
            spec["gpu_slice"] = {"mig": draw(st.sampled_from(["mig-1g.10gb", "3g.40gb", "mig-7g.80gb"]))}
        elif choice == "time":
            spec["gpu_slice"] = {"time_sliced": True, "memory_fraction": draw(st.floats(0.05, 1.0))}
        elif choice == "fraction":
            spec["gpu_slice"] = {"memory_fraction": draw(st.floats(0.05, 1.0))}
    if draw(st.booleans()):
        spec["queue"] = draw(dns_label)
    if draw(st.booleans()):
        spec["priority_class"] = draw(dns_label)
    if draw(st.booleans()):
        spec["network"] = {"rdma_resource": "rdma/hca", "rdma_count": draw(st.integers(1, 4)),
                           "host_network": draw(st.booleans())}
    if kind == "training":
        if gpu_count and draw(st.booleans()):
            spec["processes_per_replica"] = draw(st.integers(1, gpu_count))
        if draw(st.booleans()):
            spec["restarts"] = {"max_restarts": draw(st.integers(0, 10)), "max_pod_restarts": draw(st.integers(0, 10))}
        if draw(st.booleans()):
            spec["elastic"] = {"min_replicas": draw(st.integers(1, replicas)),
                               "max_replicas": draw(st.integers(replicas, replicas + 4))}
        if draw(st.booleans()):
            ck = {"dir": "/ckpt/run", "every_steps": draw(st.integers(1, 1000))}
            if draw(st.booleans()):
                ck["volume_claim"] = draw(dns_label)
            spec["checkpoint"] = ck
        if draw(st.booleans()):
            spec["data"] = {"source": "s3://bucket/shards", "cache_dir": "/cache", "cache_size": "10Gi",
                            "prewarm": draw(st.booleans())}
        if draw(st.booleans()):
            spec["sync"] = {"strategy": "allreduce"}
            spec["numerics"] = {"precision": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
                                "accumulate_steps": draw(st.integers(1, 16))}
    return spec


@settings(max_examples=30, **SETTINGS)
@given(valid_specs())
def test_valid_specs_render_and_validate_for_every_target(capsys, data):
    path = write_spec(data)
    try:
        code, out, err = run_cli(["validate", path], capsys)
    finally:
        os.unlink(path)
    assert code == 0, err
    spec = parse_spec(data)
    # `validate` checked every target's manifests; it says so once per target.
    checked = out.count("pass offline validation")
    assert checked == (1 if spec.kind == "inference" else len(TARGETS) - ("not available" in out))
    for target in TARGETS:
        try:
            objs = render(spec, target)
        except TargetUnsupported:
            # The only documented gap: TrainJob runtime patches cannot set hostNetwork.
            assert target == "trainjob" and spec.network.host_network
            continue
        if spec.kind == "training":
            text = str(objs)
            assert f"'--nproc-per-node', '{spec.procs_per_replica}'" in text
    if spec.kind == "training":  # and the Slurm target's script, through bash -n
        script = render_sbatch(spec)
        check_syntax(script)
        assert f"--nproc-per-node {spec.procs_per_replica} " in script and f"#SBATCH --job-name={spec.name}" in script


# (path, bad value, text the message must contain)
MUTATIONS = [
    (("replicas",), st.integers(max_value=0), "replicas: must be >= 1"),
    (("replicas",), st.text(max_size=5), "replicas: must be a whole number"),
    (("replicas",), st.floats(allow_nan=False), "replicas: must be a whole number"),
    (("gpu_count",), st.integers(max_value=-1), "gpu_count: must be >= 0"),
    (("gpu_count",), st.integers(min_value=65), "gpu_count: must be <= 64"),
    (("name",), st.text(min_size=1, max_size=8).filter(lambda s: not s[:1].islower() or not s.isalnum()), "name: must be"),
    (("image",), st.integers() | st.lists(st.integers(), max_size=2) | st.just(""), "image: must be"),
    (("command",), st.text(max_size=10), "command: must be a list"),
    (("command",), st.lists(st.integers(), min_size=1, max_size=2), "command[0]: must be a string"),
    (("kind",), st.text(max_size=8).filter(lambda s: s not in ("training", "inference")), "kind: must be one of"),
    (("cpu",), st.text(alphabet="xyz!# ", min_size=1, max_size=5), "cpu: must be a Kubernetes quantity"),
    (("memory",), st.integers(max_value=0), "memory: must be > 0"),
    (("env",), st.lists(st.integers(), max_size=2), "env: must be a mapping"),
    (("restarts", "max_restarts"), st.integers(max_value=-1), "restarts.max_restarts: must be >= 0"),
    (("numerics", "precision"), st.text(max_size=6).filter(lambda s: s not in ("fp32", "bf16", "fp16")), "numerics.precision: must be one of"),
    (("numerics", "accumulate_steps"), st.integers(max_value=0), "numerics.accumulate_steps: must be >= 1"),
    (("gpu_slice", "memory_fraction"), st.floats(min_value=1.01, max_value=1e6), "gpu_slice.memory_fraction: must be <= 1"),
    (("checkpoint", "keep_last"), st.integers(max_value=0), "checkpoint.keep_last: must be >= 1"),
    (("network", "host_network"), st.text(max_size=4), "network.host_network: must be true or false"),
    (("queue",), st.text(alphabet="ABC _!", min_size=1, max_size=6), "queue: must be"),
    (("shm_size",), st.sampled_from(["1GB", "-1Gi", "Gi", "big"]), "shm_size: must be"),
    (("nonsense_key",), st.integers(), "nonsense_key: unknown key"),
]


@st.composite
def invalid_specs(draw):
    spec = {"name": "fuzz", "image": "img:1", "command": ["python", "train.py"], "gpu_count": 1,
            "checkpoint": {"dir": "/ck"}}
    path, bad, needle = draw(st.sampled_from(MUTATIONS))
    value = draw(bad)
    target = spec
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return spec, needle


@settings(max_examples=60, **SETTINGS)
@given(invalid_specs())
def test_invalid_specs_fail_clearly(capsys, case):
    data, needle = case
    path = write_spec(data)
    try:
        for command in (["validate", path], ["render", path, "--target", "jobset"], ["run", path]):
            code, out, err = run_cli(command, capsys)
            assert code == 2, (command, err)
            assert "Traceback" not in err and "Traceback" not in out
            assert err.startswith(f"slipstream {command[0]}: error: {path}: ")
            assert needle in err, err
            assert "got" in err or "unknown key" in err
    finally:
        os.unlink(path)


junk_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=40, **SETTINGS)
@given(st.dictionaries(st.sampled_from(["name", "image", "command", "args", "replicas", "gpu_count", "env", "gpu_slice",
                                        "elastic", "sync", "kind", "serve", "data", "cpu", "zzz"]), junk_values))
def test_junk_values_never_crash(capsys, data):
    path = write_spec(yaml.safe_dump(data))
    try:
        code, out, err = run_cli(["validate", "--spec-only", path], capsys)
    finally:
        os.unlink(path)
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("slipstream validate: error: ")


@settings(max_examples=40, **SETTINGS)
@given(st.text(max_size=80))
def test_arbitrary_text_never_crashes(capsys, text):
    path = write_spec(text)
    try:
        code, out, err = run_cli(["validate", "--spec-only", path], capsys)
    finally:
        os.unlink(path)
    assert code == 2 and "Traceback" not in err and err.startswith("slipstream validate: error: ")


# ---------------------------------------------------------------------------- one spec, one meaning
# String fields full of shell syntax, quotes, newlines, control and non-ASCII characters and
# $(VAR) / $$ forms: every target gives the program the Kubernetes expansion of the spec's strings,
# byte for byte, or the spec is refused with a message naming the field.

_FRAGMENTS = ["$(A)", "$(B)", "$(C)", "$(NOPE)", "$$", "$$(A)", "$", "$(", ")", "${A}", "$A", "$((1+1))",
              "$(touch {marker})", "`touch {marker}`", "'", '"', "\\", ";", "&&", "|", "*", "~", "#", "!", "%", "{a,b}",
              " ", "\t", "\n", "\r", "\x01", "\x7f", "\x1b", "é", "中", "😀", "\u2028", "\xa0", "-x", "=", "\0", "$é"]
spec_text = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.characters(min_codepoint=1, max_codepoint=0x2FFF,
                                                                           exclude_categories=("Cs",))),
                     max_size=8).map("".join)
env_names = st.sampled_from(["A", "A", "B", "B", "C", "C", "HOME", "UID", "SLURM_X"])


@st.composite
def stringy_specs(draw):
    spec = {"name": "fuzz", "image": "img:1", "command": ["python3", "train.py", *draw(st.lists(spec_text, max_size=3))],
            "args": draw(st.lists(spec_text, max_size=3)), "env": {}}
    spec["env"]["A"] = draw(st.text(max_size=4))  # defined first: $(A) anywhere else expands
    for _ in range(draw(st.integers(0, 3))):
        spec["env"][draw(env_names)] = draw(spec_text)
    if draw(st.integers(0, 3)) == 0:
        spec["data"] = {"source": "s3://b/" + draw(spec_text) + "/x", "cache_dir": "/cache", "prewarm": True}
    return spec


def _with_marker(value, marker: str):
    if isinstance(value, str):
        return value.replace("{marker}", marker)
    if isinstance(value, list):
        return [_with_marker(v, marker) for v in value]
    if isinstance(value, dict):
        return {k: _with_marker(v, marker) for k, v in value.items()}
    return value


def _field_value(data: dict, field: str) -> str:
    """``command[2]``, ``args[0]``, ``env.A``, ``data.source``: that field's text in ``data``."""
    m = re.fullmatch(r"(command|args)\[(\d+)\]", field)
    if m:
        return data[m.group(1)][int(m.group(2))]
    section, key = field.split(".", 1)
    return str(data[section][key])


def _walk(obj):
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


@settings(max_examples=int(os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES", "30")), **SETTINGS)
@given(stringy_specs())
def test_string_fields_reach_the_program_byte_for_byte_on_every_target(data):
    import subprocess
    import tempfile
    from pathlib import Path
    from unittest import mock

    from slipstream.errors import ConfigError
    from slipstream.job import runner
    from slipstream.job.commands import entry_argv
    from slipstream.job.spec import load_spec_text
    from slipstream.job.variables import expand, expand_env

    from .sbatch_shim import agent_call, run_sbatch_script

    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "ran"
        data = _with_marker(data, str(marker))
        try:
            spec = load_spec_text(yaml.safe_dump(data))  # escaped: PyYAML writes a raw NEL it reads back as a space
        except ConfigError as exc:  # refused: each problem names a field holding a reason to refuse it
            event("refused by the spec check")
            lines = str(exc).splitlines()
            for line in lines[1:] if len(lines) > 1 else lines:
                field = line.strip().split(": ", 1)[0]
                value = _field_value(data, field)
                assert "\0" in value or "$(" in value or re.search(r"\$[^\x00-\x7f]", value), (field, value, line)
            return
        assert list(spec.full_command) == data["command"] + data["args"]  # YAML carried every byte
        env = expand_env(spec.worker_env().items())
        want = [expand(w, env) for w in entry_argv(spec)]

        # Kubernetes: the manifests carry the spec's strings unchanged; the kubelet expands them.
        for target in TARGETS:
            objs = render(spec, target)
            runs = [d["command"] for d in _walk(objs) if d.get("command", [None])[:2] == ["slipstream", "run"]]
            assert runs and all(c[-len(want):] == entry_argv(spec) for c in runs)
            for d in _walk(objs):
                if isinstance(d.get("env"), list):
                    given = [(e["name"], e["value"]) for e in d["env"] if "value" in e]
                    assert given[:len(spec.worker_env())] == list(spec.worker_env().items())
                    kubelet = expand_env(given)
                    assert all(kubelet[k] == env[k] for k in env)
                    if "command" in d and d["command"][:2] == ["slipstream", "run"]:
                        assert [expand(w, kubelet) for w in d["command"][-len(want):]] == want

        # The local runner: the argv and environment its replicas are started with.
        started = []
        real_popen = subprocess.Popen

        def fake_popen(argv, env=None, **kw):
            started.append((argv, env))
            return real_popen(["true"])

        with mock.patch.object(runner.subprocess, "Popen", fake_popen), \
                mock.patch.object(runner, "prewarm_local", return_value=0):
            assert runner.run_local(spec) == 0
        for argv, child_env in started:
            assert argv[-len(want):] == want
            assert all(child_env[k] == env[k] for k in env)

        # Slurm: the whole batch script, run by bash with srun and slipstream stood in for.
        try:
            script = render_sbatch(spec)
        except TargetUnsupported as exc:
            event("refused by the slurm target")
            assert any(f"env.{n}:" in str(exc) for n in ("UID", "SLURM_X")), exc
            return
        event("ran on every target")
        calls = run_sbatch_script(script, Path(tmp))
        assert not marker.exists(), "the batch script ran code from the spec"
        agent = agent_call(calls)
        assert agent["argv"][-len(want):] == want
        assert {k: agent["env"].get(k) for k in env} == env
        if spec.data:
            prewarm = [c["argv"] for c in calls if c["argv"][:2] == ["data", "prewarm"]]
            assert prewarm and prewarm[0][2] == env["SLIPSTREAM_DATA_SOURCE"] == expand(spec.data.source, env)
