"""The project refers to nothing outside itself, and its examples and docs say what the code does."""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    out = []
    for name in filter(None, names):
        path = REPO / name
        if path.is_file() and path.suffix not in (".png", ".jpg", ".gz", ".tar", ".whl", ".pt"):
            out.append(path)
    return out


def test_no_file_refers_to_anything_outside_the_project():
    outside = ("../" + "shared", "GUIDE" + ".md", "shared/" + "GUIDE")  # spelt apart: this file is tracked too
    hits = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(REPO)}: {word}" for word in outside if word in text]
    assert hits == []


def _accepted_flags(script: Path) -> set[str]:
    """The option strings a script's argparse parser takes (read from its add_argument calls)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def _script_of(command: list[str]) -> Path | None:
    """The Python file a job spec's command runs (``python FILE`` or ``python -m MODULE``), or None."""
    if not command or Path(command[0]).name not in ("python", "python3"):
        return None
    rest = command[1:]
    if rest[:1] == ["-m"]:
        return REPO / (rest[1].replace(".", "/") + ".py")
    return REPO / rest[0]


def test_every_example_job_passes_only_flags_its_script_accepts():
    checked = 0
    for spec_path in sorted((REPO / "examples" / "jobs").glob("*.yaml")):
        spec = yaml.safe_load(spec_path.read_text())
        command = [str(c) for c in spec.get("command", [])]
        script = _script_of(command)
        if script is None:
            continue  # not a Python program of this project (an inference server's own command)
        assert script.is_file(), f"{spec_path.name}: {script} does not exist"
        script_args = command[2 + (command[1] == "-m"):] + [str(a) for a in spec.get("args", [])]
        given = {a.split("=", 1)[0] for a in script_args if a.startswith("-")}
        unknown = given - _accepted_flags(script)
        assert not unknown, f"{spec_path.name}: {script.relative_to(REPO)} does not take {sorted(unknown)}"
        checked += 1
    assert checked >= 3


def test_the_flag_check_catches_an_unknown_flag():
    assert "--epochs" not in _accepted_flags(REPO / "examples" / "train_resnet.py")
    assert "--steps" in _accepted_flags(REPO / "examples" / "train_resnet.py")


def test_the_docs_list_every_extra():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"all"}
    page = (REPO / "docs" / "install.md").read_text()
    sentence = re.search(r"Optional parts are extras \((.*?); `all` gathers them\)", page, re.S)
    assert sentence, "docs/install.md lost its list of extras"
    listed = set(re.findall(r"`([a-z][a-z-]*)`", sentence.group(1)))
    assert listed == extras
    rows = set(re.findall(r"^\| `([a-z][a-z-]*)` \|", page, re.M))
    assert extras <= rows, f"extras without a row in docs/install.md's table: {sorted(extras - rows)}"


def test_install_hints_carry_the_installed_torch():
    """A bare `pip install 'slipstream[X]'` can replace the installed torch (docs/install.md):
    every hint in the code goes through slipstream.extras.pip_install_hint, which pins it."""
    from slipstream.extras import pip_install_hint

    bare = []
    for path in sorted((REPO / "src" / "slipstream").rglob("*.py")):
        if path.name == "extras.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pip install\s+['\"]?slipstream\[", line):
                bare.append(f"{path.relative_to(REPO)}:{number}")
    assert bare == []
    from importlib.metadata import version

    assert pip_install_hint("job") == f"pip install 'slipstream[job]' 'torch=={version('torch')}'"


def test_no_file_names_an_image_the_project_does_not_build():
    """Job specs and docs name the image scripts/build_image.sh makes (slipstream:VERSION), not a
    registry's copy that nobody publishes."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    unbuilt = "ghcr.io/" + "slipstream-ml"  # spelt apart: this file is tracked too
    hits = [str(p.relative_to(REPO)) for p in _tracked_text_files()
            if unbuilt in p.read_text(encoding="utf-8", errors="replace")]
    assert hits == []
    build = (REPO / "scripts" / "build_image.sh").read_text()
    assert 'tag="${tag:-slipstream:$version}"' in build
    for spec_path in sorted((REPO / "examples" / "jobs").glob("*.yaml")):
        spec = yaml.safe_load(spec_path.read_text())
        if spec.get("kind", "training") == "training":
            assert spec["image"] in (f"slipstream:{version}", f"slipstream:{version}-cpu"), spec_path.name
