"""The published JSON Schema: equal to what the rules generate, and agreeing with the reader."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from hypothesis import given, settings

from slipstream.config import PRECISIONS
from slipstream.errors import ConfigError
from slipstream.job.json_schema import SCHEMA_FILE, job_schema, schema_text
from slipstream.job.spec import load_spec, parse_spec

from .conftest import EXAMPLES, REPO, run_cli
from .test_fuzz import SETTINGS, valid_specs


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_is_the_generated_one(capsys):
    assert SCHEMA_FILE.read_text(encoding="utf-8") == schema_text(), (
        "the job spec's rules changed: regenerate with "
        "`slipstream job schema --out src/slipstream/job/schema/jobspec.schema.json`"
    )
    code, out, err = run_cli(["job", "schema"], capsys)
    assert code == 0 and out == schema_text(), err


def test_enumerations_come_from_the_core():
    from slipstream import sync

    props = job_schema()["properties"]
    assert props["numerics"]["properties"]["precision"]["enum"] == list(PRECISIONS)
    assert props["sync"]["properties"]["strategy"]["enum"] == list(sync.available())


def _doc_specs() -> list[tuple[str, object]]:
    """Job specs in the repository: examples/jobs, and the YAML blocks of the docs that are job specs."""
    found = [(str(p.relative_to(REPO)), yaml.safe_load(p.read_text())) for p in sorted(EXAMPLES.glob("*.yaml"))]
    for md in sorted([*REPO.glob("*.md"), *(REPO / "docs").glob("*.md")]):
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", md.read_text(encoding="utf-8"), re.S)):
            docs = [d for d in yaml.safe_load_all(block) if isinstance(d, dict)]
            found += [(f"{md.name} block {i}", d) for d in docs if "image" in d and "command" in d]
    return found


def test_every_spec_in_the_repository_validates(validator):
    specs = _doc_specs()
    assert len(specs) >= 5, specs  # the four examples and docs/job.md's example at least
    for where, data in specs:
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(data)]
        assert not errors, (where, errors)
        parse_spec(data)  # and the reader agrees


def test_golden_inputs_validate(validator):
    """tests/job/golden holds the manifests of examples/jobs/<name>.yaml: each input validates."""
    names = {p.name.split(".")[0] for p in (REPO / "tests" / "job" / "golden").glob("*.yaml")}
    for name in sorted(names):
        path = EXAMPLES / f"{name}.yaml"
        load_spec(path)
        validator.validate(yaml.safe_load(path.read_text()))


@settings(max_examples=40, **SETTINGS)
@given(valid_specs())
def test_specs_the_reader_accepts_validate(validator, data):
    validator.validate(json.loads(json.dumps(data)))


@pytest.mark.parametrize(
    "over",
    [
        {"replicas": 0}, {"replicas": "2"}, {"gpu_cont": 1}, {"name": "Bad_Name"}, {"command": []},
        {"sync": {"precision": "fp8"}}, {"sync": {"strategy": "magic"}}, {"kind": "inference", "sync": {}},
        {"serve": {"port": 80}}, {"env": {"SLIPSTREAM_PRECISION": "bf16"}}, {"env": {"1BAD": "x"}},
        {"gpu_slice": {"memory_fraction": 0}}, {"cpu": "lots"}, {"checkpoint": {"interval_steps": 5}},
    ],
)
def test_what_the_reader_refuses_per_key_the_schema_refuses(validator, over):
    data = {"name": "t", "image": "img:1", "command": ["python", "train.py"], **over}
    with pytest.raises(ConfigError):
        parse_spec(data)
    assert list(validator.iter_errors(data)), over
